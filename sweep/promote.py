"""``python -m sweep promote NAME --top K --budget-s B --seeds S [--by METRIC] [--spec SPEC] [--json]``.

A short screen ranks configurations by one noisy run each at a budget that may favour the wrong ones;
what is scored is one run at the full budget. Promotion takes the K best distinct configurations of
study NAME (complete trials, best first; parameters compared without ``seed``; ad-hoc trials run at
another budget are left out), reruns each with seeds 0..S-1 at budget B and reports, per
configuration, the mean of the ranked metric with a 95% Student-t confidence interval and the seeds'
standard deviation, and alongside the means (and intervals) of the study's other metrics, val_bpb and
core where the records hold them. A winner is declared only when its interval clears the runner-up's;
otherwise the report says the difference is within noise.

What is ranked follows the study's objective (:mod:`sweep.objective`): a single or composite study's
value in its direction (a composite score is maximised); a pareto study has no single order, so
``--by METRIC`` names one of its metrics, ranked in that metric's direction. The linked study keeps
the source's objective, so a pareto study's replicates record every metric.

``--spec SPEC`` reruns the configurations under another spec's fixed values, trial settings and
resources (screen under ``phase1-short``, promote under ``phase1`` with its budget and full
evaluation); the configurations' parameters must fit that spec's search space. B defaults to that
spec's budget, else to the competition's 1800 s.

The reruns form a linked study, ``NAME-promote-B``, in the same storage, run by the same driver, Ray
tasks and trainer as ``sweep run`` with no pruning. Its spec is derived from NAME's (see
:func:`linked_spec`), so ``status``, ``best`` and ``export`` accept the linked name too (``run`` refuses it:
it would sample new points), and the dashboard lists it beside its source.
Its user attribute ``promote`` names the source study, the source trials, the seeds, the spec the
replicates run under and the ranked metric; resuming under another ``--spec`` is refused. Running the
command again continues: replicates already in the study (finished, or failed for good) are never
rerun; missing ones are enqueued (more seeds, or configurations that joined the top K since) and run.
Each replicate is a trial whose parameters are the configuration's plus ``seed``, so retries of lost
trials keep their place.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from sweep import objective as obj
from sweep import storage as st
from sweep.space import Param, SearchSpace, SpaceError
from sweep.spec import Component, SpecError, StudySpec, load, resolve_path
from sweep.study import fail, load_study, parse_seconds

SEED = "seed"  # the trainer's seed parameter: what varies between replicates
CONFIDENCE = 0.95
ATTR_PROMOTE = "promote"  # study user attribute of a linked study
ALONGSIDE = ("val_bpb", "core")  # record fields reported beside the ranked metric wherever recorded
COMPETITION_BUDGET_S = 1800.0  # --budget-s without --spec
_LINKED = re.compile(r"^(?P<base>.+)-promote-(?P<budget>\d+(?:\.\d+)?)$")


class PromoteError(ValueError):
    """Bad input for promote; exit 2 with this one line."""


# -- the linked study's spec ------------------------------------------------------------------------

def linked_name(base: str, budget_s: float) -> str:
    return f"{base}-promote-{budget_s:g}"


def linked_spec(base: StudySpec, budget_s: float, n_trials: int = 1, seeds: int = 1,
                under: StudySpec | None = None) -> StudySpec:
    """The spec the replicates run under: ``under``'s (default the source's), at ``budget_s``, with ``seed``
    searched and no pruner; named after, stored with and optimising the objective of the source ``base``.

    Every replicate is enqueued with all its parameters, so the sampler never proposes one; the seed
    is an int parameter (its range may grow between runs, which Optuna allows for ints). Intermediate
    evaluations are kept unless they collide on the new budget's charged-second axis.
    """
    run = under or base
    steps = [round(f * budget_s) for f in run.eval_fractions]
    fractions = run.eval_fractions if len(set(steps)) == len(steps) else ()
    space = run.space
    params = [p for p in space.params if p.name != SEED] + [Param(SEED, "int", low=0, high=max(0, seeds - 1))]
    try:
        space = SearchSpace.build(params, space.derived, space.constraints,
                                  {k: v for k, v in space.fixed.items() if k != SEED})
    except SpaceError as e:
        raise PromoteError(f"{run.path}: cannot search {SEED} for replicates: {e}") from None
    needs = sorted(obj.NEEDS_CORE & set(base.objective.metrics))
    if needs and not space.fixed.get("core_bundle"):
        raise PromoteError(f"--spec {run.name}: study {base.name!r} optimises {', '.join(needs)}, which needs "
                           "[fixed] core_bundle there (the trainer's CORE evaluation)")
    return dataclasses.replace(run, name=linked_name(base.name, budget_s), budget_s=float(budget_s),
                               eval_fractions=tuple(fractions), n_trials=max(1, n_trials), space=space,
                               pruner=Component("none"), sampler=Component("random", {"seed": 0}),
                               storage=base.storage, artifacts=base.artifacts, storage_proxy=base.storage_proxy,
                               objective=base.objective, direction=base.direction)


READ_ONLY_COMMANDS = ("status", "best", "export", "promote")  # what a linked name may be given to


def load_spec(name_or_path: str, command: str = "status") -> StudySpec:
    """A study spec by name or path, or the derived spec of a linked study ``BASE-promote-B``.

    Only reading commands take a linked name: ``sweep run`` of it would sample new points, not replicates.
    """
    try:
        return load(name_or_path)
    except SpecError:
        path = resolve_path(name_or_path)
        m = _LINKED.match(path.stem)
        if m is None or path.exists():
            raise
        base_path = path.with_name(m["base"] + path.suffix)
        try:
            base = load(base_path)
        except SpecError:
            raise SpecError(f"{name_or_path}: neither a study spec nor a promotion of one "
                            f"(no spec {base_path})") from None
        if command not in READ_ONLY_COMMANDS:
            by = " --by METRIC" if base.objective.multi else ""
            raise SpecError(f"{name_or_path} is a promotion of study {base.name!r}: `python -m sweep promote "
                            f"{m['base']} --budget-s {m['budget']}{by}` runs it") from None
        return linked_spec(base, float(m["budget"]))


# -- choosing configurations ------------------------------------------------------------------------

def config_key(params: dict[str, Any]) -> str:
    """What identifies a configuration: its parameters without the seed."""
    return json.dumps({k: v for k, v in params.items() if k != SEED}, sort_keys=True, default=str)


def ranked_metric(objective: obj.Objective, by: str | None, study: str = "") -> str:
    """What a promotion ranks by: a single or composite study's value, or a pareto study's ``--by`` metric."""
    if objective.multi:
        if by not in objective.metrics:
            given = f"--by {by}: not one of its metrics" if by else "--by METRIC is required"
            raise PromoteError(f"study {study!r} is pareto ({objective.describe()}), so it has no single "
                               f"order: {given}; rank by one of {', '.join(objective.metrics)}")
        return by
    name = objective.names[0]
    if by is not None and by != name:
        raise PromoteError(f"--by {by}: study {study!r} ranks by its value, {name} ({objective.describe()}); "
                           "--by picks one of a pareto study's metrics")
    return name


def metric_direction(objective: obj.Objective, metric: str) -> str:
    """The direction that makes ``metric`` better: the study's for its own values, else the field's own."""
    if metric in objective.names:
        return objective.directions[objective.names.index(metric)]
    return obj.DIRECTIONS.get(metric, "minimize")


def metric_value(t: Any, objective: obj.Objective, metric: str) -> float | None:
    """A complete trial's ``metric``: one of its objective values, else the field of its result record."""
    if t.state.name != "COMPLETE" or t.values is None:
        return None
    v = t.values[objective.names.index(metric)] if metric in objective.names else t.user_attrs.get(metric)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None


