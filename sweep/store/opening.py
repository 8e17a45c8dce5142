"""Where studies live: storage URLs, Optuna storage objects, retries and password redaction.

URL forms (``SWEEP_STORAGE`` wins over the spec's ``study.storage``, which wins over the default):

- ``journal:PATH`` (or a bare path ending in ``.log``/``.journal``): Optuna's JournalStorage on a
  file, appended under a lock, so several processes on one machine can write at once. The
  default is ``journal:runs/optuna-journal.log`` relative to the current directory, one file for
  every study, which ``optuna-dashboard runs/optuna-journal.log`` opens directly.
- ``postgresql+psycopg2://user:password@host/db`` (and other SQLAlchemy URLs): Optuna's RDBStorage
  with pre-ping, a small bounded pool per process and recycled connections, so a restarted
  database costs a retry rather than a crashed sweep. The driver creates the sweep's indexes
  (:func:`ensure_indexes`) and every worker process shares one cached storage across its trials.
- ``grpc://HOST:PORT``: Optuna's gRPC storage proxy (:class:`StorageProxy`, started by the driver
  on the head node with ``SWEEP_STORAGE_PROXY=1`` or ``study.storage_proxy = true``): workers talk
  to it instead of the database, so the database sees one small pool however many workers run.

Passwords never leave this module in clear text: :func:`redact` and :func:`scrub` are applied to
anything that is printed, logged, raised or stored.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import gc
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sweep.redact import redact, scrub

ENV_STORAGE = "SWEEP_STORAGE"
ENV_PROXY = "SWEEP_STORAGE_PROXY"  # "1": the driver starts a gRPC proxy for its workers
ENV_PROXY_HOST = "SWEEP_STORAGE_PROXY_HOST"  # the address it binds (default: this node's Ray address)
DEFAULT_STORAGE = "journal:runs/optuna-journal.log"
PROXY_SCHEME = "grpc://"

T = TypeVar("T")
log = logging.getLogger("sweep.storage")

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
PROXY_THREADS = 16  # gRPC server threads; calls beyond the pool wait for a connection
PROXY_READ_TTL_S = 0.5  # the proxy serves one read of the study's trials to every worker asking within this
# A worker's pruner re-reads the study's unfinished trials at most this often; trials created since
# are read at every call. Optuna re-reads every unfinished trial on every call: with 64 trials
# running that is most of a report's cost (see bench/storage_load.py).
WORKER_REFRESH_S = 10.0
_COMMON_ENGINE = {"pool_pre_ping": True, "pool_recycle": 300, "pool_timeout": 30}
_PG_CONNECT_ARGS = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 30,
                    "keepalives_interval": 10, "keepalives_count": 3}


class StorageError(ValueError):
    """A storage URL that cannot be used; the message is already redacted."""


def resolve_url(spec_storage: str | None = None) -> str:
    """The storage URL in force, with a journal path made absolute (workers may run elsewhere)."""
    url = os.environ.get(ENV_STORAGE) or spec_storage or DEFAULT_STORAGE
    path = journal_path(url)
    if path is not None:
        return f"journal:{Path(path).expanduser().resolve()}"
    return url


def journal_path(url: str) -> str | None:
    """The file behind a journal URL, or None for a database URL."""
    if url.startswith("journal:"):
        rest = url[len("journal:"):]
        return rest[2:] if rest.startswith("//") else rest
    if "://" not in url and url.endswith((".log", ".journal")):
        return url
    return None


def is_database(url: str) -> bool:
    return journal_path(url) is None


def is_proxy(url: str) -> bool:
    return url.startswith(PROXY_SCHEME)


def proxy_wanted(spec_flag: bool = False) -> bool:
    """Whether the driver should start a gRPC proxy: ``SWEEP_STORAGE_PROXY`` wins over the spec."""
    env = os.environ.get(ENV_PROXY, "").strip().lower()
    if env:
        return env not in ("0", "false", "no", "off")
    return spec_flag


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
                storage = _throttled(storage, WORKER_REFRESH_S)
            _SHARED[key] = storage
        return storage


def _journal_types() -> tuple[type, ...]:
    from optuna.storages.journal import JournalStorage

    return (JournalStorage,)


def _cached(storage: Any) -> Any:
    """Optuna's in-process cache around an RDB storage, kept (optuna wraps a bare RDBStorage anew each load)."""
    from optuna.storages import RDBStorage
    from optuna.storages._cached_storage import _CachedStorage

    return _CachedStorage(storage) if isinstance(storage, RDBStorage) else storage


