"""Whether a candidate beats its base, from paired runs, with a stated false-adopt rate (docs/compare.md).

Each pair is a base and a candidate run with the same seed (so the same data order) on the same node (so the
node's offset cancels); its difference ``cand - base`` in val_bpb is negative where the candidate helps.
:func:`decide` puts a confidence sequence around the mean difference: an interval that holds at every look
at once, so the comparison may stop after any pair without inflating its error rate. :func:`fixed_rules`
is P's written rules (the strongest team's, docs/competition.md "How teams decided") for the benchmark to beat.
Pure statistics: stdlib only, so the command, the dashboard and bench/compare_bench.py decide alike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

VERDICTS = ("ADOPT", "DISCARD", "UNDECIDED", "CONTINUE")

# The sd of one paired difference at the 2M-token screen, from the teams' measurements (docs/competition.md): a run's
# seed-to-seed sd is 0.0006, of which data order (sd 0.0004) is shared by the pair and cancels; the rest,
# sqrt(0.0006^2 - 0.0004^2) = 0.00045, is taken as independent per side, and a same-seed rerun adds 5e-6:
# sqrt(2 * (0.0006^2 - 0.0004^2) + 2 * 5e-6^2) = 0.00063, rounded up to 0.0007. The warm-up spike path is
# not in it: a pair shares its seed's path unless the change re-rolls it, and the sample sd takes over then.
NOISE_SD = 0.0007
NOISE_SLACK = 1.5  # how far over the prior the sample sd may go before it replaces it (compare_bench measures)
TOLERANCE = 0.10  # a step or token count more than 10% apart is not a same-budget comparison (P's 0.90-1.10)

# P's fixed thresholds (one host: nominate or discard; two hosts: adopt).
P_NOMINATE = -0.0006
P_DISCARD = 0.0005
P_ADOPT_MEAN = -0.0010
P_AGREE = 0.0015

# A control this far from the mean of its node's earlier controls of the same seed is drift: a same-seed
# rerun differs by 5e-6, so P's 0.0010 leaves nothing but a changed node (or software) above it.
DRIFT_THRESHOLD = 0.0010
# Against earlier controls of other seeds, seed noise adds: the distance has sd 0.0006 * sqrt(1 + 1/k)
# (<= 0.00085), and a control that took the warm-up spike path while the earlier ones did not (or the
# reverse) sits 0.003 to 0.0045 off. 0.0060 is over the largest spike by 1.8 sd of that noise, so a
# spike path alone alarms for under 1% of controls (compare_bench.drift_false_alarms measures it).
DRIFT_THRESHOLD_OTHER_SEEDS = 0.0060

# The public-to-official offsets, from F's 15 uploads / n=18 (docs/competition.md "How teams decided").
SCREEN_TOKENS = 2_097_152
CONFIRM_TOKENS = 20_971_520
_OFFICIAL_OVER_SCREEN = (0.0067, 0.0004)  # official - public at 2M tokens, F's 15 uploads
_CONFIRM_OVER_SCREEN = (0.0071, 0.00012)  # public at 20M - public at 2M, F's n = 18


@dataclass(frozen=True)
class Pair:
    """A base run and a candidate run with the same seed on the same node; values are val_bpb."""

    seed: int
    node: str
    base: float | None
    cand: float | None
    base_steps: int | None = None
    cand_steps: int | None = None
    base_tokens: int | None = None
    cand_tokens: int | None = None
    base_dropped: str | None = None  # why the scorer would reject the run: over budget, causality failed...
    cand_dropped: str | None = None

    @property
    def diff(self) -> float | None:
        """``cand - base``: negative where the candidate helps; None where a side has no value."""
        if self.base is None or self.cand is None:
            return None
        return self.cand - self.base

    def problem(self, tolerance: float = TOLERANCE) -> str | None:
        """Why this pair cannot count (dropped, or not a same-budget comparison), or None where it can."""
        for side, value, dropped in (("base", self.base, self.base_dropped),
                                     ("candidate", self.cand, self.cand_dropped)):
            if dropped is not None:
                return f"dropped: {side} {dropped or 'rejected by the scorer'}"
            if value is None:
                return f"dropped: {side} has no value"
            if not math.isfinite(value):
                return f"dropped: {side} value {value} is not finite"
        for what, b, c in (("steps", self.base_steps, self.cand_steps),
                           ("tokens", self.base_tokens, self.cand_tokens)):
            if b is None or c is None or b == c:
                continue
            if b <= 0:
                return f"CONFOUNDED: {what} {b} vs {c} (the base has none)"
            apart = abs(c - b) / b
            if apart > tolerance:
                return f"CONFOUNDED: {what} {b} vs {c} ({apart:.1%} apart)"
        return None


@dataclass(frozen=True)
class Rule:
    """When to stop: the false-adopt rate, the effect that matters, the prior noise and the run cap."""

    alpha: float = 0.05  # the false-adopt rate: P(ADOPT) when the candidate does not help, at any look
    min_effect: float = 0.001  # a gain smaller than this does not matter (DISCARD rules out one this large)
    noise_sd: float = NOISE_SD  # the prior sd of one paired difference (see noise_slack)
    max_pairs: int = 8  # usable pairs at which it stops UNDECIDED (and 2 * max_pairs run in all)
    min_pairs: int = 2  # no verdict from fewer usable pairs: one pair cannot tell a gain from a spike path
    tolerance: float = TOLERANCE  # steps or tokens further apart than this confound a pair
    futility: float = 0.0  # stop UNDECIDED early when neither verdict has this chance by the cap (0: never)
    # The sample sd replaces the prior once it exceeds noise_slack x noise_sd: pairs that disagree beyond
    # what the stated noise explains (a spike path on one side) widen the interval; two pairs that agree
    # by chance never narrow it below the prior.
    noise_slack: float = NOISE_SLACK
    # A first usable pair showing less gain than this stops the comparison UNDECIDED (futile), as P's rules
    # stop a run that does not nominate; None: never. A stop that can only lower the false-adopt rate.
    futile_first: float | None = P_NOMINATE

    def __post_init__(self) -> None:
        def bad(field: str, need: str, got: object) -> ValueError:
            return ValueError(f"rule {field} must be {need}, got {got!r}")

        if not (isinstance(self.alpha, int | float) and 0 < self.alpha < 0.5):
            raise bad("alpha", "between 0 and 0.5", self.alpha)
        if not (isinstance(self.min_effect, int | float) and 0 < self.min_effect < math.inf):
            raise bad("min_effect", "a positive number", self.min_effect)
        if not (isinstance(self.noise_sd, int | float) and 0 < self.noise_sd < math.inf):
            raise bad("noise_sd", "a positive number", self.noise_sd)
        if not (isinstance(self.min_pairs, int) and not isinstance(self.min_pairs, bool) and self.min_pairs >= 1):
            raise bad("min_pairs", "an integer >= 1", self.min_pairs)
        if not (isinstance(self.max_pairs, int) and not isinstance(self.max_pairs, bool)
                and self.max_pairs >= self.min_pairs):
            raise bad("max_pairs", f"an integer >= min_pairs ({self.min_pairs})", self.max_pairs)
        if not (isinstance(self.tolerance, int | float) and 0 < self.tolerance < 1):
            raise bad("tolerance", "between 0 and 1", self.tolerance)
        if not (isinstance(self.futility, int | float) and 0 <= self.futility < 0.5):
            raise bad("futility", "between 0 and 0.5 (0: off)", self.futility)
        if not (isinstance(self.noise_slack, int | float) and 1 <= self.noise_slack < math.inf):
            raise bad("noise_slack", "a number >= 1", self.noise_slack)
        if self.futile_first is not None and not (isinstance(self.futile_first, int | float)
                                                  and math.isfinite(self.futile_first)):
            raise bad("futile_first", "a finite number or None", self.futile_first)


@dataclass(frozen=True)
class Verdict:
    """What a comparison says now; ``to_dict`` is the ``--json`` shape (docs/compare.md lists its keys)."""

    verdict: str  # ADOPT, DISCARD, UNDECIDED or CONTINUE (not stopped yet)
    pairs_used: int  # usable pairs the verdict rests on
    mean: float | None  # mean paired difference, cand - base
    lower: float | None  # the confidence sequence's interval for the true mean difference
    upper: float | None
    noise_sd: float | None  # the sd of a paired difference the interval used
    detectable: float | None  # at the cap: the smallest gain these pairs could have shown
    excluded: tuple[str, ...]  # one line per pair that does not count, with why
    reason: str  # one line for a person
    pairs_run: int  # every pair run, excluded ones included

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["excluded"] = list(self.excluded)
        return out


def _split(pairs: Sequence[Pair], tolerance: float) -> tuple[list[Pair], tuple[str, ...]]:
    usable, excluded = [], []
    for p in pairs:
        why = p.problem(tolerance)
        if why is None:
            usable.append(p)
        else:
            excluded.append(f"seed {p.seed} on {p.node}: {why}")
    return usable, tuple(excluded)


def _phi(x: float) -> float:
    """The standard normal distribution function."""
    return 0.5 * math.erfc(-x / math.sqrt(2))


@lru_cache(maxsize=4096)
def mixture_z(n: int, alpha: float, rho: float) -> float:
    """The one-sided normal-mixture boundary after ``n`` pairs, in sds of the mean: the sum S_n of
    standardised differences crosses it at any n with probability <= ``alpha`` (Ville's inequality on the
    mixture of exp(l S_n - l^2 n / 2) over l >= 0, l half-normal with precision ``rho``). The mixture is
    2 sqrt(rho / (n + rho)) exp(x^2 / 2) Phi(x) with x = S_n / sqrt(n + rho); the boundary is where it
    reaches 1 / alpha, found by bisection (it grows with x)."""
    target = math.log(1 / alpha) - math.log(2) - 0.5 * math.log(rho / (n + rho))
    lo, hi = 0.0, 64.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid * mid / 2 + math.log(_phi(mid)) >= target:
            hi = mid
        else:
            lo = mid
    return hi * math.sqrt((n + rho) / n)


@lru_cache(maxsize=256)
def mixture_rho(n: int, alpha: float) -> float:
    """The mixture precision that makes the boundary tightest at ``n`` pairs (golden-section on log rho)."""
    a, b = math.log(1e-3), math.log(1e3)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        c, d = b - g * (b - a), a + g * (b - a)
        if mixture_z(n, alpha, math.exp(c)) <= mixture_z(n, alpha, math.exp(d)):
            b = d
        else:
            a = c
    return math.exp((a + b) / 2)


def half_width(n: int, sd: float, rule: Rule) -> float:
    """How far the interval reaches from the mean after ``n`` usable pairs with paired sd ``sd``."""
    return sd * mixture_z(n, rule.alpha, mixture_rho(rule.min_pairs, rule.alpha)) / math.sqrt(n)


def chances_by_cap(n: int, mean: float, sd: float, rule: Rule) -> tuple[float, float]:
    """(P(ADOPT), P(DISCARD)) at the cap if the true mean were ``mean`` and the sd ``sd``: the mean after
    ``max_pairs`` pairs is normal around ``mean`` with sd ``sd * sqrt(max_pairs - n) / max_pairs``."""
    cap = rule.max_pairs
    if n >= cap:
        raise ValueError(f"{n} pairs are already at the cap of {cap}")
    reach = half_width(cap, sd, rule)
    spread = sd * math.sqrt(cap - n) / cap
    return _phi((-reach - mean) / spread), _phi((mean - reach + rule.min_effect) / spread)


def _fmt(x: float) -> str:
    return f"{x:+.5f}"


def decide(pairs: Sequence[Pair], rule: Rule) -> Verdict:
    """The verdict after the pairs run so far, in order; valid to call after every pair (docs/compare.md).

    ADOPT when the whole interval is below zero, DISCARD when it excludes a gain of ``min_effect``, both
    only from ``min_pairs`` usable pairs on; UNDECIDED at ``max_pairs`` usable pairs (or ``2 * max_pairs``
    run), with the smallest gain it could have detected; with ``rule.futility`` set, UNDECIDED early where
    neither verdict has that chance by the cap at the present mean and sd (a stop that can only lower the
    false-adopt rate); CONTINUE otherwise.
    """
    usable, excluded = _split(pairs, rule.tolerance)
    n, run = len(usable), len(pairs)
    out_of_runs = run >= 2 * rule.max_pairs
    if n == 0:
        verdict = "UNDECIDED" if out_of_runs else "CONTINUE"
        why = f"{run} pairs run, none usable" if run else "no pairs yet"
        return Verdict(verdict, 0, None, None, None, None, None, excluded, f"{verdict}: {why}", run)
    diffs = [p.diff for p in usable]
    mean = math.fsum(diffs) / n  # type: ignore[arg-type]  # usable pairs have both values
    spread = statistics.stdev(diffs) if n >= 2 else 0.0  # type: ignore[type-var]
    sd = spread if spread > rule.noise_slack * rule.noise_sd else rule.noise_sd
    half = half_width(n, sd, rule)
    lower, upper = mean - half, mean + half
    interval = f"mean {_fmt(mean)}, interval {_fmt(lower)} to {_fmt(upper)} over {n} pairs (sd {sd:.5f})"
    detectable = None
    if n >= rule.min_pairs and upper < 0:
        verdict, why = "ADOPT", f"the candidate lowers val_bpb: {interval}, all below zero"
    elif n >= rule.min_pairs and lower > -rule.min_effect:
        verdict, why = "DISCARD", f"no gain of {rule.min_effect:g} or more: {interval}"
    elif n >= rule.max_pairs or out_of_runs:
        verdict, detectable = "UNDECIDED", half
        cap = f"{n} usable pairs" if n >= rule.max_pairs else f"{run} pairs run"
        why = f"at the cap ({cap}): {interval}; the smallest gain it could detect is {half:.5f}"
    elif n == 1 and rule.futile_first is not None and mean > rule.futile_first:
        verdict, detectable = "UNDECIDED", half_width(rule.max_pairs, sd, rule)
        why = (f"futile: the first pair's difference {_fmt(mean)} shows less gain than {_fmt(rule.futile_first)} "
               f"(P's nominating threshold; futile_first), so no more pairs are run")
    elif rule.futility and n >= rule.min_pairs and max(chances_by_cap(n, mean, sd, rule)) < rule.futility:
        verdict, detectable = "UNDECIDED", half_width(rule.max_pairs, sd, rule)
        why = (f"futile: {interval}; neither verdict has a {rule.futility:g} chance by {rule.max_pairs} pairs, "
               f"where the smallest gain it could detect is {detectable:.5f}")
    else:
        verdict = "CONTINUE"
        why = interval + (f"; no verdict before {rule.min_pairs} usable pairs" if n < rule.min_pairs else "")
    return Verdict(verdict, n, mean, lower, upper, sd, detectable, excluded, f"{verdict}: {why}", run)


def _delta(p: Pair) -> float:
    """A usable pair's difference rounded to 1e-9 (far under the 5e-6 rerun noise), so that a delta written
    as 0.0005 meets P's ">= +0.0005" although 0.9605 - 0.96 is 0.00049999... in floating point."""
    return round(p.diff, 9)  # type: ignore[arg-type]