def top_configs(trials: list[Any], spec: StudySpec, k: int, metric: str | None = None) -> list[dict[str, Any]]:
    """The ``k`` best distinct configurations by ``metric`` (default: the study's value) among the complete
    trials run at the spec's budget."""
    from sweep.run.outcome import ATTR_ADHOC_BUDGET

    metric = metric or spec.objective.names[0]
    sign = 1.0 if metric_direction(spec.objective, metric) == "minimize" else -1.0
    scored = [(v, t) for t in trials if (v := metric_value(t, spec.objective, metric)) is not None
              and float(t.user_attrs.get(ATTR_ADHOC_BUDGET, spec.budget_s)) == spec.budget_s]
    picked: dict[str, dict[str, Any]] = {}
    for v, t in sorted(scored, key=lambda vt: (sign * vt[0], vt[1].number)):
        key = config_key(t.params)
        if key not in picked:
            picked[key] = {"source_trial": t.number, "source_value": v,
                           "params": {p: x for p, x in t.params.items() if p != SEED}}
        if len(picked) == k:
            break
    return list(picked.values())


# -- statistics -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Summary:
    """Mean, sample standard deviation and Student-t interval of one configuration's seeds."""

    n: int
    mean: float | None
    std: float | None  # None below two values
    half_width: float | None

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else self.mean - self.half_width  # type: ignore[operator]

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else self.mean + self.half_width  # type: ignore[operator]


