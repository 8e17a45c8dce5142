"""Softcapped cross-entropy: z = softcap * tanh(logits / softcap), then cross-entropy with ignore_index=-1,
computed in float32 (float64 for float64 logits) whatever the logits' dtype; softcap 0 means no cap.

Fused, the forward keeps one float32 log-sum-exp per row for the backward instead of autograd's full
[tokens, vocab] capped logits and log-softmax, and the backward rebuilds softmax(z) from the logits and
that row statistic. reduction: 'mean' (over non-ignored targets, NaN when there are none, as
F.cross_entropy), 'sum' or 'none' (one value per target, 0 where ignored).

Backward: the NKI path uses the NKI backward kernel (`softcap_ce_bwd`); the reference path the same formula
in PyTorch, dlogits = g * (softmax(z) - onehot(target)) * (1 - tanh^2). Each path is a pair of PyTorch
custom operators (per-row loss and its backward, kernels._nki.define_op); the reduction is PyTorch's.
"""

from __future__ import annotations

from typing import Any

import torch

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


def _fwd_fake(l2: torch.Tensor, t: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    acc = _acc_dtype(l2.dtype)
    return l2.new_empty(l2.shape[0], dtype=acc), l2.new_empty(l2.shape[0], dtype=acc)


def _bwd_fake(l2: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, gscale: torch.Tensor,
              softcap: float) -> torch.Tensor:
    return torch.empty_like(l2)


def _nki_fwd(l2: torch.Tensor, t: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    return nki_forward(l2, t, softcap)


def _nki_bwd(l2: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, gscale: torch.Tensor,
             softcap: float) -> torch.Tensor:
    return nki_backward(l2, t, lse, gscale, softcap)


def _ref_fwd(l2: torch.Tensor, t: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    return reference_forward(l2, t, softcap)


def _ref_bwd(l2: torch.Tensor, t: torch.Tensor, lse: torch.Tensor, gscale: torch.Tensor,
             softcap: float) -> torch.Tensor:
    return reference_backward(l2, t, lse, gscale, softcap)


def _register(impl: str, fwd: Any, bwd: Any) -> Any:
    """The op `trnsweep::softcap_ce_<impl>` -> (loss per row, lse per row), its backward op as autograd formula."""
    nki_backed = impl == "nki"
    fwd_op = _nki.define_op(f"softcap_ce_{impl}", fwd, _fwd_fake, nki_backed)
    bwd_op = _nki.define_op(f"softcap_ce_bwd_{impl}", bwd, _bwd_fake, nki_backed)

    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        l2, t, softcap = inputs
        ctx.save_for_backward(l2, t, output[1])
        ctx.softcap = softcap

    def backward(ctx: Any, dloss: torch.Tensor, _dlse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        l2, t, lse = ctx.saved_tensors
        gscale = dloss.to(lse.dtype) * (t != IGNORE_INDEX).to(lse.dtype)  # ignored rows get no gradient
        return bwd_op(l2, t, lse, gscale.contiguous(), ctx.softcap), None, None

    fwd_op.register_autograd(backward, setup_context=setup_context)
    return fwd_op


OPS = {"reference": _register("reference", _ref_fwd, _ref_bwd), "nki": _register("nki", _nki_fwd, _nki_bwd)}


def softcap_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, softcap: float, reduction: str = "mean",
                          impl: str = "reference") -> torch.Tensor:
    """Cross-entropy of softcapped logits [..., V] against targets [...] (-1 = ignore); float32 result."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables the cap), got {softcap}")
    t = targets.reshape(-1)
    loss, _ = OPS[impl](logits.reshape(-1, logits.shape[-1]), t, float(softcap))
    if reduction == "none":
        return loss.view(targets.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (t != IGNORE_INDEX).sum().to(loss.dtype)
