"""sweep.compare.decision on hand-made pairs, its interval against an independent computation, P's rules,
the drift alarm, the official estimate, and a small run of the benchmark (bench/compare_bench.py)."""

from __future__ import annotations

import json
import math
import random

import pytest
from scipy import integrate, optimize

from bench import compare_bench
from sweep.compare.decision import (
    NOISE_SD,
    Pair,
    Rule,
    chances_by_cap,
    decide,
    drift_alarms,
    fixed_rules,
    half_width,
    mixture_rho,
    mixture_z,
    official_estimate,
)

RULE = Rule()


def pairs(*diffs: float, node: str = "node-a", start: int = 0) -> list[Pair]:
    """Pairs with the given differences, alternating over two nodes unless ``node`` is fixed."""
    return [Pair(seed=start + i, node=node if node != "alt" else f"node-{i % 2}", base=0.96, cand=0.96 + d,
                 base_steps=1200, cand_steps=1200) for i, d in enumerate(diffs)]


# --- decide ---------------------------------------------------------------------------------------------


def test_two_clear_gains_adopt_with_the_interval_below_zero():
    v = decide(pairs(-0.0030, -0.0031), RULE)
    assert v.verdict == "ADOPT" and v.pairs_used == 2 and v.pairs_run == 2
    assert v.upper < 0 and v.lower < v.mean < v.upper
    assert v.noise_sd == NOISE_SD  # the sample sd (0.00007) is under the prior, so the prior is used
    assert v.detectable is None and v.excluded == ()
    assert v.reason.startswith("ADOPT: ")


def test_no_adopt_before_min_pairs_however_large_the_gain():
    assert decide(pairs(-0.01), RULE).verdict == "CONTINUE"
    assert "no verdict before 2 usable pairs" in decide(pairs(-0.01), RULE).reason
    assert decide(pairs(-0.01), Rule(min_pairs=1)).verdict == "ADOPT"
    v = decide(pairs(-0.01, -0.01, -0.01), Rule(min_pairs=3, max_pairs=4))
    assert v.verdict == "ADOPT"
    assert decide(pairs(-0.01, -0.01), Rule(min_pairs=3, max_pairs=4)).verdict == "CONTINUE"


def test_no_discard_before_min_pairs_either():
    assert decide(pairs(0.01), Rule(futile_first=None)).verdict == "CONTINUE"
    assert decide(pairs(0.01, 0.01), Rule(futile_first=None)).verdict == "DISCARD"


def test_a_first_pair_short_of_the_nominating_gain_stops_undecided_as_futile():
    v = decide(pairs(-0.0005), RULE)  # P's nominating threshold is -0.0006: less gain than that stops
    assert v.verdict == "UNDECIDED" and v.reason.startswith("UNDECIDED: futile: the first pair's difference -0.00050")
    assert decide(pairs(-0.0007), RULE).verdict == "CONTINUE"  # enough gain to go on
    assert decide(pairs(-0.0005), Rule(futile_first=None)).verdict == "CONTINUE"
    assert decide(pairs(-0.0005), Rule(futile_first=-0.0004)).verdict == "CONTINUE"
    assert decide(pairs(-0.0030, 0.0001), RULE).verdict == "CONTINUE"  # only the first look stops


def test_the_sample_sd_replaces_the_prior_only_past_the_slack():
    calm = decide(pairs(-0.0030, -0.0030 + 0.0014), RULE)  # sample sd 0.00099 < 1.5 x 0.0007: the prior
    wide = decide(pairs(-0.0030, -0.0030 + 0.0016), RULE)  # sample sd 0.00113 > 0.00105: the sample sd
    assert calm.noise_sd == NOISE_SD
    assert wide.noise_sd == pytest.approx(0.0016 / math.sqrt(2))
    assert decide(pairs(-0.0030, -0.0030 + 0.0014), Rule(noise_slack=1.0)).noise_sd == pytest.approx(
        0.0014 / math.sqrt(2))


def test_a_gain_ruled_out_discards():
    v = decide(pairs(0.0010, 0.0012), RULE)
    assert v.verdict == "DISCARD"
    assert v.lower > -RULE.min_effect and v.upper > 0