def summarize(values: list[float], confidence: float = CONFIDENCE) -> Summary:
    if not values:
        return Summary(0, None, None, None)
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Summary(1, mean, None, None)
    from scipy.stats import t as student_t

    std = statistics.stdev(values)
    half = float(student_t.ppf(0.5 + confidence / 2, len(values) - 1)) * std / math.sqrt(len(values))
    return Summary(len(values), mean, std, half)


def verdict(rows: list[dict[str, Any]], direction: str,
            metric: str = "value") -> tuple[str, dict[str, Any] | None, str]:
    """(kind, winning row, one line): ``winner``, ``within_noise``, ``undecided``, ``single`` or ``incomplete``."""
    sign = 1.0 if direction == "minimize" else -1.0
    ranked = sorted((r for r in rows if r["n"]), key=lambda r: sign * r["mean"])
    if not ranked:
        return "incomplete", None, "no configuration has a finished replicate yet"
    if len(ranked) == 1:
        return "single", None, f"only trial {ranked[0]['source_trial']}'s configuration has results: nothing to compare"
    best, second = ranked[0], ranked[1]
    if best["half_width"] is None or second["half_width"] is None:
        return "undecided", None, (f"configurations of trials {best['source_trial']} and {second['source_trial']} "
                                   "need at least 2 finished seeds each for an interval")
    clears = best["ci_high"] < second["ci_low"] if sign > 0 else best["ci_low"] > second["ci_high"]
    pct = round(100 * CONFIDENCE)
    if clears:
        return "winner", best, (f"winner: trial {best['source_trial']}'s configuration, mean {metric} "
                                f"{best['mean']:.4f} ({direction}d); its {pct}% interval [{best['ci_low']:.4f}, "
                                f"{best['ci_high']:.4f}] clears the runner-up's (trial {second['source_trial']}) "
                                f"[{second['ci_low']:.4f}, {second['ci_high']:.4f}]")
    return "within_noise", None, (
        f"within noise: trial {best['source_trial']}'s configuration (mean {metric} {best['mean']:.4f}, "
        f"[{best['ci_low']:.4f}, {best['ci_high']:.4f}]) and trial {second['source_trial']}'s (mean "
        f"{second['mean']:.4f}, [{second['ci_low']:.4f}, {second['ci_high']:.4f}]) overlap at {pct}%: more seeds "
        "would tell them apart, if anything does")


def report(study: Any, objective: obj.Objective, metric: str | None = None) -> dict[str, Any]:
    """Per configuration of a linked study: its replicates, mean, std and interval of the ranked metric
    (``metric``, else the one the promotion recorded, else the study's value), the other metrics' alongside;
    then the verdict."""
    info = study.user_attrs.get(ATTR_PROMOTE) or {}
    metric = metric or info.get("by") or objective.names[0]
    direction = metric_direction(objective, metric)
    others = [m for m in dict.fromkeys((*objective.metrics, *ALONGSIDE)) if m != metric]
    trials = [t for t in study.get_trials(deepcopy=False) if not t.user_attrs.get("adhoc")]
    rows = []
    for c in info.get("configs", []):
        key = config_key(c["params"])
        mine = [t for t in trials if config_key(t.params) == key]
        done = sorted((t for t in mine if metric_value(t, objective, metric) is not None),
                      key=lambda t: t.params.get(SEED, 0))
        values = [metric_value(t, objective, metric) for t in done]
        complete = {t.params.get(SEED) for t in done}
        pending = {t.params.get(SEED) for t in mine if not t.state.is_finished()} - complete
        failed = {t.params.get(SEED) for t in mine} - complete - pending  # final FAILs (or a retry not yet queued)
        s = summarize(values)  # type: ignore[arg-type]
        alongside = {}
        for m in others:
            got = [v for t in done if (v := metric_value(t, objective, m)) is not None]
            if got:
                a = summarize(got)
                alongside[m] = {"n": a.n, "mean": a.mean, "std": a.std, "half_width": a.half_width}
        rows.append({
            "source_trial": c["source_trial"], "source_value": c["source_value"], "params": c["params"],
            "n": s.n, "mean": s.mean, "std": s.std, "half_width": s.half_width, "ci_low": s.low, "ci_high": s.high,
            "values": values, "seeds": [t.params.get(SEED) for t in done],
            "trials": [t.number for t in done], "failed": len(failed), "pending": len(pending),
            "alongside": alongside,
        })
    sign = 1.0 if direction == "minimize" else -1.0
    rows.sort(key=lambda r: (r["mean"] is None, sign * (r["mean"] or 0.0), r["source_trial"]))
    kind, win, line = verdict(rows, direction, metric)
    return {"study": study.study_name, "source_study": info.get("source_study"), "budget_s": info.get("budget_s"),
            "seeds": info.get("seeds"), "spec": info.get("spec", info.get("source_study")),
            "objective": objective.describe(), "metric": metric, "direction": direction,
            "confidence": CONFIDENCE, "configs": rows, "verdict": kind,
            "winner": win["source_trial"] if win else None, "message": line}


