"""Data-room benchmarks: loader tokens/s on one core, tokenizer encode MB/s, training and pre-tokenisation.

`python -m bench.data_bench` (or `python -m bench data_bench`) prints one JSON object per line. Every
figure is the median of REPS repetitions. The loader must outrun the trainer by at least 10x: the trainer
consumes about 1e4-1e5 tokens/s on a CPU, so `x_cpu_trainer` reports the ratio to 1e5 tokens/s.
Data: the demo corpus (built on first use under runs/).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from model.data import BatchLoader, TokenDataset, Tokenizer, load_dataset
from model.data.shards import write_token_shard
from model.data.source import iter_documents

REPS = 5
CPU_TRAINER_TOKENS_PER_S = 100_000  # the top of the trainer's CPU consumption (see module doc)
CACHE = os.environ.get("TRNSWEEP_BENCH_CACHE", "runs/cache")


def _median_rate(work: Callable[[], float], min_seconds: float = 0.3) -> tuple[float, list[float]]:
    """Median over REPS of units/second, each repetition repeating `work` (returns units) for min_seconds."""
    rates = []
    for _ in range(REPS):
        units, t0 = 0.0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < min_seconds:
            units += work()
        rates.append(units / elapsed)
    return statistics.median(rates), rates


def bench_loader(ds: TokenDataset, batch_size: int, seq_len: int, world_size: int = 1) -> dict[str, Any]:
    loader = BatchLoader(ds, batch_size, seq_len, rank=0, world_size=world_size)
    for _ in range(5):
        next(loader)

    def step() -> float:
        x, _ = next(loader)
        return x.numel()

    rate, rates = _median_rate(step)
    return {
        "bench": "loader",
        "batch_size": batch_size,
        "seq_len": seq_len,
        "world_size": world_size,
        "threads": torch.get_num_threads(),
        "tokens_per_s": round(rate),
        "spread": [round(r) for r in sorted(rates)],
        "x_cpu_trainer": round(rate / CPU_TRAINER_TOKENS_PER_S, 1),
    }


def bench_resume(ds: TokenDataset, batch_size: int, seq_len: int) -> dict[str, Any]:
    rows = 20_000
    t0 = time.perf_counter()
    BatchLoader(ds, batch_size, seq_len, position=rows)
    seconds = time.perf_counter() - t0
    return {"bench": "loader_resume", "seq_len": seq_len, "rows": rows, "rows_per_s": round(rows / seconds)}


def bench_encode(tok: Tokenizer, texts: list[str], threads: int) -> dict[str, Any]:
    mb = sum(len(t.encode()) for t in texts) / 1e6
    rate, _ = _median_rate(lambda: (tok.encode_batch(texts, num_threads=threads), mb)[1])
    return {
        "bench": "tokenizer_encode",
        "vocab_size": tok.vocab_size,
        "threads": threads,
        "mb_per_s": round(rate, 2),
    }


def bench_train(texts: list[str], vocab_size: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    Tokenizer.train(texts, vocab_size)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    return {
        "bench": "tokenizer_train",
        "vocab_size": vocab_size,
        "text_mb": round(mb, 2),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def bench_pretokenize(ds: TokenDataset, src: Path, text_mb: float) -> dict[str, Any]:
    """Parquet shard to token shard, end to end (read, encode on all cores, write)."""
    seconds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(REPS):
            t0 = time.perf_counter()
            write_token_shard(src, ds.tokenizer, Path(tmp) / f"{i}.tok")
            seconds.append(time.perf_counter() - t0)
    median = statistics.median(seconds)
    return {
        "bench": "pretokenize",
        "text_mb": round(text_mb, 3),
        "seconds": round(median, 3),
        "text_mb_per_s": round(text_mb / median, 2),
    }


def run() -> list[dict[str, Any]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        ds = load_dataset(None, 4096, cache_dir=CACHE)
        rows: list[dict[str, Any]] = [
            {"bench": "load_dataset", "seconds": round(time.perf_counter() - t0, 3), **ds.describe()}
        ]
        rows.append(bench_loader(ds, 32, 256))
        rows.append(bench_loader(ds, 8, 2048))
        rows.append(bench_loader(ds, 8, 2048, world_size=8))
        rows.append(bench_resume(ds, 32, 256))

        demo = Path(ds.source)
        val_file = sorted(demo.glob("*.parquet"))[-1]
        val_texts = [t for docs in iter_documents(val_file) for t in docs]
        rows.append(bench_encode(ds.tokenizer, val_texts, threads=1))
        rows.append(bench_encode(ds.tokenizer, val_texts, threads=os.cpu_count() or 1))
        train_texts = [
            t for f in sorted(demo.glob("*.parquet"))[:-1] for docs in iter_documents(f) for t in docs
        ]
        for vocab in (2048, 8192):
            rows.append(bench_train(train_texts, vocab))
        rows.append(bench_pretokenize(ds, val_file, sum(len(t.encode()) for t in val_texts) / 1e6))
    finally:
        torch.set_num_threads(threads)
    return rows


if __name__ == "__main__":
    for row in run():
        print(json.dumps(row), flush=True)