def _throttled(storage: Any, refresh_s: float) -> Any:
    """A worker's storage whose cache re-reads unfinished trials at most every ``refresh_s`` seconds."""
    from optuna.storages import GrpcStorageProxy, RDBStorage

    rdb_cls, grpc_cls = _throttled_classes()
    if isinstance(storage, RDBStorage):
        return rdb_cls(storage, refresh_s)
    if isinstance(storage, GrpcStorageProxy):
        storage._cache = grpc_cls(storage._stub, refresh_s)
    return storage


class _SortedLists:
    """Sorted trial lists by (study, states), rebuilt only when a trial of those states changes.

    Optuna's caches filter and sort every trial of the study on each read: milliseconds at 10,000
    trials, for lists that rarely change between two reports.
    """

    def __init__(self) -> None:
        self.versions: dict[tuple[int, Any], int] = {}
        self.lists: dict[tuple[int, Any], tuple[int, list[Any]]] = {}
        self.newest: dict[int, int] = {}

    def changed(self, study_id: int, old: Any, new: Any) -> None:
        """Record that trial ``new`` replaced ``old`` (None when new to the cache)."""
        for state in {new.state, old.state if old is not None else None, "any"} - {None}:
            self.versions[(study_id, state)] = self.versions.get((study_id, state), 0) + 1
        self.newest[study_id] = max(self.newest.get(study_id, -1), new._trial_id)

    def get(self, study_id: int, states: Any, trials: dict[int, Any]) -> list[Any]:
        keys = ["any"] if states is None else list(states)
        version = sum(self.versions.get((study_id, k), 0) for k in keys)
        key = (study_id, None if states is None else frozenset(states))
        cached = self.lists.get(key)
        if cached is None or cached[0] != version:
            chosen = trials.values() if states is None else [t for t in trials.values() if t.state in states]
            cached = (version, sorted(chosen, key=lambda t: t.number))
            self.lists[key] = cached
        return cached[1]


