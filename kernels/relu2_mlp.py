"""The ReLU² MLP of the GPT block: y = relu(x @ W_fc^T)^2 @ W_proj^T, weights as nn.Linear stores them
(W_fc [mlp_dim, dim], W_proj [dim, mlp_dim]).

Fused, the [tokens, mlp_dim] activation relu(h)^2 never reaches device memory in the forward, and the
backward keeps only the pre-activation h (autograd's unfused chain keeps relu(h) and relu(h)^2 as well).
Under autocast the op computes in the autocast dtype exactly as F.linear would, and returns gradients in
the parameters' own dtypes.

Backward: reference (PyTorch matmuls) on both paths, registered as the autograd formula of the custom
operator `trnsweep::relu2_mlp_<impl>` (kernels._nki.define_op). The NKI path's forward kernel writes h^T for
it; a blind-written NKI backward would be four more tiled matmuls with nothing to check them against here,
while the reference backward is plain matmuls the Neuron compiler already handles well.

The NKI forward's SBUF plan (`mlp_plan`) keeps both weights resident where they fit and otherwise streams
them in hidden groups, so its need grows with the width alone; a shape no plan fits is refused, and the
model then uses the PyTorch op for the MLP and records it (model.kernel_choice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels import _nki

P = 128  # SBUF partitions
TOKEN_BLOCK = 512  # tokens per block of the NKI forward (kernels.nki_kernels.TOKEN_BLOCK)
SBUF_PARTITION_BYTES = 224 * 1024  # NeuronCore-v3 (trn2): 28 MiB of SBUF = 128 partitions x 224 KiB (arch guide)
# The plan's budget is NKI's usable SBUF per partition (nl.tile_size.sbuf_fmax_bytes) wherever nki is
# importable (kernels._nki.usable_sbuf_bytes). Without it, this fallback: NKI documents the usable size as
# total minus reserved bytes without the amount, so 32 KiB of slack is a guess.
SBUF_BUDGET_BYTES = 192 * 1024
STREAM_GROUPS = (512, 256, 128)  # hidden units per group when the weights cannot stay resident


@dataclass(frozen=True)
class MlpPlan:
    """How the NKI forward holds the weights: hidden groups of `group` units, kept for the whole call
    (`resident`) or loaded again for every token block; `sbuf_bytes` per partition at the peak."""

    group: int
    resident: bool
    sbuf_bytes: int


def nki_sbuf_bytes(dim: int, mlp_dim: int, out_dim: int, itemsize: int, group: int, resident: bool) -> int:
    """Per-partition SBUF the NKI forward holds at its peak under a plan (an upper bound: the stand-in's
    measured peak is checked against it in tests/kernels)."""
    kc, gc, b = -(-dim // P), -(-group // P), itemsize
    if resident:
        hc = sum(-(-gs // P) for gs in _group_sizes(mlp_dim, group))
        weights = kc * mlp_dim * b + hc * out_dim * b
    else:
        weights = kc * group * b + gc * out_dim * b
    block = (kc * TOKEN_BLOCK * b + 4 * out_dim * 4 + gc * TOKEN_BLOCK * b + TOKEN_BLOCK * b + TOKEN_BLOCK * 4
             + max(dim, out_dim) * b)
    return weights + block


def _group_sizes(mlp_dim: int, group: int) -> list[int]:
    return [min(group, mlp_dim - g0) for g0 in range(0, mlp_dim, group)]


def sbuf_budget() -> int:
    """Per-partition SBUF the plan may use: NKI's figure where nki gives one, else SBUF_BUDGET_BYTES."""
    return _nki.usable_sbuf_bytes() or SBUF_BUDGET_BYTES


