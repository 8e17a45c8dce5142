"""The dashboard's notes: a trial's headline figures (the supervisor writes them), the study's best trials and
their curves (the driver), written as trials end and never at the cost of a trial."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import optuna
import optuna_dashboard
import pytest
from optuna_dashboard import get_note

from sweep import store as st
from sweep.run import notes, remote
from sweep.run.driver import Driver
from sweep.run.outcome import Outcome, outcome_attrs
from sweep.run.supervisor import TrialTask
from sweep.spec import objective as obj

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _record(value: float, **kw) -> dict:
    return {"status": "ok", "val_bpb": value, "tokens_per_second": 12345.6, "steps": 120, "mfu": None,
            "train_seconds": 3.02, "startup_seconds": 1.5, "eval_seconds": 0.4, "params": 1_234_567,
            "device": "cpu", "world_size": 1, "config": {"depth": 2}, "curve": [[1, 2.0]], **kw}


@pytest.fixture
def study(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = st.open_storage(st.resolve_url(f"journal:{tmp_path / 'j.log'}"))
    s = optuna.create_study(study_name="notes", storage=storage)
    s.set_metric_names(["val_bpb"])
    return s


def test_a_trial_note_shows_the_headline_figures_first():
    attrs = {**_record(1.23456, mfu=0.3125), "git_commit": COMMIT, "git_dirty": True, "artifacts": "/runs/a/3"}
    note = notes.trial_note(3, "COMPLETE", [1.23456], attrs, {"depth": 2, "matrix_lr": 0.0123})
    lines = note.splitlines()
    assert lines[0] == "### Trial 3: COMPLETE"
    head = [c.strip() for c in lines[2].strip("|").split("|")]
    row = [c.strip() for c in lines[4].strip("|").split("|")]
    assert dict(zip(head, row, strict=True)) == {
        "val_bpb": "1.2346", "tokens/s": "12,346", "steps": "120", "MFU": "31.2%", "charged s": "3.0",
        "params": "1.23M", "git commit": "`0123456789-dirty`"}
    assert "**params**: depth=2, matrix_lr=0.0123" in note and "`/runs/a/3`" in note

    failed = notes.trial_note(4, "FAIL", None, {"fail_kind": "oom", "fail_reason": "killed | at 2 GB"}, {})
    assert failed.startswith("### Trial 4: FAIL\n") and "**oom**: killed \\| at 2 GB" in failed
    assert "| – | – | – | – | – | – | `unknown` |" in failed  # no record: every figure says it is unknown


def test_a_trial_note_says_where_the_step_time_went():
    parts = {"forward_seconds": 2.0, "backward_seconds": 3.0, "optimizer_seconds": 4.0, "data_seconds": 1.0,
             "all_reduce_seconds": 0.0, "sync_seconds": 0.0}
    attrs = {**_record(1.5), **parts, "step_seconds_sum": 10.0, "optimizer_compiled": True,
             "optimizer_compile_seconds": 41.7}
    note = notes.trial_note(1, "COMPLETE", [1.5], attrs, {})
    assert ("**step time** (charged steps): forward 20%, backward 30%, optimizer 40%, data 10%, optimizer compiled "
            "in 42 s of start-up") in note
    assert "step time" not in notes.trial_note(1, "COMPLETE", [1.5], _record(1.5), {})  # an older record


def test_a_composite_trial_note_names_its_score_and_core():
    attrs = {**_record(1.1, core=0.2), "git_commit": COMMIT}
    note = notes.trial_note(0, "COMPLETE", [0.61], attrs, {}, ["composite"])
    assert note.startswith("### Trial 0: COMPLETE · composite 0.6100\n") and "| val_bpb | CORE | tokens/s" in note


def test_the_headline_attributes_are_written_first():
    out = Outcome(number=0, state="COMPLETE", value=1.1, values=[1.1], record=_record(1.1))
    attrs = outcome_attrs(out, {"artifacts": "/runs/a/0", "git_commit": COMMIT, "git_dirty": False})
    assert list(attrs)[:7] == ["status", "val_bpb", "tokens_per_second", "steps", "train_seconds", "git_commit",
                               "git_dirty"]  # mfu and core are None on a CPU without CORE: in their places
    assert attrs["mfu"] is None and attrs["record_fields"] == sorted(_record(1.1)) and len(attrs) == 17
    failed = outcome_attrs(Outcome(number=1, state="FAIL", fail_kind="oom", reason="killed"))
    assert list(failed)[:2] == ["fail_kind", "fail_reason"]


def test_merging_the_summary_keeps_a_persons_own_text():
    first = notes.merge_note("", "## Best trials\n\nold table\n\n---\n")
    assert first == "## Best trials\n\nold table\n\n---\n"
    edited = "my plan: try deeper models\n\n" + first + "\nlearned: lr 0.02 is best\n"
    merged = notes.merge_note(edited, "## Best trials\n\nnew table\n\n---\n")
    assert "old table" not in merged and merged.startswith("## Best trials\n\nnew table\n\n---\n")
    assert "my plan: try deeper models" in merged and "learned: lr 0.02 is best" in merged


def _fake_sup(work: Path, curve: list) -> SimpleNamespace:
    work.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "trainer.log", "events.jsonl"):
        (work / name).write_text("{}\n")
    return SimpleNamespace(artifact_dir=work, artifacts_error=None, marks={}, launch_attrs={}, launch_unix=None,
                           first_step_unix=None, curve=curve)


def _store(study, tmp_path: Path, value: float | None, objective: obj.Objective | None = None,
           values: list[float] | None = None, **record) -> tuple[bool, optuna.trial.FrozenTrial]:
    trial = study.ask()
    task = TrialTask(study=study.study_name, storage_url="journal:/unused", number=trial.number,
                     trial_id=trial._trial_id, params={"depth": 2}, config={}, budget_s=4, deadline_s=30,
                     eval_fractions=(0.5,), artifact_dir=str(tmp_path / str(trial.number)),
                     objective=objective or obj.Objective())
    if value is None:
        out = Outcome(number=trial.number, state="FAIL", fail_kind="crash", reason="trainer killed by SIGKILL")
    else:
        out = Outcome(number=trial.number, state="COMPLETE", value=value, values=values or [value],
                      record=_record(value, **record))
        if len(study.directions) == 1:
            trial.report(value + 0.5, 2)  # the eval at half the budget, as the supervisor reports it
    sup = _fake_sup(tmp_path / str(trial.number), [[2, (value or 0) + 0.5]])
    told = remote.store(study, trial, task, out, sup, t0=0.0, version={"git_commit": COMMIT, "git_dirty": False})
    if out.state == "COMPLETE":  # as the driver does when the outcome comes back
        Driver.summarise(SimpleNamespace(study=study, url="journal:/unused"), trial.number, trial._trial_id)
    return told, study._storage.get_trial(trial._trial_id)


def _figures(study) -> dict[str, dict]:
    """The study's saved plotly figures by id, as the dashboard serves them."""
    attrs = study._storage.get_study_system_attrs(study._study_id)
    return {k: json.loads(v) for k, v in optuna_dashboard._custom_plot_data.get_plotly_graph_objects(attrs).items()}


