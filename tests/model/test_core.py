"""CORE: scores a hand-built model gets exactly, static shapes and length buckets, few-shot draws, the time
limit and its even cover of the tasks, bad bundles."""

from __future__ import annotations

import json
import math
import time
from collections import Counter

import pytest
import torch

from model import core
from model.config import ConfigError, parse_config
from model.core import bucket_lengths, evaluate_core, fewshot_indices, load_bundle, reference_view, task_rows
from model.data import DataError
from model.democore import build_demo_bundle
from model.evaluate import evaluate_core as exposed
from tests.core_bundle import (
    HAND_ACCURACY,
    HAND_CENTERED,
    HAND_CORE,
    HAND_TASKS,
    LM,
    MC,
    SCHEMA,
    BigramModel,
    byte_tokenizer,
    write_bundle,
    write_hand_bundle,
)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture
def hand(tmp_path):
    return load_bundle(write_hand_bundle(tmp_path / "bundle"))


def test_hand_model_scores_exactly_what_was_worked_out(hand, tok):
    assert exposed is evaluate_core  # DESIGN: evaluate.py is where CORE is found
    result = evaluate_core(BigramModel(), tok, hand, seq_len=32, batch_size=3)
    assert result.accuracy == pytest.approx(HAND_ACCURACY)
    assert result.tasks == pytest.approx(HAND_CENTERED)
    assert result.core == pytest.approx(HAND_CORE)
    assert result.complete and result.examples == 16
    assert result.record()["core_tasks"] == result.tasks


@pytest.mark.parametrize("batch_size, seq_len", [(1, 16), (4, 64), (7, 24)])
def test_every_batch_has_one_fixed_shape_and_the_shape_does_not_change_scores(hand, tok, batch_size, seq_len):
    model = BigramModel()
    result = evaluate_core(model, tok, hand, seq_len=seq_len, batch_size=batch_size, buckets=1)
    assert set(model.shapes) == {(batch_size, seq_len)} and result.shapes == [(batch_size, seq_len)]
    rows = 4 * 4 + 4 * 4 + (2 + 2 + 2 + 3) + 4  # mc, mc_2shot, schema, lm
    assert len(model.shapes) == math.ceil(rows / batch_size)  # one forward per batch
    assert result.tasks == pytest.approx(HAND_CENTERED)


def test_bucket_lengths_halve_seq_len_down_to_a_floor():
    assert bucket_lengths(2048, 4) == [256, 512, 1024, 2048]
    assert bucket_lengths(2048, 1) == [2048]
    assert bucket_lengths(128, 4) == [64, 128]  # clamped to 64 and deduplicated
    assert bucket_lengths(100, 3) == [64, 100]
    assert bucket_lengths(32, 4) == [32]  # a seq_len under the floor is its own only bucket
    assert bucket_lengths(2048, 50) == [64, 128, 256, 512, 1024, 2048]
    assert bucket_lengths(32, 4, min_length=4) == [4, 8, 16, 32]
    with pytest.raises(ValueError, match="at least 1"):
        bucket_lengths(2048, 0)


def _rows_of(tasks, tok) -> list[list[int]]:
    """Every row the evaluation feeds (few-shot examples drawn as it draws them)."""
    views = [reference_view(t)[0] for t in tasks]
    return [tokens for v in views for i in range(len(v.examples)) for tokens, _, _ in task_rows(v, i, tok)]


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_buckets_score_exactly_what_padding_to_seq_len_scores(hand, tok, batch_size):
    padded, bucketed = BigramModel(), BigramModel()
    full = evaluate_core(padded, tok, hand, seq_len=32, batch_size=batch_size, buckets=1, min_bucket=4)
    result = evaluate_core(bucketed, tok, hand, seq_len=32, batch_size=batch_size, buckets=4, min_bucket=4)
    assert result.accuracy == full.accuracy == pytest.approx(HAND_ACCURACY)
    assert result.tasks == full.tasks and result.core == full.core
    assert result.complete and result.examples == 16 and result.scored == full.scored
    assert set(padded.shapes) == {(batch_size, 32)}
    assert len(result.shapes) > 1 and set(result.shapes) == set(bucketed.shapes)
    assert set(bucketed.shapes) <= {(batch_size, n) for n in (4, 8, 16, 32)}
    assert result.padding < full.padding
    if batch_size == 1:  # every batch is full at once: each row runs in the shortest bucket that holds it
        expected = Counter((1, next(n for n in (4, 8, 16, 32) if len(r) <= n)) for r in _rows_of(hand, tok))
        assert Counter(bucketed.shapes) == expected


