"""CORE as the reference computes it (nanochat's core_eval.py as scripts/base_eval.py drives it), example by
example: a small bundle, one task per convention, whose picks are worked out by hand below for RecallModel
(tests/core_bundle.py); and the project's own ways (length buckets, round-robin order, the split over ranks, a
time limit) leave every pick as it is.

RecallModel gives logit 4 to every token seen so far in the row (BOS included) and 0 to the rest; the tokenizer
is one token per byte. So where options share their prefix, a one-token answer already seen in the row costs
4 nats less than one not seen, and answers not seen tie (the first of equal losses is picked); greedy decoding
writes the smallest byte seen so far. With Z(m) = m e^4 + 257 - m for m distinct tokens seen, an unseen token
costs ln Z(m), a seen one ln Z(m) - 4: ln Z(4) = 6.156, ln Z(5) = 6.263, ln Z(4) - 4 = 2.156, ln Z(5) - 4 = 2.263.
"""

from __future__ import annotations

import json
import math

import pytest

from model.core import (
    cut_rows,
    evaluate_core,
    fewshot_indices,
    load_bundle,
    reference_order,
    reference_pick,
    reference_view,
    task_rows,
)
from tests.core_bundle import RecallModel, byte_tokenizer, write_bundle

SEQ_LEN = 16

# Few-shot draws. The reference shuffles a task's examples with random.Random(1337) and draws example j's shots
# with random.Random(1234 + j).sample(every position but j, k), positions in the shuffled (and capped) list.
# Python's random, run by hand: Random(1337).shuffle([0, 1, 2, 3, 4, 5]) -> [1, 0, 3, 2, 5, 4], so position j
# holds file line ORDER6[j]; Random(1234 + j).sample(positions of 6 but j, 1) -> [4], [4], [5], [1], [0], [0];
# of 4 (max_examples 4: lines 1, 0, 3, 2) -> [2], [3], [3], [0].
ORDER6 = [1, 0, 3, 2, 5, 4]
SHOT6 = [4, 4, 5, 1, 0, 0]
SHOT4 = [2, 3, 3, 0]
# Each prompt is "Q <shot's gold>\n\nQ <choice>": the one choice seen is the shot's gold, so the pick is the
# shot's gold. Golds by line: 0 1 2 0 1 2 (x y z x y z).
SHOTS = [{"query": "Q", "choices": ["x", "y", "z"], "gold": g} for g in (0, 1, 2, 0, 1, 2)]
# line 1 (position 0): shot position 4 = line 5, gold 2 -> pick 2    line 0 (position 1): line 5 -> pick 2
# line 3 (position 2): shot position 5 = line 4, gold 1 -> pick 1    line 2 (position 3): line 0 -> pick 0
# line 5 (position 4): shot position 0 = line 1, gold 1 -> pick 1    line 4 (position 5): line 1 -> pick 1
# Right: line 4 only. (File order with shots from every line, the project's old way, picked 1 1 2 1 0 0.)
SHOTS_PICKS = {0: 2, 1: 2, 2: 0, 3: 1, 4: 1, 5: 1}
# max_examples 4: line 1 (position 0) -> position 2 = line 3, gold 0; line 0 -> position 3 = line 2, gold 2;
# line 3 -> line 2, gold 2; line 2 -> position 0 = line 1, gold 1. Right: none.
SHOTS4_PICKS = {0: 2, 1: 0, 2: 1, 3: 2}