def test_a_small_gain_not_yet_resolved_continues():
    v = decide(pairs(-0.0005, -0.0008), RULE)
    assert v.verdict == "CONTINUE"
    assert v.lower < -RULE.min_effect and v.upper > 0 and v.detectable is None


def test_at_the_cap_undecided_with_the_smallest_detectable_gain():
    diffs = [0.0015, -0.0015] * 4
    v = decide(pairs(*diffs, node="alt"), RULE)
    assert v.verdict == "UNDECIDED" and v.pairs_used == RULE.max_pairs
    assert v.noise_sd == pytest.approx(0.0015 * math.sqrt(8 / 7))  # the sample sd, over the prior
    assert v.detectable == pytest.approx(v.upper - v.mean)
    assert v.detectable == pytest.approx(half_width(8, v.noise_sd, RULE))
    assert v.lower < 0 < v.upper
    assert "smallest gain it could detect" in v.reason
    assert decide(pairs(*diffs[:7], node="alt"), RULE).verdict == "CONTINUE"


def test_a_confounded_pair_is_excluded_with_its_line():
    bad = Pair(seed=3, node="node-a", base=0.96, cand=0.90, base_steps=1200, cand_steps=1050)
    v = decide([*pairs(-0.0005), bad, *pairs(-0.0008, start=4)], RULE)
    assert v.excluded == ("seed 3 on node-a: CONFOUNDED: steps 1200 vs 1050 (12.5% apart)",)
    assert v.pairs_used == 2 and v.pairs_run == 3
    assert v.mean == pytest.approx(-0.00065)  # the confounded -0.06 is not in it
    assert v.verdict == "CONTINUE"


def test_the_confounding_limit_is_inclusive_and_counts_tokens_too():
    at_limit = Pair(1, "n", 0.96, 0.96, base_steps=1200, cand_steps=1080, base_tokens=1000, cand_tokens=1100)
    assert at_limit.problem() is None
    tokens = Pair(1, "n", 0.96, 0.96, base_tokens=1000, cand_tokens=1101)
    assert tokens.problem() == "CONFOUNDED: tokens 1000 vs 1101 (10.1% apart)"
    assert tokens.problem(tolerance=0.2) is None
    no_steps = Pair(1, "n", 0.96, 0.96, base_steps=0, cand_steps=5)
    assert no_steps.problem() == "CONFOUNDED: steps 0 vs 5 (the base has none)"


def test_dropped_and_missing_runs_are_excluded_with_the_reason():
    rows = [
        Pair(1, "node-a", 0.96, 0.95, base_dropped="over budget"),
        Pair(2, "node-b", 0.96, 0.95, cand_dropped="causality failed"),
        Pair(3, "node-a", 0.96, None),
        Pair(4, "node-b", 0.96, math.nan),
        Pair(5, "node-a", math.inf, 0.96),
    ]
    v = decide(rows, RULE)
    assert v.excluded == (
        "seed 1 on node-a: dropped: base over budget",
        "seed 2 on node-b: dropped: candidate causality failed",
        "seed 3 on node-a: dropped: candidate has no value",
        "seed 4 on node-b: dropped: candidate value nan is not finite",
        "seed 5 on node-a: dropped: base value inf is not finite",
    )
    assert v.verdict == "CONTINUE" and v.pairs_used == 0 and v.mean is None and v.pairs_run == 5
    assert Pair(3, "node-a", 0.96, None).diff is None
    assert Pair(3, "node-a", 0.96, 0.95).diff == pytest.approx(-0.01)


def test_twice_max_pairs_run_stops_undecided_even_with_few_usable():
    dropped = [Pair(i, "node-a", 0.96, 0.95, cand_dropped="over budget") for i in range(15)]
    assert decide(dropped, RULE).verdict == "CONTINUE"
    assert decide(dropped + [Pair(15, "node-a", 0.96, 0.95, cand_dropped="x")], RULE).verdict == "UNDECIDED"
    v = decide(dropped + pairs(-0.0005, start=15), RULE)
    assert v.verdict == "UNDECIDED" and v.pairs_used == 1 and v.detectable is not None
    assert "16 pairs run" in v.reason


