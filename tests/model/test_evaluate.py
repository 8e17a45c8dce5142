"""The cheap evaluation path (inference mode, chunked scoring cross-entropy, widened batches) against the
scorer's plain loop, on a trained model and the real demo validation rows."""

from __future__ import annotations

import pytest
import torch

from model.config import GPTConfig
from model.data import BatchLoader, load_dataset, validation_batches
from model.data.loader import validation_rows
from model.data.rows import sample_indices
from model.evaluate import eval_batch_rows, eval_bytes_per_row, evaluate_bpb, pruning_autocast, pruning_batches, widen
from model.gpt import GPT
from tests.conftest import TINY

CPU = torch.device("cpu")
SHAPE = {k: TINY[k] for k in ("vocab_size", "depth", "model_dim", "head_dim", "seq_len")}


@pytest.fixture(scope="module")
def trained(data_cache):
    """A tiny GPT after 30 AdamW steps on the demo text, and 32 rows of validation batches of 8 rows."""
    ds = load_dataset(None, TINY["vocab_size"], cache_dir=data_cache)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = BatchLoader(ds, batch_size=8, seq_len=SHAPE["seq_len"], seed=0)
    for _ in range(30):
        x, y = next(loader)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    batches = validation_batches(ds, batch_size=8, seq_len=SHAPE["seq_len"], n_tokens=32 * SHAPE["seq_len"])
    return model, batches, ds.token_bytes


def test_the_cheap_path_scores_what_the_scorers_loop_scores_within_1e4(trained):
    model, batches, token_bytes = trained
    exact = evaluate_bpb(model, batches, token_bytes, CPU, fast=False)
    assert exact.val_bpb < 0.9 * evaluate_bpb(GPT(GPTConfig(**SHAPE)), batches, token_bytes, CPU).val_bpb  # trained
    for rows in (0, 16, 24, 1000):  # the training batch; two batches; a width that is not a multiple; all at once
        cheap = evaluate_bpb(model, batches, token_bytes, CPU, batch_rows=rows)
        assert (cheap.tokens, cheap.bytes, cheap.rows) == (exact.tokens, exact.bytes, exact.rows) == (
            exact.tokens, exact.bytes, 32)
        assert abs(cheap.val_bpb - exact.val_bpb) < 1e-4, rows
        assert cheap.row_moments == pytest.approx(exact.row_moments, rel=1e-5)
    bf16 = evaluate_bpb(model, batches, token_bytes, CPU, torch.autocast("cpu", dtype=torch.bfloat16), 16)
    assert bf16.bytes == exact.bytes and abs(bf16.val_bpb - exact.val_bpb) < 1e-4  # the pruning evaluations'
    assert pruning_autocast(CPU, torch.bfloat16).fast_dtype == torch.bfloat16  # the training's, where it has one
    assert model.training  # put back as it was


def test_widen_joins_consecutive_batches_up_to_the_rows_asked():
    batches = [(torch.full((8, 4), i), torch.full((8, 4), -i)) for i in range(5)]
    assert [x.size(0) for x, _ in widen(batches, 20)] == [16, 16, 8]
    assert [x.size(0) for x, _ in widen(batches, 0)] == [8] * 5
    assert [x.size(0) for x, _ in widen(batches, 4)] == [8] * 5  # narrower than one batch: as given
    x, y = next(widen(batches, 16))
    assert torch.equal(x[:, 0], torch.tensor([0] * 8 + [1] * 8)) and torch.equal(y, -x)


def test_eval_batch_rows_fits_the_memory_budget_in_whole_batches():
    cfg = GPTConfig(**SHAPE)
    per_row = eval_bytes_per_row(cfg, 64, logit_copies=1)  # the CPU's: its scoring reads the logits in place
    assert per_row > 4 * cfg.vocab_size * 64  # the logits at least
    assert eval_bytes_per_row(cfg, 64) == per_row + 3 * 4 * cfg.vocab_size * 64  # elsewhere the plain chain's copies
    assert eval_batch_rows(cfg, 64, 8, CPU, budget_bytes=per_row * 37) == 32
    assert eval_batch_rows(cfg, 64, 8, CPU, budget_bytes=per_row) == 8  # never below the training batch
    # Any other device (Neuron; "meta" stands for it here, where torch-neuronx is absent) keeps its shapes.
    assert eval_batch_rows(cfg, 64, 8, torch.device("meta"), budget_bytes=per_row * 100) == 8
    assert eval_bytes_per_row(cfg, 128) > 2 * per_row  # attention's scores grow with the square
    assert eval_batch_rows(cfg, 64, 8, CPU) % 8 == 0


def test_a_model_scored_past_its_length_in_inference_mode_still_trains():
    # Rotary tables grown under inference mode could not be saved for a backward: evaluate_bpb grows them first.
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SHAPE, "seq_len": 16}))
    x = torch.randint(1, SHAPE["vocab_size"], (2, 48))
    evaluate_bpb(model, [(x, x)], torch.ones(SHAPE["vocab_size"], dtype=torch.int32), CPU)
    assert model.cos.size(1) == 48 and not model.cos.is_inference()
    model(x[:, :16], x[:, :16]).backward()
    assert model.wte.weight.grad is not None


def test_pruning_evaluations_score_a_fixed_spread_sample_of_the_final_span(data_cache):
    ds = load_dataset(None, TINY["vocab_size"], cache_dir=data_cache)
    T = SHAPE["seq_len"]
    batches = pruning_batches(ds, 8, T, 32 * T, 256 * T)
    x = torch.cat([b[0] for b in batches])
    span = validation_rows(ds, T, 256 * T)
    picked = sample_indices(span.shape[0], 32)
    assert x.shape == (32, T) and torch.equal(x, torch.as_tensor(span[picked, :-1]))
    assert picked.max() > 128  # spread over the span, not its first 32 rows
    again = pruning_batches(ds, 8, T, 32 * T, 256 * T)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(batches, again, strict=True))  # the same rows every run
    first = pruning_batches(ds, 8, T, 32 * T, 32 * T)  # no wider span: the first rows, as before
    assert torch.equal(torch.cat([b[0] for b in first]), torch.as_tensor(span[:32, :-1]))