# Long rows keep their last SEQ_LEN tokens, BOS dropped; the answer span moves with them.
TRUNC = [
    # BOS x -*12 Q ␠ c: 17 tokens, so only BOS goes and "x" stays seen: "x" (option 1) costs 4 less. Pick 1,
    # right. (Keeping BOS and cutting after it, the old way, lost the "x": a tie, pick 0.)
    {"query": "x" + "-" * 12 + "Q", "choices": ["y", "x"], "gold": 1},
    # BOS Q ␠ + 16 answer tokens: 19, three go and the window is the answer alone, from position 0: no token
    # before it predicts it, and the reference's slice losses[s - 1:e - 1] = [-1:15] is empty, its mean NaN
    # for both options: pick 0, wrong. (The old way scored the repeated "a"s from position 1: pick 1.)
    {"query": "Q", "choices": ["bcdefghijklmnopq", "a" * 16], "gold": 1},
]
TRUNC_PICKS = {0: 1, 1: 0}
# BOS ! b*12 Q ! !: 17 tokens; BOS goes, "!" (0x21, the smallest byte) stays seen, so greedy writes "!" twice:
# right. (The old way lost the first "!": greedy wrote "Q", wrong.)
TRUNC_LM = [{"context": "!" + "b" * 12 + "Q", "continuation": "!!"}]
TRUNC_LM_PICKS = {0: 1}

# Empty spans: a choice that is a token prefix of another scores nothing, its mean loss is NaN.
EMPTY_MC = [
    # BOS Q b ␠ a [b | c]: the choices part after "a", so choice 0 ("a") is empty: NaN first, and the
    # reference's min() keeps its first item, NaN, whose index is 0. Pick 0, wrong. (The old way scored a
    # lone "a" for it at ln Z(4) = 6.156 against "b" seen at 2.263: pick 1.)
    {"query": "Qb", "choices": ["a", "ab", "ac"], "gold": 1},
    # BOS Q a ␠ a [x | y]: choice 1 is empty; "x" and "y" both unseen at ln Z(4): a tie, pick 0, right.
    # (The old way scored "a" for choice 1, seen: 2.156, pick 1.)
    {"query": "Qa", "choices": ["ax", "a", "ay"], "gold": 0},
]
EMPTY_MC_PICKS = {0: 0, 1: 0}
# A schema continuation the options share no token of (here an empty one; in BPE, one that merges with the
# options' last letters): no common suffix, every span empty, pick 0, wrong. (The old way scored the last
# token: "c" unseen against "b" seen, pick 1.)
EMPTY_SCHEMA = [{"context_options": ["bc", "bb"], "continuation": "", "gold": 1}]
EMPTY_SCHEMA_PICKS = {0: 0}

# Lines end at \n, \r\n or \r only: U+2028, U+0085 and U+2029 sit raw inside JSON strings (splitlines() broke
# these lines in two). Line 0: "\u2028" is three bytes, all seen in the query: pick 0. Line 1: "\x85" (two
# bytes) seen: pick 1. Line 2, ending in \r\n: "Q" seen: pick 1. All right.
LINES = [
    json.dumps({"query": "Q\u2028", "choices": ["\u2028", "z"], "gold": 0}, ensure_ascii=False),
    json.dumps({"query": "Q\x85\u2029", "choices": ["z", "\x85"], "gold": 1}, ensure_ascii=False),
    json.dumps({"query": "Q", "choices": ["y", "Q"], "gold": 1}) + "\r\n",
]
LINES_PICKS = {0: 0, 1: 1, 2: 1}

PICKS = {"shots": SHOTS_PICKS, "trunc": TRUNC_PICKS, "trunc_lm": TRUNC_LM_PICKS, "empty_mc": EMPTY_MC_PICKS,
         "empty_schema": EMPTY_SCHEMA_PICKS, "lines": LINES_PICKS}
# Accuracy is the mean of a float32 tensor in the reference: 1/6 is 0.1666666716337204 there.
ACCURACY = {"shots": 0.1666666716337204, "trunc": 0.5, "trunc_lm": 1.0, "empty_mc": 0.5, "empty_schema": 0.0,
            "lines": 1.0}
BASELINES = {"shots": 33.3333, "trunc": 50, "trunc_lm": 0, "empty_mc": 33.3333, "empty_schema": 50, "lines": 50}


