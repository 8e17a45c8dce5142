"""``sweep promote``: the K best distinct configurations rerun with S seeds each as a linked study on real Ray,
resumed without rerunning a finished replicate; the report's statistics and verdict; bad input."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import statistics

import pytest

from sweep import cli
from sweep import store as st
from sweep.ship import promote
from sweep.spec import load
from sweep.spec import objective as obj
from tests.sweep_fixtures import head_env, load_trials, run_sweep, tiny_spec, write_spec

# Student t quantiles t(0.975, df) from the table: df 1 and 2.
T975 = {1: 12.706204736174705, 2: 4.302652729911275}

A = {"depth": 1, "model_dim": 32, "matrix_lr": 0.02}
B = {"depth": 2, "model_dim": 48, "matrix_lr": 0.03}
C = {"depth": 1, "model_dim": 64, "matrix_lr": 0.04}


def _source(tmp_path, monkeypatch, cache: str | None = None, fixed_extra: dict | None = None):
    """Spec ``src`` and its study: A twice (1.30, 1.20), B 1.25, C 1.40, and an ad-hoc 1.0 at another budget."""
    import optuna

    sections = tiny_spec(cache)
    sections["fixed"] = {**sections["fixed"], **(fixed_extra or {})}
    path = write_spec(tmp_path, "src", sections)
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    monkeypatch.setenv("SWEEP_STORAGE", url)
    spec = load(path)
    study = optuna.create_study(study_name="src", storage=st.open_storage(url))
    for params, value, attrs in ((A, 1.30, {}), (B, 1.25, {}), (A, 1.20, {}), (C, 1.40, {}),
                                 ({**C, "depth": 2}, 1.0, {"adhoc": True, "adhoc_budget_s": 1.0})):
        study.add_trial(optuna.trial.create_trial(params=params, distributions=spec.space.distributions(params),
                                                  value=value, user_attrs=attrs))
    return path, url, spec, study


def test_top_configs_are_distinct_best_first_at_the_study_budget(tmp_path, monkeypatch):
    _, _, spec, study = _source(tmp_path, monkeypatch)
    top = promote.top_configs(study.get_trials(), spec, 3)
    assert [(c["source_trial"], c["source_value"], c["params"]) for c in top] == [(2, 1.20, A), (1, 1.25, B),
                                                                                  (3, 1.40, C)]
    assert len(promote.top_configs(study.get_trials(), spec, 2)) == 2


def _linked(values: dict[str, list[float]], direction: str = "minimize"):
    """An in-memory linked study: configurations A, B (and C when given) with the given seeds' values."""
    import optuna
    from optuna.distributions import FloatDistribution, IntDistribution

    study = optuna.create_study(direction=direction)
    configs = {"A": A, "B": B, "C": C}
    study.set_user_attr(promote.ATTR_PROMOTE, {
        "source_study": "src", "budget_s": 60.0, "seeds": 3,
        "configs": [{"source_trial": i, "source_value": 1.0 + i, "params": configs[k]} for i, k in enumerate(values)]})
    dists = {"depth": IntDistribution(1, 2), "model_dim": IntDistribution(32, 64, step=16),
             "matrix_lr": FloatDistribution(0.01, 0.05, log=True), "seed": IntDistribution(0, 3)}
    for k, vals in values.items():
        for seed, v in enumerate(vals):
            params = {**configs[k], "seed": seed}
            state = optuna.trial.TrialState.FAIL if v is None else optuna.trial.TrialState.COMPLETE
            study.add_trial(optuna.trial.create_trial(params=params, distributions=dists, value=v, state=state))
    return study


