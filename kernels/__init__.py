"""Fused ops, each a PyTorch reference plus an optional NKI implementation.

- `rms_norm(x)`: F.rms_norm over the last dimension, no weight, default eps.
- `relu2_mlp(x, w_fc, w_proj)`: relu(x @ w_fc^T)^2 @ w_proj^T with nn.Linear weights.
- `softcap_cross_entropy(logits, targets, softcap, reduction)`: cross-entropy of softcap * tanh(logits /
  softcap) in float32, ignore_index=-1, reduction 'mean', 'sum' or 'none'; softcap 0 = no cap.

Each is a torch.autograd.Function with a hand-written backward (see each module for which backward the NKI
path uses). A trial picks the implementation with `get_ops(impl)`, impl "reference", "nki" or "auto".

All NKI code sits behind one import check in `kernels._nki`; the `@nki.jit` kernels live in
`kernels.nki_kernels`, loaded only when first used, so importing this package never needs the Neuron SDK.
"""

from kernels._nki import NKI_AVAILABLE
from kernels.ops import IMPLS, Ops, get_ops
from kernels.relu2_mlp import relu2_mlp
from kernels.rmsnorm import rms_norm
from kernels.softcap_ce import softcap_cross_entropy

__all__ = ["IMPLS", "NKI_AVAILABLE", "Ops", "get_ops", "relu2_mlp", "rms_norm", "softcap_cross_entropy"]
