"""The trial supervisor on the real trainer: outcomes, pruning, deadlines, kills, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import optuna
import pytest

from sweep import store as st
from sweep.run.outcome import ATTR_STARTED
from sweep.run.remote import run_trial
from sweep.run.supervisor import LOG_CUT_LINE, Reporter, Supervisor, TrialTask
from tests.sweep_fixtures import ROOT, processes_with, supervise, wait_for

pytestmark = pytest.mark.slow
FAULT_ENV = "TRNSWEEP_FAULT"  # the trainer's test-only fault hook (model.faults); a trial's env reaches it


@pytest.fixture(scope="module")
def config(tiny_config) -> dict:
    return {**tiny_config, "depth": 1, "model_dim": 32, "seq_len": 32, "batch_size": 4, "eval_tokens": 512,
            "final_eval_tokens": 2048, "eval_fractions": [0.25, 0.5, 0.75], "startup_allowance_s": 20}


def make_task(tmp_path: Path, config: dict, budget_s: float = 3, deadline_s: float = 60, **kw) -> TrialTask:
    return TrialTask(study=kw.pop("study", "w"), storage_url=kw.pop("storage_url", ""), number=kw.pop("number", 0),
                     trial_id=kw.pop("trial_id", 0), params={}, config=config, budget_s=budget_s,
                     deadline_s=deadline_s, eval_fractions=tuple(config["eval_fractions"]), stop_grace_s=5,
                     heartbeat_s=kw.pop("heartbeat_s", 1), artifact_dir=str(tmp_path / "art"), **kw)


class Recorder(Reporter):
    def __init__(self, prune_at: int | None = None) -> None:
        self.reports: list[tuple[int, float]] = []
        self.prune_at = prune_at

    def report(self, value: float, step: int) -> bool:
        self.reports.append((step, value))
        return self.prune_at is not None and len(self.reports) >= self.prune_at


def assert_no_trainer_left(tmp_path: Path) -> None:
    wait_for(lambda: not processes_with(str(tmp_path / "art")), 10, what="the trainer group to be gone")


@pytest.fixture
def journal_study(tmp_path):
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    study = optuna.create_study(study_name="w", storage=st.open_storage(url),
                                pruner=optuna.pruners.NopPruner())
    return url, study


def test_complete_trial_is_recorded_with_its_result_record(tmp_path, config, journal_study):
    url, study = journal_study
    trial = study.ask()
    task = make_task(tmp_path, config, storage_url=url, number=trial.number, trial_id=trial._trial_id)
    outcome = run_trial(task)
    assert outcome.state == "COMPLETE" and outcome.told, outcome
    t = study.get_trials()[0]
    assert t.state.name == "COMPLETE" and t.value == pytest.approx(outcome.value)
    assert sorted(t.intermediate_values) == [1, 2, 3]  # eval points 0.75, 1.5, 2.25 s -> whole seconds
    assert t.user_attrs["val_bpb"] == t.value and t.user_attrs["status"] == "ok"
    record = {k: t.user_attrs[k] for k in t.user_attrs["record_fields"]}
    for key in ("train_seconds", "startup_seconds", "eval_seconds", "steps", "params", "config"):
        assert key in record
    assert t.user_attrs["slot_seconds"] >= record["train_seconds"]
    assert ATTR_STARTED in t.system_attrs
    art = tmp_path / "art"
    assert (art / "final.pt").exists() and (art / "trainer.log").stat().st_size > 0
    assert json.loads((art / "config.json").read_text())["model_dim"] == 32
    assert any(json.loads(line)["event"] == "result" for line in (art / "events.jsonl").read_text().splitlines())


def test_pruned_trial_stops_early(tmp_path, config):
    rec = Recorder(prune_at=1)
    outcome = supervise(make_task(tmp_path, config, budget_s=8), rec)
    assert outcome.state == "PRUNED" and outcome.record["status"] == "stopped"
    assert outcome.record["train_seconds"] < 8 - 1.0  # by the trainer's own clock: well short of its 8 s budget
    assert rec.reports[0][0] == 2  # 0.25 of 8 s
    assert_no_trainer_left(tmp_path)


def test_hanging_trainer_is_killed_at_the_deadline(tmp_path, config, journal_study):
    url, study = journal_study
    trial = study.ask()
    task = make_task(tmp_path, config, budget_s=3, deadline_s=8, env={FAULT_ENV: "hang@5"},
                     storage_url=url, number=trial.number, trial_id=trial._trial_id)
    t0 = time.monotonic()
    outcome = run_trial(task)
    assert time.monotonic() - t0 >= 8  # not before the deadline (a wall-clock bound no faster machine breaks)
    assert outcome.reason.startswith("hard deadline 8 s"), outcome.reason
    assert outcome.state == "FAIL" and outcome.fail_kind == "deadline" and not outcome.retryable
    t = study.get_trials()[0]
    assert t.state.name == "FAIL" and "deadline" in t.user_attrs["fail_reason"]
    assert_no_trainer_left(tmp_path)


def test_torchrun_ranks_are_killed_at_the_deadline(tmp_path, config):
    """torchrun puts every rank in a session of its own: the group kill alone would orphan them."""
    task = make_task(tmp_path, config, budget_s=3, deadline_s=15, ranks=2, env={FAULT_ENV: "hang@3"})
    out = supervise(task)
    assert out.state == "FAIL" and out.fail_kind == "deadline"
    assert_no_trainer_left(tmp_path)


def test_sigkilled_trainer_is_a_retryable_crash(tmp_path, config):
    task = make_task(tmp_path, config, budget_s=20)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=supervise(task)))
    thread.start()
    marker = str(tmp_path / "art")
    events = tmp_path / "art" / "events.jsonl"
    wait_for(lambda: events.exists() and '"step"' in events.read_text(), 30, what="the first step")
    for pid in processes_with(marker):
        if "model.train" in Path(f"/proc/{pid}/cmdline").read_text():
            os.kill(pid, signal.SIGKILL)
    thread.join(30)
    out = result["out"]
    assert out.state == "FAIL" and out.fail_kind == "crash" and out.retryable and "SIGKILL" in out.reason
    assert_no_trainer_left(tmp_path)


@pytest.mark.parametrize("fault,state,kind", [("crash", "FAIL", "crash"), ("diverge", "PRUNED", "diverged")])
def test_injected_faults(tmp_path, config, fault, state, kind):
    out = supervise(make_task(tmp_path, config, env={FAULT_ENV: f"{fault}@3"}))
    assert (out.state, out.fail_kind) == (state, kind), out.reason
    assert out.reason


def test_rejected_config(tmp_path, config):
    out = supervise(make_task(tmp_path, {**config, "no_such_key": 1}))
    assert out.state == "FAIL" and out.fail_kind == "config" and "no_such_key" in out.reason


def capped(task: TrialTask, cap: int):
    sup = Supervisor(task)
    sup.log_cap = cap
    try:
        return sup.run()
    finally:
        sup.close()


def test_trainer_log_is_capped_and_the_failure_line_still_read(tmp_path, config):
    out = capped(make_task(tmp_path / "ok", config), 64)
    assert out.state == "COMPLETE", out.reason
    log = (tmp_path / "ok" / "art" / "trainer.log").read_bytes()
    assert len(log) == 64 + len(LOG_CUT_LINE) and log.endswith(LOG_CUT_LINE)
    # the trainer's last line (its refusal) is past the cap, and still the trial's reason
    out = capped(make_task(tmp_path / "bad", {**config, "no_such_key": 1}), 8)
    assert out.state == "FAIL" and out.fail_kind == "config" and "no_such_key" in out.reason
    log = (tmp_path / "bad" / "art" / "trainer.log").read_bytes()
    assert len(log) == 8 + len(LOG_CUT_LINE) and b"no_such_key" not in log


def test_trial_finished_elsewhere_stops_the_trainer(tmp_path, config, journal_study):
    url, study = journal_study
    trial = study.ask()
    task = make_task(tmp_path, config, budget_s=30, storage_url=url, number=trial.number,
                     trial_id=trial._trial_id, heartbeat_s=0.5)
    result = {}
    thread = threading.Thread(target=lambda: result.update(out=run_trial(task)))
    thread.start()
    events = tmp_path / "art" / "events.jsonl"
    wait_for(lambda: events.exists() and '"step"' in events.read_text(), 30, what="the first step")
    study.tell(trial.number, state=optuna.trial.TrialState.FAIL)  # e.g. another driver declared it lost
    thread.join(30)
    assert result["out"].fail_kind == "lost" and not result["out"].told
    assert_no_trainer_left(tmp_path)


def _reaper_watches(pid: int, trainers: list[int]) -> bool:
    """Whether reaper ``pid`` (``python -m sweep.run.reaper FD PGID TOKEN DEADLINE``) watches one of ``trainers``."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    i = args.index("sweep.run.reaper") if "sweep.run.reaper" in args else -1
    return i >= 0 and len(args) > i + 2 and args[i + 2].isdigit() and int(args[i + 2]) in trainers


