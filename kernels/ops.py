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
            logits = logits.float()
            if softcap > 0:
                logits = softcap * torch.tanh(logits / softcap)
            return F.cross_entropy(logits, targets, ignore_index=-1, reduction=reduction)
        return softcap_cross_entropy(logits, targets, softcap, reduction=reduction, impl=self.impl)


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
