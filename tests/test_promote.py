"""``sweep promote``: the K best distinct configurations rerun with S seeds each as a linked study on real Ray,
resumed without rerunning a finished replicate; the report's statistics and verdict; bad input."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from sweep import cli, promote
from sweep import storage as st
from sweep.spec import load
from tests.sweep_fixtures import load_trials, run_sweep, sweep_env, tiny_spec, write_spec

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
    rep = promote.report(study, "minimize")
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
    rep = promote.report(_linked({"A": [1.0, 1.1, 1.2], "B": [1.3, 1.32]}), "minimize")
    assert rep["verdict"] == "within_noise" and rep["winner"] is None and rep["message"].startswith("within noise")
    rep = promote.report(_linked({"A": [1.0], "B": [1.3, 1.32]}), "minimize")
    assert rep["verdict"] == "undecided" and rep["configs"][0]["std"] is None
    rep = promote.report(_linked({"A": [1.0, 1.1]}), "minimize")
    assert rep["verdict"] == "single"
    rep = promote.report(_linked({"A": [None], "B": [None]}), "minimize")
    assert rep["verdict"] == "incomplete" and [r["failed"] for r in rep["configs"]] == [1, 1]


def test_maximize_ranks_and_clears_the_other_way():
    rep = promote.report(_linked({"A": [1.0, 1.1, 1.2], "B": [1.5, 1.52], "C": [1.49, 1.51]}, "maximize"),
                         "maximize")
    assert [r["source_trial"] for r in rep["configs"]] == [1, 2, 0]
    assert rep["verdict"] == "within_noise"  # B and C overlap
    rep = promote.report(_linked({"A": [1.0, 1.1, 1.2], "B": [1.5, 1.52]}, "maximize"), "maximize")
    assert rep["verdict"] == "winner" and rep["winner"] == 1


@pytest.mark.slow
def test_promote_runs_replicates_on_ray_and_resumes_without_rerunning(tmp_path, monkeypatch, data_cache, capsys):
    path, url, _, _ = _source(tmp_path, monkeypatch, data_cache, {"max_steps": 8})
    env = sweep_env(url, tmp_path / "art")
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
    for r in rep["configs"]:
        assert r["n"] == 2 and sorted(r["seeds"]) == [0, 1]
        assert r["mean"] == pytest.approx(statistics.fmean(r["values"]))
        assert r["std"] == pytest.approx(statistics.stdev(r["values"]))
    assert rep["verdict"] in ("winner", "within_noise")

    third = run_sweep(*args, "--seeds", "2", env=env, timeout=120)
    assert third.returncode == 0 and json.loads(third.stdout.strip().splitlines()[-1]) == rep
    assert "ray:" not in third.stderr  # nothing left to run: no driver started
    assert len(load_trials(url, "src-promote-2")) == 4

    # The linked study is a study like any other to the other commands.
    linked = str(tmp_path / "src-promote-2.toml")
    assert cli.main(["status", linked, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["counts"]["COMPLETE"] == 4
    assert cli.main(["export", linked, "--out", str(tmp_path / "sub")]) == 0
    prov = json.loads((tmp_path / "sub" / "provenance.json").read_text())
    assert prov["study"] == "src-promote-2" and "seed" in prov["params"]
    assert prov["config"]["seed"] == prov["params"]["seed"] and prov["trial_code_version"]["git_commit"]


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
