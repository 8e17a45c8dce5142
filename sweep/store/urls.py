"""Which store a URL names, and the environment variables that choose it.

URL forms (``SWEEP_STORAGE`` wins over the spec's ``study.storage``, which wins over the default):

- ``journal:PATH`` (or a bare path ending in ``.log``/``.journal``): Optuna's JournalStorage on a
  file, appended under a lock, so several processes on one machine can write at once. The
  default is ``journal:runs/optuna-journal.log`` relative to the current directory, one file for
  every study, which ``optuna-dashboard runs/optuna-journal.log`` opens directly.
- ``postgresql+psycopg2://user:password@host/db`` (and other SQLAlchemy URLs): Optuna's RDBStorage
  (see :mod:`sweep.store.opening`).
- ``grpc://HOST:PORT``: Optuna's gRPC storage proxy (see :mod:`sweep.store.proxy`), started by the
  driver on the head node with ``SWEEP_STORAGE_PROXY=1`` or ``study.storage_proxy = true``.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_STORAGE = "SWEEP_STORAGE"
ENV_PROXY = "SWEEP_STORAGE_PROXY"  # "1": the driver starts a gRPC proxy for its workers
ENV_PROXY_HOST = "SWEEP_STORAGE_PROXY_HOST"  # the address it binds (default: this node's Ray address)
DEFAULT_STORAGE = "journal:runs/optuna-journal.log"
PROXY_SCHEME = "grpc://"


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
