"""The preflight's CUDA set: ``python -m sweep preflight SPEC`` on a GPU node proves it as the Neuron set proves a trn2.

A node is a GPU node when the spec's trials will train on CUDA there: the spec's device is ``cuda``, or it is
``auto`` and the trainer's own choice (``model.device.pick_kind``, asked in a child) is cuda, or it is auto,
that choice is not neuron and ``nvidia-smi`` is on PATH (a GPU node whose torch cannot use CUDA still gets the
CUDA set, whose ``versions`` check then names the fault). ``--node cuda`` asks for the CUDA set whatever the
spec's device (``--node cuda`` on a ``device = "cpu"`` spec rehearses it where no GPU is: the probes run the
same code with the CPU's cores and RAM standing in for GPUs). The checks, in order:

- ``versions``: torch is a CUDA build (``torch.version.cuda``) with NCCL where the spec runs several ranks.
- ``device``: ``torch.cuda.is_available()`` and ``torch.cuda.device_count()`` covers the spec's ranks, one GPU
  each; names and memory reported.
- ``launch``: the tiny model through the trial's own launch path (``Supervisor``, torchrun) at the spec's ranks;
  every rank must train on its own GPU, ``cuda:LOCAL_RANK``.
- ``compile``: one salted graph through ``torch.compile`` (inductor) on the device in two processes: both must
  match eager; the second should hit the inductor cache (reported, not required).
- ``gpu_monitor``: one ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` report, in place of
  neuron-monitor.
- ``artifacts``: the Neuron set's check (the store takes a write).
- ``throughput``: the real trainer at the phase-1 baseline shape (:data:`THROUGHPUT`, bf16, compiled) for
  :data:`THROUGHPUT_SECONDS` of charged time: tokens/s, MFU, step time and peak memory.

``launch``, ``compile`` and ``throughput`` are skipped (and fail) when ``versions`` or ``device`` failed.
docs/neuron.md, "Preflight on a CUDA node", has the sources.
"""

from __future__ import annotations

import csv
import functools
import random
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from sweep.run import preflight as pf
from sweep.run.preflight import Check, CheckFailed, Plan

NODES = ("neuron", "cuda")
# What the throughput check trains (model.preflight_cuda.BASELINE, as flags) and for how long; tests shrink them.
THROUGHPUT = {"depth": 10, "model_dim": 640, "head_dim": 128, "vocab_size": 8192, "seq_len": 2048, "batch_size": 32,
              "compile": True}
THROUGHPUT_SECONDS = 60.0
# nvidia-smi --help-query-gpu names; with nounits memory is in MiB, utilisation in %, temperature in C.
SMI_FIELDS = ("index", "name", "uuid", "memory.total", "memory.used", "utilization.gpu", "temperature.gpu",
              "driver_version")
SMI_TIMEOUT_S = 30.0
SMI_FIX = ("install the NVIDIA driver, which ships nvidia-smi (e.g. apt-get install nvidia-utils-<driver "
           "version>, or the CUDA DLAMI), or put the directory holding nvidia-smi on PATH")
# nvidia-smi's documented return codes (NVIDIA's nvidia-smi documentation, "RETURN VALUE").
SMI_CODES = {2: "a supplied argument or flag is invalid", 3: "the operation is not available on this device",
             4: "no permission to access this device", 6: "a query to find an object was unsuccessful",
             8: "a device's external power cables are not attached", 9: "the NVIDIA driver is not loaded",
             10: "the kernel detected an interrupt issue with a GPU", 12: "the NVML library could not be loaded",
             14: "an infoROM is corrupted", 15: "a GPU has fallen off the bus", 255: "other or internal driver error"}


def torch_fix(version: str) -> str:
    """Reinstall the same torch from PyPI, whose Linux x86_64 wheel is the CUDA build (bench/cuda_preflight.sh)."""
    pin = f"torch=={str(version).split('+')[0]}"
    return (f"reinstall {pin} from PyPI alone, which serves the CUDA build on Linux x86_64: PIP_CONFIG_FILE=/dev/null "
            f".venv/bin/pip install --force-reinstall --index-url https://pypi.org/simple '{pin}'")


def wanted(plan: Plan, node: str | None, env: Mapping[str, str] | None = None) -> bool:
    """Whether this run is the CUDA set (see the module's doc for the rule)."""
    if node is not None:
        return node == "cuda"
    if plan.device == "cuda":
        return True
    if plan.device != "auto":
        return False
    try:
        kind = pf.probe(["gpu", "--device", "auto"], pf.child_env(plan)).get("kind")
    except CheckFailed:
        kind = None
    return kind == "cuda" or (kind != "neuron" and shutil.which("nvidia-smi", path=(env or {}).get("PATH")) is not None)