def test_report_statistics_match_hand_computations():
    study = _linked({"A": [1.0, 1.1, 1.2], "B": [1.5, 1.52, None]})
    rep = promote.report(study, _single("minimize"))
    a, b = rep["configs"]
    assert (a["source_trial"], a["n"], a["seeds"], a["failed"]) == (0, 3, [0, 1, 2], 0)
    assert a["mean"] == pytest.approx(1.1) and a["std"] == pytest.approx(0.1)
    assert a["half_width"] == pytest.approx(T975[2] * 0.1 / math.sqrt(3))  # 0.24841
    assert (a["ci_low"], a["ci_high"]) == pytest.approx((1.1 - 0.248414, 1.1 + 0.248414), abs=1e-6)
    assert (b["n"], b["failed"]) == (2, 1) and b["mean"] == pytest.approx(1.51)
    assert b["std"] == pytest.approx(0.02 / math.sqrt(2))
    assert b["half_width"] == pytest.approx(T975[1] * 0.01)  # std / sqrt(2) = 0.01
    # A's interval [0.8516, 1.3484] clears B's [1.3829, 1.6371].
    assert rep["verdict"] == "winner" and rep["winner"] == 0 and rep["message"].startswith("winner: trial 0")


def test_overlapping_intervals_are_within_noise_and_one_seed_is_undecided():
    rep = promote.report(_linked({"A": [1.0, 1.1, 1.2], "B": [1.3, 1.32]}), _single("minimize"))
    assert rep["verdict"] == "within_noise" and rep["winner"] is None and rep["message"].startswith("within noise")
    rep = promote.report(_linked({"A": [1.0], "B": [1.3, 1.32]}), _single("minimize"))
    assert rep["verdict"] == "undecided" and rep["configs"][0]["std"] is None
    rep = promote.report(_linked({"A": [1.0, 1.1]}), _single("minimize"))
    assert rep["verdict"] == "single"
    rep = promote.report(_linked({"A": [None], "B": [None]}), _single("minimize"))
    assert rep["verdict"] == "incomplete" and [r["failed"] for r in rep["configs"]] == [1, 1]


def test_maximize_ranks_and_clears_the_other_way():
    rep = promote.report(_linked({"A": [1.0, 1.1, 1.2], "B": [1.5, 1.52], "C": [1.49, 1.51]}, "maximize"),
                         _single("maximize"))
    assert [r["source_trial"] for r in rep["configs"]] == [1, 2, 0]
    assert rep["verdict"] == "within_noise"  # B and C overlap
    rep = promote.report(_linked({"A": [1.0, 1.1, 1.2], "B": [1.5, 1.52]}, "maximize"), _single("maximize"))
    assert rep["verdict"] == "winner" and rep["winner"] == 1