# -- the command ------------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def add_parser(sub: Any) -> None:

    p = sub.add_parser("promote", help="rerun a study's K best configurations at a full budget with S seeds each, "
                       "as a linked study, and compare them with confidence intervals")
    p.add_argument("study", help="NAME (sweep/studies/NAME.toml) or a path to a .toml spec")
    p.add_argument("--top", type=_positive_int, default=3, metavar="K", help="configurations to promote (default 3)")
    p.add_argument("--budget-s", type=parse_seconds, default=None, metavar="B",
                   help="charged training seconds of each replicate (default: the --spec's budget, else 1800, "
                   "the competition's)")
    p.add_argument("--seeds", type=_positive_int, default=3, metavar="S", help="replicates per configuration "
                   "(default 3)")
    p.add_argument("--by", default=None, metavar="METRIC", help="the metric to rank by; required for a pareto "
                   "study (one of its metrics), else the study's value")
    p.add_argument("--spec", default=None, metavar="NAME_OR_PATH", help="run the replicates under this spec's "
                   "fixed values, trial settings and resources (default: the study's own)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object (sweep output to stderr)")


def main(spec: StudySpec, url: str, args: argparse.Namespace, out: TextIO) -> int:

    under = load(args.spec) if args.spec is not None else None  # a bad spec is cli's SpecError: exit 2
    budget_s = args.budget_s or (under.budget_s if under is not None else COMPETITION_BUDGET_S)
    try:
        metric = ranked_metric(spec.objective, args.by, spec.name)
        source = load_study(spec, url)
        linked, study = prepare(spec, source, args.top, budget_s, args.seeds, url, metric=metric, under=under)
    except PromoteError as e:
        fail(str(e), url)
        return 2
    code = 0
    from sweep.run.driver import Driver
    from sweep.run.outcome import counts

    if sum(counts(t) for t in study.get_trials(deepcopy=False)) < linked.n_trials:
        code = Driver(linked, out=sys.stderr if args.json else out).run()
    rep = report(load_study(linked, url), spec.objective, metric)
    if args.json:
        print(json.dumps(rep), file=out, flush=True)
    else:
        print_report(rep, out)
    return code


def prepare(spec: StudySpec, source: Any, top: int, budget_s: float, seeds: int, url: str, metric: str | None = None,
            under: StudySpec | None = None) -> tuple[StudySpec, Any]:
    """Create or extend the linked study: record its configurations, enqueue the replicates it lacks.

    Returns its spec (``n_trials`` = every replicate it holds) and the study. Configurations promoted
    before stay, in their order; new ones from the current top ``top`` by ``metric`` are appended.
    ``under`` is the spec the replicates run under (default ``spec``); resuming under another is refused.
    """
    from sweep.run.driver import Driver

    metric = metric or spec.objective.names[0]
    trials = source.get_trials(deepcopy=False)
    picked = top_configs(trials, spec, top, metric)
    if not picked:
        raise PromoteError(f"study {spec.name!r} has no complete trial at its budget of {spec.budget_s:g} s to promote")
    linked = linked_spec(spec, budget_s, seeds=seeds, under=under)
    run = under or spec
    fixed_before = spec.space.fixed
    for c in picked:
        c["params"] = _fit(c, spec, linked, fixed_before, under is not None)
    was = _promoted_under(linked.name, url)
    if was is not None and was != run.name:  # checked before the driver records this spec on the study
        raise PromoteError(f"study {linked.name!r} was promoted under spec {was!r}, not {run.name!r}: resume it "
                           f"with {'--spec ' + was if was != spec.name else 'no --spec'}, or pick another --budget-s")
    study = Driver(linked, out=sys.stderr).open_study()
    info = study.user_attrs.get(ATTR_PROMOTE) or {}
    configs = list(info.get("configs", []))
    known = {config_key(c["params"]) for c in configs}
    configs += [c for c in picked if config_key(c["params"]) not in known]
    by_number = {t.number: t for t in trials}
    for c in configs:  # the screen's value in the metric ranked now (--by may change between runs)
        t = by_number.get(c["source_trial"])
        c["source_value"] = metric_value(t, spec.objective, metric) if t is not None else c.get("source_value")
    seeds = max(seeds, int(info.get("seeds", 0)))
    linked = linked_spec(spec, budget_s, seeds=seeds, under=under)
    info = {"source_study": spec.name, "source_budget_s": spec.budget_s, "budget_s": float(budget_s),
            "seeds": seeds, "spec": run.name, "spec_path": str(run.path), "by": metric,
            "objective": spec.objective.describe(), "configs": configs}
    st.retry(lambda: study.set_user_attr(ATTR_PROMOTE, info), url=url)

    have = {(config_key(t.params), t.params.get(SEED)) for t in study.get_trials(deepcopy=False)
            if not t.user_attrs.get("adhoc")}
    for c in configs:
        for s in range(seeds):
            if (config_key(c["params"]), s) not in have:
                point = {**c["params"], SEED: s}
                st.retry(lambda point=point, c=c, s=s: study.enqueue_trial(
                    point, user_attrs={"promote_source_trial": c["source_trial"], "promote_seed": s}), url=url)
                have.add((config_key(c["params"]), s))
    st.retry(lambda: study.set_user_attr("n_trials", len(have)), url=url)  # as the driver records it
    return dataclasses.replace(linked, n_trials=len(have)), study


