"""The ReLU² MLP of the GPT block: y = relu(x @ W_fc^T)^2 @ W_proj^T, weights as nn.Linear stores them
(W_fc [mlp_dim, dim], W_proj [dim, mlp_dim]).

Fused, the [tokens, mlp_dim] activation relu(h)^2 never reaches device memory in the forward, and the
backward keeps only the pre-activation h (autograd's unfused chain keeps relu(h) and relu(h)^2 as well).
Under autocast the op computes in the autocast dtype exactly as F.linear would, and returns gradients in
the parameters' own dtypes.

Backward: reference (PyTorch matmuls) on both paths. The NKI path's forward kernel writes h^T for it; a
blind-written NKI backward would be four more tiled matmuls with nothing to check them against here, while
the reference backward is plain matmuls the Neuron compiler already handles well.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from kernels import _nki

SBUF_BUDGET_BYTES = 150 * 1024  # per partition, of the 192 KiB a NeuronCore-v3 partition has; the rest is slack


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


def nki_sbuf_bytes(dim: int, mlp_dim: int, out_dim: int, itemsize: int) -> int:
    """Per-partition SBUF the NKI forward needs: both weights resident, plus one 512-token block's tiles."""
    k_chunks, h_chunks = -(-dim // 128), -(-mlp_dim // 128)
    weights = (k_chunks * mlp_dim + h_chunks * out_dim) * itemsize
    block = (k_chunks * 512 + h_chunks * 512 + 2 * 512 + dim + 512) * itemsize + 512 * 4
    return weights + block


def nki_forward(x2: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    need = nki_sbuf_bytes(x2.shape[1], w_fc.shape[0], w_proj.shape[0], x2.element_size())
    if need > SBUF_BUDGET_BYTES:
        raise ValueError(
            f"relu2_mlp NKI kernel keeps both weights in SBUF and needs {need // 1024} KiB per partition for "
            f"dim {x2.shape[1]}, mlp_dim {w_fc.shape[0]} in {x2.dtype} (budget {SBUF_BUDGET_BYTES // 1024} KiB); "
            "use kernels='reference' for this width")
    y, pre_t = _nki.launch(_nki.kernels().relu2_mlp_fwd, x2.contiguous(), w_fc.t().contiguous(),
                           w_proj.t().contiguous())
    return y.to(device=x2.device, dtype=x2.dtype), pre_t.to(device=x2.device, dtype=x2.dtype).t()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype F.linear would compute in here: autocast's when it is on for x's device, else x's own."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


class ReLU2MLPFunction(torch.autograd.Function):
    """Autograd wrapper shared by both implementations; `use_nki` picks the forward kernel."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor, use_nki: bool) -> torch.Tensor:
        dtype = _compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        wf, wp = w_fc.to(dtype), w_proj.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            y, h = nki_forward(x2, wf, wp) if use_nki else reference_forward(x2, wf, wp)
        ctx.save_for_backward(x2, wf, wp, h)
        ctx.dtypes = (x.dtype, w_fc.dtype, w_proj.dtype)
        return y.view(*x.shape[:-1], wp.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        x2, wf, wp, h = ctx.saved_tensors
        x_dtype, wf_dtype, wp_dtype = ctx.dtypes
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, wp.shape[0]).to(x2.dtype)
            dx, dwf, dwp = reference_backward(dy2, x2, wf, wp, h)
        return dx.view(*dy.shape[:-1], x2.shape[1]).to(x_dtype), dwf.to(wf_dtype), dwp.to(wp_dtype), None


def relu2_mlp(x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor, impl: str = "reference") -> torch.Tensor:
    """Fused relu(x @ w_fc^T)^2 @ w_proj^T; impl is "reference" or "nki" (resolve "auto" with get_ops)."""
    return ReLU2MLPFunction.apply(x, w_fc, w_proj, impl == "nki")