def test_reaper_kills_the_group_when_the_supervisor_dies(tmp_path, config):
    script = tmp_path / "sup.py"
    task = make_task(tmp_path, config, budget_s=60, deadline_s=120)
    script.write_text(textwrap.dedent(f"""
        import json
        from sweep.run.supervisor import Supervisor, TrialTask
        d = json.loads({json.dumps(json.dumps({k: v for k, v in task.__dict__.items() if k != "objective"},
                                              default=list))})
        d["eval_fractions"] = tuple(d["eval_fractions"]); d["pruner"] = tuple(d["pruner"])
        Supervisor(TrialTask(**d)).run()
    """))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        events = tmp_path / "art" / "events.jsonl"
        wait_for(lambda: events.exists() and '"step"' in events.read_text(), 30, what="the first step")
        trainers = processes_with(str(tmp_path / "art"))
        assert trainers
        # This test's own reaper only (it detaches from the supervisor): the one watching this trial's trainer.
        reapers = [pid for pid in processes_with("sweep.run.reaper") if _reaper_watches(pid, trainers)]
        assert len(reapers) == 1, reapers
        proc.kill()
        proc.wait()
        assert_no_trainer_left(tmp_path)
        wait_for(lambda: not set(reapers) & set(processes_with("sweep.run.reaper")), 10, what="the reaper to exit")
    finally:
        proc.kill()


