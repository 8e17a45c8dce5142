"""Softcapped cross-entropy: z = softcap * tanh(logits / softcap), then cross-entropy with ignore_index=-1,
computed in float32 (float64 for float64 logits) whatever the logits' dtype; softcap 0 means no cap.

Fused, the forward keeps one float32 log-sum-exp per row for the backward instead of autograd's full
[tokens, vocab] capped logits and log-softmax, and the backward rebuilds softmax(z) from the logits and
that row statistic. reduction: 'mean' (over non-ignored targets, NaN when there are none, as
F.cross_entropy), 'sum' or 'none' (one value per target, 0 where ignored).

Backward: the NKI path uses the NKI backward kernel (`softcap_ce_bwd`); the reference path the same formula
in PyTorch, dlogits = g * (softmax(z) - onehot(target)) * (1 - tanh^2).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from kernels import _nki

IGNORE_INDEX = -1
REDUCTIONS = ("mean", "sum", "none")


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def capped(logits: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(z, tanh(logits / softcap) or None without a cap), in the compute dtype."""
    lf = logits.to(_acc_dtype(logits.dtype))
    if softcap > 0:
        u = torch.tanh(lf / softcap)
        return softcap * u, u
    return lf, None


def reference_forward(l2: torch.Tensor, t: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row, 0 where ignored; logsumexp of z per row), both [N] in the compute dtype."""
    z, _ = capped(l2, softcap)
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1)
    return torch.where(t != IGNORE_INDEX, lse - picked, torch.zeros_like(lse)), lse


def reference_backward(l2: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, gscale: torch.Tensor,
                       softcap: float) -> torch.Tensor:
    """dlogits [N, V] in the logits' dtype; gscale [N] is each row's loss weight (0 for ignored rows)."""
    z, u = capped(l2, softcap)
    dz = torch.exp(z - lse.unsqueeze(1))
    valid = (t != IGNORE_INDEX).to(dz.dtype).unsqueeze(1)
    dz.scatter_add_(1, t.clamp_min(0).unsqueeze(1), -valid)
    if u is not None:
        dz = dz * (1 - u * u)
    return (dz * gscale.unsqueeze(1)).to(l2.dtype)


def nki_forward(l2: torch.Tensor, t: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    loss, lse = _nki.launch(_nki.kernels().softcap_ce_fwd, l2.contiguous(), t.to(torch.int32).view(-1, 1),
                            float(softcap))
    acc = _acc_dtype(l2.dtype)
    return loss.to(device=l2.device, dtype=acc).view(-1), lse.to(device=l2.device, dtype=acc).view(-1)


def nki_backward(l2: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, gscale: torch.Tensor,
                 softcap: float) -> torch.Tensor:
    dl = _nki.launch(_nki.kernels().softcap_ce_bwd, l2.contiguous(), t.to(torch.int32).view(-1, 1),
                     lse.float().view(-1, 1), gscale.float().view(-1, 1), float(softcap))
    return dl.to(device=l2.device, dtype=l2.dtype)


class SoftcapCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper shared by both implementations; `use_nki` picks the kernels for forward and backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, softcap: float, reduction: str,
                use_nki: bool) -> torch.Tensor:
        l2 = logits.reshape(-1, logits.shape[-1])
        t = targets.reshape(-1)
        loss, lse = nki_forward(l2, t, softcap) if use_nki else reference_forward(l2, t, softcap)
        ctx.save_for_backward(l2, t, lse)
        ctx.softcap, ctx.reduction, ctx.use_nki = softcap, reduction, use_nki
        ctx.logits_shape = logits.shape
        if reduction == "none":
            return loss.view(targets.shape)
        if reduction == "sum":
            return loss.sum()
        return loss.sum() / (t != IGNORE_INDEX).sum().to(loss.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        l2, t, lse = ctx.saved_tensors
        valid = (t != IGNORE_INDEX).to(lse.dtype)
        if ctx.reduction == "none":
            gscale = grad.reshape(-1).to(lse.dtype) * valid
        elif ctx.reduction == "sum":
            gscale = grad.to(lse.dtype) * valid
        else:
            gscale = grad.to(lse.dtype) * valid / valid.sum()
        backward = nki_backward if ctx.use_nki else reference_backward
        dl = backward(l2, t, lse, gscale, ctx.softcap)
        return dl.view(ctx.logits_shape), None, None, None, None


def softcap_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, softcap: float, reduction: str = "mean",
                          impl: str = "reference") -> torch.Tensor:
    """Cross-entropy of softcapped logits [..., V] against targets [...] (-1 = ignore); float32 result."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables the cap), got {softcap}")
    return SoftcapCrossEntropyFunction.apply(logits, targets, float(softcap), reduction, impl == "nki")
