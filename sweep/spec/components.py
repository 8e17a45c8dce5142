"""A spec's sampler and pruner: reading their tables, checking their options, building them.

Optuna, and :mod:`sweep.spec.pruners` (which imports it at its top), are imported inside the functions
that need them, so that loading a spec, and with it the CLI's start-up, does not pay for them.
"""

from __future__ import annotations

import importlib.util
import inspect
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sweep.spec.files import SpecReader

SAMPLERS = ("tpe", "gp", "cmaes", "random")
PRUNERS = ("hyperband", "successive_halving", "median", "percentile", "learning_curve", "none")
# Optional packages some samplers need; checked without importing them.
_SAMPLER_NEEDS = {"gp": ("scipy", "torch"), "cmaes": ("cmaes",)}


@dataclass(frozen=True)
class Component:
    """A sampler or pruner: its name and the keyword options for its constructor."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)


def _options(r: SpecReader, key: str, table: Mapping[str, Any], cls: type, fixed: set[str]) -> dict[str, Any]:
    """Keyword options for ``cls``, each checked against its constructor's signature."""
    params = inspect.signature(cls).parameters
    opts = {}
    for k, v in table.items():
        if k == "name":
            continue
        if k not in params or k in fixed:
            allowed = sorted(p for p in params if p not in fixed and p != "self")
            raise r.error(f"{key}.{k}", f"unknown option for {table['name']} (allowed: {', '.join(allowed)})")
        opts[k] = v
    return opts


def read_sampler(r: SpecReader, raw: Any, seed: int | None) -> Component:
    """The ``[sampler]`` table as a checked Component (TPE's constant liar on; ``seed`` unless set)."""
    import optuna

    t = r.table(raw, "sampler", None)
    name = r.choice(t, "sampler.name", SAMPLERS, default="tpe")
    missing = [m for m in _SAMPLER_NEEDS.get(name, ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise r.error("sampler.name", f"{name!r} needs the package(s) {', '.join(missing)}, not installed")
    cls = {"tpe": optuna.samplers.TPESampler, "gp": optuna.samplers.GPSampler,
           "cmaes": optuna.samplers.CmaEsSampler, "random": optuna.samplers.RandomSampler}[name]
    opts = _options(r, "sampler", {**t, "name": name}, cls, set())
    if name == "tpe":
        # Several trials run at once: the constant liar keeps TPE from proposing the same point twice.
        opts.setdefault("constant_liar", True)
    if seed is not None:
        opts.setdefault("seed", seed)
    try:
        build_sampler(Component(name, opts))
    except (TypeError, ValueError) as e:
        raise r.error("sampler", f"{name}: {e}") from None
    return Component(name, opts)


def read_pruner(r: SpecReader, raw: Any, fractions: tuple[float, ...], budget_s: float) -> Component:
    """The ``[pruner]`` table as a checked Component, its resource defaults taken from the eval points."""
    t = r.table(raw, "pruner", None)
    name = r.choice(t, "pruner.name", PRUNERS, default="none")
    opts = _options(r, "pruner", {**t, "name": name}, _pruner_classes()[name], set())
    first = max(1, round(fractions[0] * budget_s)) if fractions else 1
    if name == "hyperband":
        opts.setdefault("min_resource", first)
        opts.setdefault("max_resource", max(first, round(budget_s)))
    elif name == "successive_halving":
        opts.setdefault("min_resource", first)
    elif name == "median":
        opts.setdefault("n_startup_trials", 2)
    elif name == "learning_curve":
        opts.setdefault("budget_s", budget_s)
    if name != "none" and not fractions:
        raise r.error("pruner.name", f"{name!r} needs intermediate evals: trial.eval_fractions is empty")
    try:
        build_pruner(Component(name, opts))
    except (TypeError, ValueError) as e:
        raise r.error("pruner", f"{name}: {e}") from None
    return Component(name, opts)


def exercise_components(r: SpecReader, sampler: Component, pruner: Component, steps: list[int]) -> None:
    """Run a few in-memory trials through the sampler and the pruner.

    Constructors accept options of the wrong type (``n_startup_trials = None``, a string for a
    number) that only fail at the first ask or pruning call, which on a cluster is after the chips
    are reserved; here they fail at load time instead, naming the table.
    """
    import optuna

    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        for key, s, p in (("sampler", sampler, Component("none")), ("pruner", Component("random"), pruner)):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    study = optuna.create_study(sampler=build_sampler(s), pruner=build_pruner(p))
                    for i in range(3):
                        trial = study.ask()
                        trial.suggest_float("x", 0.0, 1.0)
                        trial.suggest_int("n", 1, 4)
                        trial.suggest_categorical("c", ["a", "b"])
                        for step in steps:
                            trial.report(float(i), step)
                            trial.should_prune()
                        study.tell(trial, float(i))
            except Exception as e:
                raise r.error(key, f"{s.name if key == 'sampler' else p.name}: unusable options: "
                                   f"{type(e).__name__}: {_first_line(e)}") from None
    finally:
        optuna.logging.set_verbosity(level)


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def build_sampler(c: Component) -> Any:
    """Construct the Optuna sampler a spec names (imports lazily: the worker never needs one)."""
    import optuna

    cls = {"tpe": optuna.samplers.TPESampler, "gp": optuna.samplers.GPSampler,
           "cmaes": optuna.samplers.CmaEsSampler, "random": optuna.samplers.RandomSampler}[c.name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return cls(**c.options)


def _pruner_classes() -> dict[str, type]:
    """Pruner name -> class (imports lazily, like the samplers)."""
    import optuna

    from sweep.spec.pruners import LearningCurvePruner

    return {"hyperband": optuna.pruners.HyperbandPruner, "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
            "median": optuna.pruners.MedianPruner, "percentile": optuna.pruners.PercentilePruner,
            "learning_curve": LearningCurvePruner, "none": optuna.pruners.NopPruner}


def build_pruner(c: Component) -> Any:
    """Construct the Optuna pruner a spec names."""
    return _pruner_classes()[c.name](**c.options)
