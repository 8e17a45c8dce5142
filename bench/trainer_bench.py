"""Trainer throughput on the CPU: tokens per second, wall time outside training steps, and a side-by-side
comparison of one training step against a plain implementation of the same model (bench.plain_gpt)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"vocab_size": 2048, "depth": 4, "model_dim": 128, "head_dim": 32, "seq_len": 128, "batch_size": 16,
          "eval_fractions": [0.5], "eval_tokens": 16384, "final_eval_tokens": 65536}
BUDGET_S = 20.0
REPEATS = 3


def trainer_runs(cache_dir: str) -> dict:
    """Run the real trainer CLI several times; report medians."""
    rows = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "model.train", "--config", json.dumps({**CONFIG, "cache_dir": cache_dir}),
             "--budget-s", str(BUDGET_S), "--json"],
            cwd=ROOT, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append((result, wall))
    return {
        "bench": "trainer_cpu",
        "config": CONFIG,
        "budget_s": BUDGET_S,
        "repeats": REPEATS,
        "threads": torch.get_num_threads(),
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r, _ in rows),
        "startup_seconds": statistics.median(r["startup_seconds"] for r, _ in rows),
        "eval_seconds": statistics.median(r["eval_seconds"] for r, _ in rows),
        "wall_seconds": statistics.median(w for _, w in rows),
        "outside_steps_fraction": statistics.median(1 - r["train_seconds"] / w for r, w in rows),
        "charged_over_budget_ratio": max(r["train_seconds"] / BUDGET_S for r, _ in rows),
        "val_bpb": statistics.median(r["val_bpb"] for r, _ in rows),
    }


def side_by_side(steps: int = 20, rounds: int = 5) -> dict:
    """Our model + optimiser step against the plain one, interleaved rounds, median step times."""
    from bench.plain_gpt import plain_step_fn
    from model.config import GPTConfig, OptimConfig
    from model.gpt import GPT
    from model.optim import Optimizers

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=CONFIG["vocab_size"], depth=CONFIG["depth"], model_dim=CONFIG["model_dim"],
                    head_dim=CONFIG["head_dim"], seq_len=CONFIG["seq_len"])
    model = GPT(cfg)
    opt = Optimizers(model.param_groups(), cfg.model_dim, OptimConfig(), torch.device("cpu"))

    def ours(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.set_progress(0.3)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()

    plain = plain_step_fn(cfg.vocab_size, cfg.depth, cfg.model_dim, cfg.head_dim, cfg.seq_len)
    x = torch.randint(0, cfg.vocab_size, (CONFIG["batch_size"], cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (CONFIG["batch_size"], cfg.seq_len))
    times: dict[str, list[float]] = {"ours": [], "plain": []}
    for fn in (ours, plain):
        fn(x, y)  # warm-up
    for _ in range(rounds):
        for name, fn in (("ours", ours), ("plain", plain)):
            t0 = time.perf_counter()
            for _ in range(steps):
                fn(x, y)
            times[name].append((time.perf_counter() - t0) / steps)
    ours_s, plain_s = statistics.median(times["ours"]), statistics.median(times["plain"])
    tokens = CONFIG["batch_size"] * cfg.seq_len
    return {"bench": "trainer_vs_plain", "ours_step_s": ours_s, "plain_step_s": plain_s,
            "ours_tokens_per_second": tokens / ours_s, "plain_tokens_per_second": tokens / plain_s,
            "throughput_ratio": plain_s / ours_s, "rounds": rounds, "steps_per_round": steps}


def run() -> list[dict]:
    with tempfile.TemporaryDirectory() as cache:
        return [trainer_runs(cache), side_by_side()]


if __name__ == "__main__":
    for row in run():
        print(json.dumps(row))
