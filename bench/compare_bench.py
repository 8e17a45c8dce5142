"""``sweep compare``'s decision against P's fixed rules, on simulated paired runs (docs/compare.md).

A simulated trainer gives each run val_bpb = 0.96 + effect (candidate only) + the node's offset (shared by
the pair) + a data-order term (sd 0.0004, shared by the pair's seed) + the rest of the seed noise (sd
sqrt(0.0006^2 - 0.0004^2), drawn per side: a change perturbs the trajectory) + the warm-up spike path (a
seed takes it with p 0.4, +U(0.003, 0.0045); the candidate keeps its base's draw with p ``spike_shared``,
else draws its own) + rerun noise (sd 5e-6): the teams' measurements (docs/competition.md). 3% of pairs have a
side 12-20% short of steps (CONFOUNDED) and 1% a side the scorer drops; they count as runs. Pairs rotate
over two nodes with distinct seeds. Both methods read the same pairs, in order, until they stop.

``python -m bench.compare_bench variants`` gives the false-adopt rate under other noise models and seeds.
``python -m bench compare_bench`` prints one row per method, spike model and true effect with the keys
``method effect alpha comparisons adopt_rate discard_rate undecided_rate mean_runs spike_shared adopt_se``
(``adopt_se``: the Monte-Carlo standard error of ``adopt_rate``). The goal: at effect 0 ``adopt_rate`` at or
under ``alpha`` for ``sequential``; at -0.002 its ``mean_runs`` no more than ``fixed_rules``' at an
``adopt_rate`` at least theirs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sweep.compare.decision import Pair, Rule, Verdict, decide, drift_alarms, fixed_rules

BASE_BPB = 0.96
NODE_SD = 0.0005  # node offsets: they cancel within a pair, so their size does not matter to the decision
STEPS = 1200
SPIKE_SHARED = 0.5  # the default model: no measurement says how often a change re-rolls a seed's spike path
EFFECTS = (0.0, -0.001, -0.002, 0.001)
KEYS = ("method", "effect", "alpha", "comparisons", "adopt_rate", "discard_rate", "undecided_rate",
        "mean_runs", "spike_shared", "adopt_se", "max_pairs")


@dataclass(frozen=True)
class Model:
    """The simulated trainer's noise; the defaults are the teams' measurements (docs/competition.md)."""

    seed_sd: float = 0.0006  # F's seed-to-seed sd at the 2M-token screen, spike path aside
    order_sd: float = 0.0004  # data order, shared by a pair's seed
    rerun_sd: float = 5e-6  # the same seed run again
    spike_p: float = 0.4  # the share of seeds that take the warm-up spike path
    spike_lo: float = 0.003
    spike_hi: float = 0.0045
    spike_shared: float = SPIKE_SHARED  # P(the candidate keeps its base's spike draw)
    nodes: int = 2
    confound_p: float = 0.03  # a pair with a side 12-20% short of steps
    drop_p: float = 0.01  # a pair with a side the scorer drops

    def spike(self, rng: random.Random) -> float:
        return rng.uniform(self.spike_lo, self.spike_hi) if rng.random() < self.spike_p else 0.0


def simulate_pairs(rng: random.Random, effect: float, model: Model, count: int) -> list[Pair]:
    """``count`` pairs of one comparison, in run order."""
    rest_sd = math.sqrt(model.seed_sd ** 2 - model.order_sd ** 2)
    offsets = [rng.gauss(0, NODE_SD) for _ in range(model.nodes)]
    pairs = []
    for k in range(count):
        node = k % model.nodes
        order = rng.gauss(0, model.order_sd)
        spike_b = model.spike(rng)
        spike_c = spike_b if rng.random() < model.spike_shared else model.spike(rng)
        shared = BASE_BPB + offsets[node] + order
        base = shared + rng.gauss(0, rest_sd) + spike_b + rng.gauss(0, model.rerun_sd)
        cand = shared + effect + rng.gauss(0, rest_sd) + spike_c + rng.gauss(0, model.rerun_sd)
        base_steps, cand_steps = STEPS + round(rng.gauss(0, 5)), STEPS + round(rng.gauss(0, 5))
        if rng.random() < model.confound_p:  # one side ran slow: a different budget, not a comparison
            cand_steps = round(cand_steps * rng.uniform(0.80, 0.88))
        dropped = "over budget" if rng.random() < model.drop_p else None
        pairs.append(Pair(seed=1000 + k, node=f"node-{node}", base=base, cand=cand,
                          base_steps=base_steps, cand_steps=cand_steps, cand_dropped=dropped))
    return pairs


def run_until_stop(pairs: Sequence[Pair], method: Callable[[Sequence[Pair]], Verdict]) -> tuple[str, int]:
    """(verdict, runs of both sides) for a method given the pairs one at a time until it stops."""
    for k in range(1, len(pairs) + 1):
        v = method(pairs[:k])
        if v.verdict != "CONTINUE":
            return v.verdict, 2 * k
    return "UNDECIDED", 2 * len(pairs)


def compare(effect: float, model: Model, comparisons: int, seed: int, rule: Rule) -> list[dict[str, Any]]:
    """The two methods' rows for one true effect and noise model, on the same simulated pairs."""
    rng = random.Random(f"{seed}/{effect}/{model}")
    methods: dict[str, Callable[[Sequence[Pair]], Verdict]] = {
        "sequential": lambda ps: decide(ps, rule), "fixed_rules": fixed_rules}
    tallies = {m: {"ADOPT": 0, "DISCARD": 0, "UNDECIDED": 0, "runs": 0} for m in methods}
    for _ in range(comparisons):
        pairs = simulate_pairs(rng, effect, model, 2 * rule.max_pairs)
        for name, method in methods.items():
            verdict, runs = run_until_stop(pairs, method)
            tallies[name][verdict] += 1
            tallies[name]["runs"] += runs
    rows = []
    for name, t in tallies.items():
        adopt = t["ADOPT"] / comparisons
        rows.append({"method": name, "effect": effect, "alpha": rule.alpha, "comparisons": comparisons,
                     "adopt_rate": round(adopt, 4), "discard_rate": round(t["DISCARD"] / comparisons, 4),
                     "undecided_rate": round(t["UNDECIDED"] / comparisons, 4),
                     "mean_runs": round(t["runs"] / comparisons, 3), "spike_shared": model.spike_shared,
                     "adopt_se": round(math.sqrt(adopt * (1 - adopt) / comparisons), 4)})
    return rows


