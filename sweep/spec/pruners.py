"""A learning-curve pruner that knows the trainer's learning-rate schedule.

Every trial's schedule is keyed to progress = charged seconds / budget, with a warmdown that ends at
the budget. Mid-run val_bpb is then a biased yardstick: a trial with a high learning rate sits on a
higher plateau until its learning rate anneals, and a median or Hyperband pruner stops it before it
gets there. This pruner instead predicts each trial's val_bpb at the full budget from a curve model
in which the schedule is explicit (after the learning-rate annealing scaling laws of Tissue et al.,
2024, simplified):

    L(p) = a + b * S(p) ** -c  -  k * lr * D(p)

where S(p) is the area under the learning-rate multiplier up to progress p, D(p) the drop of the
multiplier below its peak once warmup is over (the annealing done so far), and lr the trial's base
learning rate (annealing from a higher rate gains more). ``a`` and ``b`` are each trial's own; ``c``
and ``k`` are shared by the study and fitted on its completed trials (``b`` too, as their median,
for a trial with a single point). The prediction's uncertainty is measured, not assumed: the model
is fitted to the completed trials' prefixes (leaving each trial out of the shared fit) and its
errors at the same stage give the spread, shrunk towards ``prior_sigma`` while there are few.

A trial is pruned only when even its optimistic prediction (minus ``z`` times that spread) is worse
than the best trial's final val_bpb, or than another running trial's prediction by more than both
spreads together. This module must not import torch: the schedule, its area and its drop are the
trainer's own pure functions (``model.schedule``, torch-free), and its defaults the trainer's
(``model.config.OptimConfig``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import optuna
from optuna.pruners import BasePruner
from optuna.trial import FrozenTrial, TrialState

from model import schedule
from model.config import OptimConfig

# The trainer's defaults for what a schedule reads: its ratios and every base learning rate.
SCHEDULE_DEFAULTS: dict[str, float] = {f.name: getattr(OptimConfig, f.name) for f in fields(OptimConfig)
                                       if f.name in ("warmup_ratio", "warmdown_ratio", "final_lr_frac")
                                       or f.name.endswith("_lr")}
_EXPONENTS = (0.0, *(float(c) for c in np.geomspace(0.01, 4.0, 30)))  # 0: the logarithmic limit
_MAX_CALIBRATION_TRIALS = 200  # newest completed trials used for the shared fit (bounds the cost per report)


@dataclass(frozen=True)
class Schedule:
    """One trial's learning-rate schedule and the base rate that scales its annealing gain."""

    warmup_ratio: float = SCHEDULE_DEFAULTS["warmup_ratio"]
    warmdown_ratio: float = SCHEDULE_DEFAULTS["warmdown_ratio"]
    final_lr_frac: float = SCHEDULE_DEFAULTS["final_lr_frac"]
    lr: float = 1.0

    def multiplier(self, p: float) -> float:
        return schedule.lr_multiplier(p, self.warmup_ratio, self.warmdown_ratio, self.final_lr_frac)

    def area(self, p: float) -> float:
        """S(p): the integral of the multiplier over [0, p] (model.schedule.lr_area, exact)."""
        return schedule.lr_area(p, self.warmup_ratio, self.warmdown_ratio, self.final_lr_frac)

    def drop(self, p: float) -> float:
        """D(p): how far the multiplier has annealed below its peak of 1; 0 during warmup."""
        return schedule.lr_drop(p, self.warmup_ratio, self.warmdown_ratio, self.final_lr_frac)

    def features(self, p: float, c: float) -> tuple[float, float]:
        """The model's two regressors at progress p: S^-c (-ln S for c = 0) and the lr-scaled annealing
        (negated)."""
        s = max(self.area(p), 1e-9)
        return (s ** -c if c > 0 else -math.log(s)), -self.lr * self.drop(p)


@dataclass(frozen=True)
class Curve:
    """A trial's learning curve: (progress, val_bpb) points in increasing progress, and its schedule."""

    points: tuple[tuple[float, float], ...]
    schedule: Schedule

    def prefix(self, until: float) -> Curve:
        return Curve(tuple(pt for pt in self.points if pt[0] <= until + 1e-9), self.schedule)


@dataclass(frozen=True)
class Shared:
    """The study-level parameters: exponent c, annealing gain k per unit lr drop, typical b, and the
    fit's residual sum of squares."""

    c: float
    k: float
    b: float
    sse: float = 0.0


