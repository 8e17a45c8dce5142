"""The benchmarks set torch's global thread count and seeds for their own runs (bench/*.py); a test of them
must leave both as it found them, or every later test in the process runs on another machine than it thinks."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_compile_thread() -> Iterator[None]:
    """The reference's compiled step compiles in this process, without inductor's pool of compile workers
    (children the session would otherwise end with, on this 2-core machine)."""
    import torch._inductor.config

    with torch._inductor.config.patch(compile_threads=1):
        yield


@pytest.fixture(autouse=True)
def torch_globals_restored() -> Iterator[None]:
    threads, interop = torch.get_num_threads(), torch.get_num_interop_threads()
    torch_rng, py_rng = torch.random.get_rng_state(), random.getstate()
    yield
    torch.set_num_threads(threads)
    torch.random.set_rng_state(torch_rng)
    random.setstate(py_rng)
    assert torch.get_num_interop_threads() == interop  # fixed once per process: a bench may not change it