# -- versions and device: one probe, judged twice --------------------------------------------------------

def judge_versions(info: Mapping[str, Any], plan: Plan) -> Check:
    data = {k: info.get(k) for k in ("torch", "cuda_build", "nccl", "cudnn", "kind")}
    if info.get("kind") != "cuda":
        return Check("versions", True, f"torch {info.get('torch')} on the {info.get('kind')} path (no CUDA build "
                     "needed)", data=data)
    if not info.get("cuda_build"):
        raise CheckFailed(f"torch {info.get('torch')} is a CPU-only build (torch.version.cuda is None)",
                          torch_fix(info.get("torch", "")), data)
    if plan.ranks > 1 and not info.get("nccl"):
        raise CheckFailed(f"torch {info.get('torch')} has no NCCL: the spec's {plan.ranks} ranks cannot form their "
                          "process group (nccl)", torch_fix(info.get("torch", "")), data)
    return Check("versions", True, f"torch {info['torch']}, CUDA {info['cuda_build']}, NCCL {info.get('nccl')}, "
                 f"cuDNN {info.get('cudnn')}", data=data)


def judge_device(info: Mapping[str, Any], plan: Plan) -> Check:
    kind, count, devs = info.get("kind"), int(info.get("device_count") or 0), info.get("devices") or []
    data = {"kind": kind, "device_count": count, "devices": devs, "ranks": plan.ranks,
            "cuda_visible_devices": info.get("cuda_visible_devices")}
    if kind == "cuda" and not info.get("cuda_available"):
        raise CheckFailed(f"torch.cuda.is_available() is False (torch {info.get('torch')}, CUDA build "
                          f"{info.get('cuda_build')})", "check the driver with nvidia-smi: its 'CUDA Version' must be "
                          "at least torch's CUDA build; check CUDA_VISIBLE_DEVICES", data)
    if count < plan.ranks:
        what = "torch.cuda.device_count()" if kind == "cuda" else "os.cpu_count()"
        one = "GPU" if kind == "cuda" else "core"
        raise CheckFailed(f"{what} = {count}; the spec runs {plan.ranks} rank(s), one {one} each",
                          "use a node with enough GPUs, widen CUDA_VISIBLE_DEVICES, or run fewer ranks", data)
    names: dict[str, int] = {}
    for d in devs:
        label = f"{d['name']} ({d['memory_bytes'] / 2**30:.1f} GiB)"
        names[label] = names.get(label, 0) + 1
    shown = ", ".join(f"{n} x {label}" for label, n in names.items())
    unit = "GPU(s)" if kind == "cuda" else "core(s)"
    return Check("device", True, f"{count} {unit} for {plan.ranks} rank(s): {shown}", data=data)


# -- launch -------------------------------------------------------------------------------------------

def launch_task(plan: Plan, work: Path, ranks_dir: Path) -> Any:
    """The Neuron set's tiny trial without its Neuron launch keys: no LNC, no compiler flags, no cores."""
    task = pf._launch_task(plan, work, ranks_dir)
    config = {k: v for k, v in task.config.items() if k not in ("lnc", "neuron_cc_flags")}
    env = {k: v for k, v in task.env.items() if k != pf.neuron.CORES_VAR}
    return replace(task, config=config, env=env, compile_cache="")


def judge_ranks(reports: Mapping[int, Mapping[str, Any]], plan: Plan, kind: str) -> str:
    """Each rank's report (model.preflight_train): on CUDA every rank on its own GPU, cuda:LOCAL_RANK."""
    data = {"ranks": [dict(r) for _, r in sorted(reports.items())]}
    for rank, r in sorted(reports.items()):
        if r.get("error"):
            raise CheckFailed(f"rank {rank} failed: {r['error']}", "run the trainer by hand on that GPU", data)
    if kind == "cuda":
        seen: dict[int, int] = {}
        for rank, r in sorted(reports.items()):
            dev, want = r.get("cuda_device"), r.get("local_rank")
            if dev != want:
                raise CheckFailed(f"rank {rank} trained on cuda:{dev}; it must train on its own GPU cuda:{want}",
                                  "each rank sets cuda:LOCAL_RANK (model.device.setup); leave CUDA_VISIBLE_DEVICES "
                                  "alone inside a trial", data)
            if dev in seen:
                raise CheckFailed(f"ranks {seen[dev]} and {rank} share cuda:{dev}", "one GPU per rank", data)
            seen[dev] = rank
    if len(reports) != plan.ranks:
        raise CheckFailed(f"{len(reports)} of {plan.ranks} rank(s) reported", "read the launch's trainer.log", data)
    if kind == "cuda":
        return ", ".join(f"rank {k}: cuda:{r['cuda_device']}" for k, r in sorted(reports.items()))
    return f"{plan.ranks} process(es) on the {kind}"


