"""``python -m sweep preflight`` against the Neuron stand-ins (tests/neuron_standins.py): the whole run passes
end to end, and each check fails with its own message when a stand-in is broken the way it guards against.
The supervisor, torchrun, the trainer, the kernels and the compile cache logic are real; S3 is moto."""

from __future__ import annotations

import io
import json
import os
import socket
from dataclasses import replace
from pathlib import Path

import pytest

from sweep import cli
from sweep.run import preflight as pf
from sweep.spec import load
from tests.neuron_standins import drop_packages, install
from tests.sweep_fixtures import write_spec

# A study shaped like phase1 (fixed lnc, ranks, one chip's cores) with a model that trains in a blink, on the
# stand-in's neuron device (the CPU underneath, TorchNeuron's device rules on top).
SPEC = {
    "study": {"n_trials": 1},
    "trial": {"budget_s": 4, "startup_allowance_s": 20, "eval_timeout_s": 20},
    "trial.resources": {"neuron_cores": 2, "num_cpus": 1},
    "fixed": {"device": "neuron", "num_threads": 1, "vocab_size": 512, "head_dim": 64, "seq_len": 64, "lnc": 2,
              "ranks": 2},
    "params.model_dim": {"type": "int", "low": 128, "high": 256, "step": 128},
}


