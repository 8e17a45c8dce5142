"""The learning-curve pruner: its schedule integrals (the trainer's schedule) are exact, its fit recovers a
known curve family with an interval that covers the truth, and it keeps a high-lr trial that a median pruner stops."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from model.schedule import lr_area, lr_drop, lr_multiplier
from sweep.spec import SpecError, load
from sweep.spec.pruners import SCHEDULE_DEFAULTS, Curve, LearningCurvePruner, Schedule, fit_shared, predict_final
from tests.curves import BUDGET, STEPS, TRUE_C, TRUE_K, synthetic


def _study(pruner: optuna.pruners.BasePruner) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    return optuna.create_study(pruner=pruner, sampler=optuna.samplers.RandomSampler(seed=0))


def _start(study: optuna.Study, lr: float, warmdown: float) -> optuna.Trial:
    study.enqueue_trial({"matrix_lr": lr, "warmdown_ratio": warmdown})
    t = study.ask()
    t.suggest_float("matrix_lr", 1e-3, 1.0, log=True)
    t.suggest_float("warmdown_ratio", 0.0, 1.0)
    return t


def _run_until_pruned(study: optuna.Study, lr: float, warmdown: float, **kw: float) -> int | None:
    """Feed a synthetic curve through the study's pruner; the step it was pruned at, or None."""
    _, values, final = synthetic(lr, warmdown, **kw)
    t = _start(study, lr, warmdown)
    for step, v in values.items():
        t.report(v, step)
        if t.should_prune():
            study.tell(t, state=optuna.trial.TrialState.PRUNED)
            return step
    study.tell(t, final)
    return None


def _screened(pruner: optuna.pruners.BasePruner) -> optuna.Study:
    """Three completed trials at ordinary learning rates, run through the same pruner."""
    study = _study(pruner)
    for i, lr in enumerate((0.01, 0.02, 0.04)):
        assert _run_until_pruned(study, lr, 0.5, noise=0.002, seed=i) is None
    return study


# Valid schedules (warmup + warmdown <= 1) with each piece present or absent: warmup, flat, warmdown (to a floor,
# or over the whole run).
SCHEDULES = ((0.0, 0.5, 0.0), (0.1, 0.3, 0.05), (0.0, 0.0, 0.0), (0.6, 0.4, 0.1), (0.0, 1.0, 0.0), (0.2, 0.8, 0.0),
             (0.3, 0.0, 0.2))


def test_schedule_integrals_are_exact() -> None:
    """The pruner's S(p) and D(p) (model.schedule's, the trainer's own schedule) against a fine numerical
    integration of lr_multiplier and against the multiplier itself."""
    n = 2000  # the midpoint rule errs only in the cells holding a kink: O(1 / n**2)
    for wu, wd, fl in SCHEDULES:
        for p in (0.0, 0.05, 0.1, 0.3, 0.5, 0.65, 0.95, 1.0, 1.3):
            top = min(p, 1.0)
            riemann = sum(lr_multiplier((i + 0.5) * top / n, wu, wd, fl) for i in range(n)) * top / n
            assert lr_area(p, wu, wd, fl) == pytest.approx(riemann, abs=1e-6), (p, wu, wd, fl)
            assert Schedule(wu, wd, fl).area(p) == lr_area(p, wu, wd, fl)
            expected_drop = 0.0 if p < wu else 1.0 - lr_multiplier(p, wu, wd, fl)
            assert lr_drop(p, wu, wd, fl) == pytest.approx(max(expected_drop, 0.0), abs=1e-12)
            assert Schedule(wu, wd, fl).drop(p) == lr_drop(p, wu, wd, fl)
        assert lr_drop(1.0, wu, wd, fl) == pytest.approx(1.0 - (fl if wd > 0 else 1.0))  # all the annealing done
    # Areas add up piece by piece: the flat part has area = its length, a linear warmdown the mean of its ends.
    assert lr_area(1.0, 0.0, 0.5, 0.0) == pytest.approx(0.5 + 0.25)
    assert lr_area(1.0, 0.2, 0.5, 0.1) == pytest.approx(0.1 + 0.3 + 0.5 * 0.55, abs=1e-8)


