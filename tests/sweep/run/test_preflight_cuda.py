"""``python -m sweep preflight`` with the CUDA set (sweep/run/preflight_cuda.py), on this machine's CPU path.

There is no GPU here, so the whole set runs with ``--node cuda`` on a ``device = "cpu"`` spec: the probes run the
same code a GPU node runs but for the device calls (cores and RAM for GPUs, float32 for bf16, no MFU); torchrun,
the supervisor, inductor and the trainer are real; ``nvidia-smi`` is a stand-in printing the CSV its
documentation describes. Each check's failure path is a real failure where this machine can give one (a CPU
torch asked for CUDA, nvidia-smi missing or failing, a launch on a device that is not there), and the judgement
of a probe's report where only a GPU could (ranks sharing a GPU, too few GPUs, no NCCL, out of memory)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sweep import cli
from sweep.run import preflight as pf
from sweep.run import preflight_cuda as pc
from sweep.spec import load
from tests.sweep_fixtures import write_spec

SPEC = {
    "study": {"n_trials": 1},
    "trial": {"budget_s": 4, "startup_allowance_s": 20, "eval_timeout_s": 20},
    "trial.resources": {"num_cpus": 1},
    "fixed": {"device": "cpu", "num_threads": 1, "vocab_size": 512, "head_dim": 64, "seq_len": 64, "ranks": 2},
    "params.model_dim": {"type": "int", "low": 128, "high": 256, "step": 128},
}
TINY = {"depth": 1, "model_dim": 64, "head_dim": 32, "vocab_size": 512, "seq_len": 64, "batch_size": 2,
        "compile": False}

# nvidia-smi --query-gpu=F1,F2,... --format=csv,noheader,nounits: one line per GPU, the asked fields in order,
# ", " between them; "[N/A]" where a field is not supported (NVIDIA's nvidia-smi documentation; see
# docs/neuron.md "Preflight on a CUDA node" for what is documented and what is a guess).
FAKE_SMI = '''#!{python}
import os, sys
GPUS = [{{"index": "0", "name": "NVIDIA H200", "uuid": "GPU-0f0e", "memory.total": "143771", "memory.used": "1",
         "utilization.gpu": "0", "temperature.gpu": "31", "driver_version": "570.124.06"}},
        {{"index": "1", "name": "NVIDIA H200", "uuid": "GPU-1a2b", "memory.total": "143771", "memory.used": "90000",
         "utilization.gpu": "87", "temperature.gpu": "[N/A]", "driver_version": "570.124.06"}}]
mode = os.environ.get("FAKE_SMI", "")
if mode == "no-driver":
    print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    sys.exit(9)
query = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--query-gpu=")]
fmt = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--format=")]
if not query or fmt != ["csv,noheader,nounits"]:
    print("Invalid combination of input arguments.")
    sys.exit(2)
fields = query[0].split(",")
for f in fields:
    if f not in GPUS[0]:
        print(f'Field "{{f}}" is not a valid field to query.')
        sys.exit(2)
for g in GPUS:
    values = [g[f] for f in fields]
    print(", ".join(values[:3] if mode == "short-row" else values))
'''


@pytest.fixture
def gpu_node(tmp_path, monkeypatch) -> Path:
    """A stand-in nvidia-smi first on PATH, the report and artifacts under tmp_path, the probe tiny and short."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI.format(python=sys.executable))
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv(pf.REPORT_VAR, str(tmp_path / "report.json"))
    monkeypatch.setenv("SWEEP_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.delenv("FAKE_SMI", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no pool of compile workers on this 2-core machine
    monkeypatch.setattr(pc, "THROUGHPUT", TINY)
    monkeypatch.setattr(pc, "THROUGHPUT_SECONDS", 2.0)
    return tmp_path


def plan(tmp_path: Path, **fixed) -> pf.Plan:
    return pf.plan_for(load(write_spec(tmp_path, "gpu", {**SPEC, "fixed": {**SPEC["fixed"], **fixed}})), env={})


def failed(fn, *args) -> pf.Check:
    check = pf.run_checks(None, Path("."), {"it": lambda: fn(*args)})[0]  # type: ignore[arg-type]
    assert not check.ok, check
    assert check.fix and "\n" not in check.detail + check.fix
    return check


@pytest.fixture(scope="module")
def cuda_here() -> dict:
    """What the gpu probe reports on this machine when asked for CUDA (a CPU-only torch, no GPU)."""
    env = {**os.environ, "PYTHONPATH": str(pf.REPO_ROOT)}
    return pf.probe(["gpu", "--device", "cuda"], env)


# -- the whole run ------------------------------------------------------------------------------------

def test_the_cuda_set_passes_end_to_end_on_the_cpu_path(gpu_node, capsys):
    out = io.StringIO()
    code = cli.main(["preflight", str(write_spec(gpu_node, "gpu", SPEC)), "--node", "cuda"], out=out)
    assert code == 0, out.getvalue()
    report = json.loads(out.getvalue().strip().splitlines()[-1])
    assert report == json.loads((gpu_node / "report.json").read_text())
    assert report["ok"] and report["check_set"] == "cuda" and report["ranks"] == 2
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["versions", "device", "launch", "compile", "gpu_monitor", "artifacts", "throughput"]
    assert all(c["ok"] for c in checks.values()), checks
    assert checks["device"]["data"]["kind"] == "cpu" and checks["device"]["data"]["device_count"] >= 2
    assert checks["launch"]["data"]["state"] == "COMPLETE" and len(checks["launch"]["data"]["ranks"]) == 2
    first, second = checks["compile"]["data"]["runs"]
    assert first["cache_misses"] >= 1 and first["cache_hits"] == 0 and second["cache_hits"] >= 1
    gpus = checks["gpu_monitor"]["data"]["gpus"]
    assert [g["index"] for g in gpus] == [0, 1] and gpus[0]["memory.total"] == 143771
    assert gpus[1]["temperature.gpu"] is None and "GPU(s) 1 already hold" in checks["gpu_monitor"]["detail"]
    t = checks["throughput"]["data"]
    assert t["status"] == "ok" and t["tokens_per_second"] > 0 and t["steps"] > t["excluded_steps"]
    assert t["shape"] == {k: v for k, v in TINY.items() if k != "compile"} and t["dtype"] == "float32"
    assert t["mfu"] is None and t["peak_flops"] is None  # no bf16 peak for a CPU
    from model.config import parse_config
    from model.counts import flops_per_token

    shape = {k: v for k, v in TINY.items() if k != "compile"}
    assert t["flops_per_token"] == flops_per_token(parse_config(shape).model)
    assert "tokens/s" in checks["throughput"]["detail"] and "MFU n/a" in checks["throughput"]["detail"]
    assert (gpu_node / "artifacts" / "_preflight").is_dir()
    table = out.getvalue().rsplit("\n", 2)[0]
    assert any(line.startswith("throughput") and " ok " in line and "tokens/s" in line for line in table.splitlines())
    assert "every check passed" in capsys.readouterr().err


def test_the_throughput_probe_alone_prints_one_json_line():
    args = [sys.executable, "-m", "model.preflight", *pc.throughput_args(
        replace(pf.plan_for(load("cuda-probe"), env={}), device="cpu"), TINY, 2.0)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=pf.REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(pf.REPO_ROOT)})
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 1, proc.stdout + proc.stderr
    out = json.loads(lines[0])
    assert out["status"] == "ok" and out["kind"] == "cpu" and out["tokens_per_second"] > 0
    assert out["summary"].startswith(f"{out['tokens_per_second']:,.0f} tokens/s, MFU n/a")
    assert pc.judge_throughput(out).ok
    c = failed(pc.judge_throughput, {**out, "status": "failed", "reason": "out of memory: CUDA out of memory"})
    assert "out of memory" in c.detail and "batch_size" in c.fix
    c = failed(pc.judge_throughput, {**out, "tokens_per_second": 0.0, "steps": 3})
    assert c.detail.startswith("no training step was charged in 2.0 s (3 step(s), 3 excluded)")


