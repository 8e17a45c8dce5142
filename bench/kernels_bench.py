"""Fused reference ops against the unfused PyTorch chains they replace, on the CPU: forward+backward time and
the activation bytes autograd keeps for the backward (inputs and weights not counted: both keep those).

The NKI kernels cannot run here; these figures say what the reference path costs or saves, e.g. for a trial
that sets kernels="reference" on a GPU or CPU, and how much activation memory fusing frees on any device.
Run alone with `python -m bench.kernels_bench`.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.ops import get_ops

REPEATS = 5
SOFTCAP = 15.0


def _saved_bytes(fn: Callable[[], torch.Tensor], exclude: tuple[torch.Tensor, ...]) -> int:
    """Bytes of distinct storages autograd saves while fn runs, leaving out the given inputs'."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _step_seconds(fn: Callable[[], torch.Tensor], params: tuple[torch.Tensor, ...]) -> float:
    def once() -> float:
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        fn().sum().backward()
        return time.perf_counter() - t0

    once()  # warm-up
    return statistics.median(once() for _ in range(REPEATS))


def _row(op: str, shape: str, fused: Callable[[], torch.Tensor], plain: Callable[[], torch.Tensor],
         inputs: tuple[torch.Tensor, ...]) -> dict:
    fused_s, plain_s = _step_seconds(fused, inputs), _step_seconds(plain, inputs)
    fused_b, plain_b = _saved_bytes(fused, inputs), _saved_bytes(plain, inputs)
    return {"bench": "kernels_reference_vs_unfused", "op": op, "shape": shape, "threads": torch.get_num_threads(),
            "repeats": REPEATS, "fused_step_s": fused_s, "unfused_step_s": plain_s,
            "speedup": plain_s / fused_s, "fused_saved_mib": fused_b / 2**20, "unfused_saved_mib": plain_b / 2**20}


def run() -> list[dict]:
    torch.manual_seed(0)
    ops = get_ops("reference")
    rows = []

    x = torch.randn(8, 256, 640, requires_grad=True)
    rows.append(_row("rms_norm", "8x256x640 f32", lambda: ops.rms_norm(x), lambda: F.rms_norm(x, (640,)), (x,)))

    x = torch.randn(4, 256, 640, requires_grad=True)
    w_fc = (torch.randn(2560, 640) / 25).requires_grad_()
    w_proj = (torch.randn(640, 2560) / 50).requires_grad_()
    rows.append(_row("relu2_mlp", "4x256x640, mlp 2560, f32", lambda: ops.relu2_mlp(x, w_fc, w_proj),
                     lambda: F.linear(F.relu(F.linear(x, w_fc)).square(), w_proj), (x, w_fc, w_proj)))

    logits = (torch.randn(4, 256, 8192) * 4).requires_grad_()
    targets = torch.randint(0, 8192, (4, 256))

    def plain_ce() -> torch.Tensor:
        z = SOFTCAP * torch.tanh(logits / SOFTCAP)
        return F.cross_entropy(z.view(-1, 8192), targets.view(-1), ignore_index=-1)

    rows.append(_row("softcap_cross_entropy", "1024x8192 f32", lambda: ops.softcap_cross_entropy(
        logits, targets, SOFTCAP), plain_ce, (logits,)))
    return rows


if __name__ == "__main__":
    for row in run():
        print(json.dumps(row), flush=True)