def test_the_pruner_reads_unrecorded_schedule_values_as_the_trainers_defaults() -> None:
    # The documented defaults (docs/competition.md, "Baseline model and optimiser", and docs/recipe.md: the
    # trainer carries autoresearch's): warmup 0, warmdown 0.5 of the budget, final lr fraction 0; matrix lr
    # 0.04, embedding 0.6, unembedding 0.004, scalars 0.5.
    documented = {"warmup_ratio": 0.0, "warmdown_ratio": 0.5, "final_lr_frac": 0.0, "matrix_lr": 0.04,
                  "embedding_lr": 0.6, "unembedding_lr": 0.004, "scalar_lr": 0.5}
    assert documented == SCHEDULE_DEFAULTS
    assert Schedule() == Schedule(0.0, 0.5, 0.0, 1.0)
    # A trial that recorded none of them (no parameter, no config), in a spec that fixes none: read at the defaults.
    bare = optuna.trial.create_trial(value=1.0)
    assert LearningCurvePruner()._schedule(bare, {}, "matrix_lr") == Schedule(0.0, 0.5, 0.0, 0.04)


def test_fit_recovers_the_family_and_its_interval_covers_the_truth() -> None:
    curves, finals = [], []
    for i, (lr, wd) in enumerate([(0.01, 0.5), (0.02, 0.3), (0.04, 0.6), (0.06, 0.4), (0.03, 0.8), (0.08, 0.5)]):
        sched, values, final = synthetic(lr, wd, noise=0.002, seed=i)
        curves.append(Curve(tuple((s / BUDGET, v) for s, v in values.items()) + ((1.0, final),), sched))
        finals.append(final)
    shared = fit_shared(curves)[0]
    assert shared.c == pytest.approx(TRUE_C, rel=0.25)
    assert shared.k == pytest.approx(TRUE_K, rel=0.1)

    study = _study(LearningCurvePruner(n_startup_trials=3, budget_s=BUDGET))
    for i, (lr, wd) in enumerate([(0.01, 0.5), (0.02, 0.3), (0.04, 0.6), (0.06, 0.4)]):
        _run_until_pruned(study, lr, wd, noise=0.002, seed=i)
    pruner = study.pruner
    assert isinstance(pruner, LearningCurvePruner)
    # A new trial, seen only up to half its budget (before most of its warmdown), predicted at the end.
    _, values, truth = synthetic(0.05, 0.7, noise=0.0)
    t = _start(study, 0.05, 0.7)
    for step in STEPS[:5]:
        t.report(values[step], step)
    frozen = study.get_trials(deepcopy=False)[-1]
    pred = pruner.predict(study, frozen)
    assert pred is not None
    assert 0 < pred.sigma < 0.05  # calibrated below the prior by the completed trials
    assert abs(pred.value - truth) <= 2 * pred.sigma
    # A naive reading of the last point would be far off: the annealing term carries the prediction.
    assert values[STEPS[4]] - truth > 4 * pred.sigma


def test_keeps_a_high_lr_trial_that_anneals_to_the_best_where_median_prunes_it() -> None:
    median = _screened(optuna.pruners.MedianPruner(n_startup_trials=2))
    median_best = median.best_value
    assert _run_until_pruned(median, 0.1, 0.5, noise=0.002, seed=9) is not None

    lc = _screened(LearningCurvePruner(n_startup_trials=3, budget_s=BUDGET))
    assert _run_until_pruned(lc, 0.1, 0.5, noise=0.002, seed=9) is None
    assert lc.best_trial.params["matrix_lr"] == 0.1  # it was the best trial after all
    assert lc.best_value < median_best


def test_prunes_a_clearly_bad_trial() -> None:
    lc = _screened(LearningCurvePruner(n_startup_trials=3, budget_s=BUDGET))
    step = _run_until_pruned(lc, 0.02, 0.5, b=1.2, noise=0.002, seed=7)
    assert step is not None and step <= 30