@functools.cache
def _throttled_classes() -> tuple[type, type]:
    """Optuna's two trial caches (in-process over RDB, and the gRPC client's) with a throttled refresh.

    Both read ``trial_id > last finished id OR trial_id IN unfinished ids`` at every call. Here a
    call within ``refresh_s`` of the last full read fetches only trials newer than any it holds;
    finished trials never change, so the only staleness is in other trials still running.
    """
    import copy

    from optuna.storages._cached_storage import _CachedStorage
    from optuna.storages._grpc.auto_generated import api_pb2
    from optuna.storages._grpc.client import GrpcClientCache
    from optuna.storages._grpc.servicer import _from_proto_trial

    class ThrottledCachedStorage(_CachedStorage):
        def __init__(self, backend: Any, refresh_s: float) -> None:
            super().__init__(backend)
            self._refresh_s = refresh_s
            self._full_at: dict[int, float] = {}
            self._sorted = _SortedLists()

        def _add_trials_to_cache(self, study_id: int, trials: list[Any]) -> None:
            known = self._studies[study_id].trials
            for t in trials:
                self._sorted.changed(study_id, known.get(t.number), t)
            super()._add_trials_to_cache(study_id, trials)

        def get_all_trials(self, study_id: int, deepcopy: bool = True, states: Any = None) -> list[Any]:
            self._read_trials_from_remote_storage(study_id)
            with self._lock:
                trials = self._sorted.get(study_id, states, self._studies[study_id].trials)
                return copy.deepcopy(trials) if deepcopy else list(trials)

        def _read_trials_from_remote_storage(self, study_id: int) -> None:
            now = time.monotonic()
            if study_id not in self._studies or now - self._full_at.get(study_id, -1e18) >= self._refresh_s:
                super()._read_trials_from_remote_storage(study_id)
                self._full_at[study_id] = now
                return
            with self._lock:
                trials = self._backend._get_trials(study_id, states=None, included_trial_ids=set(),
                                                   trial_id_greater_than=self._sorted.newest.get(study_id, -1))
                self._add_trials_to_cache(study_id, trials)
                # The last finished id moves only in a full read, which sees every trial.
                self._studies[study_id].unfinished_trial_ids.update(
                    t._trial_id for t in trials if not t.state.is_finished())

    class ThrottledGrpcCache(GrpcClientCache):
        def __init__(self, stub: Any, refresh_s: float) -> None:
            super().__init__(stub)
            self._refresh_s = refresh_s
            self._full_at: dict[int, float] = {}
            self._sorted = _SortedLists()

        def _add_trial_to_cache(self, study_id: int, trial: Any) -> None:
            self._sorted.changed(study_id, self.studies[study_id].trials.get(trial.number), trial)
            super()._add_trial_to_cache(study_id, trial)

        def get_all_trials(self, study_id: int, states: Any) -> list[Any]:
            with self.lock:
                self._read_trials_from_remote_storage(study_id)
                return list(self._sorted.get(study_id, states, self.studies[study_id].trials))

        def _read_trials_from_remote_storage(self, study_id: int) -> None:
            now = time.monotonic()
            if study_id not in self.studies or now - self._full_at.get(study_id, -1e18) >= self._refresh_s:
                if study_id in self.studies and study_id not in self._sorted.newest:  # filled from outside
                    for t in self.studies[study_id].trials.values():
                        self._sorted.changed(study_id, None, t)
                super()._read_trials_from_remote_storage(study_id)
                self._full_at[study_id] = now
                return
            study = self.studies[study_id]
            req = api_pb2.GetTrialsRequest(study_id=study_id, included_trial_ids=[],
                                           trial_id_greater_than=self._sorted.newest.get(study_id, -1))
            for proto in self.grpc_client.GetTrials(req).trials:
                trial = _from_proto_trial(proto)
                self._sorted.changed(study_id, study.trials.get(trial.number), trial)
                study.trials[trial.number] = trial
                if not trial.state.is_finished():
                    study.unfinished_trial_ids.add(trial._trial_id)

    return ThrottledCachedStorage, ThrottledGrpcCache


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
        kwargs["connect_args"] = dict(_PG_CONNECT_ARGS)
    elif url.startswith("sqlite"):
        kwargs = {}
    try:
        # A worker's single connection must suffice: the schema check takes a second one, and the
        # driver has already created the tables and checked their version.
        skip = role in ("worker", "proxy")

        def connect() -> Any:
            with contextlib.nullcontext() if skip else _schema_lock(url):
                return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, skip_compatibility_check=skip,
                                                  skip_table_creation=skip)

        storage = retry(connect, what="connect", url=url)
    except Exception as e:
        if is_transient(e):
            raise
        raise StorageError(f"storage {redact(url)}: {scrub(_first_line(e), url)}") from None
    if role == "driver":
        ensure_indexes(storage, url)
    return storage


@contextlib.contextmanager
def _schema_lock(url: str) -> Any:
    """Serialise Optuna's schema creation between processes (two drivers starting on a fresh database
    race on CREATE TYPE and one of them fails); a PostgreSQL advisory lock on its own connection."""
    if not url.startswith("postgresql"):
        yield
        return
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    engine = sqlalchemy.create_engine(url, poolclass=NullPool, connect_args=dict(_PG_CONNECT_ARGS))
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

    engine = getattr(storage, "engine", None) or getattr(getattr(storage, "_backend", None), "engine", None)
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
                    scrub(_first_line(e), url))
        return []
    return created


