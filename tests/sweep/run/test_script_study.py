"""A study of a team's own script (sweep/spec/script.py, model/script/run.py) on the worked example's train.py.

One real sweep of the script (a subprocess driver, local Ray, the stand-in kit) serves every read-only check:
the record holds the summary block, the trial records the script's sha256, best names the rewritten script,
and export writes the script differing only in the searched literals. The supervisor checks run the script
trainer alone: a pruned trial stops within its grace, a crashing script is FAIL with its last error line.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from model.script import source
from sweep.run.supervisor import Reporter, TrialTask
from tests.kit_standin import prepare_text
from tests.sweep_fixtures import ROOT, head_env, load_trials, run_sweep, supervise, sweep_env, write_spec

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "sweep" / "studies" / "script-demo" / "train.py"
PARAMS = {"learning_rate": {"type": "float", "low": 0.002, "high": 0.02, "log": True},
          "model_dim": {"type": "int", "low": 32, "high": 64, "step": 32},
          "depth": {"type": "int", "low": 1, "high": 2, "constant": "DEPTH"}}


def sections(kit: Path, **trial) -> dict:
    return {"study": {"n_trials": 3, "concurrency": 2, "seed": 1},
            "trial": {"script": str(SCRIPT), "kit": str(kit / "prepare.py"), "budget_s": 6,
                      "startup_allowance_s": 60, "eval_timeout_s": 60, "eval_fractions": [0.5], "heartbeat_s": 2,
                      "stale_after_s": 30, "stop_grace_s": 10, **trial},
            "trial.resources": {"num_cpus": 1}, "pruner": {"name": "none"},
            "fixed": {"num_threads": 1, "batch_size": 4, "seq_len": 32, "eval_batch_size": 4}, "params": None,
            **{f"params.{k}": v for k, v in PARAMS.items()}}


@pytest.fixture(scope="module")
def study(standin_kit, tmp_path_factory, ray_cluster):
    """The finished script study: (spec path, storage, env, the driver's stdout)."""
    tmp = tmp_path_factory.mktemp("script-study")
    spec = write_spec(tmp, "scripted", sections(standin_kit))
    storage = f"journal:{tmp / 'j.log'}"
    env = head_env(ray_cluster, storage, tmp / "artifacts")
    proc = run_sweep("run", str(spec), env=env, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return spec, storage, env, proc.stdout


def test_a_script_study_runs_and_records_the_summary_block_and_the_scripts_sha(study):
    spec, storage, _, out = study
    trials = load_trials(storage, "scripted")
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3
    sha = hashlib.sha256(SCRIPT.read_bytes()).hexdigest()
    for t in trials:
        a = t.user_attrs
        assert a["script_sha256"] == sha and a["status"] == "ok" and a["val_bpb_source"] == "kit"
        # the summary's figure is the script's claim; the kit's scorer, in a process of its own, agrees with it
        assert a["claimed_val_bpb"] == pytest.approx(a["val_bpb"], abs=1e-5) and a["claim_differs"] is False
        for k in ("training_seconds", "startup_allowance_est", "charged_seconds_est", "over_budget", "num_steps",
                  "total_tokens_M", "world_size", "seq_len", "num_params_M"):
            assert k in a["record_fields"], k
        assert a["seq_len"] == 32 and a["steps"] == a["num_steps"] > 2
        assert t.value == pytest.approx(a["val_bpb"]) and 1 < t.value < 20
        assert a["constants"] == {"NUM_THREADS": 1, "BATCH_SIZE": 4, "SEQ_LEN": 32, "EVAL_BATCH_SIZE": 4,
                                  "LEARNING_RATE": t.params["learning_rate"], "MODEL_DIM": t.params["model_dim"],
                                  "DEPTH": t.params["depth"]}
        # The smoothed training loss at half the 6 s budget, named as such; the final val_bpb is not appended to it.
        assert sorted(t.intermediate_values) == [3] and a["curve_metric"] == "train_loss_smoothed"
    best = min(trials, key=lambda t: t.value)
    assert f"best: trial {best.number} " in out and "script:     " in out
    shown = Path(re.search(r"script: +(\S+)", out)[1])
    assert shown.read_text() == source.rewrite(SCRIPT.read_text(), best.user_attrs["constants"])


def test_export_writes_the_script_differing_only_in_the_searched_literals(study, tmp_path):
    spec, storage, env, _ = study
    proc = run_sweep("export", str(spec), "--out", str(tmp_path / "sub"), env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    best = min(load_trials(storage, "scripted"), key=lambda t: t.value)
    wanted = best.user_attrs["constants"]
    old = SCRIPT.read_bytes().splitlines(keepends=True)
    new = (tmp_path / "sub" / "train.py").read_bytes().splitlines(keepends=True)
    assert len(old) == len(new)
    changed = {}
    for a, b in zip(old, new, strict=True):
        if a == b:
            continue
        ma = re.fullmatch(rb"([A-Z_]+) = (\S+)(\s*(?:#.*)?\r?\n?)", a)
        mb = re.fullmatch(rb"([A-Z_]+) = (\S+)(\s*(?:#.*)?\r?\n?)", b)
        assert ma and mb and ma[1] == mb[1] and ma[3] == mb[3], (a, b)  # the name and the comment stay
        changed[ma[1].decode()] = ast.literal_eval(mb[2].decode())
    original = {k: source.constants(SCRIPT.read_text())[k][0].value for k in wanted}
    assert changed == {k: v for k, v in wanted.items() if v != original[k]} and changed
    prov = json.loads((tmp_path / "sub" / "provenance.json").read_text())
    assert prov["constants"] == wanted and prov["script_sha256"] == best.user_attrs["script_sha256"]
    assert "torchrun --standalone --nproc_per_node=1 train.py" in (tmp_path / "sub" / "launch.sh").read_text()


@pytest.mark.parametrize(("params", "fixed", "words"), [
    ({"depth": {"type": "int", "low": 1, "high": 2, "constant": "N_LAYER"}}, {},
     r"scripted\.toml:\d+: params\.depth: .*train\.py has no module-level constant N_LAYER \(its constants: "),
    ({"seed": {"type": "categorical", "choices": ["a", "b"]}}, {},
     r"params\.seed: .*train\.py:\d+: SEED = 0 is a int literal; the spec sets it to a str"),
    ({}, {"t0": 1}, r"t0: .*train\.py:\d+: T0 is not a literal"),
])
def test_a_constant_the_script_lacks_exits_2_with_file_line_and_name(standin_kit, tmp_path, params, fixed, words):
    s = sections(standin_kit)
    s.update({f"params.{k}": v for k, v in params.items()})
    s["fixed"] = {**s["fixed"], **fixed}
    spec = write_spec(tmp_path, "scripted", s)
    proc = run_sweep("run", str(spec), env=sweep_env(f"journal:{tmp_path / 'j.log'}", tmp_path / "a"), timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert re.search(words, proc.stderr), proc.stderr
    assert not (tmp_path / "j.log").exists()  # nothing was written


# -- the script trainer under the supervisor ------------------------------------------------------------------

class PruneFirst(Reporter):
    def __init__(self) -> None:
        self.reports: list[tuple[int, float]] = []

    def report(self, value: float, step: int) -> bool:
        self.reports.append((step, value))
        return True


def script_task(tmp_path: Path, kit: Path, script: Path = SCRIPT, budget_s: float = 120) -> TrialTask:
    config = {"script": str(script), "kit": str(kit / "prepare.py"),
              "constants": {"NUM_THREADS": 1, "BATCH_SIZE": 4, "SEQ_LEN": 32}, "eval_fractions": [0.02, 0.5]}
    return TrialTask(study="w", storage_url="", number=0, trial_id=0, params={}, config=config, budget_s=budget_s,
                     deadline_s=budget_s + 120, eval_fractions=(0.02, 0.5), trainer="model.script.run",
                     launches_ranks=True, stop_grace_s=10, heartbeat_s=1, artifact_dir=str(tmp_path / "art"))


def test_a_pruned_script_trial_stops_within_its_grace(tmp_path, standin_kit):
    reporter = PruneFirst()
    out = supervise(script_task(tmp_path, standin_kit), reporter)
    assert out.state == "PRUNED" and reporter.reports[0][0] == round(0.02 * 120), out
    # The script trainer answered the SIGTERM with its result record: it stopped, it was not killed.
    assert out.record is not None and out.record["status"] == "stopped", out
    assert "did not stop within" not in out.reason


def test_a_crashing_script_is_failed_with_its_last_error_line(tmp_path, standin_kit):
    broken = tmp_path / "train.py"
    broken.write_text(SCRIPT.read_text().replace("    tokenizer = Tokenizer.from_directory()\n",
                                                 "    raise ValueError('the team broke it')\n"))
    out = supervise(script_task(tmp_path, standin_kit, broken, budget_s=5))
    assert out.state == "FAIL" and out.fail_kind == "failed", out
    assert out.reason == "trainer failed: ValueError: the team broke it"


SCORE = """
import json, sys
from pathlib import Path
from model.script.score import evaluate_checkpoint
work = Path(sys.argv[1])
print(json.dumps(evaluate_checkpoint(work / "train.py", work / "prepare.py", work / "out" / "final.pt", 4, "cpu")))
"""


def test_kit_setup_runs_once_and_the_kit_scores_a_script_that_does_not_evaluate(tmp_path, standin_kit):
    # A kit folder as a team has it before `python prepare.py`: no tokenizer yet. Two trials start at once,
    # the second of a script that leaves val_bpb to the evaluator (EVALUATE = False).
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "prepare.py").write_text(prepare_text(VOCAB_SIZE=512, EVAL_TOKENS=4 * 2048))
    shutil.copytree(standin_kit / "data", kit / "data")
    records = []
    procs = []
    for i, evaluate in enumerate((True, False)):
        config = json.dumps({"script": str(SCRIPT), "kit": str(kit / "prepare.py"), "kit_setup": True,
                             "eval_batch_size": 4, "constants": {"NUM_THREADS": 1, "BATCH_SIZE": 4, "SEQ_LEN": 32,
                                                                 "EVALUATE": evaluate}})
        procs.append(subprocess.Popen([sys.executable, "-m", "model.script.run", "--config", config, "--budget-s",
                                       "2", "--json", "--out-dir", str(tmp_path / f"t{i}")], cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=240)
        records.append(json.loads(out.strip().splitlines()[-1]))
        assert p.returncode == 0 and records[-1]["status"] == "ok", err[-2000:]
    assert (kit / "tokenizer" / "tokenizer.pkl").is_file() and (kit / ".kit-ready").is_file()
    assert (tmp_path / "t0" / "script" / "tokenizer").resolve() == (kit / "tokenizer").resolve()
    assert [r["val_bpb_source"] for r in records] == ["kit", "kit"] and "claimed_val_bpb" not in records[1]
    assert "val_bpb" not in records[1]["summary"] and 1 < records[1]["val_bpb"] < 20
    # The adapter's own scoring (load_for_eval, then the kit's evaluate_bpb) gives the script's own figure.
    proc = subprocess.run([sys.executable, "-c", SCORE, str(tmp_path / "t0" / "script")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == pytest.approx(records[0]["val_bpb"], abs=1e-6)


@pytest.mark.parametrize(("change", "words"), [
    ({"trial": {"output": {"loss": "loss("}}}, "trial.output.loss: not a regular expression"),
    ({"trial": {"output": {"progress": "[0-9]+%"}}}, "trial.output.progress: must be a regular expression with a"),
    ({"trial": {"trainer": "model.train"}}, "trial.trainer: a study of a script runs model.script.run"),
    ({"pruner": {"name": "learning_curve"}}, "pruner.name: the learning_curve pruner models our trainer's schedules"),
])
def test_a_script_studys_own_keys_are_checked_when_the_spec_loads(standin_kit, tmp_path, change, words):
    from sweep.spec import studyspec
    from sweep.spec.files import SpecError

    s = sections(standin_kit)
    for table, values in change.items():
        s[table] = {**s[table], **values}
    with pytest.raises(SpecError, match=re.escape(words)):
        studyspec.load(write_spec(tmp_path, "scripted", s))
