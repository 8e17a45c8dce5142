"""The study store: where studies live and how every process reaches them (see :mod:`sweep.store.opening`).

The public facade: ``from sweep import store as st`` gives every name the rest of the code uses.
"""

from sweep.redact import password, redact, scrub
from sweep.store.opening import (
    DEFAULT_STORAGE,
    ENGINE_KWARGS,
    ENV_PROXY,
    ENV_PROXY_HOST,
    ENV_STORAGE,
    PROXY_READ_TTL_S,
    PROXY_SCHEME,
    PROXY_THREADS,
    SWEEP_INDEXES,
    WORKER_REFRESH_S,
    StorageError,
    StorageProxy,
    ensure_indexes,
    forget_shared,
    is_database,
    is_proxy,
    is_transient,
    journal_path,
    open_storage,
    proxy_host,
    proxy_wanted,
    resolve_url,
    retry,
    serve_proxy,
)

__all__ = [
    "DEFAULT_STORAGE", "ENGINE_KWARGS", "ENV_PROXY", "ENV_PROXY_HOST", "ENV_STORAGE", "PROXY_READ_TTL_S",
    "PROXY_SCHEME", "PROXY_THREADS", "SWEEP_INDEXES", "WORKER_REFRESH_S", "StorageError", "StorageProxy",
    "ensure_indexes", "forget_shared", "is_database", "is_proxy", "is_transient", "journal_path", "open_storage",
    "password", "proxy_host", "proxy_wanted", "redact", "resolve_url", "retry", "scrub", "serve_proxy",
]
