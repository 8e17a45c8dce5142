"""A comparison read back: the report an agent loop gates on (``--json``, schema ``trnsweep.compare/1`` in
``sweep/compare/schema.json``), the table a person reads, and the dashboard's view of it.

The report is built from the study alone (its record and trials), so ``compare`` run again on a finished
comparison prints the same report without running anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from sweep.compare.decision import (
    DRIFT_THRESHOLD,
    DRIFT_THRESHOLD_OTHER_SEEDS,
    NOISE_SD,
    decide,
    drift_alarms,
    official_estimate,
)
from sweep.compare.pairs import controls, runs_by_pair, seeds_by_pair, stage_pairs
from sweep.compare.plan import BASE, STAGES, Plan, side_of

SCHEMA = "trnsweep.compare/1"
SCHEMA_PATH = Path(__file__).with_name("schema.json")


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _looks(pairs: Sequence[Any], rule: Any) -> list[dict[str, Any]]:
    """The interval after each usable pair: how it narrowed (the dashboard's figure)."""
    out = []
    for k in range(1, len(pairs) + 1):
        v = decide(pairs[:k], rule)
        if v.mean is not None:
            out.append({"pairs": k, "mean": v.mean, "lower": v.lower, "upper": v.upper, "verdict": v.verdict})
    return out


def _estimate(values: Sequence[float], eval_tokens: int | None) -> dict[str, Any] | None:
    if not values or eval_tokens is None:
        return None
    try:
        est, sd = official_estimate(statistics.fmean(values), eval_tokens)
    except ValueError:
        return None
    return {"official": est, "sd": sd, "from_public": statistics.fmean(values), "eval_tokens": eval_tokens,
            "label": "estimate"}


def report(plan: Plan, study: Any) -> dict[str, Any]:
    """Everything the comparison knows, as one JSON-ready object (schema ``trnsweep.compare/1``)."""
    trials = study.get_trials(deepcopy=False)
    by_pair, seeds = runs_by_pair(trials), seeds_by_pair(trials)
    rec = study.user_attrs.get("compare") or plan.record
    cands = []
    for label in plan.candidates:
        stages = []
        for stage, (pairs, v) in stage_pairs(plan, label, by_pair, seeds).items():
            usable = [p for p in pairs if p.problem(plan.rule.tolerance) is None]
            tokens = plan.eval_tokens(stage)
            stages.append({"stage": stage, **v.to_dict(), "looks": _looks(usable, plan.rule), "eval_tokens": tokens,
                           "estimate": {"base": _estimate([p.base for p in usable], tokens),
                                        "cand": _estimate([p.cand for p in usable], tokens)}})
        cands.append({"label": label, "side": rec["sides"].get(label, {}), "verdict": stages[-1]["verdict"],
                      "stages": stages})
    pair_rows = [{"pair": p, "seed": seeds.get(p), "runs": {side: dataclasses.asdict(r) for side, r in
                                                            sorted(by_pair[p].items())}} for p in sorted(by_pair)]
    runs = sum(t.state.name in ("COMPLETE", "PRUNED", "FAIL") for t in trials)  # every run that ended
    verdict = _overall([c["verdict"] for c in cands])
    return {"schema": SCHEMA, "comparison": study.study_name, "spec": rec.get("spec"),
            "base": rec["sides"].get(BASE, {}), "candidates": cands, "pairs": pair_rows,
            "drift_alarms": drift(controls(by_pair, seeds), plan.rule.noise_sd),
            "runs_used": runs, "rule": {"alpha": plan.rule.alpha, "min_effect": plan.rule.min_effect,
                                        "noise_sd": plan.rule.noise_sd, "max_pairs": plan.rule.max_pairs,
                                        "min_pairs": plan.rule.min_pairs, "tolerance": plan.rule.tolerance},
            "budget_s": rec.get("budget_s"), "eval_tokens": rec.get("eval_tokens"), "verdict": verdict}


def drift(controls_: Sequence[tuple[str, int, float]], noise_sd: float) -> list[str]:
    """The drift alarms, their thresholds (the teams', for their noise) scaled by the noise the comparison
    states: a laptop's runs, stated 0.01 apart, alarm where a trn2 node's would at 0.0007."""
    scale = max(1.0, noise_sd / NOISE_SD)
    return drift_alarms(controls_, DRIFT_THRESHOLD * scale, DRIFT_THRESHOLD_OTHER_SEEDS * scale)


def _overall(verdicts: Sequence[str]) -> str:
    """One word for the whole comparison: the single candidate's verdict; of several, CONTINUE while any is,
    else ADOPT if any is adopted, else UNDECIDED if any is, else DISCARD."""
    for word in ("CONTINUE", "ADOPT", "UNDECIDED", "DISCARD"):
        if word in verdicts:
            return word
    return "UNDECIDED"


def _f(v: Any, digits: int = 4, signed: bool = False) -> str:
    n = _num(v)
    if n is None:
        return "-"
    return f"{n:+.{digits}f}" if signed else f"{n:.{digits}f}"


def _interval(x: Mapping[str, Any]) -> str:
    return f"[{_f(x['lower'], signed=True)}, {_f(x['upper'], signed=True)}]"


def _cell(r: Mapping[str, Any] | None) -> str:
    """A run's value; ``x`` dropped, ``.`` not run (yet)."""
    if r is None:
        return "."
    return _f(r["value"]) if r["value"] is not None else ("x" if r["dropped"] else "...")


def _side_text(d: Mapping[str, Any]) -> str:
    if d.get("kind") == "script":
        return f"{d.get('text')} (sha256 {str(d.get('sha256'))[:12]})"
    return str(d.get("text"))


def print_report(rep: Mapping[str, Any], out: TextIO) -> None:
    rule = rep["rule"]
    print(f"comparison {rep['comparison']} (spec {rep['spec']}, {rep['budget_s']:g} s per run"
          + (f", {rep['eval_tokens']:,} evaluation tokens" if rep.get("eval_tokens") else "") + ")", file=out)
    print(f"  base: {_side_text(rep['base'])}", file=out)
    for c in rep["candidates"]:
        print(f"  {c['label']}: {_side_text(c['side'])}", file=out)
    labels = [BASE] + [c["label"] for c in rep["candidates"]]
    head = "".join(f" {label[:9]:>9}" for label in labels)
    print(f"{'pair':>4} {'seed':>4} {'node':>8}{head}  steps", file=out)
    for row in rep["pairs"]:
        runs = row["runs"]
        node = next((r["node"] for r in runs.values() if r["node"]), "?")
        for stage in STAGES:
            cells = [runs.get(side_of(label, stage)) for label in labels]
            if not any(cells):
                continue
            vals = "".join(f" {_cell(r):>9}" for r in cells)
            steps = "/".join(str(r["steps"]) if r and r["steps"] is not None else "-" for r in cells)
            tag = "" if stage == "screen" else f" {stage}"
            print(f"{row['pair']:>4} {row['seed']:>4} {str(node)[:8]:>8}{vals}  {steps}{tag}", file=out)
    conf = round(100 * (1 - 2 * rule["alpha"]))
    for c in rep["candidates"]:
        for s in c["stages"]:
            if s["mean"] is None:
                print(f"{c['label']} ({s['stage']}): no usable pair yet", file=out)
            else:
                print(f"{c['label']} ({s['stage']}): mean effect {_f(s['mean'], signed=True)} val_bpb, {conf}% "
                      f"confidence sequence {_interval(s)} after {s['pairs_used']} pair(s); "
                      f"noise sd {_f(s['noise_sd'])}", file=out)
            for line in s["excluded"]:
                print(f"  excluded: {line}", file=out)
            est = s.get("estimate") or {}
            if est.get("base") and est.get("cand"):
                b, k = est["base"], est["cand"]
                print(f"  official score (estimate from the public {b['eval_tokens']:,}-token figure): base "
                      f"{b['official']:.4f} ± {b['sd']:.4f}, {c['label']} {k['official']:.4f} ± {k['sd']:.4f}",
                      file=out)
        print(f"verdict {c['label']}: {c['stages'][-1]['reason']}", file=out)
    for line in rep["drift_alarms"]:
        print(f"drift alarm: {line}", file=out)
    print(f"runs used: {rep['runs_used']} (false-adopt rate at most {rule['alpha']:g} per candidate; "
          f"the effect that matters: {rule['min_effect']:g})", file=out)
    out.flush()


# -- the dashboard's view ---------------------------------------------------------------------------

def note(rep: Mapping[str, Any]) -> str:
    """The comparison's study note: the verdicts, the paired differences and the interval at each look."""
    lines = [f"# Comparison {rep['comparison']}", "", f"Base: `{_side_text(rep['base'])}`", ""]
    for c in rep["candidates"]:
        lines += [f"## {c['label']}: **{c['verdict']}**", "", f"`{_side_text(c['side'])}`", "",
                  c["stages"][-1]["reason"], ""]
        for s in c["stages"]:
            lines += [f"{s['stage']}: the interval as it narrowed", "", "| pairs | mean | interval | verdict |",
                      "|---|---|---|---|"]
            lines += [f"| {x['pairs']} | {_f(x['mean'], signed=True)} | {_interval(x)} | {x['verdict']} |"
                      for x in s["looks"]]
            lines.append("")
    lines += ["## Pairs", "", "| pair | seed | side | trial | node | value | steps | dropped |",
              "|---|---|---|---|---|---|---|---|"]
    for row in rep["pairs"]:
        for side, r in row["runs"].items():
            lines.append(f"| {row['pair']} | {row['seed']} | {side} | {r['trial']} | {r['node']} | {_f(r['value'])} | "
                         f"{r['steps'] if r['steps'] is not None else '-'} | {r['dropped'] or ''} |")
    for a in rep["drift_alarms"]:
        lines.append(f"\nDrift alarm: {a}")
    return "\n".join(lines) + "\n"


def figure(rep: Mapping[str, Any]) -> Any:
    """Paired differences per candidate and the confidence sequence after each pair, as a plotly figure."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for c in rep["candidates"]:
        for s in c["stages"]:
            looks = s["looks"]
            if not looks:
                continue
            x = [p["pairs"] for p in looks]
            name = f"{c['label']} {s['stage']}"
            fig.add_trace(go.Scatter(x=x, y=[p["mean"] for p in looks], mode="lines+markers", name=f"{name}: mean",
                                     error_y={"type": "data", "symmetric": False,
                                              "array": [p["upper"] - p["mean"] for p in looks],
                                              "arrayminus": [p["mean"] - p["lower"] for p in looks]}))
    fig.add_hline(y=0.0, line_dash="dot")
    fig.update_layout(title=f"{rep['comparison']}: mean paired difference (candidate - base, val_bpb) and its "
                      "confidence sequence after each pair", xaxis_title="pairs", yaxis_title="difference")
    return fig


def write_dashboard(study: Any, rep: Mapping[str, Any]) -> str | None:
    """The note and the figure on the comparison's study page; the error's text when they could not be written."""
    from sweep.run.notes import guarded

    def write() -> None:
        import optuna_dashboard

        optuna_dashboard.save_note(study, note(rep))
        optuna_dashboard.save_plotly_graph_object(study, figure(rep), graph_object_id="compare")

    return guarded("comparison note", write)


def as_json(rep: Mapping[str, Any]) -> str:
    return json.dumps(rep, sort_keys=True, default=str)
