"""The trainer's defaults side by side with the public recipe (bench.recipe_reference), per second of training.

Same shape (depth 4, width 256, two heads of 128, sequence 256, batch 8, vocabulary 8192), same data (the
demo stream; the final evaluation's rows, model.evaluate.final_val_bpb), 2 threads, float32, the same
charged clock (model.train.ChargedClock) with the same uncharged first steps on both sides: EXCLUDED_STEPS,
the competition's kind of figure (its kit leaves a few steps free), not autoresearch's own clock, which leaves
its first 11 steps out. Both sides compile their optimiser step as the public recipe does (torch.compile of
its fused update functions; ours: model.optim), each inside its uncharged start-up; ours also compiles its
loss (compile_loss, the trainer's default; the reference's is the plain chain). Each run is its own
process; the two sides alternate which goes first, pair after pair, and every figure is a median over pairs.
Tokens per second are both sides' charged tokens over their charged step seconds.

    python -m bench recipe_bench                    # RECIPE_BENCH_PAIRS (3) and RECIPE_BENCH_BUDGETS ("12,60")
    python -m bench.recipe_bench --pairs 1 --budgets 12,20 [--ours '{"window_pattern": "SSSL"}']
    python -m bench.recipe_bench --side reference --budget-s 12    # one run: its JSON line

Targets: issue 17, the defaults' val_bpb at 60 s at most the reference's with a tokens/s ratio >= 1; issue 26, the same
against the reference with its optimiser step compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SHAPE: dict[str, Any] = {"vocab_size": 8192, "depth": 4, "model_dim": 256, "head_dim": 128, "seq_len": 256,
                         "batch_size": 8}
THREADS = 2
EXCLUDED_STEPS = 3
FINAL_EVAL_TOKENS = 65536


def _env_pairs() -> int:
    return int(os.environ.get("RECIPE_BENCH_PAIRS", "3"))


def _env_budgets() -> list[float]:
    return [float(b) for b in os.environ.get("RECIPE_BENCH_BUDGETS", "12,60").split(",") if b.strip()]


def run_reference(budget_s: float, shape: dict[str, Any], cache_dir: str, seed: int = 0,
                  window_pattern: str = "SSSL", eval_tokens: int = FINAL_EVAL_TOKENS,
                  compile: bool = True) -> dict[str, Any]:
    """One budgeted run of the reference in this process: its record (the fields the bench reads)."""
    import torch

    from bench.recipe_reference import RefConfig, RefGPT, RefOptimizer
    from model.data import BatchLoader, load_dataset
    from model.evaluate import final_val_bpb
    from model.train import STEP_PARTS, ChargedClock, StepTimer

    torch.set_num_threads(THREADS)
    torch.manual_seed(seed)
    ds = load_dataset(None, shape["vocab_size"], cache_dir=cache_dir)
    cfg = RefConfig(vocab_size=ds.vocab_size, depth=shape["depth"], dim=shape["model_dim"],
                    head_dim=shape["head_dim"], seq_len=shape["seq_len"], window_pattern=window_pattern)
    model = RefGPT(cfg)
    opt = RefOptimizer(model, compile=compile)
    B, T = shape["batch_size"], shape["seq_len"]
    loader = BatchLoader(ds, batch_size=B, seq_len=T, rank=0, world_size=1, seed=seed)
    clock = ChargedClock(budget_s, allowance_s=float("inf"), excluded_steps=EXCLUDED_STEPS)
    clock.start(0.0)
    steps = 0
    parts = dict.fromkeys(STEP_PARTS, 0.0)
    while not clock.should_stop():
        t0 = time.perf_counter()
        opt.schedule(clock.progress, steps)
        lap = StepTimer()
        x, y = next(loader)
        lap("data")
        loss = model(x, y)
        lap("forward")
        loss.backward()
        lap("backward")
        opt.step()
        model.zero_grad(set_to_none=True)
        lap("optimizer")
        clock.add_step(time.perf_counter() - t0)
        if clock.steps_seen > clock.excluded_steps:
            for part, seconds in lap.parts.items():
                parts[part] += seconds
        steps += 1
    record = final_val_bpb(model, ds, B, T, eval_tokens, 0, 0, torch.device("cpu"))
    return {"side": "reference", "val_bpb": record["val_bpb"], "steps": steps,
            "charged_steps": len(clock.step_times), "step_seconds_sum": sum(clock.step_times),
            "tokens_per_second": len(clock.step_times) * B * T / sum(clock.step_times),
            "window_pattern": window_pattern, "optimizer_compiled": compile,
            "startup_seconds": clock.startup_s, **_per_step(parts, len(clock.step_times))}


def _per_step(parts: dict[str, float], steps: int) -> dict[str, float]:
    """Milliseconds per charged step, part by part (model.train.STEP_PARTS)."""
    return {f"{part}_ms_per_step": 1000 * seconds / steps if steps else 0.0 for part, seconds in parts.items()}


def _ours(budget_s: float, shape: dict[str, Any], cache_dir: str, overrides: dict[str, Any],
          eval_tokens: int, compile: bool = True) -> dict[str, Any]:
    config = {**shape, "data": "demo", "cache_dir": cache_dir, "num_threads": THREADS, "device": "cpu",
              "eval_fractions": [], "save_checkpoint": False, "excluded_steps": EXCLUDED_STEPS,
              "final_eval_tokens": eval_tokens, "compile_optimizer": compile, "compile_loss": compile,
              **overrides}
    proc = subprocess.run([sys.executable, "-m", "model.train", "--config", json.dumps(config),
                           "--budget-s", str(budget_s), "--json"], cwd=ROOT, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"model.train exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    r = json.loads(lines[-1])
    charged = r["steps"] - r["excluded_steps"]
    tokens = charged * shape["batch_size"] * shape["seq_len"]
    from model.train import STEP_PARTS

    return {"side": "ours", "val_bpb": r["val_bpb"], "steps": r["steps"], "charged_steps": charged,
            "step_seconds_sum": r["step_seconds_sum"], "tokens_per_second": tokens / r["step_seconds_sum"],
            "params": r["params"], "optimizer_compiled": r["optimizer_compiled"],
            "startup_seconds": r["startup_seconds"],
            **_per_step({part: r[f"{part}_seconds"] for part in STEP_PARTS}, charged)}


def _reference(budget_s: float, shape: dict[str, Any], cache_dir: str, window_pattern: str,
               eval_tokens: int, compile: bool = True) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "bench.recipe_bench", "--side", "reference", "--budget-s",
                           str(budget_s), "--shape", json.dumps(shape), "--cache-dir", cache_dir,
                           "--window-pattern", window_pattern, "--eval-tokens", str(eval_tokens),
                           *([] if compile else ["--eager"])], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"reference exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(pairs: int, budgets: list[float], shape: dict[str, Any] | None = None,
            overrides: dict[str, Any] | None = None, cache_dir: str | None = None,
            window_pattern: str = "SSSL", eval_tokens: int = FINAL_EVAL_TOKENS, compile: bool = True) -> dict[str, Any]:
    """Alternating pairs of runs at each budget; medians, ratios and every run's figures. ``compile``: both sides'
    optimiser steps compiled (the bench's figures); off, both eager."""
    shape = {**SHAPE, **(shape or {})}
    with tempfile.TemporaryDirectory() as tmp:
        cache = cache_dir or tmp
        load_before = os.getloadavg()
        runs: list[dict[str, Any]] = []
        for pair in range(pairs):
            for budget in budgets:
                sides = ["ours", "reference"] if pair % 2 == 0 else ["reference", "ours"]
                for side in sides:
                    rec = (_ours(budget, shape, cache, overrides or {}, eval_tokens, compile) if side == "ours"
                           else _reference(budget, shape, cache, window_pattern, eval_tokens, compile))
                    runs.append({**rec, "pair": pair, "budget_s": budget})
        load_after = os.getloadavg()

    def med(side: str, key: str, budget: float | None = None) -> float:
        return statistics.median(r[key] for r in runs if r["side"] == side
                                 and (budget is None or r["budget_s"] == budget))

    def pair_ratio(budget: float, pair: int) -> float:
        ours, ref = (next(r for r in runs if r["side"] == s and r["pair"] == pair and r["budget_s"] == budget)
                     for s in ("ours", "reference"))
        return ours["tokens_per_second"] / ref["tokens_per_second"]

    row: dict[str, Any] = {
        "bench": "recipe_vs_reference", "shape": shape, "threads": THREADS, "pairs": pairs, "budgets": budgets,
        "uncharged_steps": EXCLUDED_STEPS, "uncharged_steps_note": "both sides; autoresearch's own clock leaves 11",
        "optimizers_compiled": compile,
        "ours_overrides": overrides or {}, "reference_window_pattern": window_pattern, "eval_tokens": eval_tokens,
        "load_before": load_before, "load_after": load_after,
        "ours_tokens_per_second": med("ours", "tokens_per_second"),
        "reference_tokens_per_second": med("reference", "tokens_per_second"),
        "tokens_per_second_ratio": statistics.median(pair_ratio(b, p) for b in budgets for p in range(pairs)),
    }
    from model.train import STEP_PARTS

    for side in ("ours", "reference"):
        row[f"{side}_ms_per_step"] = {part: round(med(side, f"{part}_ms_per_step"), 2) for part in STEP_PARTS}
    for b in budgets:
        tag = f"{b:g}s"
        row[f"ours_val_bpb_{tag}"] = med("ours", "val_bpb", b)
        row[f"reference_val_bpb_{tag}"] = med("reference", "val_bpb", b)
        row[f"val_bpb_delta_{tag}"] = row[f"ours_val_bpb_{tag}"] - row[f"reference_val_bpb_{tag}"]
    row["runs"] = runs
    return row


def run() -> list[dict]:
    return [compare(_env_pairs(), _env_budgets())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.recipe_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=None, help="alternating pairs (default RECIPE_BENCH_PAIRS or 3)")
    parser.add_argument("--budgets", default=None, help="comma-separated seconds (default RECIPE_BENCH_BUDGETS)")
    parser.add_argument("--ours", default="{}", help="JSON config over the trainer's defaults")
    parser.add_argument("--shape", default="{}", help="JSON over the bench's shape (tests use a tiny one)")
    parser.add_argument("--window-pattern", default="SSSL", help="the reference's attention windows")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--eval-tokens", type=int, default=FINAL_EVAL_TOKENS, help="the final evaluation's tokens")
    parser.add_argument("--side", choices=["reference"], default=None, help="one reference run (internal)")
    parser.add_argument("--budget-s", type=float, default=12.0)
    parser.add_argument("--eager", action="store_true", help="both sides' optimiser steps uncompiled")
    args = parser.parse_args(argv)
    try:
        shape = {**SHAPE, **json.loads(args.shape)}
        overrides = json.loads(args.ours)
        budgets = [float(b) for b in args.budgets.split(",")] if args.budgets else _env_budgets()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.side == "reference":
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(run_reference(args.budget_s, shape, args.cache_dir or tmp,
                                           window_pattern=args.window_pattern, eval_tokens=args.eval_tokens,
                                           compile=not args.eager)),
                  flush=True)
        return 0
    pairs = args.pairs if args.pairs is not None else _env_pairs()
    print(json.dumps(compare(pairs, budgets, shape, overrides, args.cache_dir, args.window_pattern, args.eval_tokens,
                             compile=not args.eager)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
