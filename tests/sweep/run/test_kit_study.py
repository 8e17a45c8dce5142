"""A study of a team's script in the competition kit's own dialect, on the kit-demo worked example.

One real sweep (a subprocess driver, local Ray, the kit stand-in, two torchrun ranks a trial) serves the
read-only checks: each trial's value is what the kit's own `prepare.py eval-public` prints for its checkpoint
when run by hand, the script's figure is only its claim, and export's train.py differs from the team's only
in the swept literals (constants and a flag's default). The supervisor checks run one trial alone: a stopped
trial leaves none of its ranks behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.script import source
from sweep.run.supervisor import Reporter, TrialTask
from tests.sweep_fixtures import ROOT, head_env, load_trials, run_sweep, supervise, write_spec

pytestmark = pytest.mark.slow
DEMO = ROOT / "sweep" / "studies" / "kit-demo"
EVAL_ARGS = ["--seq-len", "{seq_len}", "--eval-tokens", "{eval_tokens}", "--batch-size", "4"]


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    """A team's folder: the kit stand-in set up (`python prepare.py setup`) beside the team's train.py."""
    folder = tmp_path_factory.mktemp("kit")
    for name in ("prepare.py", "train.py"):
        shutil.copyfile(DEMO / name, folder / name)
    subprocess.run([sys.executable, "prepare.py", "setup"], cwd=folder, check=True, capture_output=True)
    return folder


def sections(kit: Path) -> dict:
    return {"study": {"n_trials": 2, "concurrency": 1, "seed": 3},
            "trial": {"script": str(kit / "train.py"), "kit": str(kit / "prepare.py"), "ranks": 2, "budget_s": 6,
                      "startup_allowance_s": 60, "eval_timeout_s": 120, "eval_fractions": [0.5], "heartbeat_s": 2,
                      "stale_after_s": 60, "stop_grace_s": 10, "eval_args": EVAL_ARGS, "eval_tokens": 8192,
                      "eval_seq_len": 128, "seed_knob": "--seed"},
            "trial.env": {"OMP_NUM_THREADS": "1"}, "trial.resources": {"num_cpus": 1}, "pruner": {"name": "none"},
            "params": None,
            "params.matrix_lr": {"type": "float", "low": 0.004, "high": 0.02, "log": True},
            "params.depth": {"type": "int", "low": 1, "high": 2},
            "params.seq_len": {"type": "categorical", "choices": [32, 64], "flag": "--seq-len"}}


@pytest.fixture(scope="module")
def study(kit, tmp_path_factory, ray_cluster):
    tmp = tmp_path_factory.mktemp("kit-study")
    spec = write_spec(tmp, "kitted", sections(kit))
    storage = f"journal:{tmp / 'j.log'}"
    env = head_env(ray_cluster, storage, tmp / "artifacts")
    proc = run_sweep("run", str(spec), env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return spec, storage, env, tmp / "artifacts"


def test_each_trials_value_is_the_kits_eval_public_on_its_checkpoint(study, kit, tmp_path):
    _, storage, _, artifacts = study
    trials = load_trials(storage, "kitted")
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2
    for t in trials:
        a = t.user_attrs
        assert a["dialect"] == "kit" and a["val_bpb_source"] == "eval-public" and a["eval_tokens"] == 8192
        assert a["world_size"] == 2 and "claimed_val_bpb" not in a  # the script evaluates nothing by default
        assert "--max-train-seconds 6" in a["command"] and f"--seq-len {t.params['seq_len']}" in a["command"]
        # the kit's scorer, run by hand as a team runs it, on the checkpoint the trial kept
        work = tmp_path / str(t.number)
        work.mkdir()
        for name in ("prepare.py", "data", "tokenizer"):
            (work / name).symlink_to(kit / name)
        shutil.copyfile(artifacts / "kitted" / str(t.number) / "script" / "train.py", work / "train.py")
        shutil.copyfile(artifacts / "kitted" / str(t.number) / "final.pt", work / "final.pt")
        out = subprocess.run([sys.executable, "prepare.py", "eval-public", "--train-py", "train.py", "--checkpoint",
                              "final.pt", "--seq-len", "128", "--eval-tokens", "8192", "--batch-size", "4"],
                             cwd=work, capture_output=True, text=True, check=True).stdout
        assert t.value == json.loads(out)["val_bpb"]


def test_export_differs_from_the_script_only_in_the_swept_literals(study, kit, tmp_path):
    spec, storage, env, _ = study
    proc = run_sweep("export", str(spec), "--out", str(tmp_path / "sub"), env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    best = min(load_trials(storage, "kitted"), key=lambda t: t.value)
    text = (kit / "train.py").read_text()
    wanted = source.rewrite_flag_defaults(
        source.rewrite(text, {"MATRIX_LR": best.params["matrix_lr"], "DEPTH": best.params["depth"]}),
        {"--seq-len": best.params["seq_len"]})
    assert (tmp_path / "sub" / "train.py").read_text() == wanted != text
    # the competition's launch: the whole chip, whatever the trial ran on (two CPU ranks), the budget left alone
    launch = (tmp_path / "sub" / "launch.sh").read_text().strip().splitlines()[-1]
    assert launch == "NEURON_LOGICAL_NC_CONFIG=2 torchrun --standalone --nproc_per_node=4 train.py"


class StopAtFirst(Reporter):
    def report(self, value: float, step: int) -> bool:
        return True


def test_a_stopped_kit_trial_leaves_none_of_its_ranks(tmp_path, kit):
    config = {"script": str(kit / "train.py"), "kit": str(kit / "prepare.py"), "dialect": "kit",
              "constants": {"DEPTH": 1}, "eval_fractions": [0.05], "eval_args": EVAL_ARGS}
    task = TrialTask(study="w", storage_url="", number=0, trial_id=0, params={}, config=config, budget_s=200,
                     deadline_s=400, eval_fractions=(0.05,), trainer="model.script.run", launches_ranks=True,
                     ranks=2, stop_grace_s=10, heartbeat_s=1, artifact_dir=str(tmp_path / "art"),
                     env={"OMP_NUM_THREADS": "1"})
    out = supervise(task, StopAtFirst())
    assert out.state == "PRUNED", out
    work = tmp_path / "art" / "script"  # every rank (and torchrun) runs in the trial's folder
    deadline = time.monotonic() + 10
    while (left := in_folder(work)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left


def in_folder(folder: Path) -> list[int]:
    """The processes whose working directory is ``folder``."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if Path(os.readlink(proc / "cwd")) == folder:
                    found.append(int(proc.name))
            except OSError:
                continue
    return found
