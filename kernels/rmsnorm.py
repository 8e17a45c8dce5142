"""RMSNorm without a weight, as `model.gpt.rms_norm`: y = x * rsqrt(mean(x^2, last dim) + eps).

eps is F.rms_norm's default, the machine epsilon of the dtype it computes in (float32 for 16- and 32-bit
inputs, float64 for float64), and the math runs in that dtype before casting back. The fused op reads x
once, writes y once and keeps one float32 rstd per row for the backward, where autograd's unfused chain
keeps several full-size intermediates.

Backward: the NKI path uses the NKI backward kernel (`rmsnorm_bwd`); the reference path the same formula
in PyTorch, dx = rstd * (dy - xhat * mean(dy * xhat)) with xhat = x * rstd.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from kernels import _nki


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_eps(dtype: torch.dtype) -> float:
    """F.rms_norm's eps when none is given, for an input of `dtype`."""
    return torch.finfo(_acc_dtype(dtype)).eps


def reference_forward(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [N, D] -> (y [N, D] in x2's dtype, rstd [N, 1] in the compute dtype)."""
    xf = x2.to(_acc_dtype(x2.dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + default_eps(x2.dtype))
    return (xf * rstd).to(x2.dtype), rstd


def reference_backward(dy2: torch.Tensor, x2: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    xf, gf = x2.to(rstd.dtype), dy2.to(rstd.dtype)
    xhat = xf * rstd
    return (rstd * (gf - xhat * (gf * xhat).mean(-1, keepdim=True))).to(x2.dtype)


def nki_forward(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd = _nki.launch(_nki.kernels().rmsnorm_fwd, x2.contiguous(), default_eps(torch.float32))
    return y.to(device=x2.device, dtype=x2.dtype), rstd.to(device=x2.device, dtype=torch.float32).view(-1, 1)


def nki_backward(dy2: torch.Tensor, x2: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    dx = _nki.launch(_nki.kernels().rmsnorm_bwd, dy2.contiguous(), x2.contiguous(), rstd.contiguous())
    return dx.to(device=x2.device, dtype=x2.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper shared by both implementations; `use_nki` picks the kernels for forward and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, use_nki: bool) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y, rstd = nki_forward(x2) if use_nki else reference_forward(x2)
        ctx.save_for_backward(x2, rstd)
        ctx.use_nki = use_nki
        return y.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        x2, rstd = ctx.saved_tensors
        dy2 = dy.reshape(x2.shape)
        dx = nki_backward(dy2, x2, rstd) if ctx.use_nki else reference_backward(dy2, x2, rstd)
        return dx.view(dy.shape), None


def rms_norm(x: torch.Tensor, impl: str = "reference") -> torch.Tensor:
    """Fused RMSNorm over the last dimension; impl is "reference" or "nki" (resolve "auto" with get_ops)."""
    return RMSNormFunction.apply(x, impl == "nki")
