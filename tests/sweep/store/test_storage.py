"""Storage: URL resolution, redaction, concurrent journal writers, PostgreSQL pooling and retries."""

from __future__ import annotations

import multiprocessing
import os

import optuna
import pytest
import sqlalchemy.exc

from sweep import cli
from sweep import store as st
from tests.sweep_fixtures import pg_available, pg_database, run_sweep, sweep_env, tiny_spec, write_spec

needs_pg = pytest.mark.skipif(not pg_available(), reason="PostgreSQL on 127.0.0.1:5432 is not running")


def test_redact_and_scrub():
    url = "postgresql+psycopg2://alice:s3cr%40t@db.example:5432/sweeps"
    assert st.redact(url) == "postgresql+psycopg2://alice:***@db.example:5432/sweeps"
    assert st.redact("postgresql://bob@host/db") == "postgresql://bob@host/db"
    assert st.redact("journal:/tmp/x.log") == "journal:/tmp/x.log"
    # Unquoted '/' and '@' in a password must not leak it.
    for secret in ("pa/ss", "p@ss", "a/b@c"):
        leaky = f"postgresql://u:{secret}@h:5432/db"
        assert secret not in st.redact(leaky) and st.redact(leaky).endswith("@h:5432/db")
        assert st.password(leaky) == secret
        assert secret not in st.scrub(f"cannot connect to {leaky}", leaky)
    text = f"could not connect to {url} (password s3cr@t)"
    assert "s3cr" not in st.scrub(text, url)


def test_resolve_url(monkeypatch, tmp_path):
    monkeypatch.delenv(st.ENV_STORAGE, raising=False)
    monkeypatch.chdir(tmp_path)
    assert st.resolve_url(None) == f"journal:{tmp_path / 'runs' / 'optuna-journal.log'}"
    assert st.resolve_url("journal:rel/j.log") == f"journal:{tmp_path / 'rel' / 'j.log'}"
    assert st.resolve_url("postgresql://h/db") == "postgresql://h/db"
    monkeypatch.setenv(st.ENV_STORAGE, "postgresql://env/db")
    assert st.resolve_url("postgresql://spec/db") == "postgresql://env/db"
    with pytest.raises(st.StorageError):
        st.open_storage("nonsense")


def _journal_writer(args: tuple[str, int]) -> list[int]:
    url, n = args
    study = optuna.load_study(study_name="conc", storage=st.open_storage(url, role="worker"))
    numbers = []
    for i in range(n):
        trial = study.ask()
        trial.suggest_float("x", 0, 1)
        trial.set_user_attr("writer", os.getpid())
        trial.report(float(i), i)
        study.tell(trial, float(i))
        numbers.append(trial.number)
    return numbers


def test_journal_is_safe_with_concurrent_writers(tmp_path):
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    optuna.create_study(study_name="conc", storage=st.open_storage(url))
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.map(_journal_writer, [(url, 8)] * 4)
    numbers = sorted(n for r in results for n in r)
    assert numbers == list(range(32))
    trials = optuna.load_study(study_name="conc", storage=st.open_storage(url)).get_trials()
    assert len(trials) == 32 and all(t.state.name == "COMPLETE" for t in trials)
    assert len({t.user_attrs["writer"] for t in trials}) == 4


def test_retry_backs_off_on_transient_errors_only():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed the connection"))
        return "ok"

    assert st.retry(flaky, base_s=0.01) == "ok" and len(calls) == 3
    wrapped = optuna.exceptions.StorageInternalError("commit failed")
    wrapped.__cause__ = sqlalchemy.exc.OperationalError("x", {}, Exception("gone"))
    assert st.is_transient(wrapped)

    def broken():
        calls.append(1)
        raise ValueError("not transient")

    calls.clear()
    with pytest.raises(ValueError):
        st.retry(broken, base_s=0.01)
    assert len(calls) == 1


def test_retry_waits_out_a_longer_outage_within_patience_only():
    """The driver's patience: past the attempts, retries go on until the store is back (or the limit)."""
    import time

    away_until = time.time() + 0.6

    def store() -> str:
        if time.time() < away_until:
            raise sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("connection refused"))
        return "ok"

    with pytest.raises(sqlalchemy.exc.OperationalError):  # two attempts: 0.01 s of backoff, then it fails
        st.retry(store, attempts=2, base_s=0.01, max_s=0.05)
    with st.patience(5.0):
        assert st.retry(store, attempts=2, base_s=0.01, max_s=0.05) == "ok"
    first, back = st.last_outage()
    assert first < away_until <= back
    away_until = time.time() + 5.0
    calls = []
    with st.patience(0.3), pytest.raises(sqlalchemy.exc.OperationalError):  # the limit is kept
        st.retry(lambda: calls.append(time.time()) or store(), attempts=2, base_s=0.01, max_s=0.05)
    # It gave up at its 0.3 s of patience, by its own readings, with the store still away for seconds.
    assert calls[-1] - calls[0] < 0.3 + 0.05 and calls[-1] < away_until


@needs_pg
def test_postgres_storage_survives_dropped_connections():
    import psycopg2

    with pg_database() as url:
        storage = st.open_storage(url)
        engine = storage.engine
        assert engine.pool.size() == st.ENGINE_KWARGS["driver"]["pool_size"]
        assert engine.pool._pre_ping
        study = optuna.create_study(study_name="pg", storage=storage)
        study.enqueue_trial({"x": 0.5})
        dbname = url.rsplit("/", 1)[1]
        admin = psycopg2.connect(host="127.0.0.1", user="postgres", dbname="postgres")
        admin.autocommit = True
        with admin.cursor() as cur:  # what a database restart does to every pooled connection
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (dbname,))
        admin.close()
        trial = st.retry(study.ask, url=url)
        study.tell(trial, 1.0)
        assert len(study.get_trials()) == 1
        storage.engine.dispose()


@needs_pg
def test_password_never_printed(tmp_path, capsys, monkeypatch):
    secret = "hunter2-Very-Secret"
    with pg_database(password=secret) as url:
        spec = write_spec(tmp_path, "pwtest", tiny_spec())
        env = sweep_env(url, tmp_path / "art")
        proc = run_sweep("status", str(spec), "--json", env=env, timeout=60)
        assert proc.returncode == 2  # no such study yet
        assert secret not in proc.stderr + proc.stdout and "***" in proc.stderr
        bad = url.rsplit("/", 1)[0] + "/no_such_database_here"
        monkeypatch.setenv(st.ENV_STORAGE, bad)
        assert cli.main(["status", str(spec)]) == 2  # an unreachable store: one line naming it, exit 2
        captured = capsys.readouterr()
        assert secret not in captured.err + captured.out
        (line,) = captured.err.strip().splitlines()
        assert "no_such_database_here" in line and 'database "no_such_database_here" does not exist' in line
