"""What the sweep adds to Optuna's database schema: a lock around its creation, and the indexes the
sweep's queries need. PostgreSQL only; other stores pass through.

``sqlalchemy`` is imported inside the functions (heavy, and a journal store never needs it).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from sweep.redact import scrub
from sweep.store import _optuna
from sweep.store.retry import first_line

log = logging.getLogger("sweep.store")

# Every PostgreSQL connection of the store (the pools' and the schema lock's own): fail fast on a host
# that does not answer, and notice a peer that went away without closing.
PG_CONNECT_ARGS = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 30,
                   "keepalives_interval": 10, "keepalives_count": 3}


@contextlib.contextmanager
def schema_lock(url: str) -> Any:
    """Serialise Optuna's schema creation between processes (two drivers starting on a fresh database
    race on CREATE TYPE and one of them fails); a PostgreSQL advisory lock on its own connection."""
    if not url.startswith("postgresql"):
        yield
        return
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    engine = sqlalchemy.create_engine(url, poolclass=NullPool, connect_args=dict(PG_CONNECT_ARGS))
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(hashtext('trnsweep:schema'))"))
            try:
                yield
            finally:
                with contextlib.suppress(Exception):
                    conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(hashtext('trnsweep:schema'))"))
    finally:
        engine.dispose()


# Indexes Optuna's schema lacks for the queries a sweep repeats (see bench/storage_load.py): the
# cached storage reads new and unfinished trials by (study_id, trial_id > n); ask numbers a trial by
# counting (study_id, trial_id < n); best-trial and per-state counts filter (study_id, state). The
# per-trial tables are already indexed by their (trial_id, ...) unique constraints.
SWEEP_INDEXES = {
    "ix_sweep_trials_study_trial": "trials (study_id, trial_id)",
    "ix_sweep_trials_study_state": "trials (study_id, state)",
}


def ensure_indexes(storage: Any, url: str | None = None) -> list[str]:
    """Create the sweep's indexes on a PostgreSQL store if missing; return the names created.

    Idempotent and safe with several drivers at once (an advisory lock serialises them). A role
    without the right to create indexes gets a warning, not a failed sweep.
    """
    import sqlalchemy

    engine = _optuna.engine_of(storage)
    if engine is None or engine.dialect.name != "postgresql":
        return []
    created = []
    try:
        with engine.begin() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_xact_lock(hashtext('trnsweep:indexes'))"))
            have = {r[0] for r in conn.execute(sqlalchemy.text(
                "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"))}
            for name, target in SWEEP_INDEXES.items():
                if name not in have:
                    conn.execute(sqlalchemy.text(f"CREATE INDEX IF NOT EXISTS {name} ON {target}"))
                    created.append(name)
    except Exception as e:
        log.warning("could not create the sweep's indexes (%s); the study works, only slower",
                    scrub(first_line(e), url))
        return []
    return created
