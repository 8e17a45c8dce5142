"""The study store: where studies live and how every process reaches them.

The public facade: ``from sweep import store as st`` gives every name the rest of the code uses. Inside,
one module per concern: :mod:`~sweep.store.urls` (which store a URL names), :mod:`~sweep.store.opening`
(storages and their pools), :mod:`~sweep.store.caches` (the throttled and coalesced trial caches),
:mod:`~sweep.store.schema` (schema lock, indexes), :mod:`~sweep.store.proxy` (the gRPC proxy),
:mod:`~sweep.store.retry` (what is transient, and retrying it), :mod:`~sweep.store.artifacts` (trial
files and provenance) and :mod:`~sweep.store._optuna`, the one module that touches Optuna's internals
(its public accessors are re-exported here for the rest of the sweep).
"""

from sweep.redact import password, redact, scrub
from sweep.store._optuna import (
    cached_study,
    engine_of,
    forget_cached_trials,
    reported_steps,
    seed_grpc_cache,
    study_id,
    study_storage,
    trial_id,
)
from sweep.store.opening import ENGINE_KWARGS, WORKER_REFRESH_S, forget_shared, open_storage
from sweep.store.proxy import PROXY_READ_TTL_S, PROXY_THREADS, StorageProxy, proxy_host, serve_proxy
from sweep.store.retry import first_line, is_transient, last_outage, patience, retry
from sweep.store.schema import SWEEP_INDEXES, ensure_indexes
from sweep.store.urls import (
    DEFAULT_STORAGE,
    ENV_PROXY,
    ENV_PROXY_HOST,
    ENV_STORAGE,
    PROXY_SCHEME,
    StorageError,
    is_database,
    is_proxy,
    journal_path,
    proxy_wanted,
    resolve_url,
)

__all__ = [
    "DEFAULT_STORAGE", "ENGINE_KWARGS", "ENV_PROXY", "ENV_PROXY_HOST", "ENV_STORAGE", "PROXY_READ_TTL_S",
    "PROXY_SCHEME", "PROXY_THREADS", "SWEEP_INDEXES", "StorageError", "StorageProxy", "WORKER_REFRESH_S",
    "cached_study", "engine_of", "ensure_indexes", "first_line", "forget_shared", "is_database", "is_proxy",
    "is_transient", "journal_path", "last_outage", "open_storage", "password", "patience", "proxy_host",
    "proxy_wanted", "redact",
    "resolve_url", "retry", "scrub", "seed_grpc_cache", "serve_proxy", "study_id", "study_storage", "trial_id",
    "reported_steps", "forget_cached_trials",
]