# -- a team's script: its curve is its own figure, named as such ----------------------------------

UNITS_SCRIPT = """\
import sys, time
for step in range(1, 41):
    print(f"\\rstep {step:05d} ({2.5 * step:.1f}%) | loss: {LOSS - step / 100:.6f} | remaining: 1s ", end="")
    time.sleep(0.05)
print("\\n---\\nval_bpb:          1.234567")
"""


def _script_task(tmp_path: Path, url: str, trial: optuna.trial.Trial, loss: float, **kw) -> TrialTask:
    script = tmp_path / f"train{trial.number}.py"
    script.write_text(f"LOSS = {loss}\n" + UNITS_SCRIPT)
    config = {"script": str(script), "eval_fractions": [0.5], "startup_allowance_s": 20, "trust_script": True}
    return TrialTask(study="w", storage_url=url, number=trial.number, trial_id=trial._trial_id, params={},
                     config=config, budget_s=4, deadline_s=60, eval_fractions=(0.5,), stop_grace_s=5, heartbeat_s=1,
                     artifact_dir=str(tmp_path / f"art{trial.number}"), trainer="model.script.run",
                     launches_ranks=True, **kw)


def test_a_scripts_curve_keeps_its_unit_and_a_pruned_one_shows_no_val_bpb(tmp_path, journal_study):
    from sweep.study import status_dict

    url, study = journal_study
    trial = study.ask()
    done = run_trial(_script_task(tmp_path, url, trial, loss=4.0))
    assert done.state == "COMPLETE" and done.curve_metric == "train_loss_smoothed", done
    t = study.get_trials()[0]
    assert t.value == pytest.approx(1.234567) and t.user_attrs["curve_metric"] == "train_loss_smoothed"
    # Only the smoothed training loss at half the budget: the final val_bpb is not appended to it.
    assert list(t.intermediate_values) == [2] and 3.5 < t.intermediate_values[2] < 4.0

    # A worse script, pruned at its first report: no value stands in the val_bpb column; the reason names its loss.
    trial = study.ask()
    task = _script_task(tmp_path, url, trial, loss=9.0, pruner=("median", {"n_startup_trials": 0}))
    pruned = run_trial(task)
    assert pruned.state == "PRUNED" and pruned.told, pruned
    t = study.get_trials()[1]
    assert t.state.name == "PRUNED" and t.value is None and 8.5 < t.intermediate_values[2] < 9.0
    assert t.user_attrs["fail_reason"] == f"pruned at 2 s (train_loss_smoothed {t.intermediate_values[2]:.4f})"
    assert [row["value"] for row in status_dict(study)["trials"]] == [pytest.approx(1.234567), None]