# -- the gRPC storage proxy ---------------------------------------------------------------------


def _open_proxy_client(url: str) -> Any:
    from optuna.storages import GrpcStorageProxy

    host, _, port = url[len(PROXY_SCHEME):].rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise StorageError(f"storage {url!r}: want grpc://HOST:PORT")
    try:
        import grpc  # noqa: F401
    except ImportError:
        raise StorageError(f"storage {url}: the gRPC proxy needs the grpcio package") from None
    with _quiet_experimental():
        return GrpcStorageProxy(host=host.strip("[]"), port=int(port))


@contextlib.contextmanager
def _quiet_experimental() -> Any:
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


class _CoalescedReads:
    """The proxy's storage: every worker's pruner asks for the study's trials about once a second,
    so one read serves every request within ``ttl`` seconds (a pruning decision one read older is
    as good). Writes and single-trial reads go straight through.

    Stale while revalidating: one request refreshes an expired snapshot while the others are served
    the previous one, so no reader waits behind a refresh (tens of milliseconds with many trials
    running); only the very first read of a study waits.
    """

    def __init__(self, inner: Any, ttl: float) -> None:
        self._inner, self._ttl = inner, ttl
        self._lock = threading.Lock()
        self._refreshing: set[int] = set()
        # study id -> (read at, trials by number, their trial ids (ascending, as numbers are), by id)
        self._snap: dict[int, tuple[float, list[Any], list[int], dict[int, Any]]] = {}

    def _snapshot(self, study_id: int) -> tuple[list[Any], list[int], dict[int, Any]]:
        with self._lock:
            snap = self._snap.get(study_id)
            fresh = snap is not None and time.monotonic() - snap[0] <= self._ttl
            if snap is not None and (fresh or study_id in self._refreshing):
                return snap[1], snap[2], snap[3]
            self._refreshing.add(study_id)
        try:
            trials = self._inner.get_all_trials(study_id, deepcopy=False)
            ids = [t._trial_id for t in trials]
            snap = (time.monotonic(), trials, ids, dict(zip(ids, trials, strict=True)))
            with self._lock:
                first = study_id not in self._snap
                self._snap[study_id] = snap
            if first:
                # The study's trials stay for the proxy's life: out of the collector's sight, or each
                # full collection walks millions of objects and stalls every call for half a second.
                gc.collect()
                gc.freeze()
            return snap[1], snap[2], snap[3]
        finally:
            with self._lock:
                self._refreshing.discard(study_id)

    def get_all_trials(self, study_id: int, deepcopy: bool = True, states: Any = None) -> list[Any]:
        import copy

        trials, _, _ = self._snapshot(study_id)
        if states is not None:
            trials = [t for t in trials if t.state in states]
        return copy.deepcopy(trials) if deepcopy else list(trials)

    def trials_after(self, study_id: int, greater_than: int, included: set[int]) -> list[Any]:
        """What a client's cache asks for: trials newer than it has seen, and those it holds unfinished."""
        trials, ids, by_id = self._snapshot(study_id)
        i = bisect.bisect_right(ids, greater_than)
        return [by_id[x] for x in sorted(included) if x in by_id and x <= greater_than] + trials[i:]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def proxy_host() -> str:
    """The address the proxy binds: this node's address in a Ray cluster, loopback for a local Ray.

    Never 0.0.0.0: the proxy has no authentication, so it listens only where the workers reach it.
    """
    host = os.environ.get(ENV_PROXY_HOST)
    if host:
        return host
    if os.environ.get("RAY_ADDRESS"):
        with contextlib.suppress(Exception):
            import ray

            return ray.util.get_node_ip_address()
    return "127.0.0.1"