def test_leftover_rows_of_short_buckets_fill_a_longer_batch_rather_than_dummy_rows(hand, tok):
    model = BigramModel()
    result = evaluate_core(model, tok, hand, seq_len=32, batch_size=45, buckets=4, min_bucket=4)
    assert model.shapes == [(45, 32)] and result.tasks == pytest.approx(HAND_CENTERED)
    real = sum(min(len(r), 32) for r in _rows_of(hand, tok))
    assert result.padding == pytest.approx(1 - real / (45 * 32))


def test_a_long_context_is_cut_on_the_left_and_still_scored(tmp_path, tok):
    long = [{"context": "z" * 500 + " Q:", "continuation": "aaa"}, {"context": "z" * 300 + " Q:", "continuation": "ab"}]
    task = {"label": "long", "dataset_uri": "long.jsonl", "num_fewshot": 0, "icl_task_type": "language_modeling"}
    tasks = load_bundle(write_bundle(tmp_path, [task], {"long.jsonl": long}, {"long": 0}))
    model = BigramModel()
    result = evaluate_core(model, tok, tasks, seq_len=16, batch_size=2)
    assert result.accuracy == {"long": 0.5} and set(model.shapes) == {(2, 16)}


def test_fewshot_draws_are_fixed_distinct_and_never_the_example_itself():
    for idx in range(12):
        draw = fewshot_indices(12, idx, 4)
        assert draw == fewshot_indices(12, idx, 4) and idx not in draw and len(set(draw)) == 4
    assert len({tuple(fewshot_indices(12, i, 4)) for i in range(12)}) > 6  # not one draw for all
    assert sorted(fewshot_indices(3, 1, 5)) == [0, 2]  # asks for more than there are: all the others


def test_fewshot_prompts_carry_other_examples_with_their_gold_answers(tmp_path, tok):
    rows = [{"query": f"q{i}:", "choices": [f"right{i}", f"wrong{i}"], "gold": 0} for i in range(6)]
    task = {"label": "t", "dataset_uri": "t.jsonl", "num_fewshot": [3], "icl_task_type": "multiple_choice"}
    (t,) = load_bundle(write_bundle(tmp_path, [task], {"t.jsonl": rows}, {"t": 50}))
    view, order = reference_view(t)  # positions in the reference's shuffle; order[j]: position j's line
    for j in range(6):
        text = tok.decode(task_rows(view, j, tok)[0][0][1:])
        shots = [order[i] for i in fewshot_indices(6, j, 3)]
        assert text == "".join(f"q{i}: right{i}\n\n" for i in shots) + f"q{order[j]}: right{order[j]}"


def test_schema_and_lm_rows_score_the_shared_continuation_only(hand, tok):
    schema, lm = hand[2], hand[3]
    for tokens, start, end in task_rows(schema, 3, tok):
        assert tok.decode(tokens[start:end]) == "aaa"
    ((tokens, start, end),) = task_rows(lm, 1, tok)
    assert tok.decode(tokens[:start]) == "<|bos|>Q:" and tok.decode(tokens[start:end]) == " aa"


class FakeClock:
    """Time that moves only when the model runs: one second per forward."""

    def __init__(self, model: BigramModel) -> None:
        self.model = model

    def __call__(self) -> float:
        return float(len(self.model.shapes))


def test_time_limit_stops_before_crossing_it_and_flags_incomplete(hand, tok):
    model = BigramModel()
    result = evaluate_core(model, tok, hand, seq_len=32, batch_size=4, max_seconds=5.5, clock=FakeClock(model))
    assert len(model.shapes) == 5 and result.seconds == 5.0  # a sixth batch would have ended at 6 > 5.5
    assert not result.complete
    assert 0 < result.examples < 16
    assert set(result.tasks) == {"mc", "mc_2shot", "schema", "lm"}  # round-robin: every task got examples
    assert result.core == pytest.approx(sum(result.tasks.values()) / 4)
    # Time that would run out only after the last batch does not make a finished evaluation incomplete.
    model = BigramModel()
    result = evaluate_core(model, tok, hand, seq_len=32, batch_size=45, max_seconds=1.5, clock=FakeClock(model))
    assert len(model.shapes) == 1 and result.complete and result.examples == 16
    assert result.scored == {"mc": 4, "mc_2shot": 4, "schema": 4, "lm": 4}