def drift_false_alarms(controls: int = 20000, per_node: int = 8, seed: int = 36, model: Model = Model()) -> float:
    """The share of controls that raise a drift alarm where nothing drifted: a node's controls with
    distinct seeds (as a comparison runs them), seed noise and spike paths only."""
    rng = random.Random(seed)
    alarms = total = 0
    for _ in range(controls // per_node):
        offset = rng.gauss(0, NODE_SD)
        runs = [("node-0", k, BASE_BPB + offset + rng.gauss(0, model.seed_sd) + model.spike(rng))
                for k in range(per_node)]
        alarms += len(drift_alarms(runs))
        total += per_node - 1  # the first control has nothing to drift from
    return alarms / total


def run(comparisons: int = 2000, seed: int = 36, effects: Iterable[float] = EFFECTS,
        spike_models: Iterable[float] = (SPIKE_SHARED, 0.0, 1.0), rule: Rule | None = None,
        model: Model = Model()) -> list[dict[str, Any]]:
    """Rows for every spike model and effect at the default rule (a cap of 8 usable pairs): the default model
    first, then the worst case (0: every change re-rolls the spike path), then the best (1: no change does);
    then the default model at P's budget (a cap of 2 pairs, ``--max-runs 4``), where the two methods spend
    the same runs. Each row says its cap (``max_pairs``)."""
    rule = rule or Rule()
    rows = [{**row, "max_pairs": rule.max_pairs} for shared in spike_models for effect in effects
            for row in compare(effect, replace(model, spike_shared=shared), comparisons, seed, rule)]
    tight = replace(rule, max_pairs=2)
    rows += [{**row, "max_pairs": tight.max_pairs} for effect in effects
             for row in compare(effect, model, comparisons, seed, tight)]
    return rows


VARIANTS = {
    "default": Model(),
    "spike_p 0.3": Model(spike_p=0.3),
    "spike_p 0.5": Model(spike_p=0.5),
    "spikes 0.002-0.003": Model(spike_lo=0.002, spike_hi=0.003),  # F's 0.0010-0.0012 sd with spikes
    "seed_sd 0.0007": Model(seed_sd=0.0007),  # a paired sd of 0.00081, over the prior 0.0007
    "3 nodes": Model(nodes=3),
    "no confounded or dropped": Model(confound_p=0.0, drop_p=0.0),
    "spike_shared 0.75": Model(spike_shared=0.75),
    "spike_shared 0.25": Model(spike_shared=0.25),
}


def variants(comparisons: int = 4000, seeds: Sequence[int] = (1, 2, 3)) -> list[dict[str, Any]]:
    """The false-adopt rate at effect 0 under other noise models and bench seeds (docs/compare.md)."""
    rows = []
    for name, model in VARIANTS.items():
        for seed in seeds:
            seq, fixed = compare(0.0, model, comparisons, seed, Rule())
            rows.append({"model": name, "seed": seed, "comparisons": comparisons, "adopt_rate": seq["adopt_rate"],
                         "adopt_se": seq["adopt_se"], "fixed_rules_adopt_rate": fixed["adopt_rate"]})
    return rows


if __name__ == "__main__":
    import json
    import sys

    for r in variants() if sys.argv[1:] == ["variants"] else run():
        print(json.dumps(r))
