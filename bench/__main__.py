"""Run the benchmarks and print one JSON object per line: `python -m bench [NAME ...]`.

Each module in SUITES has `run() -> list[dict]`. These machines are shared and noisy, so every figure is a
median over repetitions, and comparisons are ratios measured within one run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

SUITES = ("trainer_bench", "recipe_bench", "eval_bench", "data_bench", "kernels_bench", "core_bench", "sweep_bench",
          "storage_load", "replay_bench", "compare_bench")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("names", nargs="*", help=f"subset of {', '.join(SUITES)}")
    args = parser.parse_args(argv)
    names = args.names or list(SUITES)
    unknown = sorted(set(names) - set(SUITES))
    if unknown:
        print(f"error: unknown benchmark {unknown[0]!r}; choose from {', '.join(SUITES)}", file=sys.stderr)
        return 2
    for name in names:
        module = importlib.import_module(f"bench.{name}")
        t0 = time.perf_counter()
        for row in module.run():
            print(json.dumps({"suite": name, **row}), flush=True)
        print(f"{name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
