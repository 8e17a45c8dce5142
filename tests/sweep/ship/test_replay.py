"""Replay: samplers and pruners re-run on a study's recorded curves, deterministic and at no compute."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from sweep import cli
from sweep import store as st
from sweep.ship.replay import components, recorded_trials, replay
from sweep.spec import Component, load
from tests.conftest import subprocess_env
from tests.curves import BUDGET, STEPS, synthetic
from tests.sweep_fixtures import tiny_spec, write_spec

ROOT = Path(__file__).resolve().parents[3]
STARTUP_S = 5.0
# Ordinary learning rates and warmdowns, a few clearly bad runs (large b), and one high-lr run that
# looks bad mid-run but anneals to the best final val_bpb.
RECORDINGS = [(0.01, 0.5, None), (0.02, 0.3, None), (0.04, 0.6, None), (0.03, 0.5, None), (0.015, 0.4, None),
              (0.02, 0.5, 1.2), (0.01, 0.6, 1.5), (0.03, 0.4, 1.0), (0.025, 0.5, 0.9), (0.1, 0.5, None),
              (0.005, 0.5, None), (0.05, 0.7, None)]


def _demo_spec(tmp: Path, name: str, study_extra: str = "", tables: str = "") -> tuple[Path, Path]:
    """Spec NAME extending demo.toml with the recordings' budget and eval points, stored in tmp's journal."""
    journal = tmp / "journal.log"
    fractions = ", ".join(f"{s / BUDGET:g}" for s in STEPS)
    spec = tmp / f"{name}.toml"
    spec.write_text(f'extends = "{ROOT / "sweep" / "studies" / "demo.toml"}"\n'
                    f'[study]\nstorage = "journal:{journal}"\n{study_extra}'
                    f"[trial]\nbudget_s = {BUDGET}\neval_fractions = [{fractions}]\n"
                    '[sampler]\nname = "random"\n[pruner]\nname = "none"\n' + tables)
    return spec, journal


@pytest.fixture(scope="module")
def recorded_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A journal store holding a finished study with full curves, and the spec that names it."""
    spec, journal = _demo_spec(tmp_path_factory.mktemp("replay"), "recorded")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(study_name="recorded", storage=st.open_storage(f"journal:{journal}"))
    for i, (lr, wd, b) in enumerate(RECORDINGS):
        _, values, final = synthetic(lr, wd, b=b, noise=0.002, seed=i)
        study.enqueue_trial({"matrix_lr": lr, "warmdown_ratio": wd})
        t = study.ask()
        t.suggest_float("matrix_lr", 0.005, 0.1, log=True)
        t.suggest_float("warmdown_ratio", 0.2, 0.8)
        for step, v in values.items():
            t.report(v, step)
        t.report(final, BUDGET)
        for k, v in {"train_seconds": float(BUDGET), "startup_seconds": STARTUP_S,
                     "config": {"matrix_lr": lr, "warmdown_ratio": wd, "final_lr_frac": 0.0}}.items():
            t.set_user_attr(k, v)
        study.tell(t, final)
    return spec


def _recorded(spec_path: Path) -> list:
    spec = load(spec_path)
    study = optuna.load_study(study_name=spec.name, storage=st.open_storage(st.resolve_url(spec.storage)))
    return recorded_trials(study.get_trials(), spec.budget_s)


def _pruner(spec_path: Path, name: str, **opts: object) -> Component:
    spec = load(spec_path)
    return components(spec, None, [], name, [f"{k}={json.dumps(v)}" for k, v in opts.items()], None)[1]


def test_replay_is_deterministic_and_no_pruning_spends_the_most(recorded_study: Path) -> None:
    recs = _recorded(recorded_study)
    assert len(recs) == len(RECORDINGS)
    sampler = Component("random", {"seed": 3})
    runs = {name: replay(recs, sampler, _pruner(recorded_study, name), BUDGET)
            for name in ("none", "median", "hyperband", "learning_curve")}
    assert replay(recs, sampler, _pruner(recorded_study, "learning_curve"), BUDGET) == runs["learning_curve"]
    none = runs["none"]
    assert none.compute_s == none.full_compute_s == len(RECORDINGS) * (BUDGET + STARTUP_S)
    assert none.pruned == 0 and none.best_number == none.true_best_number and none.true_best_pruned is False
    for name in ("median", "hyperband", "learning_curve"):
        r = runs[name]
        assert r.pruned > 0 and r.compute_s < none.compute_s, name
        assert r.full_compute_s == none.full_compute_s
        # The trajectory is cumulative: compute only grows, the best only improves.
        assert [s.compute_s for s in r.trajectory] == sorted(s.compute_s for s in r.trajectory)
        assert r.trajectory[-1].compute_s == r.compute_s
    # Every trial a pruner stops costs its stopping step plus start-up, never more than running it out.
    lc = runs["learning_curve"]
    assert lc.true_best_pruned is False and lc.best_val_bpb == none.best_val_bpb