def check_launch(plan: Plan, workdir: Path, kind: str) -> Check:
    ranks_dir = workdir / "ranks"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    task = launch_task(plan, workdir / "trial", ranks_dir)
    out, _, reports = pf.run_launch(task, ranks_dir)
    data = {"state": out.state, "ranks": list(reports.values())}
    if out.state != "COMPLETE" and not any(r.get("error") for r in reports.values()):
        raise CheckFailed(f"the tiny trial ended {out.state}: {out.reason or 'no reason recorded'}",
                          f"read {task.artifact_dir}/trainer.log", data)
    shown = judge_ranks(reports, plan, kind)
    return Check("launch", True, f"{plan.ranks} rank(s), {(out.record or {}).get('steps')} step(s); {shown}",
                 data=data)


# -- compile ------------------------------------------------------------------------------------------

COMPILE_TOLERANCE = 1e-4  # relative: inductor's fused sin/square/sum of 128 values against eager float32 on the CPU


def check_compile(plan: Plan, workdir: Path) -> Check:
    cache = workdir / "inductor-cache"  # fresh: the first compile must miss, the second may hit
    shutil.rmtree(cache, ignore_errors=True)
    env = pf.child_env(plan, {"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    salt = round(random.Random().uniform(0.5, 1.5), 9)
    return judge_compile([pf.probe(["compile", "--device", plan.device, "--salt", repr(salt), "--backend", "inductor"],
                                   env) for _ in range(2)], str(cache))


def judge_compile(runs: list[dict[str, Any]], cache: str) -> Check:
    """Both compiled runs match eager; whether the second hit the inductor cache is reported."""
    data = {"runs": runs, "cache_dir": cache}
    for i, r in enumerate(runs):
        if r["max_abs_err"] > COMPILE_TOLERANCE * max(r.get("max_abs_ref") or 0.0, 1.0):
            raise CheckFailed(f"compiled run {i + 1} differs from eager by {r['max_abs_err']:.3g}",
                              "run python -m model.preflight compile --backend inductor by hand", data)
    hit = runs[1].get("cache_hits", 0) > 0
    return Check("compile", True, f"inductor on {runs[0]['device']}: {runs[0]['seconds']} s, then "
                 f"{runs[1]['seconds']} s ({'cache hit' if hit else 'NO cache hit: every trial compiles afresh'})",
                 data=data)


# -- nvidia-smi ---------------------------------------------------------------------------------------

def _smi_value(text: str) -> Any:
    text = text.strip()
    if text.startswith("[") or text in ("N/A", ""):  # "[N/A]", "[Not Supported]": not a number
        return None
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def parse_smi(text: str) -> list[dict[str, Any]]:
    """``--format=csv,noheader,nounits`` rows as dicts keyed by :data:`SMI_FIELDS`."""
    rows = []
    for n, row in enumerate(csv.reader(text.splitlines(), skipinitialspace=True), 1):
        if not row:
            continue
        if len(row) != len(SMI_FIELDS):
            raise CheckFailed(f"nvidia-smi row {n} has {len(row)} value(s), {len(SMI_FIELDS)} asked",
                              "run nvidia-smi --query-gpu=" + ",".join(SMI_FIELDS) + " --format=csv by hand", {})
        rows.append({k: (v.strip() if k in ("name", "uuid", "driver_version") else _smi_value(v))
                     for k, v in zip(SMI_FIELDS, row, strict=True)})
    return rows


def check_gpu_monitor(plan: Plan) -> Check:
    tool = shutil.which("nvidia-smi")
    if tool is None:
        raise CheckFailed("nvidia-smi is not on PATH", SMI_FIX)
    cmd = [tool, "--query-gpu=" + ",".join(SMI_FIELDS), "--format=csv,noheader,nounits"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SMI_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"nvidia-smi did not answer in {SMI_TIMEOUT_S:g} s", "check the driver: dmesg | grep -i "
                          "nvrm; a hung GPU needs a reset or a reboot") from None
    if proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[0][:200]
        cause = SMI_CODES.get(proc.returncode, "an undocumented code")
        raise CheckFailed(f"nvidia-smi exited {proc.returncode} ({cause}): {said}",
                          "load the NVIDIA driver (modprobe nvidia) or reinstall it; see nvidia-smi's RETURN VALUE",
                          {"returncode": proc.returncode})
    rows = parse_smi(proc.stdout)
    if not rows:
        raise CheckFailed("nvidia-smi listed no GPU", "check the driver: nvidia-smi -L", {})
    data = {"gpus": rows}
    if len(rows) < plan.ranks:
        raise CheckFailed(f"nvidia-smi lists {len(rows)} GPU(s); the spec runs {plan.ranks} rank(s), one GPU each",
                          "use a node with enough GPUs or run fewer ranks", data)
    busy = [r["index"] for r in rows if (r["memory.used"] or 0) > 0.1 * (r["memory.total"] or 0)]
    first = rows[0]
    note = f"; GPU(s) {', '.join(map(str, busy))} already hold over 10% of their memory" if busy else ""
    return Check("gpu_monitor", True, f"one report: {len(rows)} GPU(s), {first['name']}, {first['memory.total']} MiB, "
                 f"driver {first['driver_version']}{note}", data=data)


# -- throughput ---------------------------------------------------------------------------------------

def throughput_args(plan: Plan, shape: Mapping[str, Any], seconds: float) -> list[str]:
    args = ["throughput", "--device", plan.device, "--seconds", f"{seconds:g}", "--json"]
    for key, value in shape.items():
        if key != "compile":
            args += ["--" + key.replace("_", "-"), str(value)]
    return args + ([] if shape.get("compile", True) else ["--no-compile"])


def judge_throughput(out: Mapping[str, Any]) -> Check:
    data = dict(out)
    if out.get("status") != "ok":
        reason = out.get("reason") or out.get("status")
        fix = ("lower the probe's batch_size (sweep.run.preflight_cuda.THROUGHPUT)" if "out of memory" in str(reason)
               else "run python -m model.preflight throughput by hand and read its traceback")
        raise CheckFailed(f"the trainer ended {out.get('status')}: {reason}", fix, data)
    if not out.get("tokens_per_second"):
        raise CheckFailed(f"no training step was charged in {out.get('seconds')} s ({out.get('steps')} step(s), "
                          f"{out.get('excluded_steps')} excluded)", "give the probe more seconds", data)
    return Check("throughput", True, str(out.get("summary")), data=data)


def check_throughput(plan: Plan, shape: Mapping[str, Any] | None = None, seconds: float | None = None) -> Check:
    shape = THROUGHPUT if shape is None else shape
    seconds = THROUGHPUT_SECONDS if seconds is None else seconds
    out = pf.probe(throughput_args(plan, shape, seconds), pf.child_env(plan), timeout=seconds + pf.PROBE_TIMEOUT_S)
    return judge_throughput(out)


# -- the run ------------------------------------------------------------------------------------------

def main(spec: Any, url: str | None, args: Any, out: Any) -> int:
    """``python -m sweep preflight``: preflight.main with this set where :func:`wanted` says so."""
    def check_set(plan: Plan, workdir: Path) -> tuple[str, dict[str, Callable[[], Check]]] | None:
        return ("cuda", checks_for(plan, workdir)) if wanted(plan, args.node) else None

    return pf.main(spec, url, args, out, check_set)


def checks_for(plan: Plan, workdir: Path) -> dict[str, Callable[[], Check]]:
    """The CUDA set in order, for preflight.run_checks; versions and device share one probe."""
    info = functools.cache(lambda: pf.probe(["gpu", "--device", plan.device], pf.child_env(plan)))

    def gated(fn: Callable[[], Check]) -> Callable[[], Check]:
        """Skipped once versions or device failed, as run_checks skips the Neuron set's device checks."""
        def run() -> Check:
            for name, judge in (("versions", judge_versions), ("device", judge_device)):
                try:
                    judge(info(), plan)
                except CheckFailed:
                    raise CheckFailed(f"skipped: the {name} check failed", f"fix the {name} check first") from None
            return fn()
        return run

    return {"versions": lambda: judge_versions(info(), plan), "device": lambda: judge_device(info(), plan),
            "launch": gated(lambda: check_launch(plan, workdir, info().get("kind", plan.device))),
            "compile": gated(lambda: check_compile(plan, workdir)), "gpu_monitor": lambda: check_gpu_monitor(plan),
            "artifacts": lambda: pf.check_artifacts(plan), "throughput": gated(lambda: check_throughput(plan))}
