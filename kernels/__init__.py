"""Fused ops, each a PyTorch reference plus an optional NKI implementation.

- `rms_norm(x)`: F.rms_norm over the last dimension, no weight, default eps (`kernels.rmsnorm`).
- `relu2_mlp(x, w_fc, w_proj)`: relu(x @ w_fc^T)^2 @ w_proj^T with nn.Linear weights (`kernels.relu2_mlp`).
- `softcap_cross_entropy(logits, targets, softcap, reduction)`: cross-entropy of softcap * tanh(logits /
  softcap) in float32, ignore_index=-1, reduction 'mean', 'sum' or 'none'; softcap 0 = no cap
  (`kernels.softcap_ce`).

Each path of each op is a PyTorch custom operator (`torch.ops.trnsweep.*`, registered through
`kernels._nki.define_op`: `torch_neuronx.nki_op` for the NKI kernels on TorchNeuron) with a hand-written backward
as its autograd formula (see each module for which backward the NKI path uses). A trial picks the
implementation with `kernels.ops.get_ops(impl)`, impl one of `IMPLS`; for "auto" the trainer decides
(`model.kernel_choice`, from the node's preflight report).

This package's top level is torch-free on purpose: `IMPLS` is all it holds, so the trainer's torch-free
configuration (`model.config`, which validates a trial's `kernels` setting) and the sweep can import it
without torch. The ops live in `kernels.ops` and the modules above. All NKI code sits behind one import
check in `kernels._nki`; the `@nki.jit` kernels live in `kernels.nki_kernels`, loaded only when first used,
so importing any of this never needs the Neuron SDK.
"""

# "torch": plain PyTorch compositions; "reference": the ops' PyTorch twins of the NKI kernels, as custom ops;
# "nki": the NKI kernels; "auto": nki where this node's preflight passed them, else torch (model.kernel_choice).
IMPLS = ("torch", "reference", "nki", "auto")

__all__ = ["IMPLS"]