def test_a_node_whose_torch_cannot_use_cuda_fails_at_versions_and_skips_the_gpu_checks(gpu_node, capsys):
    out, spec = io.StringIO(), write_spec(gpu_node, "gpu", {**SPEC, "fixed": {**SPEC["fixed"], "device": "cuda"}})
    assert cli.main(["preflight", str(spec)], out=out) == 1  # the spec's device picks the CUDA set
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sweep: preflight failed at versions: torch ") and "PyPI" in err[0]
    report = json.loads((gpu_node / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert report["check_set"] == "cuda" and report["first_failure"] == "versions"
    assert checks["device"]["detail"].startswith("torch.cuda.is_available() is False")
    for name in ("launch", "compile", "throughput"):
        assert not checks[name]["ok"] and checks[name]["detail"] == "skipped: the versions check failed"
    assert checks["gpu_monitor"]["ok"] and checks["artifacts"]["ok"]
    assert "SKIP" in out.getvalue() and "FAIL" in out.getvalue()


# -- which set runs ------------------------------------------------------------------------------

def test_the_spec_decides_which_set_runs(tmp_path, monkeypatch):
    p = pf.plan_for(load("cuda-probe"), env={})
    assert (p.device, p.compile, p.ranks) == ("cuda", True, 1)
    assert pc.wanted(p, None) and not pc.wanted(p, "neuron")
    assert not pc.wanted(pf.plan_for(load("phase1"), env={}), None)
    assert pc.wanted(replace(p, device="cpu"), "cuda") and not pc.wanted(replace(p, device="cpu"), None)
    auto = replace(p, device="auto")  # the trainer's own choice here is the CPU: CUDA set only with nvidia-smi
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    assert not pc.wanted(auto, None)
    (tmp_path / "nvidia-smi").write_text(FAKE_SMI.format(python=sys.executable))
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.path.dirname(sys.executable)}")
    assert pc.wanted(auto, None)


# -- each check's failure path ------------------------------------------------------------------

def test_versions_refuse_a_cpu_only_torch_and_one_without_nccl(tmp_path, cuda_here):
    assert cuda_here["kind"] == "cuda" and cuda_here["cuda_build"] is None  # this machine's CPU wheel
    c = failed(pc.judge_versions, cuda_here, plan(tmp_path))
    assert c.detail == f"torch {cuda_here['torch']} is a CPU-only build (torch.version.cuda is None)"
    assert "PyPI" in c.fix and "CUDA" in c.fix and f"'torch=={cuda_here['torch'].split('+')[0]}'" in c.fix
    built = {**cuda_here, "cuda_build": "12.8", "nccl": None}
    assert "has no NCCL" in failed(pc.judge_versions, built, plan(tmp_path)).detail
    assert pc.judge_versions(built, plan(tmp_path, ranks=1)).ok  # one rank needs no process group


def test_device_unavailable_or_too_few_gpus(tmp_path, cuda_here):
    c = failed(pc.judge_device, cuda_here, plan(tmp_path))
    assert c.detail.startswith("torch.cuda.is_available() is False") and "nvidia-smi" in c.fix
    one = {**cuda_here, "cuda_available": True, "device_count": 1,
           "devices": [{"index": 0, "name": "NVIDIA H200", "memory_bytes": 150 * 2**30}]}
    c = failed(pc.judge_device, one, plan(tmp_path))
    assert c.detail == "torch.cuda.device_count() = 1; the spec runs 2 rank(s), one GPU each"
    assert pc.judge_device(one, plan(tmp_path, ranks=1)).detail == "1 GPU(s) for 1 rank(s): 1 x NVIDIA H200 (150.0 GiB)"


def test_launch_on_a_gpu_that_is_not_there_fails_naming_the_trainers_error(gpu_node):
    c = failed(pc.check_launch, plan(gpu_node, device="cuda", ranks=1), gpu_node / "work", "cuda")
    # The rank's own error: a CPU-only torch has no CUDA to set cuda:LOCAL_RANK on (model.device.setup).
    assert c.detail.startswith("rank 0 failed: ") and "cuda" in c.detail.lower(), c.detail
    assert c.data["ranks"][0]["exit"] == 1


def test_ranks_must_each_train_on_their_own_gpu(tmp_path):
    p = plan(tmp_path)
    good = {0: {"rank": 0, "local_rank": 0, "cuda_device": 0}, 1: {"rank": 1, "local_rank": 1, "cuda_device": 1}}
    assert pc.judge_ranks(good, p, "cuda") == "rank 0: cuda:0, rank 1: cuda:1"
    c = failed(pc.judge_ranks, {**good, 1: {**good[1], "cuda_device": 0}}, p, "cuda")
    assert c.detail == "rank 1 trained on cuda:0; it must train on its own GPU cuda:1"
    c = failed(pc.judge_ranks, {**good, 1: {**good[1], "error": "RuntimeError: CUDA error: invalid device ordinal"}},
               p, "cuda")
    assert c.detail == "rank 1 failed: RuntimeError: CUDA error: invalid device ordinal"
    assert failed(pc.judge_ranks, {0: good[0]}, p, "cuda").detail == "1 of 2 rank(s) reported"


def test_compile_that_differs_from_eager_fails():
    runs = [{"device": "cuda:0", "seconds": 9.1, "max_abs_err": 0.0, "max_abs_ref": 300.0, "cache_hits": 0},
            {"device": "cuda:0", "seconds": 1.2, "max_abs_err": 0.5, "max_abs_ref": 300.0, "cache_hits": 1}]
    assert pc.judge_compile([runs[0], {**runs[1], "max_abs_err": 0.01}], "/tmp/cache").ok  # 3e-5 of 300
    c = failed(pc.judge_compile, runs, "/tmp/cache")
    assert c.detail == "compiled run 2 differs from eager by 0.5"
    runs[1]["max_abs_err"], runs[1]["cache_hits"] = 0.0, 0
    assert "NO cache hit" in pc.judge_compile(runs, "/tmp/cache").detail


def test_gpu_monitor_missing_failing_malformed_or_short_of_gpus(gpu_node, monkeypatch):
    p = plan(gpu_node)
    assert pc.check_gpu_monitor(p).ok
    assert failed(pc.check_gpu_monitor, replace(p, ranks=4)).detail == \
        "nvidia-smi lists 2 GPU(s); the spec runs 4 rank(s), one GPU each"
    monkeypatch.setenv("FAKE_SMI", "no-driver")
    c = failed(pc.check_gpu_monitor, p)
    assert c.detail == ("nvidia-smi exited 9 (the NVIDIA driver is not loaded): NVIDIA-SMI has failed because it "
                        "couldn't communicate with the NVIDIA driver.") and "driver" in c.fix
    monkeypatch.setenv("FAKE_SMI", "short-row")
    assert failed(pc.check_gpu_monitor, p).detail == "nvidia-smi row 1 has 3 value(s), 8 asked"
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable))
    c = failed(pc.check_gpu_monitor, p)
    assert c.detail == "nvidia-smi is not on PATH" and "NVIDIA driver" in c.fix


def test_the_gpu_machine_script_refuses_a_node_without_nvidia_smi(tmp_path):
    if any(Path(d, "nvidia-smi").exists() for d in ("/usr/bin", "/bin")):
        pytest.skip("this machine has an nvidia-smi")
    script = pf.REPO_ROOT / "bench" / "cuda_preflight.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path)})
    assert proc.returncode == 2 and "nvidia-smi is not on PATH" in proc.stderr
    assert not (tmp_path / "out" / "install.log").exists()  # it stopped before installing anything