def fixed_rules(pairs: Sequence[Pair]) -> Verdict:
    """P's written rules on the pairs so far, in order: no stated error rate, no interval.

    One host (the first usable pair): a delta <= -0.0006 nominates (CONTINUE: replicate on another host),
    >= +0.0005 discards, anything between is UNDECIDED (no rule goes on). Two hosts (the first later usable
    pair on another node): both negative, mean <= -0.0010 and within 0.0015 of each other adopts; else
    either >= +0.0005 discards; else UNDECIDED. A step or token ratio outside 0.90-1.10 is CONFOUNDED.
    """
    usable, excluded = _split(pairs, TOLERANCE)
    run = len(pairs)

    def verdict(v: str, used: list[Pair], why: str) -> Verdict:
        mean = math.fsum(p.diff for p in used) / len(used) if used else None  # type: ignore[misc]
        return Verdict(v, len(used), mean, None, None, None, None, excluded, f"{v}: {why}", run)

    if not usable:
        return verdict("CONTINUE", [], "no usable pair yet")
    first = usable[0]
    d1 = _delta(first)
    if d1 >= P_DISCARD:
        return verdict("DISCARD", [first], f"one host: delta {_fmt(d1)} >= {_fmt(P_DISCARD)}")
    if d1 > P_NOMINATE:
        return verdict("UNDECIDED", [first], f"one host: delta {_fmt(d1)} between {_fmt(P_NOMINATE)} and "
                                             f"{_fmt(P_DISCARD)}; no rule continues")
    second = next((p for p in usable[1:] if p.node != first.node), None)
    if second is None:
        return verdict("CONTINUE", [first], f"NOMINATE: one host delta {_fmt(d1)}; replicate on another host")
    d2 = _delta(second)
    both = f"two hosts: deltas {_fmt(d1)} and {_fmt(d2)}"
    if d1 < 0 and d2 < 0 and (d1 + d2) / 2 <= P_ADOPT_MEAN and abs(d1 - d2) <= P_AGREE:
        return verdict("ADOPT", [first, second], f"{both}, both negative, mean <= {_fmt(P_ADOPT_MEAN)}, "
                                                 f"within {P_AGREE} of each other")
    if max(d1, d2) >= P_DISCARD:
        return verdict("DISCARD", [first, second], f"{both}, one >= {_fmt(P_DISCARD)}")
    return verdict("UNDECIDED", [first, second], f"{both}: neither adopt nor discard")


