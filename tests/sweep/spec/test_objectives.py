"""Objectives end to end: a pareto sweep of two-rank (gloo) trials on a real Ray head (its driver a
subprocess), a composite trial's reports and score, and a record that lacks a metric. The trainer is the
real one, scoring CORE on a few examples per task of the demo bundle."""

from __future__ import annotations

import io
import json
from pathlib import Path

import optuna
import pytest

from sweep import cli
from sweep import store as st
from sweep.run.driver import Driver, SweepAborted
from sweep.run.remote import run_trial
from sweep.run.supervisor import TrialTask
from sweep.spec import load
from sweep.spec import objective as obj
from sweep.study import best_dict, record_of, trial_result
from tests.sweep_fixtures import head_env, load_trials, run_sweep, tiny_spec, write_spec

pytestmark = pytest.mark.slow

TRAINER = "model.train"
CORE = {"core_bundle": "demo", "core_max_examples": 6, "core_max_seconds": 30}  # a few examples per task
PARETO = {"type": "pareto", "metrics": ["val_bpb", "core"]}


@pytest.fixture
def journal(tmp_path, monkeypatch) -> str:
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    monkeypatch.setenv(st.ENV_STORAGE, url)
    monkeypatch.setenv("SWEEP_ARTIFACTS", str(tmp_path / "art"))
    return url


