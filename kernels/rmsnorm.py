"""RMSNorm without a weight, as `model.gpt.rms_norm`: y = x * rsqrt(mean(x^2, last dim) + eps).

eps is F.rms_norm's default, the machine epsilon of the dtype it computes in (float32 for 16- and 32-bit
inputs, float64 for float64), and the math runs in that dtype before casting back. The fused op reads x
once, writes y once and keeps one float32 rstd per row for the backward, where autograd's unfused chain
keeps several full-size intermediates.

Backward: the NKI path uses the NKI backward kernel (`rmsnorm_bwd`); the reference path the same formula
in PyTorch, dx = rstd * (dy - xhat * mean(dy * xhat)) with xhat = x * rstd. Each path is a pair of PyTorch
custom operators (`trnsweep::rmsnorm_<impl>` and its backward), the backward registered as the forward's
autograd formula, so torch.compile sees one opaque node each way (kernels._nki.define_op).
"""

from __future__ import annotations

from typing import Any

import torch

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


def _fwd_fake(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x2), x2.new_empty((x2.shape[0], 1), dtype=_acc_dtype(x2.dtype))


def _bwd_fake(dy2: torch.Tensor, x2: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x2)


def _nki_fwd(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return nki_forward(x2)


def _nki_bwd(dy2: torch.Tensor, x2: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    return nki_backward(dy2, x2, rstd)


def _ref_fwd(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return reference_forward(x2)


def _ref_bwd(dy2: torch.Tensor, x2: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    return reference_backward(dy2, x2, rstd)


def _register(impl: str, fwd: Any, bwd: Any) -> Any:
    """The forward op `trnsweep::rmsnorm_<impl>` with its backward op as autograd formula (both paths alike)."""
    nki_backed = impl == "nki"
    fwd_op = _nki.define_op(f"rmsnorm_{impl}", fwd, _fwd_fake, nki_backed)
    bwd_op = _nki.define_op(f"rmsnorm_bwd_{impl}", bwd, _bwd_fake, nki_backed)

    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.save_for_backward(inputs[0], output[1])

    def backward(ctx: Any, dy: torch.Tensor, _drstd: torch.Tensor | None) -> torch.Tensor:
        x2, rstd = ctx.saved_tensors
        return bwd_op(dy.contiguous(), x2, rstd)

    fwd_op.register_autograd(backward, setup_context=setup_context)
    return fwd_op


OPS = {"reference": _register("reference", _ref_fwd, _ref_bwd), "nki": _register("nki", _nki_fwd, _nki_bwd)}


def rms_norm(x: torch.Tensor, impl: str = "reference") -> torch.Tensor:
    """Fused RMSNorm over the last dimension; impl is "reference" or "nki" (resolve "auto" with get_ops)."""
    y, _ = OPS[impl](x.reshape(-1, x.shape[-1]))
    return y.view(x.shape)
