"""CORE evaluation speed on the CPU: the demo model on the demo bundle, length buckets against one pad.

Rows padded to a few fixed lengths (``core_buckets``, default 4) against every row padded to seq_len
(``core_buckets = 1``), interleaved rounds on the same randomly initialised demo model and all demo
examples, one thread. Reports median examples per second of each, their ratio, the padded fraction of
the positions run, and whether both scored exactly the same (they must: right padding is invisible to a
causal model).

``python -m bench core_bench`` prints one JSON line; ``CORE_BENCH_ROUNDS`` (default 5) sets the rounds.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

ROUNDS = int(os.environ.get("CORE_BENCH_ROUNDS", "5"))
CACHE_DIR = "runs/cache"


def run() -> list[dict[str, Any]]:
    import torch

    from model.config import RunConfig, parse_config
    from model.core import evaluate_core, load_bundle
    from model.data import load_dataset
    from model.democore import build_demo_bundle
    from model.gpt import GPT

    torch.set_num_threads(1)
    cfg = parse_config({})
    data = load_dataset(None, cfg.model.vocab_size, cache_dir=CACHE_DIR)
    tasks = load_bundle(build_demo_bundle(CACHE_DIR))
    torch.manual_seed(0)
    model = GPT(cfg.model)
    rates: dict[int, list[float]] = {1: [], RunConfig.core_buckets: []}
    last = {}
    for _ in range(ROUNDS):
        for buckets in rates:
            r = evaluate_core(model, data.tokenizer, tasks, seq_len=cfg.model.seq_len,
                              batch_size=RunConfig.batch_size, buckets=buckets)
            rates[buckets].append(r.examples / r.seconds)
            last[buckets] = r
    one, many = 1, RunConfig.core_buckets
    return [{
        "bench": "core_eval", "params": model.num_params(), "seq_len": cfg.model.seq_len,
        "batch_size": RunConfig.batch_size, "examples": last[one].examples, "rounds": ROUNDS,
        "pad_to_seq_len_examples_per_s": round(statistics.median(rates[one]), 1),
        "buckets_examples_per_s": round(statistics.median(rates[many]), 1),
        "speedup": round(statistics.median(rates[many]) / statistics.median(rates[one]), 3),
        "buckets": many, "shapes": last[many].shapes,
        "padding_pad_to_seq_len": round(last[one].padding, 4), "padding_buckets": round(last[many].padding, 4),
        "same_scores": last[one].accuracy == last[many].accuracy,
        "core": None if last[many].core is None else round(last[many].core, 6),
    }]