@dataclass(frozen=True)
class Prediction:
    """Predicted val_bpb at the full budget and the standard deviation of that prediction's error."""

    value: float
    sigma: float


def _sufficient(curve: Curve) -> np.ndarray:
    """Partial the trial's own (a, b) out of y and of the annealing regressor x2, for every exponent.

    Returns a (len(_EXPONENTS), 5) array: sums for the shared k's closed-form fit (|ry|², <rx2, ry>,
    |rx2|²) and the slopes of y and of x2 on S^-c, since the trial's own b given k is b_y - k * b_x2.
    """
    sched = curve.schedule
    area = np.array([max(sched.area(p), 1e-9) for p, _ in curve.points])
    x2 = np.array([-sched.lr * sched.drop(p) for p, _ in curve.points])
    y = np.array([v for _, v in curve.points])
    cs = np.array(_EXPONENTS)[:, None]
    x1 = np.where(cs > 0, area[None, :] ** -np.maximum(cs, 1e-12), -np.log(area)[None, :])
    xc = x1 - x1.mean(axis=1, keepdims=True)
    vx = (xc * xc).sum(axis=1)
    safe = np.where(vx > 1e-24, vx, 1.0)
    by = np.where(vx > 1e-24, xc @ (y - y.mean()) / safe, 0.0)
    bx = np.where(vx > 1e-24, xc @ (x2 - x2.mean()) / safe, 0.0)
    ry = (y - y.mean())[None, :] - by[:, None] * xc
    rx = (x2 - x2.mean())[None, :] - bx[:, None] * xc
    return np.stack([(ry * ry).sum(1), (rx * ry).sum(1), (rx * rx).sum(1), by, bx], axis=1)


def fit_shared(curves: Sequence[Curve]) -> list[Shared]:
    """Shared parameters fitted on full curves, once on all of them and once leaving each one out.

    Returns ``len(curves) + 1`` entries: index 0 uses every curve, index ``j + 1`` all but curve j
    (for calibrating on curve j honestly). Per trial a and b are free; c is chosen on a grid and k
    (>= 0: annealing never raises the loss) in closed form; the shared b is the median of the trials'.
    """
    n = len(curves)
    stats = np.stack([_sufficient(cv) for cv in curves], axis=1)  # (C, n, 5)
    totals = stats[:, :, :3].sum(axis=1)  # (C, 3)
    # Row 0: every curve; row j + 1: all but curve j.
    sums = np.concatenate([totals[None], totals[None] - stats[:, :, :3].transpose(1, 0, 2)])  # (n + 1, C, 3)
    yy, xy, xx = sums[..., 0], sums[..., 1], sums[..., 2]
    k = np.where(xx > 1e-12, np.maximum(0.0, xy / np.where(xx > 1e-12, xx, 1.0)), 0.0)
    sse = yy - 2 * k * xy + k * k * xx
    best_c = np.argmin(sse, axis=1)  # first minimum on ties: deterministic
    sloped = np.array([len(cv.points) >= 2 for cv in curves])
    out = []
    for row in range(n + 1):
        ci, kk = int(best_c[row]), float(k[row, best_c[row]])
        keep = sloped.copy()
        if row:
            keep[row - 1] = False
        bs = stats[ci, keep, 3] - kk * stats[ci, keep, 4]
        out.append(Shared(_EXPONENTS[ci], kk, float(np.median(bs)) if len(bs) else 0.0, float(sse[row, ci])))
    return out


def _fit_own(curve: Curve, shared: Shared) -> tuple[float, float]:
    """The trial's own (a, b) given the shared c and k; b is the shared one for a single point."""
    x = np.array([curve.schedule.features(p, shared.c) for p, _ in curve.points])
    y = np.array([v for _, v in curve.points]) - shared.k * x[:, 1]
    if len(y) == 1 or float(np.ptp(x[:, 0])) < 1e-12:
        b = shared.b
        return float(np.mean(y - b * x[:, 0])), b
    a, b = np.linalg.lstsq(np.column_stack([np.ones(len(y)), x[:, 0]]), y, rcond=None)[0]
    return float(a), float(b)


def predict_final(curve: Curve, shared: Shared) -> float:
    """val_bpb at progress 1 from the curve so far."""
    a, b = _fit_own(curve, shared)
    s, d = curve.schedule.features(1.0, shared.c)
    return a + b * s + shared.k * d


