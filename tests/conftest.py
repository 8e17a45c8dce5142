"""Shared fixtures: the repository root, a warm data cache, and a runner for the real trainer CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import pg_cluster
from tests.pg_cluster import PgCluster

ROOT = Path(__file__).resolve().parent.parent

# A model small enough that the CPU trains it visibly in a few seconds.
TINY = {
    "vocab_size": 512,
    "depth": 2,
    "model_dim": 64,
    "head_dim": 16,
    "seq_len": 64,
    "batch_size": 8,
    "eval_tokens": 4096,
    "final_eval_tokens": 16384,
    "num_threads": 1,
    "log_every": 5,
    # A compile costs tens of seconds of start-up; tests/model/test_compiled_steps.py checks both.
    "compile_optimizer": False,
    "compile_loss": False,
}


@pytest.fixture(scope="session")
def data_cache(tmp_path_factory) -> str:
    """One cache for the session: the demo corpus, tokenizer and token shards are built once."""
    cache = tmp_path_factory.mktemp("cache")
    from model.data import load_dataset

    load_dataset(None, TINY["vocab_size"], cache_dir=cache)
    return str(cache)


@pytest.fixture(scope="session")
def tiny_config(data_cache) -> dict:
    return {**TINY, "cache_dir": data_cache}


def subprocess_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra}
    env.pop("WORLD_SIZE", None)
    return env


@dataclass
class TrainerRun:
    returncode: int
    events: list[dict]
    stderr: str

    @property
    def result(self) -> dict:
        assert self.events and self.events[-1]["event"] == "result", self.stderr[-2000:]
        return self.events[-1]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["event"] == kind]


def trainer_command(config: dict, budget_s: float, out_dir: Path | None = None, ranks: int = 1) -> list[str]:
    args = ["-m", "model.train", "--config", json.dumps(config), "--budget-s", str(budget_s), "--json"]
    if out_dir is not None:
        args += ["--out-dir", str(out_dir)]
    if ranks > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={ranks}", *args]
    return [sys.executable, *args]


def parse_events(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


@pytest.fixture
def run_trainer():
    def run(config: dict, budget_s: float, out_dir: Path | None = None, ranks: int = 1,
            timeout: float = 240) -> TrainerRun:
        proc = subprocess.run(trainer_command(config, budget_s, out_dir, ranks), cwd=ROOT, env=subprocess_env(),
                              capture_output=True, text=True, timeout=timeout)
        return TrainerRun(proc.returncode, parse_events(proc.stdout), proc.stderr)

    return run


# The stand-in competition kit (tests/kit_standin) on the demo corpus, with TINY's vocabulary: MAX_SEQ_LEN is
# the kit's 2048; EVAL_TOKENS is cut to KIT_EVAL_ROWS rows of it so that its evaluate_bpb takes a moment.
KIT_EVAL_ROWS = 16


@pytest.fixture(scope="session")
def standin_kit(data_cache, tmp_path_factory) -> Path:
    """A stand-in kit folder (prepare.py, data/, tokenizer/ trained by its own train_tokenizer)."""
    from tests.kit_standin import build_kit

    demo = Path(data_cache).parent / "data" / "demo"
    return build_kit(tmp_path_factory.mktemp("kit") / "kit", demo, VOCAB_SIZE=TINY["vocab_size"],
                     EVAL_TOKENS=KIT_EVAL_ROWS * 2048)



@pytest.fixture(scope="module")
def private_pg() -> Iterator[PgCluster]:
    """A PostgreSQL server of the module's own (tests.pg_cluster): the one a test may stop or restart."""
    why = pg_cluster.available()
    if why:
        pytest.skip(why)
    with pg_cluster.pg_cluster() as cluster:
        yield cluster


_EXIT_STATUS: list[int] = []


def pytest_configure(config: pytest.Config) -> None:
    """The guard that fails a run which restarted the machine's PostgreSQL (tests own their services)."""
    if not config.pluginmanager.has_plugin("tests.pg_guard"):
        config.pluginmanager.import_plugin("tests.pg_guard")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _EXIT_STATUS.append(int(session.exitstatus))  # the guard's verdict included


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without the interpreter's teardown once every result is printed.

    A full run once ended in a segmentation fault after its summary line (820 passed), in the interpreter's
    teardown: the tests had all passed, the exit code did not say so. Exiting here keeps pytest's own
    status (the PostgreSQL guard's verdict included) and skips that teardown.

    Why it stays: a test that runs Ray in this process (``local_ray``, the fault suite's in-process
    drivers) leaves native threads running after ``ray.shutdown()``: Ray's GCS client I/O thread
    (``gcs_client_io_service``) and gRPC core's global threads (timer, executor, resolver, event engine),
    held by Ray's own C++ objects, beyond the tests' reach. They run on through the interpreter's
    finalization and the C++ static destructors, the usual ground of a rare crash at exit. What the tests
    hold themselves is closed (the gRPC proxy test closes its client's channel, whose threads then end);
    at the end of each group of test files no Python thread but the main one and no child process is left.
    ``TRNSWEEP_PYTEST_HARD_EXIT=0`` runs the normal teardown (with ``python -X faulthandler`` to see a crash).
    """
    if _EXIT_STATUS and os.environ.get("TRNSWEEP_PYTEST_HARD_EXIT", "1") == "1":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
