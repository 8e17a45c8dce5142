"""Evaluation throughput on the CPU: the final val_bpb evaluation before and after it was made cheap.

At the shape the issue measured (depth 4, width 256, two heads of 128, sequence 256, batch 8, vocabulary 8192)
on the demo validation set: `before` scores as the trainer did (no_grad, the training batch, the plain
softcapped cross-entropy over the whole logits), `after` as it does now (inference mode, the scoring cross-
entropy a chunk at a time, batches of eval_batch_rows: the training batch on the CPU, where wider measured
slower); `inference_only` is `after` at the training batch, to tell the two gains apart; `*_bf16` are those
under bfloat16 autocast, as the pruning evaluations run on a CPU with native bfloat16
(model.evaluate.pruning_autocast; the final val_bpb keeps float32). Rounds alternate the variants; figures are
medians, with the 1-minute load average before and after (a busy machine slows every variant, the multi-
threaded ones most). Each variant's val_bpb is reported with its difference from `before` (the scorer's
figure).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch

from model.config import GPTConfig
from model.data import load_dataset, validation_batches
from model.evaluate import eval_batch_rows, evaluate_bpb
from model.gpt import GPT

SHAPE = {"vocab_size": 8192, "depth": 4, "model_dim": 256, "head_dim": 128, "seq_len": 256}
BATCH = 8
EVAL_TOKENS = 32768
ROUNDS = 5
TRAIN_STEPS = 20  # a briefly trained model, so that its logits are not the initial near-uniform ones


def _trained_model(ds: Any) -> GPT:
    """The shape above after a few plain AdamW steps on the demo text (enough to make bf16's error show)."""
    from model.data import BatchLoader

    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = BatchLoader(ds, batch_size=BATCH, seq_len=SHAPE["seq_len"], seed=0)
    for _ in range(TRAIN_STEPS):
        x, y = next(loader)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def eval_throughput(cache_dir: str, rounds: int = ROUNDS, eval_tokens: int = EVAL_TOKENS) -> dict:
    ds = load_dataset(None, SHAPE["vocab_size"], cache_dir=cache_dir)
    model = _trained_model(ds)
    batches = validation_batches(ds, batch_size=BATCH, seq_len=SHAPE["seq_len"], n_tokens=eval_tokens)
    cpu = torch.device("cpu")

    def bf16() -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    rows = eval_batch_rows(model.config, SHAPE["seq_len"], BATCH, cpu)
    variants = {
        "before": lambda: evaluate_bpb(model, batches, ds.token_bytes, cpu, fast=False),
        "inference_only": lambda: evaluate_bpb(model, batches, ds.token_bytes, cpu),
        "after": lambda: evaluate_bpb(model, batches, ds.token_bytes, cpu, batch_rows=rows),
        "inference_bf16": lambda: evaluate_bpb(model, batches, ds.token_bytes, cpu, bf16()),
        "after_bf16": lambda: evaluate_bpb(model, batches, ds.token_bytes, cpu, bf16(), rows),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    bpb: dict[str, float] = {}
    tokens = 0
    load_before = os.getloadavg()[0]
    for fn in variants.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            res = fn()
            times[name].append(time.perf_counter() - t0)
            bpb[name], tokens = res.val_bpb, res.rows * SHAPE["seq_len"]
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    return {
        "bench": "eval_cpu", "shape": SHAPE, "batch_size": BATCH, "eval_batch_rows": rows, "eval_tokens": tokens,
        "rounds": rounds, "threads": torch.get_num_threads(),
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        **{f"{k}_eval_tokens_per_second": v for k, v in tps.items()},
        **{f"{k}_speedup": v / tps["before"] for k, v in tps.items() if k != "before"},
        "val_bpb_before": bpb["before"],
        **{f"{k}_val_bpb_diff": v - bpb["before"] for k, v in bpb.items() if k != "before"},
        "seconds": {k: [round(t, 3) for t in v] for k, v in times.items()},
    }


def run() -> list[dict]:
    with tempfile.TemporaryDirectory() as cache:
        return [eval_throughput(cache)]


if __name__ == "__main__":
    import json

    for row in run():
        print(json.dumps(row))