def test_a_study_reports_one_metric_and_a_composite_reports_no_scripts_figure(tmp_path):
    from model.script.signing import sign
    from sweep.run.supervisor import Supervisor, curve_metric
    from sweep.spec import objective as obj

    assert curve_metric("model.train", {"output": {"val": "x=(.*)"}}) == "val_bpb"
    assert curve_metric("model.script.run", {"output": {}}) == "train_loss_smoothed"
    assert curve_metric("model.script.run", {"output": {"val": r"val_loss=([0-9.]+)"}}) == "val"

    def events(objective: obj.Objective, output: dict) -> tuple[Recorder, list]:
        rec, kept = Recorder(), []
        rec.keep = lambda curve: kept.append([list(p) for p in curve])
        task = TrialTask(study="w", storage_url="", number=0, trial_id=0, params={}, config={"output": output},
                         budget_s=8, deadline_s=60, eval_fractions=(0.25, 0.5), trainer="model.script.run",
                         launches_ranks=True, artifact_dir=str(tmp_path / "art"), objective=objective)
        sup = Supervisor(task, rec)
        for metric, value, progress in (("train_loss_smoothed", 5.0, 0.25), ("val", 3.5, 0.5)):
            event = {"event": "eval", "val_bpb": value, "metric": metric, "progress": progress}
            sup._handle(sign(sup.key, event).encode())  # a script trainer's lines are signed
        return rec, kept

    # A study whose spec reads a validation figure: the smoothed loss before the first one is not reported.
    rec, _ = events(obj.Objective(), {"val": r"val_loss=([0-9.]+)"})
    assert rec.reports == [(4, 3.5)]
    rec, _ = events(obj.Objective(), {})
    assert rec.reports == [(2, 5.0)]
    # A composite's report is its normalised val_bpb term: a script's training loss has none; the curve is kept.
    composite = obj.Objective("composite", ("val_bpb", "core"), ("maximize",),
                              (obj.Term("val_bpb", 0.5, 1.0, 2.0), obj.Term("core", 0.5, 0.3, 0.0)))
    rec, kept = events(composite, {})
    assert rec.reports == [] and kept == [[[2, 5.0]]]


def test_the_driver_stores_a_pruned_scripts_outcome_without_a_value_too(journal_study):
    from sweep.run.outcome import Outcome, tell_returned

    url, study = journal_study
    for metric in ("train_loss_smoothed", "val_bpb"):
        trial = study.ask()
        trial.report(4.25, 2)
        result = Outcome(number=trial.number, state="PRUNED", reason=f"pruned at 2 s ({metric} 4.2500)",
                         curve_metric=metric).as_dict()  # as Ray carries it back to the driver
        assert tell_returned(study, trial._trial_id, result, url)
    script, ours = study.get_trials()
    assert script.state.name == "PRUNED" and script.value is None and script.user_attrs["curve_metric"] == (
        "train_loss_smoothed")
    assert ours.value == 4.25 and "curve_metric" not in ours.user_attrs  # our trainer's: Optuna's, as before