def _task(label: str, kind: str, shots: int = 0, delimiter: str = " ") -> dict:
    return {"label": label, "dataset_uri": f"{label}.jsonl", "num_fewshot": [shots], "icl_task_type": kind,
            "continuation_delimiter": delimiter}


TASKS = [_task("shots", "multiple_choice", 1), _task("trunc", "multiple_choice"),
         _task("trunc_lm", "language_modeling", delimiter=""), _task("empty_mc", "multiple_choice"),
         _task("empty_schema", "schema", delimiter=""), _task("lines", "multiple_choice")]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture
def bundle(tmp_path):
    data = {"shots.jsonl": SHOTS, "trunc.jsonl": TRUNC, "trunc_lm.jsonl": TRUNC_LM, "empty_mc.jsonl": EMPTY_MC,
            "empty_schema.jsonl": EMPTY_SCHEMA, "lines.jsonl": LINES}
    return load_bundle(write_bundle(tmp_path / "bundle", TASKS, data, BASELINES))


def test_every_pick_is_the_one_worked_out_by_hand(bundle, tok):
    result = evaluate_core(RecallModel(), tok, bundle, seq_len=SEQ_LEN, batch_size=4)
    assert result.picks == PICKS
    assert result.accuracy == ACCURACY
    # Centered as the reference writes it, 0.01 x the percentage (not percent / 100: 0.333333 here).
    centered = {k: (ACCURACY[k] - 0.01 * b) / (1.0 - 0.01 * b) for k, b in BASELINES.items()}
    assert result.tasks == centered and centered["shots"] != (ACCURACY["shots"] - 0.333333) / (1 - 0.333333)
    assert result.core == sum(centered.values()) / 6
    assert result.complete and result.examples == 15


def test_fewshot_draws_follow_the_reference_shuffle_and_cap(bundle, tok):
    assert reference_order(6) == ORDER6 and reference_order(6, 4) == ORDER6[:4]
    assert [fewshot_indices(6, j, 1) for j in range(6)] == [[s] for s in SHOT6]
    assert [fewshot_indices(4, j, 1) for j in range(4)] == [[s] for s in SHOT4]
    view, order = reference_view(bundle[0])
    assert order == ORDER6 and view.examples == [SHOTS[i] for i in ORDER6]
    # Position 0 is line 1 (gold y); its shot is position 4 = line 5 (gold z).
    assert [tok.decode(t[1:]) for t, _, _ in task_rows(view, 0, tok)] == ["Q z\n\nQ x", "Q z\n\nQ y", "Q z\n\nQ z"]
    capped = evaluate_core(RecallModel(), tok, bundle[:1], seq_len=SEQ_LEN, batch_size=4, max_examples=4)
    assert capped.picks == {"shots": SHOTS4_PICKS} and capped.accuracy == {"shots": 0.0}


def test_reference_pick_is_the_first_least_number_unless_the_first_is_nan():
    nan = math.nan
    assert reference_pick([3.0, 2.0, 2.0]) == 1  # ties: the first
    assert reference_pick([nan, 1.0, 0.5]) == 0  # min() keeps a NaN that comes first
    assert reference_pick([2.0, nan, 1.0]) == 2  # a later NaN is never picked
    assert reference_pick([1.0, nan, 1.0]) == 0
    assert reference_pick([nan, nan]) == 0