def test_median_prunes_the_late_bloomer_that_the_learning_curve_pruner_keeps(recorded_study: Path) -> None:
    recs = _recorded(recorded_study)
    seeds = range(4)
    med = [replay(recs, Component("random", {"seed": s}), _pruner(recorded_study, "median"), BUDGET) for s in seeds]
    lc = [replay(recs, Component("random", {"seed": s}), _pruner(recorded_study, "learning_curve"), BUDGET)
          for s in seeds]
    assert any(r.true_best_pruned for r in med)
    assert not any(r.true_best_pruned for r in lc)


def test_fewer_trials_than_recordings(recorded_study: Path) -> None:
    recs = _recorded(recorded_study)
    r = replay(recs, Component("tpe", {"seed": 0, "n_startup_trials": 3}), _pruner(recorded_study, "none"), BUDGET,
               n_trials=5, startup_s=0.0)
    assert r.trials == len(r.trajectory) == 5
    assert len({s.number for s in r.trajectory}) == 5  # each recording runs at most once
    assert r.compute_s == 5 * BUDGET


def test_cli_replay_end_to_end(recorded_study: Path) -> None:
    env = subprocess_env()
    env.pop("SWEEP_STORAGE", None)
    proc = subprocess.run([sys.executable, "-m", "sweep", "replay", str(recorded_study), "--sampler", "random",
                           "--pruner", "learning_curve", "--pruner-opt", "z=2.5", "--pruner-opt",
                           '{"n_startup_trials": 3}', "--seed", "1", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["pruner"] == {"name": "learning_curve", "z": 2.5, "n_startup_trials": 3, "budget_s": BUDGET}
    assert body["sampler"]["seed"] == 1 and body["recorded"] == body["trials"] == len(RECORDINGS)
    assert 0 < body["compute_s"] < body["full_compute_s"] and body["compute_saved_frac"] > 0
    assert len(body["trajectory"]) == len(RECORDINGS)
    out = io.StringIO()
    assert cli.main(["replay", str(recorded_study), "--pruner", "median", "--seed", "1"], out=out) == 0
    assert "best val_bpb" in out.getvalue() and "pruned" in out.getvalue()


@pytest.mark.parametrize("args, cause", [
    (["--sampler", "annealing"], "sampler.name"),
    (["--pruner", "asha"], "pruner.name"),
    (["--pruner", "median", "--pruner-opt", "n_startup"], "expected KEY=VALUE"),
    (["--pruner", "learning_curve", "--pruner-opt", "z=-1"], "z must be"),
    (["--n-trials", "0"], "--n-trials"),
])
def test_cli_replay_bad_input_exits_2_in_one_line(recorded_study: Path, capsys: pytest.CaptureFixture[str],
                                                  args: list[str], cause: str) -> None:
    assert cli.main(["replay", str(recorded_study), *args], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert cause in err and err.count("\n") == 1


def test_cli_replay_unknown_study_or_no_curves(recorded_study: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    journal = tmp_path / "journal.log"
    spec = tmp_path / "other.toml"
    spec.write_text(recorded_study.read_text().replace(str(recorded_study.parent / "journal.log"), str(journal)))
    assert cli.main(["replay", str(spec)], out=io.StringIO()) == 2
    assert "no study 'other'" in capsys.readouterr().err
    study = optuna.create_study(study_name="other", storage=st.open_storage(f"journal:{journal}"))
    study.enqueue_trial({"x": 1.0})
    t = study.ask()
    t.suggest_float("x", 0.0, 2.0)
    study.tell(t, 1.0)  # complete, but without a curve
    assert cli.main(["replay", str(spec)], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "no complete trial with a recorded learning curve" in err and err.count("\n") == 1
    assert cli.main(["replay", str(tmp_path / "missing.toml")], out=io.StringIO()) == 2


# -- objectives -------------------------------------------------------------------------------------

COMPOSITE_TOML = ('[objective]\ntype = "composite"\n[objective.terms.val_bpb]\nweight = 0.5\nbest = 1.0\n'
                  'worst = 2.0\n[objective.terms.core]\nweight = 0.5\nbest = 0.3\nworst = 0.0\n'
                  '[fixed]\ncore_bundle = "demo"\n')


@pytest.fixture(scope="module")
def composite_study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished composite study (0.5 val_bpb in [2, 1] + 0.5 core in [0, 0.3]) recorded as the worker records
    one: intermediate reports and the final one are the normalised val_bpb term, the value is the score. Core
    runs against val_bpb, so the best score is not the best val_bpb."""
    from sweep.spec import objective as obj

    spec, journal = _demo_spec(tmp_path_factory.mktemp("replay_composite"), "comp", 'direction = "maximize"\n',
                               COMPOSITE_TOML)
    objective = load(spec).objective
    term = objective.terms[0]
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(study_name="comp", storage=st.open_storage(f"journal:{journal}"),
                                direction="maximize")
    for i, (lr, wd, b) in enumerate(RECORDINGS):
        _, values, final = synthetic(lr, wd, b=b, noise=0.002, seed=i)
        record = {"val_bpb": final, "core": 0.25 - 0.02 * i, "train_seconds": float(BUDGET),
                  "startup_seconds": STARTUP_S, "config": {"matrix_lr": lr, "warmdown_ratio": wd}}
        study.enqueue_trial({"matrix_lr": lr, "warmdown_ratio": wd})
        t = study.ask()
        t.suggest_float("matrix_lr", 0.005, 0.1, log=True)
        t.suggest_float("warmdown_ratio", 0.2, 0.8)
        for step, v in values.items():
            t.report(term.normalise(v), step)
        t.report(term.normalise(final), BUDGET)
        t.set_user_attr(obj.ATTR_CURVE, [[s, v] for s, v in sorted({**values, BUDGET: final}.items())])
        for k, v in record.items():
            t.set_user_attr(k, v)
        study.tell(t, objective.values(record))
    return spec


def test_composite_replays_its_reported_term_in_the_study_direction(composite_study: Path) -> None:
    recs = _recorded(composite_study)
    assert len(recs) == len(RECORDINGS)
    best_score = max(recs, key=lambda r: r.value)
    best_bpb = max(recs, key=lambda r: r.final_report)  # the highest term: the lowest val_bpb
    assert best_score.number != best_bpb.number  # so ranking by val_bpb would pick another trial
    sampler = Component("random", {"seed": 3})
    none = replay(recs, sampler, _pruner(composite_study, "none"), BUDGET, direction="maximize")
    assert (none.true_best_number, none.best_number, none.best_val_bpb) == (best_score.number,) * 2 + (
        best_score.value,)
    bests = [s.best_val_bpb for s in none.trajectory]
    assert bests == sorted(bests)  # maximised: the best so far only grows
    median = replay(recs, sampler, _pruner(composite_study, "median", n_startup_trials=2), BUDGET,
                    direction="maximize")
    assert median.pruned > 0 and median.compute_s < none.compute_s
    # The median pruner stops the trials whose reported term (higher is better) lags: the pruned ones end
    # lower than the kept ones, on average.
    final = {r.number: r.final_report for r in recs}
    pruned = [final[s.number] for s in median.trajectory if s.state == "PRUNED"]
    kept = [final[s.number] for s in median.trajectory if s.state == "COMPLETE"]
    assert sum(pruned) / len(pruned) < sum(kept) / len(kept)


def test_cli_composite_replay_and_refusals(composite_study: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    assert cli.main(["replay", str(composite_study), "--pruner", "median", "--seed", "1", "--json"], out=out) == 0
    body = json.loads(out.getvalue())
    assert (body["metric"], body["direction"], body["recorded"]) == ("composite", "maximize", len(RECORDINGS))
    out = io.StringIO()
    assert cli.main(["replay", str(composite_study), "--pruner", "median"], out=out) == 0
    assert "best composite" in out.getvalue() and "(maximized)" in out.getvalue()
    assert cli.main(["replay", str(composite_study), "--pruner", "learning_curve"], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert "--pruner learning_curve: it models minimised val_bpb curves" in err and err.count("\n") == 1
    sections = tiny_spec(objective={"type": "pareto", "metrics": ["val_bpb", "core"]})
    sections["fixed"] = {**sections["fixed"], "core_bundle": "demo"}
    pareto = write_spec(tmp_path, "par", sections)
    assert cli.main(["replay", str(pareto)], out=io.StringIO()) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "study 'par' is pareto (minimize val_bpb, maximize core): Optuna cannot prune " \
                                    "a multi-objective study, so its sweep made no pruning decisions to replay" in err
