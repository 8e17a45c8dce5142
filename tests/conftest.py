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
from tests.ci import skip_unless_ci
from tests.pg_cluster import PgCluster
from tests.ray_head import Head, ray_head

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



# The project's one stand-in for the competition kit's own dialect (ensure_tokenizer, make_dataloader split by
# rank, evaluate_bpb -> dict, causality_check, record_step_boundary, `prepare.py setup` / `eval-public`).
KIT_DIALECT_PREPARE = ROOT / "sweep" / "studies" / "kit-demo" / "prepare.py"


@pytest.fixture(scope="session")
def kit_dialect(tmp_path_factory) -> Path:
    """A folder holding a copy of the kit-dialect stand-in, set up (`prepare.py setup`: one training shard,
    public_val, the 8192-token tokenizer) with its cache in that folder."""
    folder = tmp_path_factory.mktemp("kit_dialect")
    (folder / "prepare.py").write_bytes(KIT_DIALECT_PREPARE.read_bytes())
    env = subprocess_env()
    env.pop("NEURON_COMPETITION_R1_CACHE_DIR", None)
    env.pop("NEURON_COMPETITION_R1_TOKENIZER_PATH", None)
    proc = subprocess.run([sys.executable, "prepare.py", "setup", "--num-train-shards", "1"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Head]:
    """A Ray head of the session's own, in processes of its own (tests.ray_head): drivers join it from
    subprocesses; the pytest process never connects to Ray. One for the session (a head takes seconds to start
    and stop); each sweep on it checks that every CPU is free again when it ends (tests/faults)."""
    with ray_head() as head:
        yield head


@pytest.fixture(scope="module")
def private_pg() -> Iterator[PgCluster]:
    """A PostgreSQL server of the module's own (tests.pg_cluster): the one a test may stop or restart."""
    why = pg_cluster.available()
    if why:
        skip_unless_ci(why)
    with pg_cluster.pg_cluster() as cluster:
        yield cluster


def pytest_configure(config: pytest.Config) -> None:
    """The guards that fail a run which restarted the machine's PostgreSQL (tests own their services) or left
    threads, child processes or a Ray driver behind (tests.session_guard)."""
    for plugin in ("tests.pg_guard", "tests.session_guard"):
        if not config.pluginmanager.has_plugin(plugin):
            config.pluginmanager.import_plugin(plugin)
