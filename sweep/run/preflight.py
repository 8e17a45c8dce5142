"""``python -m sweep preflight [NAME]``: prove in a few minutes that this node can run the study's trials.

Each check is run here or in a child process (the sweep imports no torch: ``model.preflight`` and
``model.preflight_train`` hold the device side), in this order; the first that fails is named with
one line saying what fixes it, and the exit code is 1 (0 when all pass, 2 for bad input):

- ``environment``: under the spec's ``competition`` profile, the image venv is on this node; its versions
  (torch, torch-neuronx, neuronx-cc, nki, runtime, collectives) are read with its own python and recorded, and
  a node whose versions differ from the study's first node's is refused in one line naming the difference.
- ``versions``: the Neuron packages installed are a set the release notes list as compatible (latest-sdk).
- ``neuron_ls``: ``neuron-ls`` is on PATH and shows the cores the spec's trial reserves.
- ``device``: ``torch.neuron.is_available()`` and ``torch.neuron.device_count()`` at the spec's LNC cover its ranks.
- ``launch``: a tiny model trains a few steps at the spec's rank count through a trial's own launch plan
  (the supervisor, ``TrialLaunch``, torchrun); every rank says which core it holds, and each must hold
  exactly its own core of the plan, as TorchNeuron demands of a distributed run.
- ``model_compile`` (advisory): the same tiny model under ``torch.compile(backend="neuron")`` where the spec's
  trials compile; a failure is reported and the node joins (a compile error would refuse every node alike).
- ``compile_cache``: one salted graph compiled twice in two processes: the first must write a NEFF where
  ``TORCH_NEURONX_NEFF_CACHE_DIR`` points, the second must find it (a hit). Where the cache lives, that it
  is writable and how it is shared are reported; a ``trial.compile_cache`` path on a local disk fails.
- ``kernels`` (advisory): every NKI kernel against the PyTorch op on the device in bf16, at the spec's narrowest
  and widest ``model_dim``, within :data:`TOLERANCE` (max error over max magnitude), eager and under
  ``torch.compile(backend="neuron")`` as trials run them. kernels="auto" trusts NKI only where this check
  passed at the trial's LNC (the report below); where it failed, the node still joins and its trials run the
  PyTorch ops, with the reason in their record.
- ``monitor``: one ``neuron-monitor`` report.
- ``artifacts``: the spec's artifact store (``SWEEP_ARTIFACTS``, else ``study.artifacts``) takes a write:
  ``_preflight/HOST.json`` under its prefix (S3 PutObject and HeadObject, which the worker role holds).

Every check is required but those in :data:`ADVISORY`: a failed required check fails the node (exit 1,
``ok`` false), a failed advisory one is reported (``advisory_failures``, a line on stderr) and the node
passes. Checks that need the device are skipped (and fail) when ``versions`` or ``device`` failed. The report
(``{"ok", "first_failure", "advisory_failures", "lnc", "ranks", "study", "node", "checks": [{"name", "ok",
"required", "detail", "fix", ...}], ...}``) is printed after the table and written to
``$TRNSWEEP_PREFLIGHT_REPORT`` (default ``~/.cache/trnsweep/preflight.json``); the launch's working files (its
``trainer.log``) stay in ``preflight-work/`` beside it until the next run. The cluster's workers run this before
``ray start``, so a node that fails a required check never joins (infra/ray/trn2.yaml).

Where the spec's trials train on CUDA, :mod:`sweep.run.preflight_cuda`'s set runs instead, through the same
``run_checks`` and report (``--node neuron|cuda`` overrides the spec; the CLI calls its ``main``).

Long file: the ten checks, each with the one-line failures and fixes a node's operator reads, stay
together with the plan they share and the report the kernels read, so the whole contract is one page.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from sweep import neuron
from sweep.neuron import environment, versions
from sweep.neuron.environment import Environment
from sweep.neuron.monitor import find_tool, monitor_once
from sweep.run.supervisor import Supervisor, TrialTask
from sweep.store import artifacts

REPORT_VAR = "TRNSWEEP_PREFLIGHT_REPORT"
DEFAULT_REPORT = "~/.cache/trnsweep/preflight.json"
RANKS_VAR = "TRNSWEEP_PREFLIGHT_RANKS"  # where model.preflight_train's ranks write their reports
TOLERANCE = 2e-2  # bf16 kernels against fp32 PyTorch, relative to the output's magnitude
NEURON_BIN = versions.NEURON_TOOLS_BIN
TOOLS_FIX = f"install aws-neuronx-tools (the Neuron DLAMI has it in {NEURON_BIN}) or put its directory on PATH"
REPO_ROOT = Path(__file__).resolve().parents[2]
PROBE_TIMEOUT_S = 600.0
MONITOR_TIMEOUT_S = 30.0
LAUNCH_STEPS = 4
# The launch's model: small enough to compile and train in seconds, real enough to use every op.
LAUNCH_MODEL = {"depth": 2, "model_dim": 128, "head_dim": 64, "vocab_size": 512, "seq_len": 64, "batch_size": 2,
                "kernels": "torch", "data": "", "core_bundle": "", "save_checkpoint": False, "eval_fractions": [],
                "excluded_steps": 1, "max_steps": LAUNCH_STEPS, "log_every": 1,
                # the launch is what is checked (the compile check and the throughput probe compile): no minute of
                # compiling a four-step optimiser and loss
                "compile_optimizer": False, "compile_loss": False}
NETWORK_FS = ("nfs", "nfs4", "lustre", "cifs", "smb3", "ceph", "glusterfs", "gpfs", "beegfs", "fuse.s3fs",
              "fuse.mountpoint-s3", "fuse.juicefs", "efs")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)
    required: bool = True  # False: a failure is reported, and the node still passes


class CheckFailed(Exception):
    """A check's failure: what was seen (one line) and what fixes it (one line)."""

    def __init__(self, detail: str, fix: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.detail, self.fix, self.data = detail, fix, data or {}


@dataclass(frozen=True)
class Plan:
    """What the spec's trials will ask of this node."""

    study: str
    lnc: int
    node_lnc: int
    ranks: int
    flags: str | None
    neuron_cores: int  # at the node's LNC, as Ray counts them
    device: str
    compile: bool
    widths: tuple[tuple[int, int], ...]  # (model_dim, mlp_dim) at the narrowest and widest model
    vocab: int
    softcap: float
    compile_cache: str
    artifacts: str
    env: dict[str, str]
    environment: Environment = field(default_factory=Environment)  # the spec's profile
    python: str | None = None  # the trainer's python: the image venv's under competition, else this one
    opt_level: str | None = None  # NEURON_COMPILER_OPT_LEVEL of the trials (neuron_opt_level), if set
    storage: str = ""  # the study's storage URL: where the study's first node's versions are kept


def plan_for(spec: Any, lnc: int | None = None, env: Mapping[str, str] | None = None, samples: int = 200) -> Plan:
    """The spec's launch shape and widths, from its fixed values and sampled feasible points."""
    env = os.environ if env is None else env
    node_lnc = int(env.get(neuron.LNC_VAR) or neuron.DEFAULT_NODE_LNC)
    rng = random.Random(0)
    shapes = []
    for _ in range(samples):
        point, broken = spec.space.complete(spec.space.sample(rng))
        if broken is None:
            shapes.append(neuron.graph_shape(point, spec.ranks, spec.env))
    if not shapes:
        raise ValueError(f"{spec.name}: no sampled point satisfies the constraints")
    lncs = sorted({s["lnc"] or node_lnc for s in shapes})
    if lnc is None and len(lncs) > 1:
        raise ValueError(f"{spec.name} trains at LNC {', '.join(map(str, lncs))}: pick one with --lnc")
    lnc = lnc or lncs[0]
    at = [s for s in shapes if (s["lnc"] or node_lnc) == lnc] or shapes
    dims = sorted({(s["model_dim"], s["mlp_dim"]) for s in at})
    first = at[0]
    return Plan(study=spec.name, lnc=lnc, node_lnc=node_lnc, ranks=max(s["ranks"] for s in at),
                flags=first["neuron_cc_flags"] or None, neuron_cores=spec.resources.neuron_cores,
                device=str(first["device"]), compile=bool(first["compile"]), widths=(dims[0], dims[-1])
                if dims[0] != dims[-1] else (dims[0],), vocab=max(s["vocab_size"] for s in at),
                softcap=float(first["softcap"]), compile_cache=spec.compile_cache,
                artifacts=artifacts.artifacts_url(spec.artifacts), env=dict(spec.env),
                environment=spec.environment, python=_trainer_python(spec.environment),
                opt_level=first.get("neuron_opt_level"))


def _trainer_python(profile: Environment) -> str | None:
    """The image venv's python under competition (None where it is missing: the environment check says so)."""
    try:
        return environment.trainer_python(profile.trial_env())
    except environment.ProfileError:
        return None


# -- running the device side --------------------------------------------------------------------------

def child_env(plan: Plan, extra: Mapping[str, str] | None = None, cores: str | None = None) -> dict[str, str]:
    """A child's environment: this one, the spec's trial.env, LNC and compiler flags, the repository importable."""
    env = {**os.environ, **plan.env, neuron.LNC_VAR: str(plan.lnc), **(extra or {})}
    if plan.flags:  # the trials' compiles use them, so the cache check's must too
        env[neuron.CC_FLAGS_VAR] = plan.flags
    if plan.opt_level:
        env[neuron.OPT_LEVEL_VAR] = plan.opt_level
    env.pop(neuron.CORES_VAR, None)
    if cores is not None:
        env[neuron.CORES_VAR] = cores
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def probe(args: list[str], env: Mapping[str, str], timeout: float = PROBE_TIMEOUT_S,
          python: str | None = None) -> dict[str, Any]:
    """Run ``python -m model.preflight ARGS`` (with the trainer's python where given); its JSON line, or
    CheckFailed saying why there is none."""
    try:
        proc = subprocess.run([python or sys.executable, "-m", "model.preflight", *args], capture_output=True,
                              text=True, timeout=timeout, env=dict(env), cwd=REPO_ROOT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"model.preflight {args[0]} did not finish in {timeout:g} s",
                          "see what holds the device: neuron-ls, neuron-top") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise CheckFailed(f"model.preflight {args[0]} exited {proc.returncode}: {tail}",
                          "run `python -m model.preflight " + args[0] + "` by hand and read its traceback")
    out = json.loads(lines[-1])
    if out.get("error"):
        raise CheckFailed(f"model.preflight {args[0]}: {out['error']}", _fix_for(out["error"]), out)
    return out


def _fix_for(error: str) -> str:
    if "torch.neuron is missing" in error or "torch_neuronx" in error or "torch-neuronx" in error:
        return "install the pinned Neuron set: pip install -e '.[neuron]' from the Neuron index (docs/neuron.md)"
    if "nki" in error:
        return "install the pinned nki package with the neuron extra (docs/neuron.md)"
    return "run the probe by hand (python -m model.preflight ...) and read its traceback"


# -- the checks ---------------------------------------------------------------------------------------

def check_environment(plan: Plan) -> Check:
    """Under competition: the image venv is on this node, its versions are read and recorded, and they are the
    versions of the study's first node (a node of another image would measure another machine)."""
    if not plan.environment.competition:
        return Check("environment", True, "latest-sdk: the pinned TorchNeuron set (the versions check)")
    try:
        python = environment.trainer_python(plan.environment.trial_env())
        assert python is not None
        found = environment.read_versions(python)
    except environment.ProfileError as e:
        raise CheckFailed(str(e), f"boot the competition image ({environment.COMPETITION_AMI}: python -m infra "
                                  "render-cluster --profile competition) or set [environment] venv") from None
    data: dict[str, Any] = {"profile": plan.environment.profile, "python": python, "versions": found}
    if plan.storage:
        try:
            refusal, first = environment.admit(plan.storage, plan.study, found)
        except Exception as e:  # no store reachable from here: the first trial compares instead
            refusal, first = None, False
            data["study"] = f"not compared: {type(e).__name__}"
        if refusal:
            raise CheckFailed(refusal, "boot every node of the study from one image, or start another study", data)
        data["recorded_as_first"] = first
    shown = ", ".join(f"{k} {v}" for k, v in sorted(found.items())) or "no Neuron package found"
    return Check("environment", True, f"competition venv {python}: {shown}", data=data)


def check_versions(plan: Plan) -> Check:
    if plan.environment.competition:  # the pins are latest-sdk's; the image venv's own set is read, not judged
        return Check("versions", True, "competition: the image venv's own set (the environment check reads it)")
    found = versions.installed_versions()
    problems = versions.problems(found)
    data = {"installed": found, "pins": versions.PINS}
    if problems:
        raise CheckFailed("; ".join(problems), f"pip install {' '.join(repr(r) for r in versions.requirements())} "
                          f"--extra-index-url {versions.NEURON_PIP_INDEX}, or use the venv {versions.DLAMI_VENV}",
                          data)
    shown = ", ".join(f"{k} {v}" for k, v in found.items())
    return Check("versions", True, f"Neuron {versions.NEURON_SDK} set: {shown}", data=data)


def check_neuron_ls(plan: Plan) -> Check:
    if find_tool("neuron-ls") is None:
        raise CheckFailed(f"neuron-ls is not on PATH or in {NEURON_BIN}", TOOLS_FIX)
    devices = neuron.neuron_ls()
    if not devices:
        raise CheckFailed("neuron-ls shows no Neuron device (or failed)",
                          "check the Neuron driver: lsmod | grep neuron; reinstall aws-neuronx-dkms")
    cores = sum(len(d.cores) for d in devices)
    need = plan.neuron_cores
    data = {"devices": len(devices), "cores": cores, "node_lnc": plan.node_lnc}
    if cores < need:
        raise CheckFailed(f"neuron-ls shows {cores} core(s) at LNC {plan.node_lnc}; the spec reserves {need}",
                          "use an instance with the chips the spec needs, or lower trial.resources.neuron_cores", data)
    return Check("neuron_ls", True, f"{len(devices)} device(s), {cores} core(s) at LNC {plan.node_lnc}", data=data)


def check_device(plan: Plan) -> Check:
    out = probe(["device"], child_env(plan), python=plan.python)
    if not out.get("available"):
        raise CheckFailed("torch.neuron.is_available() is False", "check the driver and runtime (neuron-ls, "
                          "aws-neuronx-runtime-lib) and that no other process holds every core", out)
    count = int(out.get("device_count") or 0)
    if count < plan.ranks:
        raise CheckFailed(f"torch.neuron.device_count() = {count} at LNC {plan.lnc}, the spec runs {plan.ranks} "
                          "rank(s)", f"set {neuron.LNC_VAR} to the node's LNC or fewer ranks in the spec", out)
    return Check("device", True, f"torch.neuron available, {count} NeuronCore(s) at LNC {plan.lnc}", data=out)


def _launch_task(plan: Plan, work: Path, ranks_dir: Path, compiled: bool = False) -> TrialTask:
    cores = plan.neuron_cores or -(-plan.ranks * plan.lnc // plan.node_lnc)
    config = {**LAUNCH_MODEL, "device": plan.device, "compile": compiled, "ranks": plan.ranks, "lnc": plan.lnc,
              "eval_tokens": LAUNCH_MODEL["batch_size"] * LAUNCH_MODEL["seq_len"] * plan.ranks,
              "final_eval_tokens": LAUNCH_MODEL["batch_size"] * LAUNCH_MODEL["seq_len"] * plan.ranks}
    if plan.flags:
        config["neuron_cc_flags"] = plan.flags
    if plan.opt_level:
        config["neuron_opt_level"] = plan.opt_level
    env = {**plan.env, neuron.CORES_VAR: neuron.format_cores(range(cores)), RANKS_VAR: str(ranks_dir)}
    return TrialTask(study=plan.study, storage_url="", number=0, trial_id=-1, params={}, config=config,
                     budget_s=3600.0, deadline_s=PROBE_TIMEOUT_S * 1.5, eval_fractions=(1.0,), ranks=plan.ranks,
                     trainer="model.preflight_train", stop_grace_s=10.0, heartbeat_s=30.0, env=env,
                     compile_cache=plan.compile_cache, artifact_dir=str(work))


def run_launch(task: TrialTask, ranks_dir: Path,
               python: str | None = None) -> tuple[Any, dict[str, Any], dict[int, dict[str, Any]]]:
    """The tiny trial through the supervisor (the trainer's python where given): its outcome, launch attributes
    and each rank's report."""
    sup = Supervisor(task, python=python)
    try:
        out = sup.run()
    finally:
        sup.close()
    reports = {}
    for f in sorted(ranks_dir.glob("rank-*.json")):
        r = json.loads(f.read_text())
        reports[int(r["rank"])] = r
    return out, sup.launch_attrs, reports


def check_launch(plan: Plan, workdir: Path) -> Check:
    """The launch itself, eager: a model compile that fails is the advisory ``model_compile`` check's, so it
    never keeps a node (and so every node) out of the study."""
    ranks_dir = workdir / "ranks"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    task = _launch_task(plan, workdir / "trial", ranks_dir)
    out, attrs, reports = run_launch(task, ranks_dir, plan.python)
    plan_cores = neuron.parse_cores(attrs["neuron_rank_cores"]) if attrs.get("neuron_rank_cores") else []
    data: dict[str, Any] = {"state": out.state, "plan": attrs.get("neuron_rank_cores"), "ranks": [
        {"rank": r["rank"], "cores": r.get("cores", r.get("cores_at_start")), "exit": r.get("exit")}
        for r in reports.values()]}
    for rank, r in sorted(reports.items()):
        if r.get("error"):
            raise CheckFailed(f"rank {rank} failed before training: {r['error']}", _core_fix(), data)
    held: dict[int, str] = {}
    for rank, r in sorted(reports.items()):
        text = r.get("cores") or r.get("cores_at_start") or ""
        try:
            cores = neuron.parse_cores(text) if text else []
        except neuron.LaunchError:
            cores = []
        want = plan_cores[r["local_rank"]] if r["local_rank"] < len(plan_cores) else None
        if len(cores) != 1 or (want is not None and cores[0] != want):
            raise CheckFailed(f"rank {rank} holds {neuron.CORES_VAR}={text or 'unset'}; it must hold exactly its "
                              f"own core ({want})", _core_fix(), data)
        if text in held.values():
            raise CheckFailed(f"ranks share core {text}", _core_fix(), data)
        held[rank] = text
    if out.state != "COMPLETE":
        raise CheckFailed(f"the tiny trial ended {out.state}: {out.reason or 'no reason recorded'}",
                          f"read {task.artifact_dir}/trainer.log", data)
    if len(reports) != plan.ranks:
        raise CheckFailed(f"{len(reports)} of {plan.ranks} rank(s) reported", f"read {task.artifact_dir}/trainer.log",
                          data)
    steps = (out.record or {}).get("steps")
    shown = ", ".join(f"rank {k}: core {v}" for k, v in sorted(held.items()))
    return Check("launch", True, f"{plan.ranks} rank(s), {steps} step(s); {shown}", data=data)


def check_model_compile(plan: Plan, workdir: Path) -> Check:
    """The launch's tiny model under ``torch.compile(backend="neuron")``, as the spec's trials compile theirs."""
    if not plan.compile:
        return Check("model_compile", True, "the spec's trials run eager: nothing compiled")
    ranks_dir = workdir / "ranks-compiled"
    ranks_dir.mkdir(parents=True, exist_ok=True)
    task = _launch_task(plan, workdir / "trial-compiled", ranks_dir, compiled=True)
    out, _, _ = run_launch(task, ranks_dir, plan.python)
    if out.state != "COMPLETE":
        reason = (out.reason or "no reason recorded").splitlines()[0][:300]
        raise CheckFailed(f"the tiny model compiled ended {out.state}: {reason}",
                          f"read {task.artifact_dir}/trainer.log", {"state": out.state})
    return Check("model_compile", True, f"{(out.record or {}).get('steps')} compiled step(s)")


def _core_fix() -> str:
    return f"each torchrun rank needs its own {neuron.CORES_VAR} (sweep/neuron/trial.py, docs/neuron.md)"


def fs_type(path: str, mounts: str = "/proc/mounts") -> str:
    """The file system type of the mount holding ``path`` ("" where /proc/mounts cannot be read)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    with contextlib.suppress(OSError):
        for line in Path(mounts).read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) >= len(best):
                best, kind = parts[1], parts[2]
    return kind


def cache_sharing(loc: neuron.CacheLocation, env: Mapping[str, str]) -> tuple[bool, str]:
    """Whether other nodes see this cache, and how."""
    if loc.kind == "s3":
        return True, f"NEFFs mirrored in {loc.neff_dir}, pulled from and pushed to {loc.remote} by each trial"
    if loc.kind == "shared":
        kind = fs_type(loc.neff_dir)
        return kind in NETWORK_FS or kind.startswith("fuse."), f"{loc.root} on a {kind or 'unknown'} file system"
    s3 = env.get("TRNSWEEP_S3")
    if s3:
        return True, f"node directory {loc.root}, synced with {s3}/neuron-cache by infra/ray/node_sync.sh"
    return False, f"node directory {loc.root}, not shared (no TRNSWEEP_S3 for node_sync)"


# TorchNeuron reads the cache switch under two names (sweep/neuron/cache.py): the fix names both.
CACHE_SWITCH_FIX = f"unset {' and '.join(neuron.NEFF_DISABLE_VARS)} (the node's environment or trial.env)"


def check_compile_cache(plan: Plan) -> Check:
    loc = neuron.cache_location(plan.compile_cache, {**os.environ, **plan.env})
    data: dict[str, Any] = {"kind": loc.kind, "neff_dir": loc.neff_dir, "var": neuron.NEFF_CACHE_VAR}
    try:
        os.makedirs(loc.neff_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=loc.neff_dir, prefix=".preflight-"):
            pass
    except OSError as e:
        raise CheckFailed(f"the NEFF cache {loc.neff_dir} is not writable: {e.strerror or e}",
                          f"make {loc.neff_dir} writable by this user, or point trial.compile_cache elsewhere",
                          data) from None
    shared, how = cache_sharing(loc, os.environ)
    data.update(shared=shared, how=how)
    if loc.kind == "shared" and not shared:
        raise CheckFailed(f"trial.compile_cache {loc.root} is not on a shared file system ({how})",
                          f"mount the shared file system at {loc.root} (or use s3://), as every node must", data)
    env = child_env(plan, loc.env(), cores="0")
    disabled = neuron.cache_disabled_by(env)
    if disabled:
        raise CheckFailed(f"{disabled} is set: TorchNeuron would compile every graph again", CACHE_SWITCH_FIX, data)
    salt = round(random.Random().uniform(0.5, 1.5), 9)
    runs = []
    for _ in range(2):
        before = neuron.cache_entries([loc.neff_dir])
        out = probe(["compile", "--device", plan.device, "--salt", repr(salt)], env, python=plan.python)
        new = len(neuron.cache_entries([loc.neff_dir]) - before)
        runs.append({"new_neffs": new, "seconds": out.get("seconds")})
    data["runs"] = runs
    if runs[0]["new_neffs"] == 0:
        raise CheckFailed(f"a fresh graph compiled but wrote no NEFF under {loc.neff_dir}",
                          f"TorchNeuron must see {neuron.NEFF_CACHE_VAR}={loc.neff_dir} (sweep/neuron/cache.py)", data)
    if runs[1]["new_neffs"]:
        raise CheckFailed(f"the second compile of the same graph wrote {runs[1]['new_neffs']} new NEFF(s): "
                          "no cache hit",
                          f"check that {neuron.NEFF_CACHE_VAR} is not switched off ({CACHE_SWITCH_FIX}) and that "
                          "neuronx-cc flags are the same in both runs", data)
    return Check("compile_cache", True, f"miss then hit ({runs[0]['seconds']} s, then {runs[1]['seconds']} s); "
                 f"{loc.neff_dir}, writable; {'shared' if shared else 'NOT shared'}: {how}", data=data)


def check_kernels(plan: Plan) -> Check:
    widths = ",".join(str(w) for w, _ in plan.widths)
    ratio = plan.widths[0][1] / plan.widths[0][0]
    out = probe(["kernels", "--device", plan.device, "--widths", widths, "--mlp-ratio", f"{ratio:g}",
                 "--vocab", str(plan.vocab), "--softcap", f"{plan.softcap:g}", "--tol", f"{TOLERANCE:g}"],
                child_env(plan, cores="0"), python=plan.python)
    rows = out.get("results") or []
    data = {"lnc": plan.lnc, "tol": TOLERANCE, **out}
    bad = [r for r in rows if not r.get("ok")]
    if bad:
        r = bad[0]
        seen = r.get("error") or f"error {r['err']:.3g} > {TOLERANCE:g}"
        raise CheckFailed(f"{r['kernel']} ({r.get('mode', 'eager')}) at width {r['width']}: {seen}",
                          "trials here run the PyTorch ops; run tests/kernels with NKI_SIMULATOR=1 to find the fault",
                          data)
    proven = {r["kernel"] for r in rows if "err" in r}
    refused = sorted({r["kernel"] for r in rows} - proven)
    if refused or not rows:
        raise CheckFailed(f"{', '.join(refused) or 'no kernel'} refused at every width tested",
                          "kernels fall back to PyTorch ops here: keep kernels = \"torch\"", data)
    worst = max((r for r in rows if "err" in r), key=lambda r: r["err"])
    return Check("kernels", True, f"{len(proven)} kernel(s) in bf16, eager and compiled, at width(s) {widths} within "
                 f"{TOLERANCE:g} (worst {worst['err']:.2g}: {worst['kernel']} {worst.get('mode', '')})", data=data)


def check_monitor(plan: Plan) -> Check:
    try:
        report = monitor_once(timeout=MONITOR_TIMEOUT_S)
    except RuntimeError as e:
        fix = TOOLS_FIX if "not on PATH" in str(e) else "run neuron-monitor by hand; reinstall aws-neuronx-tools"
        raise CheckFailed(str(e), fix) from None
    hw = report.get("neuron_hardware_info") or {}
    return Check("monitor", True, f"one report: {hw.get('neuron_device_count', '?')} device(s) x "
                 f"{hw.get('neuroncore_per_device_count', '?')} core(s)", data={"keys": sorted(report)})


def check_artifacts(plan: Plan, s3_client: Any = None) -> Check:
    url, host = plan.artifacts, socket.gethostname()
    body = json.dumps({"node": host, "unix": time.time()}).encode()
    if not artifacts.is_s3(url):
        path = Path(url) / "_preflight" / f"{host}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(body)
        except OSError as e:
            raise CheckFailed(f"artifacts {url} is not writable: {e.strerror or e}",
                              "make it writable, or set SWEEP_ARTIFACTS / study.artifacts elsewhere") from None
        return Check("artifacts", True, f"wrote {path}")
    import boto3
    import botocore.exceptions as bx

    bucket, prefix = artifacts.split_s3(url)
    key = "/".join(p for p in (prefix, "_preflight", f"{host}.json") if p)
    client = s3_client or boto3.client("s3")
    try:
        client.put_object(Bucket=bucket, Key=key, Body=body)
        client.head_object(Bucket=bucket, Key=key)
    except bx.NoCredentialsError:
        raise CheckFailed(f"no AWS credentials to reach {url}", "attach the worker instance profile "
                          "(python -m infra iam) or set AWS credentials") from None
    except bx.ClientError as e:
        code = e.response.get("Error", {}).get("Code", "?")
        fix = ("create the bucket (python -m infra bucket) or fix SWEEP_ARTIFACTS" if code in ("NoSuchBucket", "404")
               else "grant s3:PutObject and s3:GetObject on it to the node's role (python -m infra iam)")
        raise CheckFailed(f"s3://{bucket}/{key}: {code}", fix) from None
    except bx.BotoCoreError as e:
        raise CheckFailed(f"{url}: {e}", "check the node's network route to S3 (VPC endpoint or NAT)") from None
    return Check("artifacts", True, f"wrote s3://{bucket}/{key}")


# -- the run ------------------------------------------------------------------------------------------

NEEDS_DEVICE = ("launch", "model_compile", "compile_cache", "kernels")
# Checks whose failure a node survives: trials run kernels = "auto", which falls back to the PyTorch ops
# wherever the kernels check did not pass (model/kernel_choice.py), so one NKI problem never keeps a node out.
# A model that fails to compile on a node fails the same way on every node of the same image: refusing the
# node would keep every node out of the study, while each trial that hits it fails alone with its error.
ADVISORY = ("kernels", "model_compile")
ADVISORY_EFFECT = {"kernels": 'run the PyTorch ops (kernels = "auto" records why)',
                   "model_compile": "that compile may fail, each alone, with the compiler's error in its record"}


def run_checks(plan: Plan, workdir: Path, checks: Mapping[str, Callable[[], Check]] | None = None) -> list[Check]:
    """Every check in order; a device check is skipped (and fails) once versions or device failed."""
    checks = checks or {
        "environment": lambda: check_environment(plan), "versions": lambda: check_versions(plan),
        "neuron_ls": lambda: check_neuron_ls(plan),
        "device": lambda: check_device(plan), "launch": lambda: check_launch(plan, workdir),
        "model_compile": lambda: check_model_compile(plan, workdir),
        "compile_cache": lambda: check_compile_cache(plan), "kernels": lambda: check_kernels(plan),
        "monitor": lambda: check_monitor(plan), "artifacts": lambda: check_artifacts(plan)}
    done: list[Check] = []
    for name, fn in checks.items():
        blocker = next((c for c in done if c.name in ("environment", "versions", "device") and not c.ok), None)
        if name in NEEDS_DEVICE and blocker is not None:
            done.append(Check(name, False, f"skipped: the {blocker.name} check failed",
                              f"fix the {blocker.name} check first"))
            continue
        t0 = time.monotonic()
        try:
            c = fn()
        except CheckFailed as e:
            c = Check(name, False, e.detail, e.fix, data=e.data)
        except Exception as e:  # a check that breaks is a failed check, named, not a traceback
            c = Check(name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                      "run `python -m sweep preflight` by hand and read the error")
        done.append(replace(c, name=name, seconds=round(time.monotonic() - t0, 2)))
    return [replace(c, required=c.name not in ADVISORY) for c in done]


def first_required_failure(checks: list[Check]) -> Check | None:
    return next((c for c in checks if not c.ok and c.required), None)


def report_of(plan: Plan, checks: list[Check], seconds: float) -> dict[str, Any]:
    first = first_required_failure(checks)
    return {"ok": first is None, "first_failure": first.name if first else None,
            "advisory_failures": [c.name for c in checks if not c.ok and not c.required], "study": plan.study,
            "lnc": plan.lnc, "ranks": plan.ranks, "node": socket.gethostname(), "unix": round(time.time(), 1),
            "seconds": round(seconds, 1), "checks": [asdict(c) for c in checks]}


def report_path() -> Path:
    return Path(os.environ.get(REPORT_VAR) or DEFAULT_REPORT).expanduser()


def write_report(report: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str) + "\n")
    tmp.replace(path)


def print_table(checks: list[Check], out: TextIO) -> None:
    width = max(len(c.name) for c in checks)
    for c in checks:
        mark = "ok" if c.ok else "SKIP" if c.detail.startswith("skipped") else "FAIL" if c.required else "WARN"
        print(f"{c.name:<{width}}  {mark:<4}  {c.seconds:7.1f}s  {c.detail}", file=out)
        if mark in ("FAIL", "WARN") and c.fix:
            print(f"{'':<{width}}        fix: {c.fix}", file=out)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("preflight", help="check in minutes that this node can run the study's trials")
    p.add_argument("study", nargs="?", default="phase1", help="NAME or spec path (default phase1)")
    p.add_argument("--lnc", type=int, choices=neuron.LNC_VALUES, default=None,
                   help="the LNC to check where the spec searches several")
    p.add_argument("--node", choices=("neuron", "cuda"), default=None,
                   help="the check set (default: the spec's device decides; see sweep.run.preflight_cuda)")


CheckSet = Callable[[Plan, Path], "tuple[str, Mapping[str, Callable[[], Check]]] | None"]


def main(spec: Any, url: str | None, args: argparse.Namespace, out: TextIO, check_set: CheckSet | None = None) -> int:
    """The command; ``check_set`` may name and supply another set of checks for the plan (preflight_cuda's)."""
    from sweep.study import UsageError

    try:
        plan = replace(plan_for(spec, args.lnc), storage=url or "")
    except (ValueError, neuron.LaunchError) as e:
        raise UsageError(str(e)) from None
    t0 = time.monotonic()
    path = report_path()
    workdir = path.parent / "preflight-work"  # the launch's trainer.log stays here for the fix to point at
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    chosen = check_set(plan, workdir) if check_set is not None else None  # None: the Neuron set
    checks = run_checks(plan, workdir, chosen[1] if chosen else None)
    report = {**report_of(plan, checks, time.monotonic() - t0), "check_set": chosen[0] if chosen else "neuron"}
    write_report(report, path)
    print_table(checks, out)
    print(json.dumps(report, default=str), file=out, flush=True)
    first = first_required_failure(checks)
    if first is not None:
        print(f"sweep: preflight failed at {first.name}: {first.detail}; fix: {first.fix}", file=sys.stderr,
              flush=True)
        return 1
    advisory = [c for c in checks if not c.ok]
    for c in advisory:
        print(f"preflight: advisory check {c.name} failed ({c.detail}); the node joins, and its trials "
              f"{ADVISORY_EFFECT.get(c.name, 'go without it')}", file=sys.stderr, flush=True)
    passed = "every required check passed" if advisory else "every check passed"
    print(f"preflight: {passed}; report in {path}", file=sys.stderr, flush=True)
    return 0