def test_the_interval_shrinks_with_more_pairs():
    base = [-0.0010, -0.0012, -0.0008, -0.0011]
    widths = [(v.upper - v.lower) for v in (decide(pairs(*(base * k)[:n]), Rule(max_pairs=16))
                                            for k, n in ((1, 2), (1, 4), (2, 8), (4, 16)))]
    assert widths == sorted(widths, reverse=True) and widths[-1] < widths[0] / 2


def test_a_larger_sample_sd_widens_the_interval():
    calm, noisy = decide(pairs(-0.002, -0.0021), RULE), decide(pairs(-0.0005, -0.0036), RULE)
    assert calm.mean == pytest.approx(noisy.mean, abs=1e-4)
    assert noisy.noise_sd > calm.noise_sd == NOISE_SD
    assert calm.verdict == "ADOPT" and noisy.verdict == "CONTINUE"


def test_the_n2_interval_by_hand_and_by_integrating_the_mixture():
    """An independent computation of the interval after 2 pairs: the one-sided normal mixture martingale,
    integrated numerically over its half-normal mixing density, equals 1/alpha exactly at the bound."""
    v = decide(pairs(-0.0020, -0.0028), RULE)
    # By hand: mean -0.0024; sample sd 0.0008/sqrt(2) = 0.00057 < 0.0007, so sd = 0.0007; the boundary's
    # z at 2 pairs (rho tuned to 2 pairs, alpha 0.05) is 2.7658, so upper = -0.0024 + 0.0007 * 2.7658 / sqrt(2).
    assert v.mean == pytest.approx(-0.0024) and v.noise_sd == 0.0007
    assert v.upper == pytest.approx(-0.0024 + 0.0007 * 2.7658 / math.sqrt(2), abs=1e-7)
    assert v.lower == pytest.approx(-0.0024 - 0.0007 * 2.7658 / math.sqrt(2), abs=1e-7)
    assert v.verdict == "ADOPT"

    rho, n, alpha = mixture_rho(2, 0.05), 2, 0.05

    def martingale(s: float) -> float:  # s: the standardised sum of deviations, in sds
        density = lambda lam: 2 * math.sqrt(rho / (2 * math.pi)) * math.exp(-rho * lam * lam / 2)  # noqa: E731
        return integrate.quad(lambda lam: math.exp(lam * s - lam * lam * n / 2) * density(lam), 0, math.inf)[0]

    s_star = optimize.brentq(lambda s: martingale(s) - 1 / alpha, 0.1, 20, xtol=1e-12)
    assert (v.upper - v.mean) == pytest.approx(0.0007 * s_star / n, rel=1e-6)
    assert mixture_z(2, 0.05, rho) == pytest.approx(s_star / math.sqrt(n), rel=1e-6)
    # rho is where the boundary at 2 pairs is lowest
    assert mixture_z(2, 0.05, rho * 1.2) > mixture_z(2, 0.05, rho) < mixture_z(2, 0.05, rho / 1.2)


def test_the_boundary_holds_at_every_look_for_gaussian_noise():
    """With no effect and noise of the stated sd, the chance that the upper bound ever dips below zero in
    40 looks stays under alpha (Ville's inequality), looking after every pair from the first."""
    rng, rule, paths, crossed = random.Random(5), Rule(min_pairs=1, max_pairs=40), 4000, 0
    for _ in range(paths):
        total = 0.0
        for n in range(1, 41):
            total += rng.gauss(0, rule.noise_sd)
            if total / n + half_width(n, rule.noise_sd, rule) < 0:
                crossed += 1
                break
    se = math.sqrt(rule.alpha * (1 - rule.alpha) / paths)
    assert crossed / paths <= rule.alpha + 2 * se
    assert crossed > 0  # the bound is not vacuous


