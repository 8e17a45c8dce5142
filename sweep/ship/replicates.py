"""A promotion's replicates, read back: what one configuration is, a trial's value of a metric, each
configuration's mean with its Student-t interval, and whether a winner clears the runner-up.

:mod:`sweep.ship.promote` creates and runs the linked study ``NAME-promote-B``; this module only reads
it back (:func:`report`, and :func:`print_report` for the terminal).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from typing import Any, TextIO

from sweep.spec import objective as obj

SEED = "seed"  # the trainer's seed parameter: what varies between replicates
CONFIDENCE = 0.95
ATTR_PROMOTE = "promote"  # study user attribute of a linked study
ALONGSIDE = ("val_bpb", "core")  # record fields reported beside the ranked metric wherever recorded


# -- configurations and their metrics -------------------------------------------------------------

def config_key(params: dict[str, Any]) -> str:
    """What identifies a configuration: its parameters without the seed."""
    return json.dumps({k: v for k, v in params.items() if k != SEED}, sort_keys=True, default=str)


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


# -- the report as text ----------------------------------------------------------------------------

def print_report(rep: dict[str, Any], out: TextIO, study_arg: str | None = None) -> None:
    """The report as text; ``study_arg`` names the linked study in the ``export:`` hint (default its name)."""
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
        print(f"export: python -m sweep export {study_arg or rep['study']} --trial {best['trials'][0]} --out DIR",
              file=out)
    out.flush()