def test_waits_for_startup_trials_and_warmup_steps() -> None:
    lc = _screened(LearningCurvePruner(n_startup_trials=4, budget_s=BUDGET))
    assert _run_until_pruned(lc, 0.02, 0.5, b=1.2, seed=7) is None
    lc = _screened(LearningCurvePruner(n_startup_trials=3, n_warmup_steps=60, budget_s=BUDGET))
    assert _run_until_pruned(lc, 0.02, 0.5, b=1.2, seed=7) == 60


def _spec(tmp_path: Path, pruner: str) -> Path:
    root = Path(__file__).resolve().parents[3]
    path = tmp_path / "lc.toml"
    path.write_text(f'extends = "{root / "sweep" / "studies" / "demo.toml"}"\n[pruner]\n{pruner}\n')
    return path


def test_spec_names_the_pruner_and_fills_the_budget(tmp_path: Path) -> None:
    spec = load(_spec(tmp_path, 'name = "learning_curve"\nz = 3\nn_warmup_steps = 5'))
    assert spec.pruner.name == "learning_curve"
    assert spec.pruner.options == {"z": 3, "n_warmup_steps": 5, "budget_s": spec.budget_s}


@pytest.mark.parametrize("body, key", [
    ('name = "learning_curve"\nz = -1', "z must be"),
    ('name = "learning_curve"\nn_startup_trials = 0', "n_startup_trials must be"),
    ('name = "learning_curve"\nprior_sigma = "wide"', "prior_sigma must be"),
    ('name = "learning_curve"\nwarmup = 3', "pruner.warmup: unknown option"),
])
def test_spec_refuses_bad_options_in_one_line(tmp_path: Path, body: str, key: str) -> None:
    with pytest.raises(SpecError) as e:
        load(_spec(tmp_path, body))
    assert key in str(e.value) and "\n" not in str(e.value)


def test_schedule_fixed_by_the_spec_comes_from_completed_trials_configs() -> None:
    """warmdown_ratio is not searched here: the trials' params lack it, their recorded configs hold it."""
    study = _study(LearningCurvePruner(n_startup_trials=3, budget_s=BUDGET))
    for i, lr in enumerate((0.01, 0.02, 0.04, 0.06)):
        _, values, final = synthetic(lr, 0.8, noise=0.002, seed=i)
        study.enqueue_trial({"matrix_lr": lr})
        t = study.ask()
        t.suggest_float("matrix_lr", 1e-3, 1.0, log=True)
        for step, v in values.items():
            t.report(v, step)
        t.set_user_attr("config", {"matrix_lr": lr, "warmdown_ratio": 0.8, "final_lr_frac": 0.0})
        study.tell(t, final)
    _, values, truth = synthetic(0.05, 0.8)
    study.enqueue_trial({"matrix_lr": 0.05})
    t = study.ask()
    t.suggest_float("matrix_lr", 1e-3, 1.0, log=True)
    for step in STEPS[:4]:
        t.report(values[step], step)
    pruner = study.pruner
    assert isinstance(pruner, LearningCurvePruner)
    pred = pruner.predict(study, study.get_trials(deepcopy=False)[-1])
    assert pred is not None and abs(pred.value - truth) <= 2 * pred.sigma
    # Read with the trainer's default warmdown (0.5) instead, the same prefix predicts far off.
    shared = fit_shared([Curve(tuple((s / BUDGET, v) for s, v in synthetic(lr, 0.8, seed=i)[1].items())
                               + ((1.0, synthetic(lr, 0.8, seed=i)[2]),), Schedule(0.0, 0.8, 0.0, lr))
                         for i, lr in enumerate((0.01, 0.02, 0.04, 0.06))])[0]
    wrong = Curve(tuple((s / BUDGET, values[s]) for s in STEPS[:4]), Schedule(0.0, 0.5, 0.0, 0.05))
    miss = abs(predict_final(wrong, shared) - truth)
    assert miss > 2 * pred.sigma and miss > 10 * abs(pred.value - truth)