def mlp_plan(dim: int, mlp_dim: int, out_dim: int, itemsize: int, budget: int | None = None) -> MlpPlan | None:
    """The NKI forward's buffer plan for a shape and dtype size, or None when no plan fits the budget
    (``sbuf_budget()`` unless given): weights resident if they fit, else streamed in the largest hidden
    group that fits."""
    budget = sbuf_budget() if budget is None else budget
    group = min(STREAM_GROUPS[0], mlp_dim)
    need = nki_sbuf_bytes(dim, mlp_dim, out_dim, itemsize, group, True)
    if need <= budget:
        return MlpPlan(group, True, need)
    for group in STREAM_GROUPS:
        need = nki_sbuf_bytes(dim, mlp_dim, out_dim, itemsize, min(group, mlp_dim), False)
        if need <= budget:
            return MlpPlan(min(group, mlp_dim), False, need)
    return None


def reference_forward(x2: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [N, D] -> (y [N, Dout], h [N, H] pre-activation), all in x2's dtype."""
    h = x2 @ w_fc.t()
    return torch.relu(h).square() @ w_proj.t(), h


def reference_backward(dy2: torch.Tensor, x2: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor,
                       h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW_fc, dW_proj) in the compute dtype, in the order autograd's own formulas use."""
    r = torch.relu(h)
    dw_proj = dy2.t() @ r.square()
    dh = (dy2 @ w_proj) * (2.0 * r)
    return dh @ w_fc, dh.t() @ x2, dw_proj


def nki_forward(x2: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y [N, Dout], h^T [H, N]) from the NKI kernel, under the buffer plan for this shape."""
    budget = sbuf_budget()
    plan = mlp_plan(x2.shape[1], w_fc.shape[0], w_proj.shape[0], x2.element_size(), budget)
    if plan is None:
        raise ValueError(
            f"relu2_mlp NKI kernel has no SBUF plan for dim {x2.shape[1]}, mlp_dim {w_fc.shape[0]} in {x2.dtype} "
            f"(budget {budget // 1024} KiB per partition); use the PyTorch op for this width")
    y, pre_t = _nki.launch(_nki.kernels().relu2_mlp_fwd, x2.contiguous(), w_fc.t().contiguous(),
                           w_proj.t().contiguous(), plan.group, plan.resident)
    return y.to(device=x2.device, dtype=x2.dtype), pre_t.to(device=x2.device, dtype=x2.dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in here: autocast's when it is on for x's device, else x's own."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def _fake(x2: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x2.new_empty((x2.shape[0], w_proj.shape[0])), x2.new_empty((w_fc.shape[0], x2.shape[0]))


def _nki_fwd(x2: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return nki_forward(x2, w_fc, w_proj)


def _ref_fwd(x2: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y, h = reference_forward(x2, w_fc, w_proj)
    return y, h.t().contiguous()


def _register(impl: str, fwd: Any) -> Any:
    """The op `trnsweep::relu2_mlp_<impl>` -> (y, h^T), with the PyTorch backward as its autograd formula."""
    op = _nki.define_op(f"relu2_mlp_{impl}", fwd, _fake, impl == "nki")

    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.save_for_backward(*inputs, output[1])

    def backward(ctx: Any, dy: torch.Tensor, _dh: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        x2, wf, wp, pre_t = ctx.saved_tensors
        with torch.autocast(dy.device.type, enabled=False):
            return reference_backward(dy.to(x2.dtype), x2, wf, wp, pre_t.t())

    op.register_autograd(backward, setup_context=setup_context)
    return op


OPS = {"reference": _register("reference", _ref_fwd), "nki": _register("nki", _nki_fwd)}


def relu2_mlp(x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor, impl: str = "reference") -> torch.Tensor:
    """Fused relu(x @ w_fc^T)^2 @ w_proj^T; impl is "reference" or "nki" (resolve "auto" with get_ops).

    It computes in the autocast dtype where autocast is on, as F.linear would; the casts sit outside the
    operator, so autograd returns each gradient in its tensor's own dtype.
    """
    dtype = _compute_dtype(x)
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    with torch.autocast(x.device.type, enabled=False):
        y, _ = OPS[impl](x2, w_fc.to(dtype), w_proj.to(dtype))
    return y.view(*x.shape[:-1], w_proj.shape[0])
