"""The device side of ``python -m sweep preflight``: probes that need torch, one JSON line each on stdout.

    python -m model.preflight device
    python -m model.preflight compile --device neuron --salt 0.7311
    python -m model.preflight kernels --device neuron --widths 512,1024 --mlp-ratio 4 --vocab 8192
    python -m model.preflight gpu --device cuda
    python -m model.preflight throughput --device cuda --seconds 60 --json

The sweep imports no torch, so it runs these in child processes and judges what they print:

- ``device``: whether PyTorch's Neuron backend is importable and available (``torch.neuron.is_available()``)
  and how many NeuronCores it counts (``torch.neuron.device_count()``) at this process's
  ``NEURON_LOGICAL_NC_CONFIG``.
- ``compile``: one small function through ``torch.compile(backend="neuron")``, with ``salt`` baked into the
  graph as a constant so that a fresh salt is a fresh graph; the sweep runs it twice with one salt and
  reads the NEFF cache directory before and after each run (the second must add nothing: a cache hit).
  ``--backend inductor`` (a CUDA node) compiles with PyTorch's own compiler instead and counts its FX graph
  and AOTAutograd cache hits and misses (the sweep points ``TORCHINDUCTOR_CACHE_DIR`` at a fresh directory).
- ``kernels``: each fused op through ``kernels.ops.get_ops("nki")`` on bf16 tensors on the device, forward and
  input gradients, against the PyTorch op in float32 on the CPU from the same bf16 inputs; the error is
  max |nki - reference| / max |reference| and must be at most ``--tol``. Each op runs twice: eager, and under
  ``torch.compile`` as trials run it (``backend="neuron"`` on Neuron, where ``torch_neuronx.nki_op`` hands the
  op to the compiler; ``aot_eager`` elsewhere, which traces the op with FakeTensors the same way). A width the
  kernel's buffer plan refuses (its one-line ValueError, after which the trainer uses the PyTorch op) is recorded
  as refused.

- ``gpu`` and ``throughput``: a CUDA node's (model.preflight_cuda).

A probe that cannot even start still prints its line (``"error"``) and exits 0; the sweep names the failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kernels.neuron import neuron_available
from model.preflight_cuda import BASELINE, DEFAULT_SECONDS, probe_gpu, probe_throughput, summary

DEFAULT_TOL = 2e-2  # bf16 keeps 8 bits of mantissa (2^-8 = 0.4%); a few roundings of sums stay well below 2%
KERNEL_ROWS = 256  # two 128-row partition tiles, so both LNC-2 halves get rows


def _device(requested: str) -> torch.device:
    """The device a probe runs on, indexed by the trainer's own rule (model.device.device_index)."""
    from model.device import device_index, pick_kind

    kind = pick_kind(requested)
    return torch.device(kind, device_index(kind, int(os.environ.get("LOCAL_RANK", 0))))


def _sync(device: torch.device) -> None:
    if device.type == "neuron":
        torch.neuron.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def probe_device() -> dict[str, Any]:
    """Is the backend here, and how many NeuronCores does it count at this process's LNC."""
    out: dict[str, Any] = {"lnc": os.environ.get("NEURON_LOGICAL_NC_CONFIG", ""), "available": False,
                           "device_count": 0, "torch": torch.__version__}
    out["available"] = neuron_available()
    neuron = getattr(torch, "neuron", None)
    if out["available"] and neuron is not None:
        out["device_count"] = int(neuron.device_count())
    elif neuron is None:
        out["error"] = "torch.neuron is missing: torch-neuronx is not installed in this Python, or did not load"
    return out


def probe_compile(requested: str, salt: float, backend: str = "neuron") -> dict[str, Any]:
    """Compile and run one salted graph with ``backend``; the sweep reads the cache around it."""
    neuron_available()  # loads torch_neuronx where torch did not autoload it: it registers the backend
    device = _device(requested)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (torch.sin(x * salt) + x).square().sum(dim=-1)

    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    x = torch.linspace(-1.0, 1.0, 512, dtype=torch.float32).reshape(4, 128).to(device)
    t0 = time.perf_counter()
    y = compiled(x)
    _sync(device)
    seconds = time.perf_counter() - t0
    want = fn(x.cpu())
    err = float((y.cpu() - want).abs().max())
    out = {"device": str(device), "seconds": round(seconds, 3), "max_abs_err": err, "salt": salt, "backend": backend,
           "max_abs_ref": float(want.abs().max())}
    if backend == "inductor":
        from torch._dynamo.utils import counters

        out["cache_hits"] = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
        out["cache_misses"] = counters["inductor"]["fxgraph_cache_miss"]
    return out


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach().float()
    scale = float(want.abs().max()) or 1.0
    return float((got.detach().float().cpu() - want).abs().max()) / scale


MODES = ("eager", "compiled")


def _compile_backend(device: torch.device) -> str:
    return "neuron" if device.type == "neuron" else "aot_eager"