def _short_and_long_bundle(tmp_path):
    """Three tasks of short rows and one of long ones: the long rows' bucket fills a third as fast."""
    short = [{"context": "Q:", "continuation": "a" * (1 + i % 3)} for i in range(40)]
    long = [{"context": "z" * 40 + " Q:", "continuation": "aa"} for _ in range(40)]
    tasks = [{"label": f"short{i}", "dataset_uri": "short.jsonl", "num_fewshot": 0,
              "icl_task_type": "language_modeling"} for i in range(3)]
    tasks.append({"label": "long", "dataset_uri": "long.jsonl", "num_fewshot": 0,
                  "icl_task_type": "language_modeling"})
    return load_bundle(write_bundle(tmp_path, tasks, {"short.jsonl": short, "long.jsonl": long},
                                    {t["label"]: 0 for t in tasks}))


def test_a_run_cut_short_has_every_task_within_lag_rounds(tmp_path, tok, monkeypatch):
    tasks = _short_and_long_bundle(tmp_path)

    def cut_short() -> dict[str, int]:
        model = BigramModel()
        result = evaluate_core(model, tok, tasks, seq_len=64, batch_size=16, min_bucket=8, max_seconds=7.5,
                               clock=FakeClock(model))
        assert not result.complete and len(model.shapes) == 7 and {n for _, n in model.shapes} == {8, 64}
        return result.scored

    lag = core.LAG_ROUNDS
    scored = cut_short()
    assert min(scored.values()) > 0 and max(scored.values()) - min(scored.values()) <= lag
    # Without the rule the long task falls further behind: the case above is one the rule decides.
    monkeypatch.setattr(core, "LAG_ROUNDS", 10**6)
    unruled = cut_short()
    assert max(unruled.values()) - unruled["long"] > lag


def test_time_limit_holds_in_real_time_with_a_slow_model(hand, tok):
    calls: list[float] = []

    class Slow(BigramModel):
        def forward(self, idx):
            calls.append(time.perf_counter())
            time.sleep(0.05)
            return super().forward(idx)

    readings: list[float] = []

    def clock() -> float:  # the real clock, its first reading kept: evaluate_core's start
        readings.append(time.perf_counter())
        return readings[-1]

    result = evaluate_core(Slow(), tok, hand, seq_len=32, batch_size=1, max_seconds=0.3, clock=clock)
    assert not result.complete and result.examples < 16
    # No batch that would end past the limit starts: every forward began within 0.3 s of the start (on a
    # loaded machine the sleeps only stretch, and fewer begin).
    start = readings[0]
    assert calls and all(t - start < 0.3 for t in calls), [round(t - start, 3) for t in calls]


def test_max_examples_takes_the_same_prefix_of_each_task(hand, tok):
    two = evaluate_core(BigramModel(), tok, hand, seq_len=32, batch_size=8, max_examples=2)
    again = evaluate_core(BigramModel(), tok, hand, seq_len=32, batch_size=3, max_examples=2)
    assert two.examples == 8 and two.complete and two.tasks == again.tasks


def _bad(tmp_path, case: str):
    tasks = [dict(t) for t in HAND_TASKS]
    data = {"mc.jsonl": list(MC), "sub/schema.jsonl": list(SCHEMA), "lm.jsonl": list(LM)}
    baselines = {"mc": 25, "mc_2shot": 25, "schema": 50, "lm": 0}
    if case == "kind":
        tasks[2]["icl_task_type"] = "generation"
    elif case == "json":
        data["lm.jsonl"][2] = '{"context": "Q:", "continuation": '
    elif case == "fields":
        data["sub/schema.jsonl"][1] = {"context_options": ["a", "b"], "gold": 0}
    elif case == "gold":
        data["mc.jsonl"][3] = {"query": "Q:", "choices": ["a", "b"], "gold": 2}
    elif case == "baseline":
        del baselines["schema"]
    elif case == "data file":
        del data["lm.jsonl"]
    root = write_bundle(tmp_path / "b", tasks, data, baselines)
    if case == "yaml":
        (root / "core.yaml").unlink()
    return root


