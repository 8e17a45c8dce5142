"""Where studies live: storage URLs, Optuna storage objects, retries and password redaction.

URL forms (``SWEEP_STORAGE`` wins over the spec's ``study.storage``, which wins over the default):

- ``journal:PATH`` (or a bare path ending in ``.log``/``.journal``): Optuna's JournalStorage on a
  file, appended under a lock, so several processes on one machine can write at once. The
  default is ``journal:runs/optuna-journal.log`` relative to the current directory, one file for
  every study, which ``optuna-dashboard runs/optuna-journal.log`` opens directly.
- ``postgresql+psycopg2://user:password@host/db`` (and other SQLAlchemy URLs): Optuna's RDBStorage
  with pre-ping, a small bounded pool per process and recycled connections, so a restarted
  database costs a retry rather than a crashed sweep.

Passwords never leave this module in clear text: :func:`redact` and :func:`scrub` are applied to
anything that is printed, logged, raised or stored.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, unquote

ENV_STORAGE = "SWEEP_STORAGE"
DEFAULT_STORAGE = "journal:runs/optuna-journal.log"

T = TypeVar("T")
log = logging.getLogger("sweep.storage")

# Connections per process: the driver and every worker hold their own engine, so a 64-worker sweep
# opens at most 64 x (1 + 2) connections plus the driver's, under PostgreSQL's usual limits
# when max_connections is raised to a few hundred. Pre-ping replaces connections that a database
# restart has cut; recycling bounds how long a connection lives behind a proxy or firewall.
ENGINE_KWARGS: dict[str, dict[str, Any]] = {
    "driver": {"pool_size": 2, "max_overflow": 2},
    "worker": {"pool_size": 1, "max_overflow": 2},
}
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


def redact(url: str) -> str:
    """The URL with its password replaced by ``***`` (journal URLs pass unchanged)."""
    if not is_database(url):
        return url
    m = re.match(r"^([^:/]+(?:\+[^:/]+)?://)([^@/]*)@(.*)$", url, re.S)
    if not m:
        return url
    scheme, userinfo, rest = m.groups()
    if ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return f"{scheme}{user}:***@{rest}"


def password(url: str) -> str | None:
    m = re.match(r"^[^:/]+(?:\+[^:/]+)?://([^@/]*)@", url)
    if not m or ":" not in m.group(1):
        return None
    return m.group(1).split(":", 1)[1] or None


def scrub(text: str, url: str | None) -> str:
    """Remove the URL's password from arbitrary text (an error message, a log line)."""
    if not url:
        return text
    secret = password(url)
    if secret:
        for form in {secret, unquote(secret), quote(unquote(secret), safe="")}:
            if form:
                text = text.replace(form, "***")
    return text


def open_storage(url: str, role: str = "driver") -> Any:
    """An Optuna storage for ``url``; ``role`` picks the connection pool size."""
    import optuna

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
        return retry(lambda: optuna.storages.RDBStorage(url, engine_kwargs=kwargs), what="connect", url=url)
    except Exception as e:
        if is_transient(e):
            raise
        raise StorageError(f"storage {redact(url)}: {scrub(_first_line(e), url)}") from None


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
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
