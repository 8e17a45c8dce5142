"""Helpers for the sweep tests: spec files, throwaway PostgreSQL databases, process checks."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PG_ADMIN = {"host": "127.0.0.1", "port": 5432, "user": "postgres", "dbname": "postgres"}

# The trainer settings of every end-to-end sweep test: a model the CPU trains in a blink.
FIXED = {
    "device": "cpu",
    "num_threads": 1,
    "vocab_size": 512,
    "head_dim": 16,
    "seq_len": 32,
    "batch_size": 4,
    "eval_tokens": 512,
    "final_eval_tokens": 2048,
    "log_every": 5,
    # A compile costs tens of seconds of start-up; tests/model/test_compiled_steps.py checks both.
    "compile_optimizer": False,
    "compile_loss": False,
}


def toml_value(v: Any) -> str:
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(v)


def spec_toml(sections: Mapping[str, Mapping[str, Any]]) -> str:
    """TOML text from {table name: {key: value}}; nested tables as [a.b]."""
    out = []
    for name, table in sections.items():
        if table is None:
            continue
        out.append(f"[{name}]")
        out += [f"{k} = {toml_value(v)}" for k, v in table.items()]
        out.append("")
    return "\n".join(out)


def tiny_spec(cache_dir: str | None = None, **sections: Mapping[str, Any] | None) -> dict[str, Any]:
    """Sections of a small, fast study; keyword arguments replace or add whole tables."""
    fixed = dict(FIXED)
    if cache_dir:
        fixed["cache_dir"] = cache_dir
    base: dict[str, Any] = {
        "study": {"n_trials": 4, "concurrency": 2, "seed": 0},
        "trial": {"budget_s": 4, "startup_allowance_s": 20, "eval_timeout_s": 20, "eval_fractions": [0.5],
                  "heartbeat_s": 1, "stale_after_s": 8, "stop_grace_s": 5},
        "trial.resources": {"num_cpus": 1},
        "sampler": {"name": "random"},
        "pruner": {"name": "none"},
        "fixed": fixed,
        "params.depth": {"type": "int", "low": 1, "high": 2},
        "params.model_dim": {"type": "int", "low": 32, "high": 64, "step": 16},
        "params.matrix_lr": {"type": "float", "low": 0.01, "high": 0.05, "log": True},
    }
    base.update(sections)
    return base


@contextlib.contextmanager
def environ(values: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with ``values`` set, as it was afterwards (set, changed or absent alike):
    for a hypothesis test, whose examples cannot take the function-scoped monkeypatch."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def write_spec(directory: Path, name: str, sections: Mapping[str, Mapping[str, Any]]) -> Path:
    path = directory / f"{name}.toml"
    path.write_text(spec_toml(sections))
    return path


@contextlib.contextmanager
def pg_database(password: str | None = None) -> Iterator[str]:
    """A fresh, uniquely named database, dropped afterwards; yields its SQLAlchemy URL."""
    import psycopg2

    name = f"sweep_test_{uuid.uuid4().hex[:12]}"
    conn = psycopg2.connect(**PG_ADMIN)
    conn.autocommit = True
    try:
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        auth = f"postgres:{password}" if password else "postgres"
        yield f"postgresql+psycopg2://{auth}@127.0.0.1:5432/{name}"
    finally:
        with conn.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


def pg_available() -> bool:
    """Whether the PostgreSQL tests can run. Under CI (which starts the server) a missing server is a
    failure, not a skip: this waits for it a while, then answers True so those tests fail loudly."""
    import psycopg2

    deadline = time.monotonic() + (60 if os.environ.get("CI") else 0)
    while True:
        try:
            psycopg2.connect(connect_timeout=3, **PG_ADMIN).close()
            return True
        except Exception:
            if time.monotonic() >= deadline:
                return bool(os.environ.get("CI"))
            time.sleep(1)


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker`` (zombies excluded)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            pids.append(int(d.name))
    return pids


def wait_for(predicate: Any, timeout: float, interval: float = 0.2, what: str = "condition") -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def sweep_env(storage: str, artifacts: Path, **extra: str) -> dict[str, str]:
    """A sweep command's environment: its store and artifacts; no RAY_ADDRESS of this process's, only one that
    ``extra`` gives (a local Ray of the command's own otherwise)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, "SWEEP_STORAGE": storage, "SWEEP_ARTIFACTS": str(artifacts), "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT), **extra}


def head_env(head: Any, storage: str, artifacts: Path, **extra: str) -> dict[str, str]:
    """What a driver or ``sweep trial`` process needs to join ``head`` (a tests.ray_head.Head)."""
    return sweep_env(storage, artifacts, RAY_ADDRESS=head.address, **head.env, **extra)


def sweep_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "sweep", *args]


def run_sweep(*args: str, env: Mapping[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(sweep_cmd(*args), env=dict(env), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def supervise(task: Any, reporter: Any = None) -> Any:
    """One trial's supervisor run to its outcome (sweep.run.supervisor), closed whatever happens."""
    from sweep.run.supervisor import Supervisor

    sup = Supervisor(task, reporter)
    try:
        return sup.run()
    finally:
        sup.close()


def load_trials(storage: str, study: str, missing_ok: bool = False) -> list[Any]:
    """The study's trials; with ``missing_ok`` none while the driver has yet to create it (for polling)."""
    import optuna

    from sweep import store as st

    try:
        return optuna.load_study(study_name=study, storage=st.open_storage(storage)).get_trials(deepcopy=False)
    except KeyError:
        if missing_ok:
            return []
        raise