@pytest.mark.parametrize("case, expected", [
    ("yaml", "core.yaml: cannot read the task list"),
    ("kind", "task 3: schema: icl_task_type must be one of"),
    ("json", "lm.jsonl:3: malformed JSON line"),
    ("fields", "schema.jsonl:2: schema example needs"),
    ("gold", "mc.jsonl:4: multiple_choice example \"gold\" must index one of the 2 options"),
    ("baseline", "eval_meta_data.csv: no random baseline for task 'schema'"),
    ("data file", "lm.jsonl: cannot read task data"),
])
def test_a_broken_bundle_is_one_line_naming_the_file(tmp_path, case, expected):
    with pytest.raises(DataError) as err:
        load_bundle(_bad(tmp_path, case))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_demo_bundle_is_built_once_deterministically_with_all_three_kinds(data_cache, tmp_path):
    first = build_demo_bundle(data_cache)
    assert build_demo_bundle(data_cache) == first
    # A second cache sharing the same demo corpus builds the same bundle, byte for byte.
    other = tmp_path / "cache"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "demo").symlink_to(first.parent / "demo")
    second = build_demo_bundle(other)
    assert second != first
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    assert all((first / f).read_bytes() == (second / f).read_bytes() for f in files)
    tasks = load_bundle(first)
    assert {t.kind for t in tasks} == {"multiple_choice", "schema", "language_modeling"}
    assert all(len(t.examples) >= 100 for t in tasks)
    last = json.loads((first / "eval_data" / "demo" / "last_word.jsonl").read_text().splitlines()[0])
    assert last["continuation"].isalpha() and len(last["context"].split()) >= 4


def test_a_tiny_gpt_scores_a_finite_core_on_the_demo_bundle(data_cache):
    from model.config import GPTConfig
    from model.data import load_dataset
    from model.gpt import GPT

    ds = load_dataset(None, 512, cache_dir=data_cache)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, depth=1, model_dim=32, head_dim=16, seq_len=64))
    result = evaluate_core(model, ds.tokenizer, load_bundle(build_demo_bundle(data_cache)), seq_len=64,
                           batch_size=8, max_examples=10)
    assert result.complete and result.examples == 40 and math.isfinite(result.core)
    assert all(-1.5 <= v <= 1 for v in result.tasks.values())
    assert model.training  # put back as it was found


def test_buckets_leave_a_real_gpts_scores_unchanged_on_the_demo_bundle(data_cache):
    from model.config import GPTConfig
    from model.data import load_dataset
    from model.gpt import GPT

    ds = load_dataset(None, 512, cache_dir=data_cache)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, depth=2, model_dim=32, head_dim=16, seq_len=256))
    with torch.no_grad():  # init leaves the blocks' outputs zero; attention must mix positions to be tested
        for p in model.parameters():
            p.normal_(std=0.3)
    tasks = load_bundle(build_demo_bundle(data_cache))
    full = evaluate_core(model, ds.tokenizer, tasks, seq_len=256, batch_size=16, buckets=1)
    result = evaluate_core(model, ds.tokenizer, tasks, seq_len=256, batch_size=16, buckets=4)
    assert result.complete and result.examples == full.examples == sum(len(t.examples) for t in tasks)
    assert result.picks == full.picks and result.accuracy == full.accuracy and result.core == full.core
    assert len(set(full.accuracy.values())) > 1  # not a degenerate model that ties everything
    assert full.shapes == [(16, 256)] and result.shapes == [(16, 64), (16, 128), (16, 256)]
    assert result.padding < full.padding / 2


def test_core_buckets_is_a_strict_trainer_key():
    assert parse_config({}).run.core_buckets == core.DEFAULT_BUCKETS
    assert parse_config({"core_buckets": 1}).run.core_buckets == 1
    with pytest.raises(ConfigError, match="core_buckets must be at least 1, got 0"):
        parse_config({"core_buckets": 0})
    with pytest.raises(ConfigError, match="'core_buckets' expects int"):
        parse_config({"core_buckets": 2.5})