def _promoted_under(name: str, url: str) -> str | None:
    """The spec an existing linked study's replicates run under (its source's, for one promoted before
    --spec existed); None when there is no such study yet."""
    import optuna

    try:
        study = st.retry(lambda: optuna.load_study(study_name=name, storage=st.open_storage(url)), url=url)
    except KeyError:
        return None
    info = study.user_attrs.get(ATTR_PROMOTE) or {}
    return info.get("spec", info.get("source_study"))


def _fit(c: dict[str, Any], spec: StudySpec, linked: StudySpec, fixed_before: dict[str, Any],
         other_spec: bool) -> dict[str, Any]:
    """A configuration's parameters as the linked spec's space takes them, or a one-line PromoteError.

    Under another spec, a parameter that spec fixes to the same value is dropped, and one it searches
    that the source fixed takes the source's fixed value: the configuration stays the one screened.
    """
    params = dict(c["params"])
    if other_spec:
        params = {k: v for k, v in params.items() if not (k in linked.space.fixed and linked.space.fixed[k] == v)}
        searched = {p.name for p in linked.space.params}
        params |= {k: v for k, v in fixed_before.items() if k in searched and k not in params and k != SEED}
    try:
        point = linked.space.validate({**params, SEED: 0})
    except SpaceError as e:
        if other_spec:
            raise PromoteError(f"--spec {linked.path}: trial {c['source_trial']}'s configuration does not fit "
                               f"its space: {e}") from None
        raise PromoteError(f"trial {c['source_trial']} of study {spec.name!r} no longer fits its spec: {e}") from None
    point.pop(SEED)
    return point


def print_report(rep: dict[str, Any], out: TextIO) -> None:
    pct = round(100 * rep["confidence"])

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    others = list(dict.fromkeys(m for r in rep["configs"] for m in r["alongside"]))
    print(f"promotion of study {rep['source_study']} at {rep['budget_s']:g} s, {rep['seeds']} seed(s) each, under "
          f"spec {rep['spec']}: study {rep['study']}, ranked by {rep['metric']} ({rep['direction']}) "
          f"(source: the configuration's trial in {rep['source_study']}; screen: its {rep['metric']} there)", file=out)
    alongside = "".join(f" {m[:8]:>8}" for m in others)
    print(f"{'source':>6} {'n':>3} {rep['metric'][:8]:>8} {'±' + str(pct) + '%':>8} {'std':>8} {'screen':>8}"
          f"{alongside}  failed/pending", file=out)
    for r in rep["configs"]:
        extra = "".join(f" {num(r['alongside'].get(m, {}).get('mean')):>8}" for m in others)
        print(f"{r['source_trial']:>6} {r['n']:>3} {num(r['mean']):>8} {num(r['half_width']):>8} {num(r['std']):>8} "
              f"{num(r['source_value']):>8}{extra}  {r['failed']}/{r['pending']}", file=out)
    if others:
        print(f"(alongside: the mean {', '.join(others)} of the same replicates, where recorded)", file=out)
    print(rep["message"], file=out)
    best = next((r for r in rep["configs"] if r["trials"]), None)
    if best is not None:
        print(f"export: python -m sweep export {rep['study']} --trial {best['trials'][0]} --out DIR", file=out)
    out.flush()