def test_cut_rows_keeps_the_last_tokens_and_empties_an_answer_with_nothing_before_it():
    tokens = [99, *range(10)]  # BOS 99, then ten tokens
    # The answer is the last three; 11 - 6 = 5 tokens go, BOS first, and the span moves down by 5.
    assert cut_rows("multiple_choice", [(tokens, 8, 11)], 6) == [([4, 5, 6, 7, 8, 9], 3, 6)]
    assert cut_rows("multiple_choice", [(tokens[:4], 2, 4)], 6) == [([99, 0, 1, 2], 2, 4)]  # short: as it is
    # The answer fills the row from position 0: the reference's slice [-1:5] is empty, so is the span.
    assert cut_rows("schema", [(tokens, 5, 11)], 6) == [([4, 5, 6, 7, 8, 9], 6, 6)]
    # Where the reference stops (an answer that starts left of the window: an assertion; a continuation on
    # the window's first position: a shape mismatch), every row of the example is scored from position 1.
    longer = [99, *range(11)]
    assert cut_rows("multiple_choice", [(tokens, 5, 11), (longer, 5, 12)], 6) == [
        ([4, 5, 6, 7, 8, 9], 1, 6), ([5, 6, 7, 8, 9, 10], 1, 6)]
    assert cut_rows("language_modeling", [(tokens, 5, 11)], 6) == [([4, 5, 6, 7, 8, 9], 1, 6)]
    assert cut_rows("language_modeling", [(tokens, 6, 11)], 6) == [([4, 5, 6, 7, 8, 9], 1, 6)]


def test_where_the_reference_stops_an_example_is_scored_on_what_fits(tmp_path, tok):
    """Answers longer than the row: the reference stops on an assertion; here each option's answer is scored
    from the window's second token. Multiple choice: the window holds the answer's last 16 letters, 4 to 19;
    "fghijklmnopqrstu" has no letter seen before it, "a" * 16 has every "a" after the first: pick 1, right.
    Language modelling: the window is "!" * 16, and greedy writes "!" after "!": right."""
    tasks = [_task("mc", "multiple_choice"), _task("lm", "language_modeling", delimiter="")]
    data = {"mc.jsonl": [{"query": "Q", "choices": ["bcdefghijklmnopqrstu", "a" * 20], "gold": 1}],
            "lm.jsonl": [{"context": "Q", "continuation": "!" * 20}]}
    tasks = load_bundle(write_bundle(tmp_path, tasks, data, {"mc": 50, "lm": 0}))
    result = evaluate_core(RecallModel(), tok, tasks, seq_len=SEQ_LEN, batch_size=2)
    assert result.picks == {"mc": {0: 1}, "lm": {0: 1}} and result.accuracy == {"mc": 1.0, "lm": 1.0}


@pytest.mark.parametrize("batch_size, buckets", [(1, 1), (4, 1), (3, 4), (7, 4), (64, 4)])
def test_buckets_and_batches_leave_every_pick_as_it_is(bundle, tok, batch_size, buckets):
    model = RecallModel()
    result = evaluate_core(model, tok, bundle, seq_len=SEQ_LEN, batch_size=batch_size, buckets=buckets,
                           min_bucket=4)
    assert result.picks == PICKS and result.accuracy == ACCURACY
    lengths = {n for _, n in model.shapes}
    assert lengths == {SEQ_LEN} if buckets == 1 else lengths <= {4, 8, 16}
    assert buckets == 1 or batch_size == 64 or len(lengths) > 1  # rows of several lengths ran short


def test_ranks_and_a_time_limit_score_a_share_with_the_same_picks(bundle, tok):
    shares = [evaluate_core(RecallModel(), tok, bundle, seq_len=SEQ_LEN, batch_size=2, rank=r, world_size=2)
              for r in (0, 1)]
    for label, picks in PICKS.items():
        first, second = (s.picks[label] for s in shares)
        assert not set(first) & set(second) and {**first, **second} == picks
    assert sum(s.examples for s in shares) == 15

    class Clock:  # one second per forward
        def __init__(self, model):
            self.model = model

        def __call__(self):
            return float(len(self.model.shapes))

    model = RecallModel()
    cut = evaluate_core(model, tok, bundle, seq_len=SEQ_LEN, batch_size=2, max_seconds=4.5, clock=Clock(model))
    assert not cut.complete and 0 < cut.examples < 15
    assert all(cut.picks[label].items() <= PICKS[label].items() for label in PICKS)
