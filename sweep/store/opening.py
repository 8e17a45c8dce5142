"""Opening a study store: one Optuna storage per URL and role, with a connection pool sized to the role.

What a URL names is :mod:`sweep.store.urls`. A database (``postgresql+psycopg2://user:password@host/db``
and other SQLAlchemy URLs) opens as Optuna's RDBStorage with pre-ping, a small bounded pool per process
and recycled connections, so a restarted database costs a retry rather than a crashed sweep; the
driver's role creates the sweep's indexes (:mod:`sweep.store.schema`) and every worker process shares
one cached storage across its trials (:mod:`sweep.store.caches`). A journal file opens as Optuna's
JournalStorage, a ``grpc://`` URL as Optuna's gRPC proxy client (:mod:`sweep.store.proxy`).

Passwords never leave the store in clear text: :func:`sweep.redact.redact` and
:func:`sweep.redact.scrub` are applied to anything that is printed, logged, raised or stored.
``optuna`` is imported inside the functions (start-up time of commands that never open a store).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from sweep.redact import redact, scrub
from sweep.store import _optuna
from sweep.store.caches import throttled
from sweep.store.retry import first_line, is_transient, retry
from sweep.store.schema import PG_CONNECT_ARGS, ensure_indexes, schema_lock
from sweep.store.urls import PROXY_SCHEME, StorageError, is_proxy, journal_path

# Connections per process: the driver and every worker process hold their own engine. A worker
# holds exactly one (its supervisor's report and heartbeat threads take turns, each call is
# milliseconds), so N workers open N connections plus the driver's 4: 64 workers fit PostgreSQL's
# default max_connections of 100; more need the gRPC proxy, whose pool is the only one the
# workers cost. Pre-ping replaces connections that a database restart has cut; recycling bounds
# how long a connection lives behind a proxy or firewall.
ENGINE_KWARGS: dict[str, dict[str, Any]] = {
    "driver": {"pool_size": 2, "max_overflow": 2},
    "worker": {"pool_size": 1, "max_overflow": 0},
    "proxy": {"pool_size": 8, "max_overflow": 0},
}
# A worker's pruner re-reads the study's unfinished trials at most this often; trials created since
# are read at every call. Optuna re-reads every unfinished trial on every call: with 64 trials
# running that is most of a report's cost (see bench/storage_load.py).
WORKER_REFRESH_S = 10.0
_COMMON_ENGINE = {"pool_pre_ping": True, "pool_recycle": 300, "pool_timeout": 30}


_SHARED: dict[tuple[str, str, int], Any] = {}
_SHARED_LOCK = threading.Lock()


def forget_shared() -> None:
    """Drop this process's shared worker storages, so the next ``open_storage(..., "worker")`` opens anew
    (a benchmark that replaces the database behind a URL)."""
    with _SHARED_LOCK:
        _SHARED.clear()


def open_storage(url: str, role: str = "driver") -> Any:
    """An Optuna storage for ``url``; ``role`` picks the connection pool size.

    Role ``worker`` returns one storage per process and URL, shared by every trial the process
    supervises (Ray reuses worker processes): its connection count stays bounded and its cache of
    finished trials stays warm, so a trial's first pruning call does not read the whole study.
    """
    if role != "worker":
        return _open(url, role)
    key = (url, role, os.getpid())  # a forked child must not share its parent's connections
    with _SHARED_LOCK:
        storage = _SHARED.get(key)
        if storage is None:
            storage = _open(url, role)
            if not isinstance(storage, _journal_types()):
                storage = throttled(storage, WORKER_REFRESH_S)
            _SHARED[key] = storage
        return storage


def _journal_types() -> tuple[type, ...]:
    from optuna.storages.journal import JournalStorage

    return (JournalStorage,)


def _open(url: str, role: str) -> Any:
    import optuna

    if is_proxy(url):
        return _open_proxy_client(url)
    path = journal_path(url)
    if path is not None:
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock, JournalStorage

        p = Path(path)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            # The open lock (O_EXCL lock file) breaks a lock left by a killed process after its
            # grace period, so a SIGKILLed driver cannot wedge the store.
            backend = JournalFileBackend(str(p), lock_obj=JournalFileOpenLock(str(p), grace_period=10))
        except OSError as e:
            raise StorageError(f"storage {url}: {e.strerror}") from None
        return JournalStorage(backend)
    if "://" not in url:
        raise StorageError(f"storage {url!r}: not a database URL nor a journal:PATH")
    kwargs: dict[str, Any] = {**_COMMON_ENGINE, **ENGINE_KWARGS.get(role, ENGINE_KWARGS["driver"])}
    if url.startswith("postgresql"):
        kwargs["connect_args"] = dict(PG_CONNECT_ARGS)
    elif url.startswith("sqlite"):
        kwargs = {}
    try:
        # A worker's single connection must suffice: the schema check takes a second one, and the
        # driver has already created the tables and checked their version.
        skip = role in ("worker", "proxy")

        def connect() -> Any:
            with contextlib.nullcontext() if skip else schema_lock(url):
                return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, skip_compatibility_check=skip,
                                                  skip_table_creation=skip)

        storage = retry(connect, what="connect", url=url)
    except Exception as e:
        if is_transient(e):
            raise
        raise StorageError(f"storage {redact(url)}: {scrub(first_line(e), url)}") from None
    if role == "driver":
        ensure_indexes(storage, url)
    return storage


def _open_proxy_client(url: str) -> Any:
    from optuna.storages import GrpcStorageProxy

    address, _, query = url[len(PROXY_SCHEME):].partition("?")
    host, _, port = address.rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise StorageError(f"storage {redact(url)}: want grpc://HOST:PORT[/?password=TOKEN]")
    token = (parse_qs(query).get("password") or [""])[0]
    try:
        import grpc  # noqa: F401
    except ImportError:
        raise StorageError(f"storage {url}: the gRPC proxy needs the grpcio package") from None
    with quiet_experimental():
        if token:  # the driver's proxy asks every call for the token of its URL (sweep.store.proxy)
            return _optuna.token_grpc_client(host.strip("[]"), int(port), token)
        return GrpcStorageProxy(host=host.strip("[]"), port=int(port))


@contextlib.contextmanager
def quiet_experimental() -> Any:
    """Silence Optuna's ExperimentalWarning (the gRPC proxy's classes raise it at every construction)."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield
