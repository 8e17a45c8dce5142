"""``python -m sweep replay NAME``: a sampler's and a pruner's decisions, replayed on recorded curves.

A finished study that trained its trials to the full budget holds each trial's learning curve (its
intermediate val_bpb at the eval points) and final val_bpb. Replay runs a sampler and a pruner over
those recordings at no compute, so a team can compare strategies before renting chips:

- the sampler can only choose among recorded configurations: each of its proposals is mapped to the
  nearest not yet used recorded trial in the normalised search space (log scale where the parameter
  is, categoricals 0 or 1 apart), and that trial is what runs; the proposal itself is kept in the
  replay study as a failed trial, which samplers ignore;
- trials run one at a time; each recorded curve is reported to an in-memory study's pruner at its
  recorded steps, and the trial stops where the pruner says so;
- compute spent is the charged seconds up to that point plus the trial's start-up (as recorded, or
  ``--startup-s``).

It reports the best value reached against compute spent (the trajectory and the totals), and
whether the study's true best trial was pruned. What it cannot show: configurations nobody recorded,
and seed noise beyond the one recorded run of each.

The replay follows the study's objective (:mod:`sweep.spec.objective`): a single study replays val_bpb,
minimised; a composite study replays what its trials reported (the normalised val_bpb term) and
ranks by its score, both maximised, as the sweep did. A pareto study is refused: Optuna cannot
prune a multi-objective study, so its sweep made no pruning decisions to replay. The fields named
``*_val_bpb`` hold the study's value (a composite study's score); ``metric`` names it.
"""

from __future__ import annotations

import argparse
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TextIO

from sweep.run.outcome import ATTR_ADHOC_BUDGET
from sweep.spec import Component, SpecReader, StudySpec, build_pruner, build_sampler, read_pruner, read_sampler
from sweep.study import fail, load_study


class ReplayError(ValueError):
    """Bad input to replay (no such study, nothing recorded, a bad option); exit 2, one line."""


@dataclass(frozen=True)
class Recorded:
    """One recorded trial: its parameters, intermediate curve (steps before the final one) and result."""

    number: int
    params: dict[str, Any]
    distributions: dict[str, Any]
    curve: tuple[tuple[int, float], ...]
    value: float
    train_seconds: float
    startup_s: float
    config: dict[str, Any]
    final_report: float | None = None  # what the trial reported at the final step (None: the value)


@dataclass(frozen=True)
class Step:
    """One replayed trial: which recording ran, how it ended, and the running totals after it."""

    index: int
    number: int
    state: str  # COMPLETE or PRUNED
    stopped_step: int | None
    compute_s: float
    best_val_bpb: float | None


@dataclass(frozen=True)
class Replay:
    """The outcome of one replay."""

    trials: int
    pruned: int
    compute_s: float
    full_compute_s: float  # what the same trials cost without pruning
    best_val_bpb: float | None
    best_number: int | None
    true_best_number: int
    true_best_val_bpb: float
    true_best_pruned: bool | None  # None: the true best was never chosen (fewer trials than recordings)
    trajectory: tuple[Step, ...]
    direction: str = "minimize"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compute_saved_frac"] = round(1 - self.compute_s / self.full_compute_s, 4) if self.full_compute_s else 0.0
        return d


def recorded_trials(trials: Sequence[Any], budget_s: float) -> list[Recorded]:
    """Complete single-valued trials of the spec's budget that reported at least one intermediate value."""
    final_step = round(budget_s)
    out = []
    for t in trials:
        if t.state.name != "COMPLETE" or len(t.values or ()) != 1 or not math.isfinite(t.values[0]):
            continue
        if t.user_attrs.get(ATTR_ADHOC_BUDGET, budget_s) != budget_s:
            continue
        curve = tuple((int(s), float(v)) for s, v in sorted(t.intermediate_values.items())
                      if 0 < s < final_step and math.isfinite(v))
        if not curve:
            continue
        a = t.user_attrs
        train_s = a.get("train_seconds")
        final = t.intermediate_values.get(final_step)
        out.append(Recorded(
            number=t.number, params=dict(t.params), distributions=dict(t.distributions), curve=curve,
            value=float(t.value), train_seconds=float(train_s) if _number(train_s) else float(final_step),
            startup_s=float(a["startup_seconds"]) if _number(a.get("startup_seconds")) else 0.0,
            config=dict(a["config"]) if isinstance(a.get("config"), Mapping) else {},
            final_report=float(final) if _number(final) else None,
        ))
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def replay(recorded: Sequence[Recorded], sampler: Component, pruner: Component, budget_s: float,
           n_trials: int | None = None, startup_s: float | None = None, direction: str = "minimize") -> Replay:
    """Run the sampler and pruner over the recordings, one trial at a time, in an in-memory study that
    optimises in ``direction`` (the recorded study's)."""
    import optuna

    if not recorded:
        raise ReplayError("nothing to replay: no complete trial with a recorded learning curve")
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study = optuna.create_study(study_name="replay", direction=direction, sampler=build_sampler(sampler),
                                    pruner=build_pruner(pruner))
    sign = 1.0 if direction == "minimize" else -1.0
    space = _union_space(recorded)
    final_step = round(budget_s)
    unused = sorted(recorded, key=lambda r: r.number)
    true_best = min(recorded, key=lambda r: (sign * r.value, r.number))
    n = len(recorded) if n_trials is None else min(n_trials, len(recorded))
    steps: list[Step] = []
    compute = full = 0.0
    best: Recorded | None = None
    pruned_numbers: set[int] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(n):
            proposal = study.ask()
            point = {name: _suggest(proposal, name, dist) for name, dist in space.items()}
            study.tell(proposal, state=optuna.trial.TrialState.FAIL)
            chosen = min(unused, key=lambda r: (_distance(point, r.params, space), r.number))
            unused.remove(chosen)
            stopped = _run(study, chosen, final_step)
            start = chosen.startup_s if startup_s is None else startup_s
            compute += (chosen.train_seconds if stopped is None else stopped) + start
            full += chosen.train_seconds + start
            if stopped is None and (best is None or sign * chosen.value < sign * best.value):
                best = chosen
            if stopped is not None:
                pruned_numbers.add(chosen.number)
            steps.append(Step(i, chosen.number, "COMPLETE" if stopped is None else "PRUNED", stopped,
                              round(compute, 3), None if best is None else best.value))
    chosen_numbers = {s.number for s in steps}
    return Replay(
        trials=n, pruned=len(pruned_numbers), compute_s=round(compute, 3), full_compute_s=round(full, 3),
        best_val_bpb=None if best is None else best.value, best_number=None if best is None else best.number,
        true_best_number=true_best.number, true_best_val_bpb=true_best.value,
        true_best_pruned=(true_best.number in pruned_numbers) if true_best.number in chosen_numbers else None,
        trajectory=tuple(steps), direction=direction,
    )


def _run(study: Any, r: Recorded, final_step: int) -> int | None:
    """Feed one recording to the study's pruner; the step it was pruned at, or None if it completed."""
    from optuna.trial import TrialState

    study.enqueue_trial(r.params, skip_if_exists=False)
    t = study.ask()
    for name, dist in r.distributions.items():
        _suggest(t, name, dist)
    for step, value in r.curve:
        t.report(value, step)
        if t.should_prune():
            t.set_user_attr("config", r.config)
            study.tell(t, state=TrialState.PRUNED)
            return step
    t.set_user_attr("config", r.config)
    # As the worker does: the final report closes the curve (a composite study's: its val_bpb term).
    t.report(r.value if r.final_report is None else r.final_report, final_step)
    study.tell(t, r.value)
    return None


def _union_space(recorded: Sequence[Recorded]) -> dict[str, Any]:
    space: dict[str, Any] = {}
    for r in recorded:
        for name, dist in r.distributions.items():
            space.setdefault(name, dist)
    return dict(sorted(space.items()))


def _suggest(trial: Any, name: str, dist: Any) -> Any:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(dist, FloatDistribution):
        return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    raise ReplayError(f"parameter {name!r}: cannot replay a {type(dist).__name__}")


def _distance(point: Mapping[str, Any], params: Mapping[str, Any], space: Mapping[str, Any]) -> float:
    """Euclidean distance in the unit cube (log scale where the distribution is); absent = 1 apart."""
    from optuna.distributions import CategoricalDistribution

    total = 0.0
    for name, dist in space.items():
        if name not in point or name not in params:
            total += 0.0 if name not in point and name not in params else 1.0
        elif isinstance(dist, CategoricalDistribution):
            total += 0.0 if point[name] == params[name] else 1.0
        else:
            lo, hi, a, b = dist.low, dist.high, point[name], params[name]
            if dist.log:
                lo, hi, a, b = (math.log(x) for x in (lo, hi, a, b))
            total += ((a - b) / (hi - lo)) ** 2 if hi > lo else 0.0
    return math.sqrt(total)


# -- command line ----------------------------------------------------------------------------------


def add_parser(sub: Any) -> None:
    p = sub.add_parser("replay", help="replay a sampler and a pruner on a finished study's recorded learning "
                       "curves, at no compute")
    p.add_argument("study", help="NAME (sweep/studies/NAME.toml) or a path to a .toml spec")
    p.add_argument("--sampler", default=None, help="tpe | gp | cmaes | random (default: the spec's, with its options)")
    p.add_argument("--sampler-opt", action="append", default=[], metavar="K=V|JSON",
                   help="a sampler option (value read as JSON where it parses), or a JSON object of them")
    p.add_argument("--pruner", default=None, help="a pruner name as in specs (default: the spec's, with its options)")
    p.add_argument("--pruner-opt", action="append", default=[], metavar="K=V|JSON", help="a pruner option, likewise")
    p.add_argument("--seed", type=int, default=None, help="sampler seed (default: the spec's, else 0)")
    p.add_argument("--n-trials", type=int, default=None, metavar="N", help="trials to replay (default: all recorded)")
    p.add_argument("--startup-s", type=float, default=None, metavar="S",
                   help="start-up seconds charged per trial (default: each trial's recorded start-up)")
    p.add_argument("--json", action="store_true")


def main(spec: StudySpec, url: str, args: argparse.Namespace, out: TextIO) -> int:

    try:
        sampler, pruner = components(spec, args.sampler, args.sampler_opt, args.pruner, args.pruner_opt, args.seed)
        if args.n_trials is not None and args.n_trials < 1:
            raise ReplayError(f"--n-trials must be >= 1, got {args.n_trials}")
        if args.startup_s is not None and not (math.isfinite(args.startup_s) and args.startup_s >= 0):
            raise ReplayError(f"--startup-s must be a finite number >= 0, got {args.startup_s}")
        if spec.objective.multi:
            raise ReplayError(f"study {spec.name!r} is pareto ({spec.objective.describe()}): Optuna cannot prune a "
                              "multi-objective study, so its sweep made no pruning decisions to replay; replay a "
                              "single or composite study")
        if spec.direction == "maximize" and pruner.name == "learning_curve":
            raise ReplayError(f"--pruner learning_curve: it models minimised val_bpb curves and study {spec.name!r} "
                              f"is maximised ({spec.objective.describe()}); pick median, percentile, hyperband, "
                              "successive_halving or none")
        trials = load_study(spec, url).get_trials(deepcopy=False)
        recorded = recorded_trials(trials, spec.budget_s)
        if not recorded:
            raise ReplayError(f"study {spec.name!r} has no complete trial with a recorded learning curve "
                              f"(of {len(trials)} trials); run it with trial.eval_fractions and no pruning")
        result = replay(recorded, sampler, pruner, spec.budget_s, args.n_trials, args.startup_s, spec.direction)
    except ReplayError as e:
        fail(str(e), url)
        return 2
    body = {"study": spec.name, "metric": spec.objective.names[0], "sampler": {"name": sampler.name, **sampler.options},
            "pruner": {"name": pruner.name, **pruner.options}, "recorded": len(recorded), **result.as_dict()}
    if args.json:
        print(json.dumps(body, default=str), file=out, flush=True)
    else:
        _print(body, out)
    return 0


