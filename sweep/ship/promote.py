"""``python -m sweep promote NAME --top K --budget-s B --seeds S [--by METRIC] [--spec SPEC] [--json]``.

A short screen ranks configurations by one noisy run each at a budget that may favour the wrong ones;
what is scored is one run at the full budget. Promotion takes the K best distinct configurations of
study NAME (complete trials, best first; parameters compared without ``seed``; ad-hoc trials run at
another budget are left out), reruns each with seeds 0..S-1 at budget B and reports, per
configuration, the mean of the ranked metric with a 95% Student-t confidence interval and the seeds'
standard deviation, and alongside the means (and intervals) of the study's other metrics, val_bpb and
core where the records hold them. A winner is declared only when its interval clears the runner-up's;
otherwise the report says the difference is within noise.

What is ranked follows the study's objective (:mod:`sweep.spec.objective`): a single or composite study's
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
replicates run under and the ranked metric, with both specs' absolute paths: a linked name is read under
the spec its replicates ran under, and one whose source spec was given by path opens by name too (or by
the path beside that spec, which the report's ``export:`` line gives); resuming under another ``--spec`` is refused.
A script's replicates need a way to take ``seed``: ``[trial] seed_knob``, or the constant the key sets
(``SEED``); without either, promote refuses before it enqueues anything. Running the
command again continues: replicates already in the study (finished, or failed for good) are never
rerun; missing ones are enqueued (more seeds, or configurations that joined the top K since) and run.
Each replicate is a trial whose parameters are the configuration's plus ``seed``, so retries of lost
trials keep their place.

The statistics and the report live in :mod:`sweep.ship.replicates`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, TextIO

from model.script import source
from sweep import store as st
from sweep.run.driver import Driver
from sweep.run.outcome import ATTR_ADHOC_BUDGET, counts
from sweep.ship.replicates import ATTR_PROMOTE, SEED, config_key, metric_direction, metric_value, print_report, report
from sweep.spec import STUDIES_DIR, Component, SpecError, StudySpec, load, resolve_path
from sweep.spec import objective as obj
from sweep.spec.space import Param, SearchSpace, SpaceError
from sweep.store import artifacts
from sweep.study import fail, load_study, parse_seconds, positive_int

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
    A kit-dialect script's replicates are scored at its ``promote_eval_tokens`` (20,971,520 by default).

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
    script = run.script
    if script is not None and script.dialect == "kit":  # a confirmation reads what teams confirm on (20M tokens)
        script = dataclasses.replace(script, eval_tokens=script.promote_eval_tokens)
    return dataclasses.replace(run, name=linked_name(base.name, budget_s), budget_s=float(budget_s), script=script,
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
        info: dict[str, Any] = {}
        if not base_path.exists() and command in READ_ONLY_COMMANDS:  # a spec given by path: promote recorded it
            info = promotion_record(path.stem, st.resolve_url(None))
            if info.get("source_spec_path"):
                base_path = Path(info["source_spec_path"])
        try:
            base = load(base_path)
        except SpecError:
            raise SpecError(f"{name_or_path}: neither a study spec nor a promotion of one "
                            f"(no spec {base_path})") from None
        if command not in READ_ONLY_COMMANDS:
            by = " --by METRIC" if base.objective.multi else ""
            raise SpecError(f"{name_or_path} is a promotion of study {base.name!r}: `python -m sweep promote "
                            f"{m['base']} --budget-s {m['budget']}{by}` runs it") from None
        info = info or promotion_record(path.stem, st.resolve_url(base.storage))
        # The replicates ran under the spec promote recorded (its --spec): read them as they ran.
        under = load(info["spec_path"]) if info.get("spec_path") and info.get("spec") != base.name else None
        return linked_spec(base, float(m["budget"]), seeds=max(1, int(info.get("seeds", 1))), under=under)


def promotion_record(name: str, url: str) -> dict[str, Any]:
    """What promote recorded on the linked study ``name`` (:data:`ATTR_PROMOTE`); empty when there is none."""
    import optuna

    journal = st.journal_path(url)
    if journal is not None and not Path(journal).exists():  # nothing stored there: create no file
        return {}
    try:
        study = st.retry(lambda: optuna.load_study(study_name=name, storage=st.open_storage(url)), url=url)
    except KeyError:
        return {}
    info = study.user_attrs.get(ATTR_PROMOTE)
    return info if isinstance(info, dict) else {}


# -- choosing configurations ------------------------------------------------------------------------

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


def top_configs(trials: list[Any], spec: StudySpec, k: int, metric: str | None = None) -> list[dict[str, Any]]:
    """The ``k`` best distinct configurations by ``metric`` (default: the study's value) among the complete
    trials run at the spec's budget."""
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


# -- the command ------------------------------------------------------------------------------------

def add_parser(sub: Any) -> None:

    p = sub.add_parser("promote", help="rerun a study's K best configurations at a full budget with S seeds each, "
                       "as a linked study, and compare them with confidence intervals")
    p.add_argument("study", help="NAME (sweep/studies/NAME.toml) or a path to a .toml spec")
    p.add_argument("--top", type=positive_int, default=3, metavar="K", help="configurations to promote (default 3)")
    p.add_argument("--budget-s", type=parse_seconds, default=None, metavar="B",
                   help="charged training seconds of each replicate (default: the --spec's budget, else 1800, "
                   "the competition's)")
    p.add_argument("--seeds", type=positive_int, default=3, metavar="S", help="replicates per configuration "
                   "(default 3)")
    p.add_argument("--by", default=None, metavar="METRIC", help="the metric to rank by; required for a pareto "
                   "study (one of its metrics), else the study's value")
    p.add_argument("--spec", default=None, metavar="NAME_OR_PATH", help="run the replicates under this spec's "
                   "fixed values, trial settings and resources (default: the study's own)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object (sweep output to stderr)")
    p.add_argument("--cold-rehearsal", action="store_true", help="then run the best configuration once on an empty "
                   "compile cache and report its cold start-up, as export --cold-rehearsal does")
    p.add_argument("--margin-s", type=parse_seconds, default=840.0, metavar="S",
                   help="cold start-up over this is said and marked (default 840; the kit's cap is 900)")


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
    if sum(counts(t) for t in study.get_trials(deepcopy=False)) < linked.n_trials:
        code = Driver(linked, out=sys.stderr if args.json else out, next_steps=False).run()  # its report follows
    rep = report(load_study(linked, url), spec.objective, metric)
    if args.json:
        print(json.dumps(rep), file=out, flush=True)
    else:
        print_report(rep, out, linked_arg(spec, linked.name))
    if getattr(args, "cold_rehearsal", False):
        code = code or rehearse_best(linked, rep, url, args.margin_s, sys.stderr if args.json else out)
    return code


def rehearse_best(linked: StudySpec, rep: dict[str, Any], url: str, margin_s: float, out: TextIO) -> int:
    """The best configuration's first finished replicate, once on an empty compile cache (sweep/ship/rehearse.py);
    the rehearsal is recorded on the linked study. Exit 1 with one line when nothing can be rehearsed."""
    from sweep.ship import export, rehearse

    done = [r for r in rep["configs"] if r["trials"]]
    if not done:
        fail("--cold-rehearsal: no configuration has a finished replicate to rehearse", url)
        return 1
    study = load_study(linked, url)
    trial = next(t for t in study.get_trials(deepcopy=False) if t.number == done[0]["trials"][0])
    try:
        export.cold_rehearsal(linked, study, trial, Path("runs") / f"{linked.name}-rehearsal", margin_s, out)
    except (export.ExportError, rehearse.RehearsalError) as e:
        fail(f"--cold-rehearsal: {e}", url)
        return 1
    return 0


def prepare(spec: StudySpec, source: Any, top: int, budget_s: float, seeds: int, url: str, metric: str | None = None,
            under: StudySpec | None = None) -> tuple[StudySpec, Any]:
    """Create or extend the linked study: record its configurations, enqueue the replicates it lacks.

    Returns its spec (``n_trials`` = every replicate it holds) and the study. Configurations promoted
    before stay, in their order; new ones from the current top ``top`` by ``metric`` are appended.
    ``under`` is the spec the replicates run under (default ``spec``); resuming under another is refused.
    """
    metric = metric or spec.objective.names[0]
    refuse_unseeded(under or spec)
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
            "seeds": seeds, "spec": run.name, "spec_path": str(Path(run.path).resolve()),
            "source_spec_path": str(Path(spec.path).resolve()), "by": metric,
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


def refuse_unseeded(run: StudySpec) -> None:
    """A script's replicates differ only in ``seed``: a script that takes it neither through ``[trial] seed_knob``
    nor as the constant the key sets (``SEED``) would fail every replicate. Refused before anything is enqueued."""
    script = run.script
    if script is None or getattr(script, "seed_knob", None) is not None:
        return
    constant = script.constant(SEED)
    try:  # what the trainer does with each replicate's seed: rewrite the constant's literal
        source.rewrite(Path(script.script).read_text(encoding="utf-8"), {constant: 0})
    except (OSError, SyntaxError, ValueError):  # source.ScriptError is a ValueError
        raise PromoteError(
            f"{run.path}: {Path(script.script).name} has no seed knob (and no integer constant {constant}), so "
            "its replicates cannot be reseeded: set [trial] seed_knob (the flag, environment variable or constant "
            "that seeds the script) to promote it") from None


def _promoted_under(name: str, url: str) -> str | None:
    """The spec an existing linked study's replicates run under (its source's, for one promoted before
    --spec existed); None when there is no such study yet."""
    info = promotion_record(name, url)
    return info.get("spec", info.get("source_study"))


def linked_arg(spec: StudySpec, name: str) -> str:
    """How a person names the linked study ``name`` of ``spec`` on a command line: the name for a spec in
    sweep/studies/, else the path beside the source spec's (which :func:`load_spec` reads as the linked study
    of that spec, in that spec's storage)."""
    path = Path(spec.path)
    if path.stem != spec.name or path.resolve().parent == STUDIES_DIR.resolve():
        return name
    return artifacts.shown_path(path.with_name(f"{name}{path.suffix}"))


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