def _compare(name: str, run: Callable[..., torch.Tensor], inputs: list[torch.Tensor], device: torch.device,
             nki: Any, ref: Any, mode: str = "eager") -> dict[str, Any]:
    """Forward and input gradients of ``run(ops, *inputs)``: nki on the device in bf16 (eager, or compiled as a
    trial compiles it), reference on the CPU in fp32."""
    gen = torch.Generator().manual_seed(1)
    dev_in = [t.detach().clone().to(device).requires_grad_(t.is_floating_point()) for t in inputs]
    cpu_in = [t.detach().float().requires_grad_(True) if t.is_floating_point() else t for t in inputs]

    def on_device(*xs: torch.Tensor) -> torch.Tensor:
        return run(nki, *xs)

    call = torch.compile(on_device, backend=_compile_backend(device), fullgraph=True) if mode == "compiled" \
        else on_device
    y = call(*dev_in)
    want = run(ref, *cpu_in)
    grad = torch.randn(want.shape, generator=gen)
    y.backward(grad.to(device=device, dtype=y.dtype))
    want.backward(grad)
    _sync(device)
    errs = {"out": _rel_err(y, want)}
    for i, (d, c) in enumerate(zip(dev_in, cpu_in, strict=True)):
        if d.is_floating_point():
            errs[f"grad{i}"] = _rel_err(d.grad, c.grad)
    return {"kernel": name, "mode": mode, "err": max(errs.values()), "errs": {k: round(v, 6) for k, v in errs.items()}}


def probe_kernels(requested: str, widths: list[int], mlp_ratio: float, vocab: int, softcap: float,
                  tol: float) -> dict[str, Any]:
    """Every fused op at every width: nki on the device in bf16 against the PyTorch op in fp32."""
    from kernels.ops import get_ops

    nki, ref = get_ops("nki"), get_ops("torch")  # first: without nki there is nothing to check on the device
    device = _device(requested)
    gen = torch.Generator().manual_seed(0)
    results: list[dict[str, Any]] = []

    def bf16(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    targets = torch.randint(0, vocab, (KERNEL_ROWS,), generator=gen)
    targets[:5] = -1  # ignored targets, as padding gives them
    cases: list[tuple[str, int, Callable[..., torch.Tensor], list[torch.Tensor]]] = []
    for w in widths:
        hidden = int(round(w * mlp_ratio))
        cases.append(("rms_norm", w, lambda ops, x: ops.rms_norm(x), [bf16(KERNEL_ROWS, w, scale=2.0)]))
        cases.append(("relu2_mlp", w, lambda ops, x, a, b: ops.relu2_mlp(x, a, b),
                      [bf16(KERNEL_ROWS, w), bf16(hidden, w, scale=w ** -0.5), bf16(w, hidden, scale=hidden ** -0.5)]))
    cases.append(("softcap_cross_entropy", vocab,
                  lambda ops, lg, t: ops.softcap_cross_entropy(lg, t, softcap, "mean"),
                  [bf16(KERNEL_ROWS, vocab, scale=3.0), targets]))
    for (name, width, run, inputs), mode in ((case, mode) for case in cases for mode in MODES):
        t0 = time.perf_counter()
        try:
            row = _compare(name, run, inputs, device, nki, ref, mode)
            row["ok"] = row["err"] <= tol
        except ValueError as e:  # the kernel's own refusal (its buffer plan); the trainer uses the PyTorch op
            row = {"kernel": name, "mode": mode, "ok": True, "refused": str(e).splitlines()[0][:300]}
        except Exception as e:
            row = {"kernel": name, "mode": mode, "ok": False,
                   "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        row.update(width=width, seconds=round(time.perf_counter() - t0, 3))
        results.append(row)
    return {"device": str(device), "dtype": "bfloat16", "tol": tol, "rows": KERNEL_ROWS, "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m model.preflight", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="probe", required=True)
    sub.add_parser("device")
    c = sub.add_parser("compile")
    c.add_argument("--device", default="auto")
    c.add_argument("--salt", type=float, required=True)
    c.add_argument("--backend", choices=("neuron", "inductor"), default="neuron")
    sub.add_parser("gpu").add_argument("--device", default="auto")
    t = sub.add_parser("throughput", help="the trainer at the phase-1 baseline shape for --seconds")
    t.add_argument("--device", default="auto")
    t.add_argument("--seconds", type=float, default=DEFAULT_SECONDS, help="charged training seconds")
    for key, value in BASELINE.items():
        t.add_argument("--" + key.replace("_", "-"), type=int, default=value)
    t.add_argument("--no-compile", dest="compile", action="store_false", help="eager (compiled by default)")
    t.add_argument("--data", default="", help="the trainer's data (default: the demo corpus)")
    t.add_argument("--json", action="store_true", help="only the JSON line (else a summary line first)")
    k = sub.add_parser("kernels")
    k.add_argument("--device", default="auto")
    k.add_argument("--widths", default="512", help="comma-separated model widths")
    k.add_argument("--mlp-ratio", type=float, default=4.0)
    k.add_argument("--vocab", type=int, default=8192)
    k.add_argument("--softcap", type=float, default=15.0)
    k.add_argument("--tol", type=float, default=DEFAULT_TOL)
    args = p.parse_args(argv)
    try:
        if args.probe == "device":
            out = probe_device()
        elif args.probe == "compile":
            out = probe_compile(args.device, args.salt, args.backend)
        elif args.probe == "gpu":
            out = probe_gpu(args.device)
        elif args.probe == "throughput":
            shape = {k: getattr(args, k) for k in BASELINE}
            out = probe_throughput(args.device, args.seconds, shape, args.compile, args.data)
        else:
            widths = [int(w) for w in args.widths.split(",") if w.strip()]
            out = probe_kernels(args.device, widths, args.mlp_ratio, args.vocab, args.softcap, args.tol)
    except Exception as e:  # the sweep reports it as the check's failure, with this line
        out = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"}
    if args.probe == "throughput" and not args.json:
        print(summary(out), flush=True)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
