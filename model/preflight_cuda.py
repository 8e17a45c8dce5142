"""The device side of the preflight on a CUDA node: what torch sees, and the trainer's throughput.

    python -m model.preflight gpu --device cuda
    python -m model.preflight throughput --device cuda --seconds 60 --json

``gpu`` reports torch's build (``torch.version.cuda``: None for a CPU-only wheel), whether CUDA is usable
(``torch.cuda.is_available()``), the NCCL and cuDNN versions and each visible GPU's name, memory and
compute capability. ``throughput`` trains the real trainer (``model.train.train``, as a trial runs it:
charged clock, excluded warm-up steps, bf16 autocast where the device has it, ``torch.compile``) at the
phase-1 baseline shape for ``--seconds`` of charged time and reports tokens/s, MFU (model.counts' training
FLOPs per token x tokens/s over the device's dense bf16 peak, model.device), the median step and the peak
memory. Both run the same code on ``--device cpu`` (a rehearsal where no GPU is), where only the
device-specific calls differ: cores and RAM instead of GPUs, float32 instead of bf16, no peak, so no MFU.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import torch

from model import device as devices

# The phase-1 baseline (docs/competition.md): depth 10, width 640, vocab 8192, sequences of 2048 tokens; head
# size 128 as autoresearch and nanochat use (5 heads); 32 sequences a micro-step, phase 1's largest batch.
BASELINE = {"depth": 10, "model_dim": 640, "head_dim": 128, "vocab_size": 8192, "seq_len": 2048, "batch_size": 32}
DEFAULT_SECONDS = 60.0


def _ram_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def probe_gpu(requested: str) -> dict[str, Any]:
    """torch's CUDA build and the devices it sees; on the CPU path the cores and RAM stand in for GPUs."""
    kind = devices.pick_kind(requested)
    out: dict[str, Any] = {"kind": kind, "torch": torch.__version__, "cuda_build": torch.version.cuda,
                           "cuda_available": bool(torch.cuda.is_available()), "nccl": None, "cudnn": None,
                           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                           "device_count": 0, "devices": []}
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        version = torch.cuda.nccl.version()  # a tuple (2, 27, 3); an int in older releases
        out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    if kind == "cuda" and out["cuda_available"]:
        out["cudnn"] = torch.backends.cudnn.version()
        out["device_count"] = torch.cuda.device_count()
        for i in range(out["device_count"]):
            p = torch.cuda.get_device_properties(i)
            peak = next((v for k, v in devices.CUDA_BF16_FLOPS.items() if k in p.name), None)
            out["devices"].append({"index": i, "name": p.name, "memory_bytes": int(p.total_memory),
                                   "capability": f"{p.major}.{p.minor}", "peak_bf16_flops": peak})
    elif kind == "cpu":  # a rank is a process: the cores stand in for GPUs
        out["device_count"] = os.cpu_count() or 1
        out["devices"].append({"index": 0, "name": platform.processor() or platform.machine(),
                               "memory_bytes": _ram_bytes(), "capability": None, "peak_bf16_flops": None})
    return out


def _device_name(rt: devices.Runtime) -> str:
    if rt.kind == "cuda":
        return torch.cuda.get_device_name(rt.device)
    return platform.processor() or platform.machine()


def probe_throughput(requested: str, seconds: float, shape: dict[str, int], compile_: bool,
                     data: str = "", cache_dir: str = "runs/cache") -> dict[str, Any]:
    """The trainer at ``shape`` for ``seconds`` of charged time, on one device; what a trial's steps cost."""
    from model import train
    from model.config import parse_config, resolve_batch

    t0 = time.perf_counter()
    b, t = int(shape["batch_size"]), int(shape["seq_len"])
    config = {**shape, "device": requested, "compile": compile_, "compile_optimizer": compile_,
              "compile_loss": compile_, "data": data, "cache_dir": cache_dir, "eval_fractions": [],
              "eval_tokens": b * t, "final_eval_tokens": t, "save_checkpoint": False, "core_bundle": ""}
    cfg = parse_config(config, budget_s=seconds)
    rt = devices.setup(requested)
    try:
        resolve_batch(cfg, rt.world_size)
        try:
            result = train.train(cfg, rt, train.Events(False, False), None)
        except (MemoryError, torch.OutOfMemoryError) as e:  # as model.train.main records it: the sweep names the fix
            result = {"status": "failed", "reason": f"out of memory: {(str(e).splitlines() or ['MemoryError'])[0]}"}
        name, peak = _device_name(rt), rt.peak_flops()
    finally:
        devices.teardown()
    keys = ("status", "reason", "steps", "train_seconds", "startup_seconds", "tokens_per_second",
            "flops_per_token", "model_flops_per_second", "mfu", "step_seconds_median", "step_seconds_max",
            "peak_memory_bytes", "params", "graph_breaks", "compiled_graphs", "excluded_steps", "step_seconds_sum",
            "data_seconds", "forward_seconds", "backward_seconds", "optimizer_seconds", "sync_seconds",
            "optimizer_compiled", "optimizer_compile_seconds", "loss_compiled", "loss_compile_seconds")
    out = {k: result.get(k) for k in keys}
    out.update(device=str(rt.device), kind=rt.kind, device_name=name, peak_flops=peak, compile=compile_,
               dtype=str(rt.autocast_dtype).removeprefix("torch.") if rt.autocast_dtype else "float32",
               shape=dict(shape), seconds=seconds, wall_seconds=round(time.perf_counter() - t0, 2))
    out["summary"] = summary(out)  # the line the sweep's table shows
    return out


def summary(out: dict[str, Any]) -> str:
    """One line a person reads: tokens/s, MFU, step, memory, shape."""
    if out.get("error") or out.get("status") != "ok":
        return f"throughput: {out.get('error') or out.get('reason') or out.get('status')}"
    s = out["shape"]
    mfu = (f"MFU {out['mfu']:.1%}" if out.get("mfu") is not None
           else f"MFU n/a (no bf16 peak known for {out['device_name']})")
    return (f"{out['tokens_per_second']:,.0f} tokens/s, {mfu}, step {out['step_seconds_median']:.3f} s, peak memory "
            f"{(out['peak_memory_bytes'] or 0) / 2**30:.1f} GiB; depth {s['depth']}, width {s['model_dim']}, seq "
            f"{s['seq_len']}, batch {s['batch_size']}, {out['dtype']}, {'compiled' if out['compile'] else 'eager'}, "
            f"{out['steps']} steps in {out['train_seconds']:.0f} s charged on {out['device_name']}")
