"""``sweep compare``: whether a candidate train.py beats a base one, with a stated false-adopt rate.

``decision`` holds the statistics and nothing else (no Ray, no store): paired differences in, a verdict out,
so the command, the dashboard and the benchmark (bench/compare_bench.py) all decide the same way.
docs/compare.md gives the method and the benchmark's table.
"""
