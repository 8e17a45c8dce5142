"""What a study optimises: the value (or values) told to Optuna for a trial, taken from its result record.

Three kinds, chosen in the spec's ``[objective]`` table (``sweep/studies/demo-phase2.toml`` annotates it):

- ``single`` (the default): value = ``val_bpb`` in ``study.direction``; intermediate val_bpb is reported
  for pruning as it always was.
- ``pareto``: one Optuna objective per metric (``metrics = ["val_bpb", "core"]``), each in its known
  direction (:data:`DIRECTIONS`). Optuna cannot prune multi-objective trials, so nothing is reported
  to it while a trial runs; the val_bpb learning curve is kept in the user attribute :data:`ATTR_CURVE`.
- ``composite``: one value to maximise, ``sum(weight x (x - worst) / (best - worst))`` over the terms,
  so each metric scores 1 at ``best`` and 0 at ``worst`` (not clipped: a trial past ``best`` scores
  above 1 and still ranks first). The competition's phase-2 score, 50% val_bpb + 50% CORE each min-max
  normalised across teams, is this with weights 0.5 and the bounds guessed from the field. While a
  trial runs, its normalised val_bpb term is reported, so the pruner compares trials in the study's
  direction (maximise) on the part of the score that exists before the end.

The module is plain Python: the spec validates with it, the worker computes values with it, the driver
and the command line name and print them with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("single", "pareto", "composite")
# Record fields an objective may use, with the direction that makes each better.
DIRECTIONS: dict[str, str] = {
    "val_bpb": "minimize",
    "val_loss": "minimize",
    "core": "maximize",
    "params": "minimize",  # the competition breaks ties towards fewer parameters
    "tokens_per_second": "maximize",
}
NEEDS_CORE = frozenset({"core"})  # fields only a trainer running CORE (config key core_bundle) emits
COMPOSITE_NAME = "composite"  # the composite value's name in Optuna and the dashboard
ATTR_CURVE = "val_bpb_curve"  # [[charged second, val_bpb], ...] of a trial whose reports are not val_bpb
# What a trial's intermediate values are, where not val_bpb: a script's own figure (sweep.run.supervisor.curve_metric).
ATTR_CURVE_METRIC = "curve_metric"


class MissingMetric(ValueError):
    """A finished trial's record lacks a metric the objective needs; the message is one line naming it."""

    def __init__(self, metric: str, message: str) -> None:
        super().__init__(message)
        self.metric = metric


@dataclass(frozen=True)
class Term:
    """One composite term: ``weight x`` the metric normalised to 1 at ``best`` and 0 at ``worst``."""

    metric: str
    weight: float
    best: float
    worst: float

    def normalise(self, x: float) -> float:
        return (x - self.worst) / (self.best - self.worst)


@dataclass(frozen=True)
class Objective:
    """A validated objective (see the module docstring); plain values, so Ray ships it with a task."""

    kind: str = "single"
    metrics: tuple[str, ...] = ("val_bpb",)  # the record fields read
    directions: tuple[str, ...] = ("minimize",)  # one per Optuna objective
    terms: tuple[Term, ...] = ()  # composite only

    @property
    def multi(self) -> bool:
        return len(self.directions) > 1

    @property
    def names(self) -> list[str]:
        """Optuna's metric names for the study (shown by the dashboard)."""
        return [COMPOSITE_NAME] if self.kind == "composite" else list(self.metrics)

    @property
    def reports(self) -> bool:
        """Whether intermediate values go to Optuna (and so to the pruner)."""
        return self.kind == "single" or any(t.metric == "val_bpb" for t in self.terms)

    def values(self, record: Mapping[str, Any]) -> list[float]:
        """The values to tell Optuna for a finished record; raises MissingMetric."""
        got = {m: _metric(record, m, self.kind) for m in self.metrics}
        if self.kind == "composite":
            return [sum(t.weight * t.normalise(got[t.metric]) for t in self.terms)]
        return [got[m] for m in self.metrics]

    def intermediate(self, val_bpb: float) -> float | None:
        """What an intermediate (or the final) val_bpb is reported to Optuna as; None: nothing."""
        if self.kind == "single":
            return val_bpb
        term = next((t for t in self.terms if t.metric == "val_bpb"), None)
        return term.normalise(val_bpb) if term is not None else None

    def describe(self) -> str:
        """One line for people: what is optimised, in which direction."""
        if self.kind == "composite":
            parts = [f"{t.weight:g} x {t.metric}[{t.worst:g}->{t.best:g}]" for t in self.terms]
            return "maximize " + " + ".join(parts)
        return ", ".join(f"{d} {m}" for m, d in zip(self.metrics, self.directions, strict=True))


def _metric(record: Mapping[str, Any], name: str, kind: str) -> float:
    v = record.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        what = "missing" if name not in record else f"{v!r}, not a finite number"
        raise MissingMetric(name, f"status ok but the result record's {name} is {what} "
                                  f"(the {kind} objective needs it)")
    return float(v)


def dominates(a: Sequence[float], b: Sequence[float], directions: Sequence[str]) -> bool:
    """Whether ``a`` is at least as good as ``b`` in every objective and better in one."""
    better = False
    for x, y, d in zip(a, b, directions, strict=True):
        if d == "maximize":
            x, y = -x, -y
        if x > y:
            return False
        better = better or x < y
    return better


def front(trials: Sequence[Any], directions: Sequence[str]) -> list[Any]:
    """The complete trials no other complete trial dominates, in trial-number order (the Pareto front)."""
    done = [t for t in trials if t.state.name == "COMPLETE" and t.values is not None
            and all(math.isfinite(v) for v in t.values)]
    return [t for t in done if not any(dominates(o.values, t.values, directions) for o in done if o is not t)]


def curve_metric(t: Any) -> str:
    """What trial ``t``'s learning curve is in: val_bpb, or the script's own figure its attributes name."""
    return str(t.user_attrs.get(ATTR_CURVE_METRIC) or "val_bpb")


def curve_attr(metric: str) -> str:
    """The user attribute a learning curve of ``metric`` is kept in (where the reports are not that curve)."""
    return ATTR_CURVE if metric == "val_bpb" else f"{metric}_curve"


def curve_points(t: Any, objective: Objective) -> list[tuple[int, float]]:
    """A trial's (charged second, value) points so far, in :func:`curve_metric`'s unit: its reports, or its kept
    curve where reports are not that curve (pareto: none; composite: the normalised term)."""
    if objective.kind == "single":
        return sorted(t.intermediate_values.items())
    return [(int(step), float(v)) for step, v in t.user_attrs.get(curve_attr(curve_metric(t))) or []]


def fmt_values(objective: Objective, values: list[float] | None, record: dict[str, Any]) -> str:
    """``val_bpb=0.9876`` / ``val_bpb=0.9876 core=0.1234`` / ``composite=0.6120 (val_bpb=0.9876 core=0.1234)``."""
    if objective.kind == "composite":
        parts = " ".join(f"{m}={_num4(record.get(m))}" for m in objective.metrics)
        return f"{COMPOSITE_NAME}={_num4(values[0] if values else None)} ({parts})"
    return " ".join(f"{m}={_num4(v)}" for m, v in zip(objective.metrics, values or [], strict=False))


def _num4(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else "?"
