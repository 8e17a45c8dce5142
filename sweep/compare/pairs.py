"""A comparison's trials read back as pairs: each pair's latest run per side, a candidate's finished pairs in
planned order, each candidate's verdict per stage, and the controls the drift alarm reads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from sweep.compare.decision import Pair, Verdict, decide
from sweep.compare.plan import BASE, Plan, side_of
from sweep.run.outcome import ATTR_FAIL_KIND, ATTR_FAIL_REASON, ATTR_NODE, ATTR_STARTED
from sweep.spec.script import SEED_KEY
from sweep.spec.studyspec import PAIR, SIDE

ATTR_NODE_WANTED = "compare_node"  # trial user attribute: the node its pair runs on


# -- what ran: the pairs ----------------------------------------------------------------------------

@dataclasses.dataclass
class Run:
    """One finished (or pending) side of a pair, as the study holds it."""

    trial: int
    state: str
    value: float | None
    node: str | None
    steps: int | None
    tokens: int | None
    dropped: str | None
    started: float | None = None  # unix time its supervisor started


def _run_of(t: Any) -> Run:
    attrs = t.user_attrs
    state = t.state.name
    value = float(t.values[0]) if state == "COMPLETE" and t.values else None
    dropped = None
    if state == "COMPLETE" and (value is None or not math.isfinite(value)):
        dropped = "non-finite value"
    elif state in ("FAIL", "PRUNED"):
        kind = attrs.get(ATTR_FAIL_KIND) or state.lower()
        dropped = f"{kind}: {attrs.get(ATTR_FAIL_REASON) or state}"
    steps = attrs.get("num_steps", attrs.get("steps"))
    tokens = attrs.get("tokens")
    if tokens is None and isinstance(attrs.get("total_tokens_M"), (int, float)):
        tokens = round(float(attrs["total_tokens_M"]) * 1e6)
    node = t.system_attrs.get(ATTR_NODE) or attrs.get(ATTR_NODE_WANTED)  # where it ran, else where it was sent
    return Run(t.number, state, value, node[:8] if isinstance(node, str) else None,
               int(steps) if isinstance(steps, (int, float)) else None,
               int(tokens) if isinstance(tokens, (int, float)) else None, dropped,
               float(started) if isinstance(started := t.system_attrs.get(ATTR_STARTED), (int, float)) else None)


def runs_by_pair(trials: Sequence[Any]) -> dict[int, dict[str, Run]]:
    """Each pair's latest trial per side (a retry replaces the trial it retries)."""
    out: dict[int, dict[str, Run]] = {}
    latest: dict[tuple[int, str], Any] = {}
    for t in trials:
        if SIDE not in t.params or PAIR not in t.params:
            continue
        k = (int(t.params[PAIR]), str(t.params[SIDE]))
        if k not in latest or t.number > latest[k].number:
            latest[k] = t
    for (pair, side), t in sorted(latest.items()):
        out.setdefault(pair, {})[side] = _run_of(t)
    return out


def seeds_by_pair(trials: Sequence[Any]) -> dict[int, int]:
    return {int(t.params[PAIR]): int(t.params[SEED_KEY]) for t in trials
            if PAIR in t.params and SEED_KEY in t.params}


def finished(r: Run | None) -> bool:
    return r is not None and r.state in ("COMPLETE", "FAIL", "PRUNED")


def pairs_for(label: str, by_pair: Mapping[int, Mapping[str, Run]], seeds: Mapping[int, int],
              stage: str = "screen") -> list[Pair]:
    """The candidate ``label``'s finished pairs of one stage, in pair order, up to the first unfinished one
    (the confidence sequence reads the pairs in the order they were planned, never as they happen to end)."""
    out: list[Pair] = []
    for p in sorted(by_pair):
        sides = by_pair[p]
        base, cand = sides.get(side_of(BASE, stage)), sides.get(side_of(label, stage))
        if base is None and cand is None:
            continue
        if cand is None and base is not None:  # this candidate was decided before the pair: not its pair
            continue
        if not (finished(base) and finished(cand)):
            break
        assert base is not None and cand is not None
        split = cand.node != base.node and None not in (cand.node, base.node)
        out.append(Pair(seed=seeds.get(p, p), node=base.node or "?", base=base.value, cand=cand.value,
                        base_steps=base.steps, cand_steps=cand.steps, base_tokens=base.tokens,
                        cand_tokens=cand.tokens, base_dropped=base.dropped,
                        cand_dropped=cand.dropped or (f"ran on node {cand.node}, its control on {base.node}"
                                                      if split else None)))
    return out


def stage_pairs(plan_: Plan, label: str, by_pair: Mapping[int, Mapping[str, Run]],
                seeds: Mapping[int, int]) -> dict[str, tuple[list[Pair], Verdict]]:
    """A candidate's pairs and verdict per stage: the screen's, and the confirmation's only where the screen
    adopted it (``--confirm``; with no pair yet it is CONTINUE, so the screen's ADOPT is not the verdict)."""
    pairs = pairs_for(label, by_pair, seeds)
    out = {"screen": (pairs, decide(pairs, plan_.rule))}
    if plan_.confirm and out["screen"][1].verdict == "ADOPT":
        pairs = pairs_for(label, by_pair, seeds, "confirm")
        out["confirm"] = (pairs, decide(pairs, plan_.rule))
    return out


def verdicts(plan_: Plan, trials: Sequence[Any]) -> dict[str, dict[str, Verdict]]:
    """Each candidate's verdict per stage (:func:`stage_pairs`)."""
    by_pair, seeds = runs_by_pair(trials), seeds_by_pair(trials)
    return {label: {stage: v for stage, (_, v) in stage_pairs(plan_, label, by_pair, seeds).items()}
            for label in plan_.candidates}


def open_stage(v: Mapping[str, Verdict], confirm: bool) -> str | None:
    """The stage a candidate still needs pairs of, or None when it is decided."""
    if v["screen"].verdict == "CONTINUE":
        return "screen"
    confirmation = v.get("confirm")
    if confirm and confirmation is not None and confirmation.verdict == "CONTINUE":
        return "confirm"
    return None


def controls(by_pair: Mapping[int, Mapping[str, Run]], seeds: Mapping[int, int]) -> list[tuple[str, int, float]]:
    return [(r.node or "?", seeds.get(p, p), r.value) for p in sorted(by_pair)
            for side, r in by_pair[p].items() if side.split("@")[0] == BASE and r.value is not None]