def drift_alarms(controls: Sequence[tuple[str, int, float]], threshold: float = DRIFT_THRESHOLD,
                 other_seeds_threshold: float = DRIFT_THRESHOLD_OTHER_SEEDS) -> list[str]:
    """One line per control (node, seed, val_bpb; in run order) that sits more than ``threshold`` from the
    mean of its node's earlier controls of the same seed, or, where the node has none of that seed, more
    than ``other_seeds_threshold`` from the mean of all its earlier controls (seed noise adds there)."""
    if not (threshold > 0 and other_seeds_threshold > 0):
        raise ValueError(f"drift thresholds must be positive, got {threshold!r} and {other_seeds_threshold!r}")
    seen: dict[str, list[tuple[int, float]]] = {}
    lines = []
    for node, seed, value in controls:
        earlier = seen.setdefault(node, [])
        same = [v for s, v in earlier if s == seed]
        ref, limit, kind = ((same, threshold, "same seed") if same
                            else ([v for _, v in earlier], other_seeds_threshold, "other seeds"))
        if ref and math.isfinite(value):
            mean = math.fsum(ref) / len(ref)
            if abs(value - mean) > limit:
                lines.append(f"drift on {node}: control seed {seed} = {value:.5f} is {_fmt(value - mean)} from "
                             f"the mean {mean:.5f} of {len(ref)} earlier controls ({kind}; limit {limit:g})")
        if math.isfinite(value):
            earlier.append((seed, value))
    return lines


def official_estimate(public: float, eval_tokens: int) -> tuple[float, float]:
    """(estimated official score, its sd) from a public val_bpb at a known evaluation size; an estimate:
    the offsets are F's 15 uploads / n=18 (docs/competition.md), not a property of this run."""
    if not math.isfinite(public):
        raise ValueError(f"public score must be finite, got {public!r}")
    official, sd = _OFFICIAL_OVER_SCREEN
    if eval_tokens == SCREEN_TOKENS:
        return public + official, sd
    if eval_tokens == CONFIRM_TOKENS:
        over, over_sd = _CONFIRM_OVER_SCREEN
        return public - over + official, math.hypot(sd, over_sd)
    raise ValueError(f"no known offset for {eval_tokens} tokens")
