"""Benchmarks: each module has run() -> list[dict]; `python -m bench` prints them as JSON lines."""