def test_the_supervisor_writes_each_trial_note_and_a_new_best_rewrites_the_study_summary(study, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setattr(notes, "TOP", 2)  # the summary holds the two best

    def version() -> int:
        return study._storage.get_study_system_attrs(study._study_id)["dashboard:note_ver"]

    told, t0 = _store(study, tmp_path, 1.5)
    assert told and "| 1.5000 | 12,346 | 120 | – | 3.0 |" in get_note(optuna.trial.Trial(study, t0._trial_id))
    assert "[0](/dashboard/studies/" in get_note(study) and set(_figures(study)) == {notes.FIGURE_ID, notes.TABLE_ID}

    optuna_dashboard.save_note(study, get_note(study) + "\nmy own note\n")  # a person writes below the line
    _store(study, tmp_path, 1.7)  # one of the two best: in the summary
    assert "[1](/dashboard/studies/" in get_note(study)
    seen = version()
    _store(study, tmp_path, None)  # a failure has its note too, and leaves the summary alone
    failed = study.trials[2]
    assert failed.state.name == "FAIL" and "**crash**: trainer killed by SIGKILL" in get_note(
        optuna.trial.Trial(study, failed._trial_id))
    _store(study, tmp_path, 1.9)  # not among the two best: the summary stays as it was
    assert version() == seen
    _store(study, tmp_path, 1.2)  # a new best
    note = get_note(study)
    rows = [line for line in note.splitlines() if line.startswith("| [")]
    assert [r.split("]")[0] for r in rows] == ["| [4", "| [0"]
    assert "sweep export notes --trial 4" in note and note.rstrip().endswith("my own note")
    fig = _figures(study)[notes.FIGURE_ID]
    assert fig["layout"]["xaxis"]["title"]["text"] == "charged seconds"
    assert fig["layout"]["yaxis"]["title"]["text"] == "val_bpb"
    assert [d["name"].split(" (")[0] for d in fig["data"]] == ["trial 4", "trial 0"]
    assert fig["data"][0]["x"] == [2.0, 4.0] and fig["data"][0]["y"] == [1.7, 1.2]  # its reports, the final one
    (table,) = _figures(study)[notes.TABLE_ID]["data"]
    assert table["header"]["values"][:3] == ["<b>trial</b>", "<b>val_bpb</b>", "<b>tokens/s</b>"]
    assert table["cells"]["values"][:2] == [["4", "0"], ["1.2000", "1.5000"]]


def test_a_pareto_studys_summary_is_its_front_and_its_curves_the_kept_ones(tmp_path):
    storage = st.open_storage(st.resolve_url(f"journal:{tmp_path / 'j.log'}"))
    study = optuna.create_study(study_name="front", storage=storage, directions=["minimize", "maximize"])
    study.set_metric_names(["val_bpb", "core"])
    pareto = obj.Objective(kind="pareto", metrics=("val_bpb", "core"), directions=("minimize", "maximize"))
    for bpb, core in [(1.0, 0.10), (1.1, 0.20), (1.2, 0.15)]:
        told, _ = _store(study, tmp_path, bpb, objective=pareto, values=[bpb, core], core=core)
        assert told
    note = get_note(study)
    assert "| trial | val_bpb | core | tokens/s |" in note
    assert [line.split("]")[0] for line in note.splitlines() if line.startswith("| [")] == ["| [0", "| [1"]
    assert _figures(study)[notes.FIGURE_ID]["data"][0]["x"] == [2.0, 4.0]  # the kept curve, its final point


def test_a_note_that_cannot_be_written_never_fails_the_trial(study, tmp_path, monkeypatch):
    def broken(*_a, **_k):
        raise RuntimeError("note store is down")

    monkeypatch.setattr(optuna_dashboard, "save_note", broken)
    monkeypatch.setattr(optuna_dashboard, "save_plotly_graph_object", broken)
    told, frozen = _store(study, tmp_path, 1.5)
    assert told and frozen.state.name == "COMPLETE" and frozen.value == 1.5
    assert frozen.user_attrs["note_error"] == "RuntimeError: note store is down"
    assert notes.guarded("x", broken) == "RuntimeError: note store is down"


def test_a_scripts_curve_is_drawn_and_kept_under_its_own_name():
    trial = optuna.trial.create_trial(value=1.2, intermediate_values={2: 4.5},
                                      user_attrs={"curve_metric": "train_loss_smoothed"})
    assert notes.curves(trial) == [(2.0, 4.5)]
    layout = notes.curves_figure([trial], ["val_bpb"]).to_plotly_json()["layout"]
    assert layout["title"]["text"].startswith("train_loss_smoothed against charged seconds")
    assert layout["yaxis"]["title"]["text"] == "train_loss_smoothed"
    # Where the reports are not the curve (pareto, composite), it is kept in an attribute named by its metric.
    kept = optuna.trial.create_trial(values=[1.2, 3.0], user_attrs={"curve_metric": "val",
                                                                   "val_curve": [[2, 3.9], [4, 3.7]]})
    pareto = obj.Objective("pareto", ("val_bpb", "params"), ("minimize", "minimize"))
    assert notes.curves(kept) == [(2.0, 3.9), (4.0, 3.7)] and obj.curve_points(kept, pareto) == [(2, 3.9), (4, 3.7)]
    assert notes.curves_figure([trial, kept], ["val_bpb"]).to_plotly_json()["layout"]["yaxis"]["title"]["text"] == (
        "train_loss_smoothed / val")