@pytest.fixture
def node(tmp_path, monkeypatch) -> Path:
    """A stand-in trn2 node: Neuron stand-ins installed, node LNC 2, its cache and report under tmp_path."""
    install(tmp_path / "standins", monkeypatch)
    for var in ("TORCH_NEURONX_NEFF_CACHE_DIR", "NEURON_COMPILE_CACHE_URL", "SWEEP_ARTIFACTS", "TRNSWEEP_S3",
                "NEURON_RT_VISIBLE_CORES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    monkeypatch.setenv("NEURON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(pf.REPORT_VAR, str(tmp_path / "report.json"))
    return tmp_path


def plan(tmp_path: Path, **fixed) -> pf.Plan:
    sections = {**SPEC, "fixed": {**SPEC["fixed"], **fixed}}
    return pf.plan_for(load(write_spec(tmp_path, "pf", sections)))


def failed(fn, *args) -> pf.Check:
    """Run one check through run_checks (as the command does) and insist it failed."""
    check = pf.run_checks(None, Path("."), {"it": lambda: fn(*args)})[0]  # type: ignore[arg-type]
    assert not check.ok, check
    assert check.fix and "\n" not in check.detail + check.fix
    return check


@pytest.fixture
def s3(monkeypatch):
    import boto3
    import moto

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    with moto.mock_aws():
        yield boto3.client("s3")


# -- the whole run ------------------------------------------------------------------------------------

def test_every_check_passes_end_to_end_against_the_standins(node, s3, monkeypatch, capsys):
    s3.create_bucket(Bucket="trn-bucket")
    monkeypatch.setenv("SWEEP_ARTIFACTS", "s3://trn-bucket/artifacts")
    spec = write_spec(node, "pf", SPEC)
    out = io.StringIO()
    assert cli.main(["preflight", str(spec)], out=out) == 0, out.getvalue()
    table, last = out.getvalue().rsplit("\n", 2)[0], out.getvalue().strip().splitlines()[-1]
    report = json.loads(last)
    assert report == json.loads((node / "report.json").read_text())
    assert report["ok"] and report["first_failure"] is None and report["lnc"] == 2 and report["ranks"] == 2
    names = [c["name"] for c in report["checks"]]
    assert names == ["environment", "versions", "neuron_ls", "device", "launch", "model_compile", "compile_cache",
                     "kernels", "monitor", "artifacts"]
    checks = {c["name"]: c for c in report["checks"]}
    assert all(c["ok"] for c in checks.values()), checks
    assert "rank 0: core 0, rank 1: core 1" in checks["launch"]["detail"]
    assert [r["new_neffs"] for r in checks["compile_cache"]["data"]["runs"]] == [1, 0]
    assert checks["compile_cache"]["data"]["neff_dir"] == str(node / "cache" / "neff")
    assert sorted((r["kernel"], r["width"], r["mode"]) for r in checks["kernels"]["data"]["results"]) == sorted(
        (k, w, m) for k, w in (("rms_norm", 128), ("relu2_mlp", 128), ("rms_norm", 256), ("relu2_mlp", 256),
                               ("softcap_cross_entropy", 512)) for m in ("eager", "compiled"))
    assert report["advisory_failures"] == [] and [c["name"] for c in report["checks"] if not c["required"]] == \
        ["model_compile", "kernels"]
    assert all(r["err"] <= pf.TOLERANCE for r in checks["kernels"]["data"]["results"])
    s3.head_object(Bucket="trn-bucket", Key=f"artifacts/_preflight/{socket.gethostname()}.json")
    for name in names:
        assert any(line.startswith(name) and " ok " in line for line in table.splitlines()), table
    assert "every check passed" in capsys.readouterr().err


def test_a_failure_exits_1_naming_the_first_failed_check_and_its_fix(node, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_NEURON", "unavailable")
    monkeypatch.setenv("SWEEP_ARTIFACTS", str(node / "artifacts"))
    out = io.StringIO()
    assert cli.main(["preflight", str(write_spec(node, "pf", SPEC))], out=out) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sweep: preflight failed at device: torch.neuron.is_available()")
    assert "fix:" in err[0]
    report = json.loads((node / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert not report["ok"] and report["first_failure"] == "device"
    for name in pf.NEEDS_DEVICE:  # nothing that needs the device ran, and none of them passed
        assert not checks[name]["ok"] and checks[name]["detail"] == "skipped: the device check failed"
    assert checks["monitor"]["ok"] and checks["artifacts"]["ok"] and checks["versions"]["ok"]
    assert "SKIP" in out.getvalue() and "FAIL" in out.getvalue()


def test_a_node_whose_only_failure_is_advisory_joins(node, monkeypatch, capsys):
    """Wrong kernel results fail the kernels check, which is advisory: exit 0, the report names it, and the
    trainer's kernels = "auto" reads the failed check and runs the PyTorch ops."""
    from model.kernel_choice import preflight_verdict

    monkeypatch.setenv("FAKE_NEURON", "wrong-kernels")
    monkeypatch.setenv("SWEEP_ARTIFACTS", str(node / "artifacts"))
    out = io.StringIO()
    assert cli.main(["preflight", str(write_spec(node, "pf", SPEC))], out=out) == 0, out.getvalue()
    report = json.loads((node / "report.json").read_text())
    assert report["ok"] and report["first_failure"] is None and report["advisory_failures"] == ["kernels"]
    checks = {c["name"]: c for c in report["checks"]}
    assert not checks["kernels"]["ok"] and not checks["kernels"]["required"]
    assert all(c["ok"] for name, c in checks.items() if name != "kernels")
    assert any(line.startswith("kernels") and " WARN " in line for line in out.getvalue().splitlines())
    err = capsys.readouterr().err
    assert "advisory check kernels failed" in err and "every required check passed" in err
    assert preflight_verdict(2, node / "report.json") == (False, f"the preflight's kernels check failed on this node "
                                                           f"({node / 'report.json'})")


def test_a_model_that_fails_to_compile_is_advisory_and_the_node_joins(node, monkeypatch, capsys):
    """A full model's compile error would fail every node of the image alike: the launch is checked eager, the
    compile apart and advisory, so the node joins and each trial that compiles fails (or falls back) alone."""
    monkeypatch.setenv("FAKE_NEURON", "model-compile-error")
    monkeypatch.setenv("SWEEP_ARTIFACTS", str(node / "artifacts"))
    out = io.StringIO()
    spec = write_spec(node, "pf", {**SPEC, "fixed": {**SPEC["fixed"], "compile": True}})
    assert cli.main(["preflight", str(spec)], out=out) == 0, out.getvalue()
    report = json.loads((node / "report.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert report["ok"] and "model_compile" in report["advisory_failures"]
    assert checks["launch"]["ok"] and checks["compile_cache"]["ok"], checks
    assert not checks["model_compile"]["required"]
    assert checks["model_compile"]["detail"].startswith("the tiny model compiled ended FAIL")
    assert "advisory check model_compile failed" in capsys.readouterr().err


def test_bad_input_is_exit_2(node, capsys):
    sections = {**SPEC, "params.lnc": {"type": "categorical", "choices": [1, 2]},
                "fixed": {k: v for k, v in SPEC["fixed"].items() if k not in ("lnc", "ranks")}}
    assert cli.main(["preflight", str(write_spec(node, "two", sections))]) == 2
    assert "--lnc" in capsys.readouterr().err


# -- what the spec asks ---------------------------------------------------------------------------

def test_phase1_plan(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    p = pf.plan_for(load("phase1"))
    assert (p.lnc, p.ranks, p.neuron_cores, p.device, p.compile, p.flags) == (2, 4, 4, "neuron", True, "--optlevel=1")
    assert p.widths == ((512, 2048), (1024, 4096)) and p.vocab == 8192


def test_a_spec_searching_lnc_needs_one_picked(tmp_path):
    sections = {**SPEC, "params.lnc": {"type": "categorical", "choices": [1, 2]},
                "fixed": {k: v for k, v in SPEC["fixed"].items() if k != "lnc"}}
    spec = load(write_spec(tmp_path, "two", sections))
    with pytest.raises(ValueError, match="LNC 1, 2: pick one with --lnc"):
        pf.plan_for(spec, env={})
    assert pf.plan_for(spec, lnc=1, env={}).lnc == 1


# -- each check's failure path ----------------------------------------------------------------------

def test_versions_refuse_the_public_index_placeholder(node, monkeypatch):
    install(node / "placeholder", monkeypatch, {"torch-neuronx": "2.13.3.0.1", "neuronx-cc": "2.28.7631.0",
                                                 "nki": "0.0.1"})
    c = failed(pf.check_versions, plan(node))
    assert "nki 0.0.1" in c.detail and "placeholder" in c.detail and "pip.repos.neuron.amazonaws.com" in c.fix


def test_neuron_ls_off_path_and_too_few_cores(node, monkeypatch):
    c = failed(pf.check_neuron_ls, replace(plan(node), neuron_cores=16))
    assert c.detail == "neuron-ls shows 8 core(s) at LNC 2; the spec reserves 16"
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if "standins" not in p))
    c = failed(pf.check_neuron_ls, plan(node))
    assert c.detail == "neuron-ls is not on PATH or in /opt/aws/neuron/bin" and "aws-neuronx-tools" in c.fix


@pytest.mark.parametrize("mode,message", [("unavailable", "torch.neuron.is_available() is False"),
                                          ("few-cores", "torch.neuron.device_count() = 1 at LNC 2")])
def test_device_unavailable_or_short_of_cores(node, monkeypatch, mode, message):
    monkeypatch.setenv("FAKE_NEURON", mode)
    assert failed(pf.check_device, plan(node)).detail.startswith(message)


def test_device_without_torch_neuronx(node, monkeypatch):
    drop_packages(monkeypatch)
    c = failed(pf.check_device, plan(node))
    assert "torch.neuron is missing" in c.detail and "[neuron]" in c.fix


def test_launch_fails_when_ranks_share_a_core(node, monkeypatch):
    monkeypatch.setenv("FAKE_NEURON", "share-core")
    c = failed(pf.check_launch, plan(node), node / "work")
    assert "NEURON_RT_VISIBLE_CORES" in c.fix
    assert c.detail == "rank 1 holds NEURON_RT_VISIBLE_CORES=0; it must hold exactly its own core (1)"


@pytest.mark.parametrize("mode,message", [("cache-elsewhere", "wrote no NEFF under"),
                                          ("no-hit", "the second compile of the same graph wrote 1 new NEFF(s)")])
def test_compile_cache_not_used_or_not_hit(node, monkeypatch, mode, message):
    monkeypatch.setenv("FAKE_NEURON", mode)
    c = failed(pf.check_compile_cache, plan(node))
    assert message in c.detail and "TORCH_NEURONX_NEFF_CACHE_DIR" in c.fix + c.detail


@pytest.mark.parametrize("var", ["TORCH_NEURONX_NEFF_DISABLE_CACHE", "TORCH_NEURONX_DISABLE_NEFF_CACHE"])
def test_compile_cache_refuses_either_disable_variable_and_its_fix_names_both(node, monkeypatch, var):
    monkeypatch.setenv(var, "1")
    c = failed(pf.check_compile_cache, plan(node))
    assert c.detail == f"{var}=1 is set: TorchNeuron would compile every graph again"
    assert "TORCH_NEURONX_NEFF_DISABLE_CACHE and TORCH_NEURONX_DISABLE_NEFF_CACHE" in c.fix
    monkeypatch.delenv(var)
    monkeypatch.setenv("FAKE_NEURON", "no-hit")  # the no-hit fix names both too
    assert "TORCH_NEURONX_DISABLE_NEFF_CACHE" in failed(pf.check_compile_cache, plan(node)).fix


def test_compile_cache_on_a_local_disk_is_not_shared(node):
    p = plan(node)
    c = failed(pf.check_compile_cache, replace(p, compile_cache=str(node / "fsx")))
    assert "is not on a shared file system" in c.detail and "mount" in c.fix


def test_compile_cache_not_writable(node):
    (node / "file").write_text("a file where the cache directory should be")
    c = failed(pf.check_compile_cache, replace(plan(node), env={"NEURON_CACHE_DIR": str(node / "file" / "cache")}))
    assert "is not writable" in c.detail


def test_kernels_wrong_results_and_no_nki(node, monkeypatch):
    monkeypatch.setenv("FAKE_NEURON", "wrong-kernels")
    c = failed(pf.check_kernels, plan(node))
    assert c.detail.startswith("rms_norm (eager) at width 128: error 0.") and "PyTorch ops" in c.fix
    monkeypatch.setenv("FAKE_NEURON", "")
    monkeypatch.delenv("NKI_SIMULATOR")
    drop_packages(monkeypatch)
    c = failed(pf.check_kernels, plan(node))
    assert "kernels='nki' is unavailable" in c.detail and "nki" in c.fix


def test_monitor_silent_or_missing(node, monkeypatch):
    monkeypatch.setenv("FAKE_NEURON", "silent-monitor")
    monkeypatch.setattr(pf, "MONITOR_TIMEOUT_S", 1.0)
    assert failed(pf.check_monitor, plan(node)).detail == "neuron-monitor printed nothing in 1 s"
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if "standins" not in p))
    c = failed(pf.check_monitor, plan(node))
    assert c.detail == "neuron-monitor is not on PATH or in /opt/aws/neuron/bin" and "aws-neuronx-tools" in c.fix


def test_artifacts_bucket_missing_or_denied(node, s3, monkeypatch):
    monkeypatch.setenv("SWEEP_ARTIFACTS", "s3://no-such-bucket/artifacts")
    c = failed(pf.check_artifacts, plan(node))
    assert "NoSuchBucket" in c.detail and "python -m infra bucket" in c.fix
    monkeypatch.setenv("SWEEP_ARTIFACTS", str(node / "file" / "sub"))
    (node / "file").write_text("not a directory")
    assert "is not writable" in failed(pf.check_artifacts, plan(node)).detail


def test_fs_type_reads_the_longest_mount(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/root / ext4 rw 0 0\nfs-1.efs:/ /fsx nfs4 rw 0 0\n")
    assert pf.fs_type("/fsx/neuron-cache", str(mounts)) == "nfs4"
    assert pf.fs_type("/fsxx", str(mounts)) == "ext4"


def test_children_get_the_trials_lnc_flags_and_one_core(node, monkeypatch):
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-3")  # whatever this shell holds, a probe holds only its own
    env = pf.child_env(replace(plan(node), flags="--optlevel=1", env={"NEURON_RT_ASYNC": "1"}), cores="0")
    assert (env["NEURON_LOGICAL_NC_CONFIG"], env["NEURON_CC_FLAGS"], env["NEURON_RT_VISIBLE_CORES"]) == \
        ("2", "--optlevel=1", "0")
    assert env["NEURON_RT_ASYNC"] == "1" and str(pf.REPO_ROOT) in env["PYTHONPATH"].split(os.pathsep)
    assert "NEURON_RT_VISIBLE_CORES" not in pf.child_env(plan(node))


# -- the competition profile: the image venv's versions, and the study's first node --------------------------

def _image_venv(root: Path, versions: dict[str, str]) -> Path:
    """A stand-in image venv whose python answers the version read with these versions (fabricated)."""
    python = root / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho '{json.dumps(versions)}'\n")
    python.chmod(0o755)
    return root


FIRST = {"torch": "2.11.0", "torch-neuronx": "2.11.3.0", "neuronx-cc": "2.26.1.0", "nki": "0.5.0",
         "aws-neuronx-runtime-lib": "2.33.10.0", "aws-neuronx-collectives": "2.33.10.0"}


def test_a_node_whose_image_venv_differs_from_the_studys_first_node_is_refused_in_one_line(tmp_path):
    import optuna

    from sweep import store as st

    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    optuna.create_study(study_name="pf", storage=st.open_storage(url))
    first, other = _image_venv(tmp_path / "a", FIRST), _image_venv(tmp_path / "b", {**FIRST, "neuronx-cc": "2.28.0.0"})

    def competition_plan(venv: Path) -> pf.Plan:
        sections = {**SPEC, "environment": {"profile": "competition", "venv": str(venv)}}
        return replace(pf.plan_for(load(write_spec(tmp_path, "pf", sections))), storage=url)

    plan = competition_plan(first)
    assert plan.python == str(first / "bin" / "python")  # trials' trainers and the probes run with it
    c = pf.check_environment(plan)
    assert c.ok and c.data["versions"] == FIRST and c.data["recorded_as_first"]
    study = optuna.load_study(study_name="pf", storage=st.open_storage(url))
    assert study.user_attrs["environment_versions"] == FIRST
    assert pf.check_environment(plan).data["recorded_as_first"] is False  # the same image: admitted
    refused = failed(pf.check_environment, competition_plan(other))
    assert refused.detail == "this node's image venv differs from study pf's first node: neuronx-cc 2.26.1.0 " \
                             "there, 2.28.0.0 here"
    assert pf.check_versions(plan).ok  # the pins are latest-sdk's: not judged here


def test_a_competition_node_without_the_image_venv_fails_and_its_device_checks_are_skipped(tmp_path):
    sections = {**SPEC, "environment": {"profile": "competition", "venv": str(tmp_path / "none")}}
    plan = pf.plan_for(load(write_spec(tmp_path, "pf", sections)))
    assert plan.python is None
    done = pf.run_checks(plan, tmp_path, {"environment": lambda: pf.check_environment(plan),
                                          "launch": lambda: pf.Check("launch", True, "not run")})
    assert not done[0].ok and "no venv" in done[0].detail and "\n" not in done[0].detail
    assert done[1].detail == "skipped: the environment check failed"
