"""The recipe bench's machinery on a tiny shape and a budget of a second: both sides run on the same data, the
JSON has every figure, and `python -m bench` knows it. (Its figures are the bench's to measure, not a test's.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import torch

from bench import __main__ as bench_main
from bench.recipe_bench import compare, run_reference
from bench.recipe_reference import RefConfig, RefGPT, RefOptimizer
from tests.conftest import ROOT
from tests.conftest import TINY as TRAINER_TINY

TINY = {"vocab_size": TRAINER_TINY["vocab_size"], "depth": 2, "model_dim": 64, "head_dim": 32, "seq_len": 32,
        "batch_size": 4}


def test_the_reference_follows_the_recipe_and_fits_a_batch():
    cfg = RefConfig(vocab_size=300, depth=4, dim=64, head_dim=32, seq_len=32)
    assert cfg.windows() == [16, 16, 16, 32]  # SSSL: half the sequence, the last layer full
    torch.manual_seed(0)
    model = RefGPT(cfg)
    assert sorted(model.ve) == ["1", "3"] and model.blocks[1].gate.weight.shape == (2, 32)
    assert torch.allclose(model.x0.data, torch.full((4,), 0.1))
    opt = RefOptimizer(model)
    x = torch.randint(0, 300, (4, 32))
    y = torch.roll(x, -1, dims=1)
    losses = []
    for step in range(12):
        opt.schedule(step / 12, step)
        loss = model(x, y)
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses
    assert model(x, y, reduction="none").shape == (4 * 32,)


def test_the_references_compiled_step_is_its_eager_one():
    """The bench's reference compiles its two step functions as the recipe does; three steps of each, from the
    same tensors and gradients, land where the eager functions do (AdamW to float32 rounding, Muon within
    bfloat16's). One graph each: every further shape costs another inductor compile on this CPU."""
    from bench.recipe_reference import _adamw_step, _muon_stack_step

    torch.manual_seed(0)
    model = RefGPT(RefConfig(vocab_size=300, depth=1, dim=64, head_dim=32, seq_len=32))
    eager = RefOptimizer(model)
    assert (eager.muon_step, eager.adamw_step) == (_muon_stack_step, _adamw_step)
    compiled = RefOptimizer(model, compile=True)
    assert compiled.muon_step is not _muon_stack_step and compiled.adamw_step is not _adamw_step

    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(2, 32, 64, generator=gen) * 1e-2 for _ in range(3)]
    p0 = torch.randn(2, 32, 64, generator=gen) * 0.1
    muon = []
    for fn in (_muon_stack_step, compiled.muon_step):  # a stack of two wide matrices
        p, momentum, second = p0.clone(), torch.zeros_like(p0), torch.zeros(2, 1, 64)
        for g in grads:
            fn(g, p, momentum, second, torch.tensor(0.9), torch.tensor(0.04), torch.tensor(0.2))
        muon.append((p, momentum))
    (pe, me), (pc, mc) = muon
    moved = (pe - p0).abs().max()
    assert moved > 0.01 and (pe - pc).abs().max() <= 0.3 * moved and torch.allclose(me, mc, rtol=1e-5, atol=1e-8)

    adam = []
    for fn in (_adamw_step, compiled.adamw_step):
        p, m, v, step = p0[0].clone(), torch.zeros(32, 64), torch.zeros(32, 64), torch.zeros(())
        for g in grads:
            fn(p, g[0], m, v, step, torch.tensor(0.3), 0.8, 0.95)
        adam.append((p, step))
    (pe, se), (pc, sc) = adam
    moved = (pe - p0[0]).abs().max()
    assert se.item() == sc.item() == 3 and moved > 0.5
    assert (pe - pc).abs().max() <= 1e-5 * moved + 1e-7  # the whole-model check's AdamW bound


def test_a_reference_run_scores_the_final_rows(data_cache):
    rec = run_reference(0.5, TINY, data_cache, eval_tokens=2048, compile=False)
    assert rec["side"] == "reference" and rec["charged_steps"] >= 1 and rec["steps"] == rec["charged_steps"] + 3
    assert rec["tokens_per_second"] > 0 and 0 < rec["val_bpb"] < 20


def test_compare_alternates_pairs_and_reports_medians_and_ratios(data_cache):
    row = compare(pairs=2, budgets=[0.5], shape=TINY, cache_dir=data_cache, eval_tokens=2048, compile=False)
    runs = row["runs"]
    assert [(r["pair"], r["side"]) for r in runs] == [(0, "ours"), (0, "reference"), (1, "reference"), (1, "ours")]
    assert row["bench"] == "recipe_vs_reference" and row["threads"] == 2 and row["shape"]["depth"] == 2
    assert row["uncharged_steps"] == 3 and row["optimizers_compiled"] is False
    assert not any(r["optimizer_compiled"] for r in runs)
    for side in ("ours", "reference"):  # where each side's step time went, per charged step
        parts = row[f"{side}_ms_per_step"]
        assert parts["forward"] > 0 and parts["backward"] > 0 and parts["optimizer"] > 0, (side, parts)
    for key in ("ours_tokens_per_second", "reference_tokens_per_second", "tokens_per_second_ratio",
                "ours_val_bpb_0.5s", "reference_val_bpb_0.5s", "val_bpb_delta_0.5s"):
        assert math.isfinite(row[key]) and (row[key] > 0 or key.startswith("val_bpb_delta")), key
    assert row["val_bpb_delta_0.5s"] == row["ours_val_bpb_0.5s"] - row["reference_val_bpb_0.5s"]
    json.dumps(row)


def test_it_is_a_registered_suite_and_its_cli_refuses_bad_json():
    assert "recipe_bench" in bench_main.SUITES
    proc = subprocess.run([sys.executable, "-m", "bench.recipe_bench", "--ours", "{bad"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and proc.stderr.count("\n") == 1