def components(spec: StudySpec, sampler_name: str | None, sampler_opts: Sequence[str], pruner_name: str | None,
               pruner_opts: Sequence[str], seed: int | None) -> tuple[Component, Component]:
    """The sampler and pruner as a spec would build them (same names, option checks and defaults)."""
    r = SpecReader(spec.path)
    if sampler_name is None and not sampler_opts:
        sampler = spec.sampler
    else:
        sampler = read_sampler(r, {"name": sampler_name or spec.sampler.name, **_opts(sampler_opts, "--sampler-opt")},
                               None)
    sampler = Component(sampler.name, {**sampler.options, "seed": seed if seed is not None
                                       else sampler.options.get("seed", 0)})
    if pruner_name is None and not pruner_opts:
        pruner = spec.pruner
    else:
        raw = {"name": pruner_name or spec.pruner.name, **_opts(pruner_opts, "--pruner-opt")}
        pruner = read_pruner(r, raw, spec.eval_fractions, spec.budget_s)
    return sampler, pruner


def _opts(items: Sequence[str], flag: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
            except ValueError as e:
                raise ReplayError(f"{flag}: not a JSON object: {e}") from None
            if not isinstance(obj, dict):
                raise ReplayError(f"{flag}: not a JSON object: {item!r}")
            out.update(obj)
            continue
        key, sep, text = item.partition("=")
        if not sep or not key.strip() or key.strip() == "name":
            raise ReplayError(f"{flag}: expected KEY=VALUE (not name), got {item!r}")
        try:
            out[key.strip()] = json.loads(text)
        except ValueError:
            out[key.strip()] = text
    return out


def _print(body: Mapping[str, Any], out: TextIO) -> None:
    opts = ", ".join(f"{k}={v}" for k, v in body["pruner"].items() if k != "name")
    print(f"replay of {body['study']}: sampler {body['sampler']['name']} (seed {body['sampler']['seed']}), "
          f"pruner {body['pruner']['name']}{f' ({opts})' if opts else ''}, {body['trials']} of "
          f"{body['recorded']} recorded trials", file=out)
    print(f"{'#':>3} {'trial':>5} {'state':<8} {'stopped':>7} {'compute_s':>10} {'best':>8}", file=out)
    for s in body["trajectory"]:
        stopped = "" if s["stopped_step"] is None else f"{s['stopped_step']}s"
        best = "-" if s["best_val_bpb"] is None else f"{s['best_val_bpb']:.4f}"
        print(f"{s['index']:>3} {s['number']:>5} {s['state']:<8} {stopped:>7} {s['compute_s']:>10.1f} {best:>8}",
              file=out)
    verdict = {None: "not replayed", True: "PRUNED", False: "kept"}[body["true_best_pruned"]]
    best = "-" if body["best_val_bpb"] is None else f"{body['best_val_bpb']:.4f}"
    print(f"best {body['metric']} {best} ({body['direction']}d) for {body['compute_s']:.1f} s of compute "
          f"({body['compute_saved_frac']:.0%} saved "
          f"against no pruning); {body['pruned']} pruned; the true best (trial {body['true_best_number']}, "
          f"{body['true_best_val_bpb']:.4f}) was {verdict}", file=out)
