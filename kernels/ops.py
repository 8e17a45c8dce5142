"""Choosing an implementation per trial: `get_ops(impl)` returns an `Ops` whose methods are the fused ops."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import IMPLS, _nki
from kernels.relu2_mlp import relu2_mlp
from kernels.rmsnorm import rms_norm
from kernels.softcap_ce import softcap_cross_entropy


@dataclass(frozen=True)
class Ops:
    """The fused ops of one resolved implementation ("reference" or "nki"); model code calls these in place
    of the unfused PyTorch chains. Frozen and hashable so a compiled model can hold it as a constant."""

    impl: str
    mlp: str = ""  # the MLP's own implementation where it differs (a width the NKI buffer plan refuses: "torch")
    compiled_loss: bool = False  # "torch": training's cross-entropy through compiled_cross_entropy()

    def rms_norm(self, x: torch.Tensor) -> torch.Tensor:
        """F.rms_norm(x, (x.size(-1),)) without a weight."""
        if self.impl == "torch":
            return F.rms_norm(x, (x.size(-1),))
        return rms_norm(x, impl=self.impl)

    def relu2_mlp(self, x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> torch.Tensor:
        """relu(x @ w_fc^T)^2 @ w_proj^T with nn.Linear weights w_fc [mlp_dim, dim], w_proj [dim, mlp_dim]."""
        impl = self.mlp or self.impl
        if impl == "torch":
            return F.linear(F.relu(F.linear(x, w_fc)).square(), w_proj)
        return relu2_mlp(x, w_fc, w_proj, impl=impl)

    def softcap_cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor, softcap: float,
                              reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy (ignore_index=-1, float32) of softcap * tanh(logits / softcap); softcap 0 = no cap."""
        if self.impl == "torch":
            if reduction == "none" and logits.device.type == "cpu" and torch.is_inference_mode_enabled():
                return scoring_cross_entropy(logits, targets, softcap)
            if self.compiled_loss and torch.is_grad_enabled():  # training's shape only: evaluation stays eager
                return compiled_cross_entropy()(logits, targets, softcap, reduction)
            return plain_cross_entropy(logits, targets, softcap, reduction)
        return softcap_cross_entropy(logits, targets, softcap, reduction=reduction, impl=self.impl)


def plain_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, softcap: float,
                        reduction: str = "mean") -> torch.Tensor:
    """The plain chain: float32, cap, cross-entropy; eager it makes six passes over [tokens, vocab] (divide,
    tanh, scale, log-softmax and their backward), each a round trip to memory."""
    logits = logits.float()
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, targets, ignore_index=-1, reduction=reduction)


_COMPILED: dict[str, object] = {}


def compiled_cross_entropy():
    """plain_cross_entropy compiled (inductor, whole graph, fixed shapes): its forward and backward fused into
    a few passes over the logits; 2.6x faster at 2048 x 8192 on this CPU (bench/recipe_bench's shape). One
    compile per process and shape; the same values to float rounding."""
    if "ce" not in _COMPILED:
        _COMPILED["ce"] = torch.compile(plain_cross_entropy, fullgraph=True, dynamic=False)
    return _COMPILED["ce"]


# Rows of logits per chunk in scoring_cross_entropy: about 2 MiB of float32 at a vocabulary of 8192, so a
# chunk's capped logits stay in a core's L2 through tanh, log-sum-exp and the target's pick.
SCORING_CHUNK_ELEMENTS = 1 << 19


def scoring_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, softcap: float) -> torch.Tensor:
    """Per-target softcapped cross-entropy (float32, 0 where the target is -1) without autograd, a chunk of
    rows at a time: the plain chain makes four passes over the whole [tokens, vocab] logits (divide, tanh,
    scale, log-softmax), each a round trip to memory; here each chunk is capped in place and reduced while
    cached. The same float32 operations as F.cross_entropy on the capped logits, so the same values to float
    rounding. For evaluation (model.evaluate), where the logits of a wide batch are the largest tensor."""
    n, vocab = logits.shape
    chunk = max(1, SCORING_CHUNK_ELEMENTS // vocab)
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    # One intra-op thread: a cached chunk's ops are too short to share, and on a busy machine each op's
    # fork and join across threads cost more than the op (bench/eval_bench.py: 2x slower with two threads).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for start in range(0, n, chunk):
            z = logits[start:start + chunk].float()
            z = torch.tanh(z / softcap).mul_(softcap) if softcap > 0 else z
            t = targets[start:start + chunk]
            picked = z.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1)
            out[start:start + chunk] = torch.where(t >= 0, torch.logsumexp(z, 1) - picked, 0.0)
    finally:
        torch.set_num_threads(threads)
    return out


def get_ops(impl: str = "auto") -> Ops:
    """Ops for a trial's `kernels` setting.

    "torch": the plain PyTorch compositions with autograd's own backward (fastest on the CPU, measured by
    bench.trainer_bench). "reference": the ops as autograd Functions with hand-written backward, the NKI
    kernels' CPU twin. "nki": the NKI kernels, on a NeuronCore or in the NKI CPU simulator (NKI_SIMULATOR=1);
    a ValueError with a one-line reason where they cannot run. "auto": "torch". Whether a node may gamble on
    the NKI kernels is the trainer's call (model.kernel_choice reads the node's preflight report) and reaches
    here as "nki" or "torch"; these ops alone never pick untested kernels.
    """
    if impl not in IMPLS:
        raise ValueError(f"kernels must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl in ("torch", "reference"):
        return Ops(impl)
    if impl == "auto":
        return Ops("torch")
    if not _nki.NKI_AVAILABLE:
        raise ValueError(f"kernels='nki' is unavailable: {_nki.unavailable_reason()}")
    if not (_nki.simulating() or _nki.neuron_device_available()):
        raise ValueError("kernels='nki' needs a NeuronCore, or NKI_SIMULATOR=1 to run the kernels on the CPU")
    return Ops("nki")