@pytest.mark.slow
def test_promote_runs_replicates_on_ray_and_resumes_without_rerunning(tmp_path, monkeypatch, data_cache, capsys,
                                                                     ray_cluster):
    path, url, _, _ = _source(tmp_path, monkeypatch, data_cache, {"max_steps": 8})
    env = head_env(ray_cluster, url, tmp_path / "art")
    args = ["promote", str(path), "--top", "2", "--budget-s", "2", "--json"]

    first = run_sweep(*args, "--seeds", "1", env=env, timeout=240)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    rep = json.loads(first.stdout.strip().splitlines()[-1])
    assert rep["study"] == "src-promote-2" and rep["source_study"] == "src" and rep["budget_s"] == 2.0
    assert [(r["source_trial"], r["n"], r["seeds"]) for r in rep["configs"]] in (
        [(2, 1, [0]), (1, 1, [0])], [(1, 1, [0]), (2, 1, [0])])
    assert rep["verdict"] == "undecided"
    before = {t.number: t for t in load_trials(url, "src-promote-2")}
    assert len(before) == 2 and all(t.state.name == "COMPLETE" for t in before.values())
    for t in before.values():
        assert t.params["seed"] == 0 and {k: v for k, v in t.params.items() if k != "seed"} in (A, B)
        assert t.user_attrs["config"]["budget_s"] == 2.0 and t.user_attrs["config"]["seed"] == 0
        assert 0 < t.user_attrs["steps"] <= 8  # max_steps, unless a loaded machine reaches the budget first

    second = run_sweep(*args, "--seeds", "2", env=env, timeout=240)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-3000:]
    rep = json.loads(second.stdout.strip().splitlines()[-1])
    after = {t.number: t for t in load_trials(url, "src-promote-2")}
    assert len(after) == 4 and all(t.state.name == "COMPLETE" for t in after.values())
    for n, t in before.items():  # the finished replicates were not run again
        assert (after[n].value, after[n].datetime_complete) == (t.value, t.datetime_complete)
    t975 = 12.706204736174698  # Student's t at 97.5% with 1 degree of freedom (two seeds)
    for r in rep["configs"]:
        assert r["n"] == 2 and sorted(r["seeds"]) == [0, 1]
        assert r["mean"] == pytest.approx(statistics.fmean(r["values"]))
        assert r["std"] == pytest.approx(statistics.stdev(r["values"]))
        half = t975 * statistics.stdev(r["values"]) / 2 ** 0.5
        assert (r["ci_low"], r["ci_high"]) == pytest.approx((r["mean"] - half, r["mean"] + half))
    best, runner_up = sorted(rep["configs"], key=lambda r: r["mean"])  # val_bpb: lower is better
    # The values decide it: a winner only if the best interval clears the runner-up's.
    assert rep["verdict"] == ("winner" if best["ci_high"] < runner_up["ci_low"] else "within_noise"), rep

    # Nothing left to run (no driver started); the best configuration's cold start-up is rehearsed once.
    third = run_sweep(*args, "--seeds", "2", "--cold-rehearsal", env=env, timeout=240)
    assert third.returncode == 0 and json.loads(third.stdout.strip().splitlines()[-1]) == rep, third.stderr[-2000:]
    assert "ray:" not in third.stderr
    assert len(load_trials(url, "src-promote-2")) == 4
    rehearsed = best["trials"][0]
    assert re.search(rf"trial {rehearsed}: cold start-up \d+ s, within the margin 840 s", third.stderr), third.stderr
    import optuna

    linked_study = optuna.load_study(study_name="src-promote-2", storage=st.open_storage(url))
    assert list(linked_study.user_attrs["cold_rehearsals"]) == [str(rehearsed)]

    # The linked study is a study like any other to the other commands.
    linked = str(tmp_path / "src-promote-2.toml")
    assert cli.main(["status", linked, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["counts"]["COMPLETE"] == 4
    assert cli.main(["export", linked, "--out", str(tmp_path / "sub")]) == 0
    prov = json.loads((tmp_path / "sub" / "provenance.json").read_text())
    assert prov["study"] == "src-promote-2" and "seed" in prov["params"]
    assert prov["config"]["seed"] == prov["params"]["seed"] and prov["trial_code_version"]["git_commit"]


def test_a_new_promotion_says_it_is_starting_not_resuming(tmp_path, monkeypatch):
    from sweep.run.driver import Driver

    _, url, spec, source = _source(tmp_path, monkeypatch)
    linked, _ = promote.prepare(spec, source, 2, 6.0, 2, url)
    out = io.StringIO()
    driver = Driver(linked, out=out, next_steps=False)  # what promote runs, up to its first trial
    driver.open_study()
    driver.reconcile()
    assert out.getvalue() == "starting study src-promote-6: 4 queued trial(s) to run first\n"


def test_bad_input_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    path, url, _, _ = _source(tmp_path, monkeypatch)
    empty = write_spec(tmp_path, "empty", tiny_spec())
    import optuna

    optuna.create_study(study_name="empty", storage=st.open_storage(url))
    cases = [
        (["promote", str(path), "--top", "0"], "--top: must be a positive integer"),
        (["promote", str(path), "--seeds", "x"], "--seeds: must be a positive integer"),
        (["promote", str(path), "--budget-s", "-5"], "--budget-s: must be a positive number"),
        (["promote", str(tmp_path / "other.toml")], "no such study spec"),
        (["promote", str(empty)], "study 'empty' has no complete trial at its budget of 4 s to promote"),
        (["status", str(tmp_path / "nobase-promote-60.toml")], "neither a study spec nor a promotion of one"),
        (["run", str(tmp_path / "src-promote-60.toml")], "is a promotion of study 'src': `python -m sweep promote"),
    ]
    for argv, message in cases:
        assert _main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)
    wrong = write_spec(tmp_path, "src", tiny_spec(**{"params.depth": {"type": "int", "low": 3, "high": 4}}))
    assert cli.main(["promote", str(wrong)]) == 2
    assert "trial 2 of study 'src' no longer fits its spec: depth: 1 is outside [3, 4]" in capsys.readouterr().err


def _main(argv: list[str]) -> int:
    """cli.main's exit code, argparse's SystemExit included."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return int(e.code)


# -- objectives: what is ranked follows the study's objective --------------------------------------

PARETO = {"objective": {"type": "pareto", "metrics": ["val_bpb", "tokens_per_second"]}}
TERMS = (obj.Term("val_bpb", 0.5, 1.0, 2.0), obj.Term("core", 0.5, 0.3, 0.0))
COMPOSITE = obj.Objective("composite", ("val_bpb", "core"), ("maximize",), TERMS)


def _single(direction: str) -> obj.Objective:
    return obj.Objective("single", ("val_bpb",), (direction,))


def _pareto_source(tmp_path, monkeypatch, cache: str | None = None, fixed_extra: dict | None = None):
    """Pareto spec ``par`` (val_bpb down, tokens_per_second up) and its study: A (1.20, 1000), B (1.25, 1100),
    C (1.40, 500); by val_bpb A, B, C; by throughput B, A, C."""
    import optuna

    sections = tiny_spec(cache, **PARETO)
    sections["fixed"] = {**sections["fixed"], **(fixed_extra or {})}
    path = write_spec(tmp_path, "par", sections)
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    monkeypatch.setenv("SWEEP_STORAGE", url)
    spec = load(path)
    study = optuna.create_study(study_name="par", storage=st.open_storage(url), directions=spec.directions)
    for params, v, tps in ((A, 1.20, 1000.0), (B, 1.25, 1100.0), (C, 1.40, 500.0)):
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions=spec.space.distributions(params), values=[v, tps],
            user_attrs={"val_bpb": v, "tokens_per_second": tps}))
    return path, url, spec, study


def test_pareto_ranks_by_the_named_metric_in_its_direction_and_requires_it(tmp_path, monkeypatch, capsys):
    path, _, spec, study = _pareto_source(tmp_path, monkeypatch)
    by_bpb = promote.top_configs(study.get_trials(), spec, 3, "val_bpb")
    by_tps = promote.top_configs(study.get_trials(), spec, 3, "tokens_per_second")
    assert [(c["source_trial"], c["source_value"]) for c in by_bpb] == [(0, 1.20), (1, 1.25), (2, 1.40)]
    assert [(c["source_trial"], c["source_value"]) for c in by_tps] == [(1, 1100.0), (0, 1000.0), (2, 500.0)]
    for argv, message in [
        (["promote", str(path)], "study 'par' is pareto (minimize val_bpb, maximize tokens_per_second), so it has "
                                 "no single order: --by METRIC is required; rank by one of val_bpb, "
                                 "tokens_per_second"),
        (["promote", str(path), "--by", "core"], "--by core: not one of its metrics; rank by one of val_bpb, "
                                                 "tokens_per_second"),
    ]:
        assert _main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def _linked_multi(objective: obj.Objective, records: dict[str, list[dict]]):
    """An in-memory linked study of ``objective`` whose replicates have the given records."""
    import optuna
    from optuna.distributions import FloatDistribution, IntDistribution

    study = optuna.create_study(directions=list(objective.directions))
    configs = {"A": A, "B": B, "C": C}
    study.set_user_attr(promote.ATTR_PROMOTE, {
        "source_study": "src", "budget_s": 60.0, "seeds": 3, "spec": "full", "by": objective.names[0],
        "configs": [{"source_trial": i, "source_value": None, "params": configs[k]} for i, k in enumerate(records)]})
    dists = {"depth": IntDistribution(1, 2), "model_dim": IntDistribution(32, 64, step=16),
             "matrix_lr": FloatDistribution(0.01, 0.05, log=True), "seed": IntDistribution(0, 3)}
    for k, recs in records.items():
        for seed, rec in enumerate(recs):
            study.add_trial(optuna.trial.create_trial(params={**configs[k], "seed": seed}, distributions=dists,
                                                      values=objective.values(rec), user_attrs=rec))
    return study


def test_pareto_report_interval_and_winner_use_the_ranked_metric_with_the_others_alongside():
    objective = obj.Objective("pareto", ("val_bpb", "tokens_per_second"), ("minimize", "maximize"))
    study = _linked_multi(objective, {
        "A": [{"val_bpb": v, "tokens_per_second": t} for v, t in ((1.30, 900), (1.31, 910), (1.29, 905))],
        "B": [{"val_bpb": v, "tokens_per_second": t} for v, t in ((1.20, 500), (1.21, 520), (1.22, 510))]})
    rep = promote.report(study, objective, "tokens_per_second")
    assert (rep["metric"], rep["direction"], rep["spec"]) == ("tokens_per_second", "maximize", "full")
    a, b = rep["configs"]
    assert (a["source_trial"], a["mean"], b["mean"]) == (0, pytest.approx(905.0), pytest.approx(510.0))
    assert a["half_width"] == pytest.approx(T975[2] * 5.0 / math.sqrt(3))
    assert a["alongside"]["val_bpb"]["mean"] == pytest.approx(1.30)
    assert a["alongside"]["val_bpb"]["half_width"] == pytest.approx(T975[2] * 0.01 / math.sqrt(3))
    assert set(a["alongside"]) == {"val_bpb"}  # core is not recorded
    assert rep["verdict"] == "winner" and rep["winner"] == 0 and "mean tokens_per_second 905.0000" in rep["message"]
    rep = promote.report(study, objective, "val_bpb")
    assert [r["source_trial"] for r in rep["configs"]] == [1, 0] and rep["winner"] == 1
    assert rep["configs"][0]["alongside"]["tokens_per_second"]["mean"] == pytest.approx(510.0)
    out = io.StringIO()
    promote.print_report(rep, out)
    assert "ranked by val_bpb (minimize)" in out.getvalue() and "tokens_p" in out.getvalue()


def test_composite_ranks_by_its_score_maximised_with_val_bpb_and_core_alongside(tmp_path, monkeypatch):
    # A has the better val_bpb, B the better score (its core outweighs it).
    study = _linked_multi(COMPOSITE, {
        "A": [{"val_bpb": v, "core": c} for v, c in ((1.10, 0.05), (1.12, 0.06), (1.11, 0.04))],
        "B": [{"val_bpb": v, "core": c} for v, c in ((1.20, 0.20), (1.22, 0.21), (1.21, 0.19))]})
    rep = promote.report(study, COMPOSITE)
    assert (rep["metric"], rep["direction"]) == ("composite", "maximize")
    b, a = rep["configs"]
    assert (b["source_trial"], a["source_trial"]) == (1, 0)
    assert b["mean"] == pytest.approx(0.5 * (2 - 1.21) + 0.5 * 0.20 / 0.3)
    assert a["alongside"]["val_bpb"]["mean"] == pytest.approx(1.11)
    assert b["alongside"]["core"]["mean"] == pytest.approx(0.20)
    assert b["alongside"]["core"]["half_width"] == pytest.approx(T975[2] * 0.01 / math.sqrt(3))
    assert rep["verdict"] == "winner" and rep["winner"] == 1
    # The source's ranking: the highest score first, not the lowest val_bpb.
    import optuna

    sections = tiny_spec(objective={"type": "composite"},
                         **{"objective.terms.val_bpb": {"weight": 0.5, "best": 1.0, "worst": 2.0},
                            "objective.terms.core": {"weight": 0.5, "best": 0.3, "worst": 0.0}})
    sections["fixed"] = {**sections["fixed"], "core_bundle": "demo"}
    spec = load(write_spec(tmp_path, "comp", sections))
    source = optuna.create_study(direction="maximize")
    for params, rec in ((A, {"val_bpb": 1.1, "core": 0.05}), (B, {"val_bpb": 1.2, "core": 0.2})):
        source.add_trial(optuna.trial.create_trial(params=params, distributions=spec.space.distributions(params),
                                                   values=spec.objective.values(rec), user_attrs=rec))
    assert [c["source_trial"] for c in promote.top_configs(source.get_trials(), spec, 2)] == [1, 0]
    with pytest.raises(promote.PromoteError, match="optimises core, which needs \\[fixed\\] core_bundle there"):
        promote.linked_spec(spec, 60, under=load(write_spec(tmp_path, "plain", tiny_spec())))


# -- --spec: replicates under another spec ---------------------------------------------------------

def test_spec_reruns_under_its_settings_and_resuming_under_another_is_refused(tmp_path, monkeypatch, capsys):
    path, url, spec, source = _source(tmp_path, monkeypatch)
    full = tiny_spec(trial={"budget_s": 6, "startup_allowance_s": 30, "eval_timeout_s": 30, "eval_fractions": [0.5]})
    full["fixed"] = {**full["fixed"], "final_eval_tokens": 4096}
    full_path = write_spec(tmp_path, "full", full)
    linked, study = promote.prepare(spec, source, 2, 6.0, 2, url, under=load(full_path))
    assert (linked.name, linked.budget_s, linked.n_trials, linked.storage) == ("src-promote-6", 6.0, 4, spec.storage)
    assert linked.space.fixed["final_eval_tokens"] == 4096 and linked.startup_allowance_s == 30
    assert linked.objective == spec.objective and linked.pruner.name == "none"
    info = study.user_attrs[promote.ATTR_PROMOTE]
    assert (info["spec"], info["spec_path"], info["by"]) == ("full", str(full_path), "val_bpb")
    assert sorted(t.state.name for t in study.get_trials()) == ["WAITING"] * 4
    assert all(linked.space.trainer_config(t.params)["final_eval_tokens"] == 4096 for t in study.get_trials())

    other = write_spec(tmp_path, "other", {**full, "trial.resources": {"num_cpus": 2}})
    narrow = write_spec(tmp_path, "narrow", {**full, "params.depth": {"type": "int", "low": 3, "high": 4}})
    fixes = write_spec(tmp_path, "fixes", {**full, "fixed": {**full["fixed"], "matrix_lr": 0.02},
                                           "params.matrix_lr": None})
    cases = [
        # --budget-s defaults to the --spec's (6 s): the same linked study, begun under spec full.
        (["promote", str(path), "--spec", str(other)], "study 'src-promote-6' was promoted under spec 'full', "
                                                       "not 'other': resume it with --spec full"),
        (["promote", str(path), "--budget-s", "6"], "was promoted under spec 'full', not 'src'"),
        (["promote", str(path), "--spec", str(narrow)], f"--spec {narrow}: trial 2's configuration does not fit "
                                                        "its space: depth: 1 is outside [3, 4]"),
        (["promote", str(path), "--spec", str(fixes)], "configuration does not fit its space: matrix_lr: is fixed, "
                                                       "not a searched parameter"),
        (["promote", str(path), "--spec", str(tmp_path / "nope.toml")], "no such study spec"),
    ]
    for argv, message in cases:
        assert _main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (argv, err)
    assert len(load_trials(url, "src-promote-6")) == 4  # nothing enqueued by the refused runs

    # A parameter the other spec searches takes the source's fixed value; one the source never had is missing.
    fixed = {k: v for k, v in full["fixed"].items() if k != "batch_size"}
    searches = load(write_spec(tmp_path, "searches", {**full, "fixed": fixed,
                                                      "params.batch_size": {"type": "categorical", "choices": [4, 8]}}))
    c = {"source_trial": 2, "params": A}
    assert promote._fit(c, spec, promote.linked_spec(spec, 6, under=searches), spec.space.fixed, True) == {
        **A, "batch_size": 4}
    more = load(write_spec(tmp_path, "more", {**full, "params.warmdown_ratio": {"type": "float", "low": 0.1,
                                                                                "high": 0.9}}))
    with pytest.raises(promote.PromoteError, match="trial 2's configuration does not fit its space: "
                                                   "warmdown_ratio: missing"):
        promote._fit(c, spec, promote.linked_spec(spec, 6, under=more), spec.space.fixed, True)


@pytest.mark.slow
def test_pareto_promotion_under_another_spec_on_ray_records_both_values_and_resumes(tmp_path, monkeypatch,
                                                                                      data_cache, capsys, ray_cluster):
    path, url, _, _ = _pareto_source(tmp_path, monkeypatch, data_cache)
    full = tiny_spec(data_cache, **PARETO, trial={"budget_s": 2, "startup_allowance_s": 20, "eval_timeout_s": 20,
                                                  "eval_fractions": [0.5], "heartbeat_s": 1, "stale_after_s": 8,
                                                  "stop_grace_s": 5})
    full["fixed"] = {**full["fixed"], "max_steps": 8, "final_eval_tokens": 1024}
    full_path = write_spec(tmp_path, "parfull", full)
    env = head_env(ray_cluster, url, tmp_path / "art")
    args = ["promote", str(path), "--spec", str(full_path), "--top", "2", "--seeds", "1", "--json"]

    first = run_sweep(*args, "--by", "tokens_per_second", env=env, timeout=240)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    rep = json.loads(first.stdout.strip().splitlines()[-1])
    assert (rep["study"], rep["spec"], rep["metric"], rep["direction"]) == (
        "par-promote-2", "parfull", "tokens_per_second", "maximize")
    assert {r["source_trial"] for r in rep["configs"]} == {0, 1} and rep["verdict"] == "undecided"
    trials = load_trials(url, "par-promote-2")
    assert len(trials) == 2 and all(t.state.name == "COMPLETE" and len(t.values) == 2 for t in trials)
    for t in trials:  # both objective values, run under parfull's budget and evaluation
        assert t.values == [t.user_attrs["val_bpb"], t.user_attrs["tokens_per_second"]]
        assert t.user_attrs["config"]["budget_s"] == 2.0 and t.user_attrs["config"]["final_eval_tokens"] == 1024
    for r in rep["configs"]:
        t = next(t for t in trials if t.number == r["trials"][0])
        assert r["mean"] == t.values[1] and r["alongside"]["val_bpb"]["mean"] == t.values[0]
    ranked = sorted(trials, key=lambda t: -t.values[1])
    assert [r["trials"][0] for r in rep["configs"]] == [t.number for t in ranked]

    # Resumed ranking by val_bpb: the same replicates, nothing rerun, reordered.
    second = run_sweep(*args, "--by", "val_bpb", env=env, timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "ray:" not in second.stderr
    rep2 = json.loads(second.stdout.strip().splitlines()[-1])
    assert rep2["metric"] == "val_bpb" and len(load_trials(url, "par-promote-2")) == 2
    assert [r["trials"][0] for r in rep2["configs"]] == [t.number for t in sorted(trials, key=lambda t: t.values[0])]

    # Another spec (here the source's own) for the same linked study is refused; a pareto export needs --trial.
    assert _main(["promote", str(path), "--by", "val_bpb", "--budget-s", "2"]) == 2
    assert "was promoted under spec 'parfull', not 'par'" in capsys.readouterr().err
    linked = str(tmp_path / "par-promote-2.toml")
    assert _main(["run", linked]) == 2
    assert "`python -m sweep promote par --budget-s 2 --by METRIC` runs it" in capsys.readouterr().err
    assert _main(["export", linked, "--out", str(tmp_path / "sub")]) == 2
    err = capsys.readouterr().err
    assert "choose a trial of its Pareto front with --trial N" in err and not (tmp_path / "sub").exists()


# -- a script study; a spec given by path ----------------------------------------------------------

SCRIPT_TEXT = "DEPTH = 1\nMODEL_DIM = 32\nLEARNING_RATE = 0.01\n{seed}print('trains')\n"


def _script_source(tmp_path, monkeypatch, seed_line: str = ""):
    """A study of a script (no [trial] seed_knob) with one complete trial; its spec given by path."""
    import optuna

    tmp_path.mkdir(exist_ok=True)
    monkeypatch.delenv("SWEEP_STORAGE", raising=False)  # each its own store
    script = tmp_path / "train.py"
    script.write_text(SCRIPT_TEXT.format(seed=seed_line))
    sections = {"study": {"n_trials": 2, "concurrency": 1, "seed": 0},
                "trial": {"script": str(script), "budget_s": 4, "startup_allowance_s": 20, "eval_timeout_s": 20,
                          "eval_fractions": [0.5]},
                "trial.resources": {"num_cpus": 1}, "pruner": {"name": "none"},
                "params.depth": {"type": "int", "low": 1, "high": 2},
                "params.learning_rate": {"type": "float", "low": 0.001, "high": 0.1, "log": True}}
    path = write_spec(tmp_path, "scripted", sections)
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    monkeypatch.setenv("SWEEP_STORAGE", url)
    spec = load(path)
    study = optuna.create_study(study_name="scripted", storage=st.open_storage(url))
    params = {"depth": 1, "learning_rate": 0.01}
    study.add_trial(optuna.trial.create_trial(params=params, distributions=spec.space.distributions(params),
                                              value=1.5))
    return path, url, spec, study


def test_promote_refuses_a_script_it_cannot_reseed_before_enqueueing_anything(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    path, url, spec, _ = _script_source(tmp_path, monkeypatch)
    assert getattr(spec.script, "seed_knob", None) is None
    capsys.readouterr()
    assert _main(["promote", str(path), "--budget-s", "6", "--seeds", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.py has no seed knob" in err and "[trial] seed_knob" in err, err
    assert promote.promotion_record("scripted-promote-6", url) == {}
    with pytest.raises(KeyError):
        load_trials(url, "scripted-promote-6")  # no linked study, no replicate
    # A seed knob, or a SEED constant the seed key sets, lets it through.
    knobbed = SimpleNamespace(script=spec.script.script, seed_knob=object())
    promote.refuse_unseeded(dataclasses.replace(spec, script=knobbed))
    path2, url2, spec2, source2 = _script_source(tmp_path / "seeded", monkeypatch, "SEED = 0\n")
    linked, study = promote.prepare(spec2, source2, 1, 6.0, 2, url2)
    assert sorted(t.system_attrs["fixed_params"]["seed"] for t in study.get_trials()) == [0, 1]


def test_a_linked_study_of_a_spec_given_by_path_opens_by_name_and_by_the_path_promote_prints(tmp_path, monkeypatch,
                                                                                            capsys):
    path, url, spec, source = _source(tmp_path, monkeypatch)
    full = tiny_spec(trial={"budget_s": 6, "startup_allowance_s": 30, "eval_timeout_s": 30, "eval_fractions": [0.5]})
    full["fixed"] = {**full["fixed"], "final_eval_tokens": 4096}
    (tmp_path / "other-dir").mkdir()
    full_path = write_spec(tmp_path / "other-dir", "full", full)
    monkeypatch.chdir(tmp_path)  # --spec given relative to here: recorded absolute
    linked, study = promote.prepare(spec, source, 2, 6.0, 2, url, under=load("other-dir/full.toml"))
    info = study.user_attrs[promote.ATTR_PROMOTE]
    assert (info["spec_path"], info["source_spec_path"]) == (str(full_path.resolve()), str(path.resolve()))

    monkeypatch.chdir(tmp_path / "other-dir")
    for arg in ("src-promote-6", promote.linked_arg(spec, "src-promote-6")):
        got = promote.load_spec(arg, "export")
        assert (got.name, got.budget_s, got.path, got.space.fixed["final_eval_tokens"]) == (
            "src-promote-6", 6.0, full_path.resolve(), 4096), arg  # the replicates' spec, the recorded --spec's
        assert got.space.validate({**A, "seed": 1})["seed"] == 1  # every seed promote enqueued
    assert promote.linked_arg(spec, "src-promote-6") == str(tmp_path / "src-promote-6.toml")

    rep = {"confidence": 0.95, "source_study": "src", "budget_s": 6.0, "seeds": 2, "spec": "full",
           "study": "src-promote-6", "metric": "val_bpb", "direction": "minimize", "message": "undecided",
           "configs": [{"source_trial": 2, "n": 0, "mean": None, "half_width": None, "std": None, "source_value": 1.2,
                        "alongside": {}, "failed": 0, "pending": 2, "trials": [5]}]}
    out = io.StringIO()
    promote.print_report(rep, out, promote.linked_arg(spec, "src-promote-6"))
    hint = out.getvalue().splitlines()[-1]
    assert hint == f"export: python -m sweep export {tmp_path / 'src-promote-6.toml'} --trial 5 --out DIR"