def test_pareto_sweep_of_two_rank_trials_keeps_curves_and_prints_its_front(ray_cluster, journal, tmp_path,
                                                                          data_cache, capsys):
    spec_path = write_spec(tmp_path, "par", tiny_spec(
        data_cache, study={"n_trials": 3, "concurrency": 2, "seed": 1}, objective=PARETO,
        trial={"budget_s": 3, "startup_allowance_s": 60, "eval_timeout_s": 30, "eval_fractions": [0.5],
               "heartbeat_s": 1, "stale_after_s": 20, "stop_grace_s": 5, "ranks": 2, "trainer": TRAINER},
        fixed={**tiny_spec(data_cache)["fixed"], **CORE}))
    run = run_sweep("run", str(spec_path), env=head_env(ray_cluster, journal, tmp_path / "art"))
    text = run.stdout
    assert run.returncode == 0, text + run.stderr
    assert "progress: done 3/3" in text and "pareto front: trial" in text

    study = optuna.load_study(study_name="par", storage=st.open_storage(journal))
    assert [d.name for d in study.directions] == ["MINIMIZE", "MAXIMIZE"]
    assert study.metric_names == ["val_bpb", "core"]
    trials = load_trials(journal, "par")
    assert [t.state.name for t in trials] == ["COMPLETE"] * 3, [t.user_attrs.get("fail_reason") for t in trials]
    for t in trials:
        assert t.values == [t.user_attrs["val_bpb"], t.user_attrs["core"]]
        assert t.user_attrs["world_size"] == 2 and t.user_attrs["launch_ranks"] == 2  # two gloo ranks trained it
        assert t.intermediate_values == {}  # nothing reported: Optuna cannot prune multi-objective trials
        curve = t.user_attrs[obj.ATTR_CURVE]
        assert [step for step, _ in curve] == [2, 3]  # the eval at 1.5 charged seconds, the final value at 3
        assert curve[-1][1] == t.user_attrs["val_bpb"]

    # The front, by brute force over the stored values, is what `best` prints.
    front = {t.number for t in trials
             if not any(o.values[0] <= t.values[0] and o.values[1] >= t.values[1] and o.values != t.values
                        for o in trials)}
    assert cli.main(["best", str(spec_path), "--json"]) == 0
    best = json.loads(capsys.readouterr().out)
    assert best["metrics"] == ["val_bpb", "core"] and best["directions"] == ["minimize", "maximize"]
    assert {m["number"] for m in best["front"]} == front
    by_number = {t.number: t for t in trials}
    for m in best["front"]:
        assert set(m) == {"number", "params", "values", "record"}
        assert m["values"] == by_number[m["number"]].values and m["params"] == by_number[m["number"]].params
        assert m["record"]["core"] == m["values"][1] and m["record"]["status"] == "ok"
    assert cli.main(["best", str(spec_path)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("pareto front of par (minimize val_bpb, maximize core)")
    assert all(f"trial {n} val_bpb=" in shown for n in front)

    assert cli.main(["status", str(spec_path), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["metrics"] == ["val_bpb", "core"] and status["counts"]["COMPLETE"] == 3
    for row in status["trials"]:
        assert row["value"] is None and row["values"] == by_number[row["number"]].values

    shown = trial_result(trials[0], load(spec_path).objective)  # what `sweep trial` prints last
    assert shown["values"] == trials[0].values and shown["val_bpb"] == trials[0].user_attrs["val_bpb"]
    assert cli.main(["status", str(spec_path)]) == 0
    assert f"{trials[0].values[0]:.4f}/{trials[0].values[1]:.4f}" in capsys.readouterr().out

    # Resuming the study under another objective is refused in one line.
    (tmp_path / "single").mkdir()
    single = write_spec(tmp_path / "single", "par", tiny_spec(data_cache))
    with pytest.raises(SweepAborted, match="exists with directions minimize, maximize, spec says minimize$"):
        Driver(load(single), out=io.StringIO()).open_study()


def _task(tmp_path: Path, url: str, study: optuna.Study, objective: obj.Objective, config: dict) -> TrialTask:
    trial = study.ask()
    return TrialTask(study=study.study_name, storage_url=url, number=trial.number, trial_id=trial._trial_id,
                     params={}, config=config, budget_s=4, deadline_s=90, eval_fractions=(0.25, 0.5),
                     trainer=TRAINER, stop_grace_s=5, heartbeat_s=1, artifact_dir=str(tmp_path / "art"),
                     objective=objective)


@pytest.fixture
def config(tiny_config) -> dict:
    return {**tiny_config, "depth": 1, "model_dim": 32, "seq_len": 32, "batch_size": 4, "eval_tokens": 512,
            "final_eval_tokens": 2048, "eval_fractions": [0.25, 0.5], "startup_allowance_s": 20}


def test_composite_trial_reports_normalised_val_bpb_and_tells_its_score(tmp_path, journal, config):
    terms = (obj.Term("val_bpb", 0.5, best=2.0, worst=4.0), obj.Term("core", 0.5, best=0.3, worst=0.0))
    objective = obj.Objective("composite", ("val_bpb", "core"), ("maximize",), terms)
    study = optuna.create_study(study_name="comp", storage=st.open_storage(journal), direction="maximize")
    out = run_trial(_task(tmp_path, journal, study, objective, {**config, **CORE}))
    assert out.state == "COMPLETE" and out.told, out.reason
    (t,) = study.get_trials()
    rec = record_of(t)
    expected = 0.5 * (rec["val_bpb"] - 4.0) / (2.0 - 4.0) + 0.5 * rec["core"] / 0.3
    assert t.value == pytest.approx(expected) == out.value and out.values == [out.value]
    curve = dict((step, v) for step, v in t.user_attrs[obj.ATTR_CURVE])
    assert sorted(curve) == sorted(t.intermediate_values) == [1, 2, 4]  # evals at 1 and 2 s, the final at 4 s
    for step, v in curve.items():  # reported: the val_bpb term, higher is better like the study
        assert t.intermediate_values[step] == pytest.approx((v - 4.0) / (2.0 - 4.0))
    assert curve[4] == rec["val_bpb"]
    assert best_dict(study, "maximize", objective)["value"] == pytest.approx(expected)
    assert obj.fmt_values(objective, t.values, rec).startswith(f"composite={expected:.4f} (val_bpb=")


def test_a_record_without_a_needed_metric_fails_naming_it_and_keeps_the_rest(tmp_path, journal, config):
    objective = obj.Objective("pareto", ("val_bpb", "core"), ("minimize", "maximize"))
    study = optuna.create_study(study_name="nocore", storage=st.open_storage(journal),
                                directions=["minimize", "maximize"])
    out = run_trial(_task(tmp_path, journal, study, objective, {**config, "core_bundle": ""}))  # CORE off
    assert out.state == "FAIL" and out.fail_kind == "metric" and out.told
    assert out.reason == "status ok but the result record's core is None, not a finite number " \
                         "(the pareto objective needs it)"
    (t,) = study.get_trials()
    assert t.state.name == "FAIL" and t.user_attrs["fail_kind"] == "metric" and "core" in t.user_attrs["fail_reason"]
    assert t.user_attrs["status"] == "ok" and t.user_attrs["val_bpb"] > 0 and t.user_attrs["core"] is None
    assert [step for step, _ in t.user_attrs[obj.ATTR_CURVE]] == [1, 2, 4]  # its learning curve, final value too
    assert t.intermediate_values == {}
    assert (tmp_path / "art" / "final.pt").exists()
