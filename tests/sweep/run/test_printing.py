"""What ``sweep run`` says at its start and its end, on stored trials without Ray: the end names the best
trial's checkpoint and result record, where the study is kept, and the commands to run next."""

from __future__ import annotations

import io
import json

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from sweep import store as st
from sweep.run import printing
from sweep.run.driver import Driver
from sweep.spec import load
from sweep.store import artifacts as art
from tests.sweep_fixtures import tiny_spec, write_spec

RECORD = {"status": "ok", "val_bpb": 2.25, "val_loss": 1.6, "steps": 120, "train_seconds": 4.0,
          "tokens_per_second": 2345.6, "params": 1_234_567, "mfu": None, "device": "cpu"}


def _trial(spec, point, value, state=TrialState.COMPLETE, **attrs):
    return create_trial(state=state, value=value if state == TrialState.COMPLETE else None, params=point,
                        distributions=spec.space.distributions(point), user_attrs=attrs)


@pytest.fixture
def stored(tmp_path, monkeypatch):
    """A study of three trials, the best (trial 1) with its working files where a sweep leaves them."""
    monkeypatch.chdir(tmp_path)
    url = st.resolve_url("journal:runs/optuna-journal.log")
    monkeypatch.setenv(st.ENV_STORAGE, url)
    monkeypatch.setenv(art.ENV_ARTIFACTS, "runs/artifacts")
    spec = load(write_spec(tmp_path, "sumry", tiny_spec()))
    study = optuna.create_study(study_name="sumry", storage=st.open_storage(url))
    point = {"depth": 1, "model_dim": 32, "matrix_lr": 0.02}
    work = tmp_path / "runs" / "artifacts" / "sumry" / "1"
    work.mkdir(parents=True)
    (work / "final.pt").write_bytes(b"weights")
    (work / "result.json").write_text(json.dumps(RECORD))
    record_attrs = {**RECORD, "record_fields": sorted(RECORD), "artifacts": str(work), "git_commit": "abc123def4567890",
                    "git_dirty": False}
    study.add_trial(_trial(spec, point, 2.5, **{**record_attrs, "val_bpb": 2.5, "artifacts": "/elsewhere/0"}))
    study.add_trial(_trial(spec, {**point, "depth": 2}, 2.25, **record_attrs))
    study.add_trial(_trial(spec, point, None, state=TrialState.PRUNED))
    return spec, url, study


def test_the_end_of_a_sweep_names_the_checkpoint_the_record_and_what_to_run_next(stored):
    spec, url, study = stored
    text = "\n".join(printing.summary_lines(study.get_trials(), spec, url))
    assert text.startswith("best: trial 1 val_bpb=2.2500 ") and "depth=2" in text.splitlines()[0]
    assert "checkpoint: runs/artifacts/sumry/1/final.pt" in text
    assert "result:     runs/artifacts/sumry/1/result.json" in text
    assert "steps=120" in text and "tokens_per_second=2346" in text and "git_commit=abc123def456" in text
    assert "study sumry: 3 trials (COMPLETE 2, PRUNED 1) in runs/optuna-journal.log" in text
    name = "sumry.toml"  # a spec outside sweep/studies/ goes by its path, relative to here
    for cmd in (f"make dashboard STUDY={name}", f"-m sweep promote {name} --top 3 --seeds 3 --budget-s 4",
                f"-m sweep export {name} --out submission/"):
        assert cmd in text, text
    # A promotion prints its own report after the run: no next steps there.
    assert "next:" not in "\n".join(printing.summary_lines(study.get_trials(), spec, url, next_steps=False))


def test_a_shipped_study_is_named_by_its_name_and_a_study_without_a_complete_trial_points_to_status(stored):
    spec, url, study = stored
    demo = load("demo")
    lines = printing.summary_lines([t for t in study.get_trials() if t.state != TrialState.COMPLETE], demo, url)
    assert lines[0] == "no trial completed" and lines[-1].endswith("-m sweep status demo` lists every trial, "
                                                                   "with why it failed")


def test_a_sweep_starts_a_study_of_queued_trials_and_resumes_one_that_ran(stored):
    spec, _, study = stored
    assert printing.opening_line("s", []) is None
    waiting = [_trial(spec, {"depth": 1, "model_dim": 32, "matrix_lr": 0.02}, None, state=TrialState.WAITING)] * 4
    assert printing.opening_line("s", waiting) == "starting study s: 4 queued trial(s) to run first"
    assert printing.opening_line("s", study.get_trials()).startswith("resuming study s: 3 trials so far")


def test_the_driver_speaks_only_of_its_own_trial_when_asked(stored):
    spec, _, _ = stored
    out = io.StringIO()
    d = Driver(spec, out=out, own_only=True)
    d.open_study()
    d.progress(force=True)
    assert out.getvalue() == ""
    d = Driver(spec, out=out)
    d.open_study()
    d.progress(force=True)
    assert out.getvalue().startswith("progress: done 3/4")


def test_a_pareto_study_ends_on_its_front_and_its_next_steps_name_a_metric_and_a_trial(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(art.ENV_ARTIFACTS, "runs/artifacts")
    fixed = {**tiny_spec()["fixed"], "core_bundle": "demo"}
    spec = load(write_spec(tmp_path, "par", tiny_spec(objective={"type": "pareto", "metrics": ["val_bpb", "core"]},
                                                      fixed=fixed)))
    point = {"depth": 1, "model_dim": 32, "matrix_lr": 0.02}
    rec = {**RECORD, "core": 0.1}
    trials = []
    for n, values in enumerate(([2.0, 0.1], [2.5, 0.3], [2.6, 0.2])):  # trial 2 is dominated by trial 1
        t = create_trial(state=TrialState.COMPLETE, values=values, params=point,
                         distributions=spec.space.distributions(point),
                         user_attrs={**rec, "val_bpb": values[0], "core": values[1], "record_fields": sorted(rec)})
        t.number = n
        trials.append(t)
    lines = printing.summary_lines(trials, spec, st.resolve_url("journal:runs/j.log"))
    fronts = [ln for ln in lines if ln.startswith("pareto front: trial")]
    assert [ln.split()[3] for ln in fronts] == ["0", "1"]
    assert sum(ln.startswith("  checkpoint: none kept") for ln in lines) == 2  # no files were left here
    text = "\n".join(lines)
    assert "-m sweep promote par.toml --top 3 --seeds 3 --budget-s 4 --by val_bpb" in text
    assert "-m sweep export par.toml --trial 0 --out submission/" in text