class LearningCurvePruner(BasePruner):
    """Prune a trial only when its predicted full-budget val_bpb is clearly worse than the best.

    Options: ``n_startup_trials`` completed trials before any pruning (the shared fit needs them),
    ``n_warmup_steps`` charged seconds before a trial can be pruned, ``z`` the margin in prediction
    standard deviations, ``prior_sigma`` (bpb) and ``prior_weight`` (pseudo-trials) for the
    uncertainty before the study has calibrated it, ``budget_s`` the charged seconds of the full
    budget (specs fill it in; else the largest step a completed trial reported), ``lr_param`` the
    parameter whose value scales the annealing gain ("" for none; "auto": whichever searched ``*_lr``
    parameter, or none, fits the completed trials' curves best).
    """

    def __init__(self, n_startup_trials: int = 4, n_warmup_steps: int = 0, z: float = 2.0,
                 prior_sigma: float = 0.05, prior_weight: float = 2.0, budget_s: float | None = None,
                 lr_param: str = "auto") -> None:
        for name, v, low in (("n_startup_trials", n_startup_trials, 1), ("n_warmup_steps", n_warmup_steps, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        for name, v in (("z", z), ("prior_sigma", prior_sigma), ("prior_weight", prior_weight)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if prior_sigma <= 0 and prior_weight > 0:
            raise ValueError(f"prior_sigma must be > 0 when prior_weight > 0, got {prior_sigma!r}")
        if budget_s is not None and (not isinstance(budget_s, (int, float)) or isinstance(budget_s, bool)
                                     or not math.isfinite(budget_s) or budget_s <= 0):
            raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
        if not isinstance(lr_param, str):
            raise ValueError(f"lr_param must be a parameter name or \"\", got {lr_param!r}")
        self.n_startup_trials, self.n_warmup_steps = n_startup_trials, n_warmup_steps
        self.z, self.prior_sigma, self.prior_weight = float(z), float(prior_sigma), float(prior_weight)
        self.budget_s, self.lr_param = budget_s, lr_param
        self._cache_key: tuple[Any, ...] | None = None
        self._calibration: _Calibration | None = None

    # -- optuna's interface ---------------------------------------------------------------------

    def prune(self, study: optuna.study.Study, trial: FrozenTrial) -> bool:
        if study.direction != optuna.study.StudyDirection.MINIMIZE:
            raise ValueError("the learning_curve pruner handles minimised objectives (val_bpb) only")
        step = trial.last_step
        if step is None or step < self.n_warmup_steps:
            return False
        trials = study.get_trials(deepcopy=False)
        cal = self._calibrate(trials)
        if cal is None or len(cal.curves) < self.n_startup_trials:
            return False
        mine = self._prediction(trial, cal)
        if mine is None:
            return False
        best = min(t.value for t in trials if t.state == TrialState.COMPLETE and t.value is not None)
        if mine.value - self.z * mine.sigma > best:
            return True
        for other in trials:
            if other.state != TrialState.RUNNING or other.number == trial.number or other.last_step is None:
                continue
            theirs = self._prediction(other, cal)
            if theirs is not None and mine.value - theirs.value > self.z * math.hypot(mine.sigma, theirs.sigma):
                return True
        return False

    # -- predictions ----------------------------------------------------------------------------

    def predict(self, study: optuna.study.Study, trial: FrozenTrial) -> Prediction | None:
        """The trial's predicted final val_bpb with its calibrated spread; None before the study can tell."""
        trials = study.get_trials(deepcopy=False)
        cal = self._calibrate(trials)
        return None if cal is None else self._prediction(trial, cal)

    def _prediction(self, trial: FrozenTrial, cal: _Calibration) -> Prediction | None:
        curve = self._curve(trial, cal.budget_s, cal.fallback, cal.lr_param, final=False)
        if curve is None or not curve.points or curve.points[-1][0] >= 1.0:
            return None
        return Prediction(predict_final(curve, cal.shared), cal.sigma(curve.points[-1][0]))

    def _calibrate(self, trials: Sequence[FrozenTrial]) -> _Calibration | None:
        done = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None
                and math.isfinite(t.value)][-_MAX_CALIBRATION_TRIALS:]
        budget = self.budget_s or max((t.last_step or 0 for t in done), default=0)
        if not done or budget <= 0:
            return None
        key = (budget, tuple(t.number for t in done))
        if key != self._cache_key:
            searched = {k for t in done for k in t.params}
            candidates = (("", *sorted(k for k in searched if k.endswith("_lr"))) if self.lr_param == "auto"
                          else (self.lr_param,))
            best: _Calibration | None = None
            for lr_param in candidates:
                fallback = self._fallback(done, lr_param, searched)
                curves = [cv for t in done if (cv := self._curve(t, budget, fallback, lr_param, final=True))
                          and len(cv.points) >= 2]
                if not curves:
                    return None
                cal = _Calibration(curves, fit_shared(curves), float(budget), fallback, lr_param, self.prior_sigma,
                                   self.prior_weight)
                if best is None or cal.shared.sse < best.shared.sse * (1 - 1e-9):
                    best = cal
            self._calibration, self._cache_key = best, key
        return self._calibration

    @staticmethod
    def _keys(lr_param: str) -> tuple[str, ...]:
        return ("warmup_ratio", "warmdown_ratio", "final_lr_frac", *((lr_param,) if lr_param else ()))

    def _fallback(self, done: Sequence[FrozenTrial], lr_param: str, searched: set[str]) -> dict[str, float]:
        """Schedule values no trial searches but the spec fixed: every completed trial's config has them."""
        for t in done:
            if isinstance(t.user_attrs.get("config"), Mapping):
                fixed = [k for k in self._keys(lr_param) if k not in searched]
                return schedule_values({}, t.user_attrs["config"], fixed)
        return {}

    def _curve(self, trial: FrozenTrial, budget: float, fallback: Mapping[str, float], lr_param: str,
               final: bool) -> Curve | None:
        """The trial's points on the progress axis; a completed trial's final value sits at progress 1."""
        pts = {min(step / budget, 1.0): v for step, v in trial.intermediate_values.items()
               if math.isfinite(v) and step > 0}
        if final:  # the final value is reported at round(budget), which may sit just off progress 1
            pts = {p: v for p, v in pts.items() if p * budget < round(budget)}
            pts[1.0] = float(trial.value)  # type: ignore[arg-type]
        if not pts:
            return None
        return Curve(tuple(sorted(pts.items())), self._schedule(trial, fallback, lr_param))

    def _schedule(self, trial: FrozenTrial, fallback: Mapping[str, float], lr_param: str) -> Schedule:
        """Schedule values from the trial's parameters, else its recorded config, else the spec's fixed
        values (``fallback``), else the trainer's defaults."""
        own = schedule_values(trial.params, trial.user_attrs.get("config"), self._keys(lr_param))
        full = {**SCHEDULE_DEFAULTS, **fallback, **own}
        lr = float(full.get(lr_param, 1.0)) if lr_param else 1.0
        return Schedule(float(full["warmup_ratio"]), float(full["warmdown_ratio"]), float(full["final_lr_frac"]), lr)


def schedule_values(params: Mapping[str, Any], config: Any, keys: Sequence[str]) -> dict[str, float]:
    """The numeric values of ``keys`` found in ``params``, else in a recorded ``config``."""
    out: dict[str, float] = {}
    for source in (config if isinstance(config, Mapping) else {}, params):
        for k in keys:
            v = source.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                out[k] = float(v)
    return out


class _Calibration:
    """The shared fit over completed trials and the empirical error of predictions from prefixes."""

    def __init__(self, curves: list[Curve], fits: list[Shared], budget_s: float, fallback: dict[str, float],
                 lr_param: str, prior_sigma: float, prior_weight: float) -> None:
        self.curves, self.shared, self.budget_s, self.fallback = curves, fits[0], budget_s, fallback
        self.lr_param = lr_param
        self._loo = fits[1:]
        self._prior = (prior_sigma, prior_weight)
        self._sigmas: dict[float, float] = {}

    def sigma(self, progress: float) -> float:
        """RMS error of final-value predictions from prefixes up to ``progress``, shrunk to the prior."""
        key = round(progress, 6)
        if key not in self._sigmas:
            errors = []
            for cv, shared in zip(self.curves, self._loo, strict=True):
                pre = Curve(tuple(pt for pt in cv.points[:-1] if pt[0] <= progress + 1e-9), cv.schedule)
                if pre.points:
                    errors.append(predict_final(pre, shared) - cv.points[-1][1])
            s0, w0 = self._prior
            sq = sum(e * e for e in errors)
            self._sigmas[key] = math.sqrt((w0 * s0 * s0 + sq) / (w0 + len(errors))) if w0 + len(errors) else 0.0
        return self._sigmas[key]
