"""`python -m model.data [SOURCE]`: build the caches of a source (e.g. before a sweep) and describe it."""

from __future__ import annotations

import argparse
import json
import sys
import time

from model.data import DataError, load_dataset
from model.data.loader import DEFAULT_CACHE


def main(argv: list[str] | None = None) -> int:
    """`python -m model.data [SOURCE]`: build the caches of a source (e.g. before a sweep) and describe it."""
    parser = argparse.ArgumentParser(prog="python -m model.data", description=main.__doc__)
    parser.add_argument("source", nargs="?", default="demo")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--val-shard", default=None)
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        ds = load_dataset(
            args.source,
            None if args.tokenizer else args.vocab_size,
            args.cache_dir,
            args.tokenizer,
            args.val_shard,
        )
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({**ds.describe(), "seconds": round(time.perf_counter() - t0, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
