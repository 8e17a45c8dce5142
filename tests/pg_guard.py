"""A pytest plugin that fails the run if the machine's PostgreSQL was restarted while it ran.

Tests own their services: a test that stops or restarts its store does it to a private cluster
(:mod:`tests.pg_cluster`), never to the machine's server, which serves other work. This guard makes
that a checked promise: it reads ``pg_postmaster_start_time()`` at the session's start and again at
its end, and a changed (or vanished) start time fails the run with a line saying so.
``$TRNSWEEP_MACHINE_PG`` (``host:port``, default 127.0.0.1:5432) names the server watched.
tests/conftest.py imports its hooks; ``pytest -p tests.pg_guard`` loads it elsewhere.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

ENV_MACHINE_PG = "TRNSWEEP_MACHINE_PG"
_STATE: dict[str, Any] = {}


def machine_pg() -> tuple[str, int]:
    host, _, port = os.environ.get(ENV_MACHINE_PG, "127.0.0.1:5432").rpartition(":")
    return host, int(port)


def start_time() -> Any:
    """The watched server's start time, or None when it cannot be reached."""
    import psycopg2

    host, port = machine_pg()
    try:
        conn = psycopg2.connect(host=host, port=port, user="postgres", dbname="postgres", connect_timeout=3)
    except psycopg2.OperationalError:
        return None
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_postmaster_start_time()")
            return cur.fetchone()[0]
    finally:
        conn.close()


def pytest_sessionstart(session: pytest.Session) -> None:
    _STATE["before"] = start_time()


def verdict() -> str | None:
    """What the run did to the machine's server, or None when it left it as it found it."""
    before = _STATE.get("before")
    if before is None:  # not running at the start: nothing of it to keep
        return None
    after = start_time()
    if after == before:
        return None
    host, port = machine_pg()
    now = "is not running" if after is None else f"was restarted at {after.isoformat()}"
    return (f"the machine's PostgreSQL ({host}:{port}, started {before.isoformat()}) {now} during this run: "
            "a test stopped or restarted a server it did not start (use tests.pg_cluster)")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    problem = verdict()
    if problem:
        _STATE["problem"] = problem
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _STATE.get("problem"):
        terminalreporter.section("machine PostgreSQL guard", red=True)
        terminalreporter.write_line(f"FAILED: {_STATE['problem']}", red=True)