class StorageProxy:
    """Optuna's gRPC storage proxy in a child process of the driver, in front of ``url``.

    The child gets the URL through its environment (never its command line, which ``ps`` shows),
    keeps one bounded connection pool and exits when the driver does (it watches its parent).
    """

    def __init__(self, url: str, host: str | None = None, threads: int = PROXY_THREADS,
                 ready_timeout_s: float = 60.0) -> None:
        if not is_database(url) or is_proxy(url):
            raise StorageError(f"storage {redact(url)}: the gRPC proxy needs a database URL")
        self.host = host or proxy_host()
        self.proc: subprocess.Popen[bytes] | None = None
        last: Exception | None = None
        for _ in range(3):  # a port taken between choosing and binding: choose again
            self.port = _free_port(self.host)
            env = {**os.environ, ENV_STORAGE: url}
            env.pop(ENV_PROXY, None)
            # Its log goes to an unnamed file, read back only if it fails to start: a pipe nobody
            # reads would block a chatty proxy.
            self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sweep.store", "proxy", "--host", self.host, "--port", str(self.port),
                 "--threads", str(threads)],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log)
            try:
                self._wait_ready(ready_timeout_s)
                return
            except Exception as e:
                last = e
                self.close()
        raise StorageError(f"storage proxy on {self.host}: did not start ({scrub(str(last), url)})")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{PROXY_SCHEME}{host}:{self.port}"

    def _wait_ready(self, timeout_s: float) -> None:
        from optuna.storages import GrpcStorageProxy

        end = time.monotonic() + timeout_s
        with _quiet_experimental():
            client = GrpcStorageProxy(host=self.host, port=self.port)
        try:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    self._log.seek(0)
                    lines = [ln for ln in self._log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
                    raise RuntimeError(lines[-1] if lines else f"exit {self.proc.returncode}")
                try:
                    client.wait_server_ready(timeout=min(1.0, max(0.1, end - time.monotonic())))
                    client.get_all_studies()  # the database behind it answers too
                    return
                except Exception:
                    if time.monotonic() > end:
                        raise
        finally:
            client.close()

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.proc = None


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_proxy(url: str, host: str, port: int, threads: int = PROXY_THREADS,
                read_ttl_s: float = PROXY_READ_TTL_S) -> None:
    """Run Optuna's gRPC proxy in front of ``url`` until SIGTERM or until the parent process exits.

    Optuna's own service (``run_grpc_proxy_server`` builds the same server), with one change: a
    client's trial read is answered from the coalesced snapshot by bisection rather than by
    filtering every trial of the study on each call.
    """
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    import optuna
    from optuna.storages._grpc.auto_generated import api_pb2, api_pb2_grpc
    from optuna.storages._grpc.servicer import OptunaStorageProxyService, _to_proto_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Many short calls share one interpreter with a few long ones (a refresh, an ask): switch
    # threads more often than every 5 ms so the short ones do not queue behind them.
    sys.setswitchinterval(0.001)
    backend = _open(url, "proxy")
    ensure_indexes(backend, url)
    storage = _CoalescedReads(_cached(backend), read_ttl_s)

    class Service(OptunaStorageProxyService):
        def GetTrials(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC's method name
            try:
                trials = storage.trials_after(request.study_id, request.trial_id_greater_than,
                                              set(request.included_trial_ids))
            except KeyError as e:
                context.abort(code=grpc.StatusCode.NOT_FOUND, details=str(e))
            return api_pb2.GetTrialsReply(trials=[_to_proto_trial(t) for t in trials])

    parent = os.getppid()

    def orphan_watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphan_watch, daemon=True).start()
    server = grpc.server(ThreadPoolExecutor(max_workers=threads))
    with _quiet_experimental():
        api_pb2_grpc.add_StorageServiceServicer_to_server(Service(storage), server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    server.wait_for_termination()


# Connection errors that no amount of waiting fixes: bad input, reported at once.
_PERMANENT = ("does not exist", "authentication failed", "no password supplied", "permission denied",
              "could not translate host name", "invalid dsn", "invalid connection option")


def is_transient(exc: BaseException) -> bool:
    """Connection-level database trouble worth retrying (a restart, a dropped connection)."""
    import sqlalchemy.exc as sa_exc

    if any(p in str(exc).lower() for p in _PERMANENT):
        return False
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        if _grpc_transient(e):
            return True
        if isinstance(e, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError)):
            return True
        if isinstance(e, sa_exc.DBAPIError) and e.connection_invalidated:
            return True
        if type(e).__module__.startswith("psycopg2") and type(e).__name__ in ("OperationalError",
                                                                              "InterfaceError"):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


# What the database's own errors look like once the proxy has turned them into gRPC statuses.
_PROXIED_DB_TROUBLE = ("operationalerror", "interfaceerror", "disconnectionerror", "server closed",
                       "connection", "could not connect", "terminating", "timeout")


def _grpc_transient(e: BaseException) -> bool:
    """A gRPC call that failed because the proxy or the database behind it is (briefly) away."""
    if not type(e).__module__.startswith("grpc") or not callable(getattr(e, "code", None)):
        return False
    try:
        code = getattr(e.code(), "name", "")  # type: ignore[attr-defined]
        details = str(e.details() or "").lower()  # type: ignore[attr-defined]
    except Exception:
        return False
    if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED"):
        return True
    return code in ("UNKNOWN", "INTERNAL") and any(w in details for w in _PROXIED_DB_TROUBLE)


def retry(fn: Callable[[], T], *, what: str = "storage call", attempts: int = 8, base_s: float = 0.25,
          max_s: float = 8.0, url: str | None = None) -> T:
    """Run ``fn``, retrying transient database errors with jittered exponential backoff.

    About a minute in total with the defaults: long enough for a PostgreSQL restart, short enough
    that a database that is really gone fails the caller instead of hanging it.
    """
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:
            if not is_transient(e) or attempt == attempts - 1:
                raise
            delay = min(max_s, base_s * 2**attempt) * (0.5 + random.random() / 2)
            log.warning("%s failed (%s); retry %d/%d in %.1fs", what, scrub(_first_line(e), url),
                        attempt + 1, attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def _first_line(e: BaseException) -> str:
    if type(e).__module__.startswith("grpc") and callable(getattr(e, "code", None)):
        with contextlib.suppress(Exception):  # a gRPC error's str() is a multi-line dump
            return f"gRPC {e.code().name}: {(e.details() or '').strip().splitlines()[0]}"  # type: ignore[attr-defined]
    cause = e.__cause__ or e.__context__
    if type(e).__name__ == "StorageInternalError" and cause is not None:
        return _first_line(cause)  # Optuna's wrapper says only "an exception is raised during the commit"
    if type(e).__module__.startswith("sqlalchemy") and getattr(e, "orig", None) is not None:
        e = e.orig  # the driver's own message, without SQLAlchemy's statement and background link
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def main(argv: list[str] | None = None) -> int:
    """``python -m sweep.store proxy --host H --port P``: the proxy process (URL from SWEEP_STORAGE)."""
    parser = argparse.ArgumentParser(prog="python -m sweep.store")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("proxy", help="serve the study store to workers over gRPC")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=PROXY_THREADS)
    p.add_argument("--read-ttl-s", type=float, default=PROXY_READ_TTL_S)
    args = parser.parse_args(argv)
    url = os.environ.get(ENV_STORAGE)
    if not url or not is_database(url) or is_proxy(url):
        print(f"sweep.store: {ENV_STORAGE} must name a database", file=sys.stderr)
        return 2
    try:
        serve_proxy(url, args.host, args.port, args.threads, args.read_ttl_s)
    except Exception as e:
        print(f"sweep.store: proxy: {scrub(_first_line(e), url)}", file=sys.stderr)
        return 1
    return 0