def test_futility_stops_a_hopeless_comparison_early():
    noisy = pairs(0.0040, -0.0040, 0.0001)
    assert decide(noisy, RULE).verdict == "CONTINUE"
    v = decide(noisy, Rule(futility=0.1))
    assert v.verdict == "UNDECIDED" and v.pairs_used == 3 and v.reason.startswith("UNDECIDED: futile")
    assert v.detectable == pytest.approx(half_width(RULE.max_pairs, v.noise_sd, RULE))
    assert max(chances_by_cap(3, v.mean, v.noise_sd, RULE)) < 0.1
    promising = pairs(-0.0012, -0.0010)
    assert decide(promising, Rule(futility=0.1)).verdict == "CONTINUE"
    with pytest.raises(ValueError, match="already at the cap"):
        chances_by_cap(8, 0.0, 0.001, RULE)


def test_to_dict_is_the_json_shape():
    bad = Pair(seed=3, node="node-a", base=0.96, cand=0.96, base_steps=1200, cand_steps=1050)
    d = decide([bad, *pairs(-0.003, -0.0031, start=4)], RULE).to_dict()
    assert list(d) == ["verdict", "pairs_used", "mean", "lower", "upper", "noise_sd", "detectable", "excluded",
                       "reason", "pairs_run"]
    assert d["excluded"] == ["seed 3 on node-a: CONFOUNDED: steps 1200 vs 1050 (12.5% apart)"]
    assert json.loads(json.dumps(d)) == d


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"alpha": 0.0}, "alpha"), ({"alpha": 0.5}, "alpha"), ({"alpha": math.nan}, "alpha"),
    ({"min_effect": 0.0}, "min_effect"), ({"min_effect": math.inf}, "min_effect"),
    ({"noise_sd": -1e-4}, "noise_sd"), ({"min_pairs": 0}, "min_pairs"), ({"min_pairs": 2.0}, "min_pairs"),
    ({"max_pairs": 1}, "max_pairs"), ({"min_pairs": 5, "max_pairs": 4}, "max_pairs"),
    ({"tolerance": 0.0}, "tolerance"), ({"futility": 0.5}, "futility"), ({"futility": -0.1}, "futility"),
])
def test_a_bad_rule_names_its_field_in_one_line(kwargs, field):
    with pytest.raises(ValueError, match=f"^rule {field} must be ") as err:
        Rule(**kwargs)
    assert "\n" not in str(err.value)


# --- P's fixed rules --------------------------------------------------------------------------------------


def test_fixed_rules_one_host():
    assert fixed_rules([]).verdict == "CONTINUE"
    nominate = fixed_rules(pairs(-0.0006))
    assert nominate.verdict == "CONTINUE" and "NOMINATE" in nominate.reason
    assert fixed_rules(pairs(0.0005)).verdict == "DISCARD"
    v = fixed_rules(pairs(-0.0005))
    assert v.verdict == "UNDECIDED" and v.pairs_used == 1 and v.lower is None and v.upper is None
    assert fixed_rules(pairs(0.0004)).verdict == "UNDECIDED"


def test_fixed_rules_two_hosts():
    assert fixed_rules(pairs(-0.0010, -0.0010, node="alt")).verdict == "ADOPT"
    assert fixed_rules(pairs(-0.0006, -0.0014, node="alt")).verdict == "ADOPT"  # mean exactly -0.0010
    assert fixed_rules(pairs(-0.0006, -0.0013, node="alt")).verdict == "UNDECIDED"  # mean -0.00095
    far = fixed_rules(pairs(-0.0010, -0.0026, node="alt"))
    assert far.verdict == "UNDECIDED" and far.pairs_used == 2  # 0.0016 apart
    assert fixed_rules(pairs(-0.0020, 0.0005, node="alt")).verdict == "DISCARD"
    assert fixed_rules(pairs(-0.0020, 0.0001, node="alt")).verdict == "UNDECIDED"


def test_fixed_rules_replicate_on_another_host_and_skip_confounded_pairs():
    same_node = pairs(-0.0020, -0.0020)  # both on node-a: the replicate must be on another host
    assert fixed_rules(same_node).verdict == "CONTINUE"
    confounded = Pair(9, "node-b", 0.96, 0.95, base_steps=1200, cand_steps=1350)  # ratio 1.125
    v = fixed_rules([*same_node, confounded])
    assert v.verdict == "CONTINUE"
    assert v.excluded == ("seed 9 on node-b: CONFOUNDED: steps 1200 vs 1350 (12.5% apart)",)
    done = fixed_rules([*same_node, confounded, Pair(10, "node-b", 0.96, 0.9582)])
    assert done.verdict == "ADOPT" and done.pairs_used == 2 and done.pairs_run == 4
    assert done.mean == pytest.approx(-0.0019)


# --- drift ------------------------------------------------------------------------------------------------


def test_drift_against_the_same_seed_uses_p_threshold():
    controls = [("node-a", 1, 0.9600), ("node-b", 1, 0.9700), ("node-a", 1, 0.9608), ("node-a", 1, 0.9617)]
    lines = drift_alarms(controls)
    assert len(lines) == 1  # 0.9617 is 0.0013 from the mean 0.9604 of the two before it
    assert lines[0].startswith("drift on node-a: control seed 1 = 0.96170 is +0.00130 from the mean 0.96040")
    assert "same seed" in lines[0]
    assert drift_alarms(controls, threshold=0.002) == []


def test_drift_against_other_seeds_allows_seed_noise_and_spike_paths():
    controls = [("node-a", 1, 0.9600), ("node-a", 2, 0.9645), ("node-a", 3, 0.9560), ("node-b", 4, 0.9)]
    lines = drift_alarms(controls)
    assert len(lines) == 1 and "control seed 3" in lines[0] and "other seeds" in lines[0]
    assert drift_alarms(controls, other_seeds_threshold=0.0070) == []
    # a same-seed control elsewhere in the node's history is the reference, not the other seeds
    assert len(drift_alarms([("n", 1, 0.9600), ("n", 2, 0.9640), ("n", 1, 0.9612)])) == 1
    with pytest.raises(ValueError, match="positive"):
        drift_alarms(controls, threshold=0)


def test_drift_false_alarms_stay_rare_with_varied_seeds():
    assert compare_bench.drift_false_alarms(controls=4000) < 0.01


# --- official estimate ------------------------------------------------------------------------------------


def test_official_estimate_from_the_screen_and_the_confirmation():
    assert official_estimate(0.9600, 2_097_152) == pytest.approx((0.9667, 0.0004))
    score, sd = official_estimate(0.9671, 20_971_520)
    assert score == pytest.approx(0.9667) and sd == pytest.approx(math.sqrt(0.0004 ** 2 + 0.00012 ** 2))
    with pytest.raises(ValueError, match="^no known offset for 1048576 tokens$"):
        official_estimate(0.96, 1_048_576)
    with pytest.raises(ValueError, match="finite"):
        official_estimate(math.nan, 2_097_152)


# --- the benchmark ----------------------------------------------------------------------------------------


def test_a_small_bench_run_keeps_the_false_adopt_rate_and_the_documented_keys():
    n = 400
    rows = compare_bench.run(comparisons=n, seed=2024, effects=(0.0, -0.002), spike_models=(0.5,))
    assert [tuple(r) for r in rows] == [compare_bench.KEYS] * 8
    assert [(r["method"], r["effect"], r["max_pairs"]) for r in rows] == [
        (m, e, cap) for cap in (8, 2) for e in (0.0, -0.002) for m in ("sequential", "fixed_rules")]
    seq0 = rows[0]
    se = math.sqrt(seq0["alpha"] * (1 - seq0["alpha"]) / n)
    assert seq0["adopt_rate"] <= seq0["alpha"] + 2 * se
    for r in rows:
        assert r["comparisons"] == n
        assert r["adopt_rate"] + r["discard_rate"] + r["undecided_rate"] == pytest.approx(1, abs=1e-3)
        assert r["mean_runs"] >= 2
    assert rows[2]["adopt_rate"] > rows[3]["adopt_rate"]  # the sequential's power at -0.002 beats P's here
    seq2, fixed2 = rows[6], rows[7]  # at P's budget (2 pairs): at least P's power in no more runs
    assert seq2["adopt_rate"] >= fixed2["adopt_rate"] - 2 * seq2["adopt_se"]
    assert seq2["mean_runs"] <= fixed2["mean_runs"]
    assert "compare_bench" in __import__("bench.__main__", fromlist=["SUITES"]).SUITES
