"""``python -m sweep compare BASE CAND [CAND ...] --spec SPEC [options]``: does CAND beat BASE, at a stated
false-adopt rate, in as few runs as the noise allows.

Each side is a script (``train.py``, run under the spec's trial settings), ``STUDY#N`` (that trial's
parameters) or parameters of the spec (``{"depth": 12}`` or ``@FILE``). Pairs (one seed, one node, the base
and each open candidate back to back) run on every node of the Ray cluster at once (``RAY_ADDRESS``; else a
local Ray, or ``--local-nodes N`` local one-CPU nodes); after each finished pair the confidence sequence
(sweep/compare/decision.py, docs/compare.md) says ADOPT, DISCARD or goes on, up to ``--max-runs``.
Run again, the same command resumes the comparison without rerunning finished pairs. Exit 0 with a
verdict (ADOPT, DISCARD or UNDECIDED), 2 on bad input, 1 otherwise; ``--json`` prints the report
(schema ``trnsweep.compare/1``) on stdout and the driver's lines on stderr.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import Any, TextIO

from sweep import store as st
from sweep.compare import report as rp
from sweep.compare.decision import Rule
from sweep.compare.pairs import open_stage, verdicts
from sweep.compare.plan import ATTR_COMPARE, CompareError, Plan, plan
from sweep.compare.run import CompareDriver, close_local_cluster, local_cluster
from sweep.spec import StudySpec
from sweep.study import fail, parse_seconds, positive_int


def _number(low: float, high: float, what: str) -> Callable[[str], float]:
    """An argparse type: a number strictly between ``low`` and ``high``."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not low < v < high:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return v
    return parse


_fraction = _number(0.0, 0.5, "a number between 0 and 0.5")
_positive = _number(0.0, math.inf, "a positive number")


def _futility(text: str) -> float | None:
    if text == "off":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number (a val_bpb difference) or off, got {text!r}") from None


def add_parser(sub: Any) -> None:
    p = sub.add_parser("compare", help="whether candidates beat a base: paired same-node seeds, a sequential "
                       "decision at a stated false-adopt rate (docs/compare.md)")
    p.add_argument("base", metavar="BASE", help="a script (.py), STUDY#N, or a JSON object of the spec's parameters")
    p.add_argument("cands", nargs="+", metavar="CAND", help="one or more candidates, in the same forms")
    p.add_argument("--spec", dest="study", required=True, metavar="NAME_OR_PATH",
                   help="the spec whose trial settings, kit, fixed values and storage the runs use")
    p.add_argument("--min-effect", type=_positive, default=0.001, metavar="D",
                   help="the smallest gain in val_bpb that matters (default 0.001): DISCARD rules out one this large")
    p.add_argument("--alpha", type=_fraction, default=0.05, help="false-adopt rate per candidate (default 0.05)")
    p.add_argument("--noise-sd", type=_positive, default=None, metavar="SD",
                   help="the prior sd of a paired difference (default 0.0007, the teams' figure at 2M tokens)")
    p.add_argument("--max-runs", type=positive_int, default=16, metavar="N",
                   help="cap on runs of the screen, both sides counted (default 16); at it: UNDECIDED")
    p.add_argument("--futile-first", type=_futility, default=-0.0006, metavar="D|off",
                   help="stop UNDECIDED when the first pair shows less gain than D (default -0.0006, P's "
                   "nominating threshold); off: never")
    p.add_argument("--step-tolerance", type=_fraction, default=None, metavar="F",
                   help="a pair whose sides' steps or tokens differ by more than this is CONFOUNDED (default 0.10)")
    p.add_argument("--first-seed", type=int, default=0, metavar="S", help="pair k runs seed S+k (default 0)")
    p.add_argument("--budget-s", type=parse_seconds, default=None, metavar="B", help="charged seconds per run "
                   "(default: the spec's budget)")
    p.add_argument("--eval-tokens", type=positive_int, default=None, metavar="N",
                   help="the screen's evaluation size (kit dialect; default the spec's eval_tokens, 2,097,152)")
    p.add_argument("--confirm", action="store_true", help="confirm an ADOPT with new pairs at the spec's "
                   "promote_eval_tokens (20,971,520; kit dialect)")
    p.add_argument("--name", default=None, help="the comparison's study name (default SPEC-compare-HASH of what "
                   "is compared and how)")
    p.add_argument("--local-nodes", type=positive_int, default=None, metavar="N",
                   help="start a local Ray of N one-CPU nodes for the comparison (a demo of pairing across nodes)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object (schema "
                   "trnsweep.compare/1; the driver's lines go to stderr)")


def main(spec: StudySpec, url: str, args: argparse.Namespace, out: TextIO) -> int:
    n_sides = 1 + len(args.cands)
    try:
        defaults = Rule()
        rule = Rule(alpha=args.alpha, min_effect=args.min_effect, noise_sd=args.noise_sd or defaults.noise_sd,
                    max_pairs=max(defaults.min_pairs, args.max_runs // n_sides),
                    min_pairs=defaults.min_pairs, tolerance=args.step_tolerance or defaults.tolerance,
                    futile_first=args.futile_first)
    except ValueError as e:
        fail(str(e), url)
        return 2
    try:
        p = plan(spec, args.base, args.cands, rule, budget_s=args.budget_s, eval_tokens=args.eval_tokens,
                 first_seed=args.first_seed, name=args.name, confirm=args.confirm)
    except CompareError as e:
        fail(str(e), url)
        return 2
    log = sys.stderr if args.json else out
    driver = CompareDriver(p, out=log)
    study = driver.open_study()
    was = study.user_attrs.get(ATTR_COMPARE)
    if was is not None and _identity(was) != _identity(p.record):
        fail(f"study {p.spec.name!r} holds another comparison ({_describe(was)}): pick another --name", url)
        return 2
    st.retry(lambda: study.set_user_attr(ATTR_COMPARE, p.record), url=url)
    code = 0 if decided(p, study.get_trials(deepcopy=False)) else _run(driver, args.local_nodes, log)
    rep = rp.report(p, driver.study)
    rp.write_dashboard(driver.study, rep)
    if args.json:
        print(rp.as_json(rep), file=out, flush=True)
    else:
        rp.print_report(rep, out)
    return code


def decided(p: Plan, trials: list[Any]) -> bool:
    """Whether a comparison has nothing left to run: every candidate decided, no trial waiting or running."""
    if any(t.state.name in ("RUNNING", "WAITING") for t in trials):
        return False
    return all(open_stage(v, p.confirm) is None for v in verdicts(p, trials).values())


def _run(driver: CompareDriver, local_nodes: int | None, log: TextIO) -> int:
    cluster = local_cluster(local_nodes) if local_nodes else None
    if cluster is not None:
        print(f"ray: a local cluster of {local_nodes} one-CPU nodes at {cluster.address}", file=log, flush=True)
    try:
        return driver.run()
    finally:
        if cluster is not None:
            close_local_cluster(cluster)


def _identity(record: dict[str, Any]) -> dict[str, Any]:
    """What a resumed comparison must share with the first run: the sides and the rule, not the command's spelling."""
    sides = {k: {f: v for f, v in d.items() if f != "text"} for k, d in record.get("sides", {}).items()}
    return {**{k: v for k, v in record.items() if k not in ("sides", "spec_path")}, "sides": sides}


def _describe(record: dict[str, Any]) -> str:
    sides = record.get("sides", {})
    return " vs ".join(str(d.get("text")) for d in sides.values())
