"""Retrying what a restarted database or a briefly absent proxy breaks, and what is worth retrying.

``sqlalchemy`` is imported inside :func:`is_transient` (heavy, and a journal store never needs it).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from sweep.redact import scrub

T = TypeVar("T")
log = logging.getLogger("sweep.store")

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


# A process's patience with a store that is away: None (the attempts alone, what workers keep) or the
# seconds to go on retrying past them (the driver's stated limit: its dying would strand every trial), and
# the last outage a retry saw end, as unix times (first failure, success after it).
_STORE: dict[str, Any] = {"patience_s": None, "outage": None}


@contextlib.contextmanager
def patience(seconds: float) -> Iterator[None]:
    """Within this block, :func:`retry` waits up to ``seconds`` for a store that is away before it fails."""
    old = _STORE["patience_s"]
    _STORE["patience_s"] = seconds
    try:
        yield
    finally:
        _STORE["patience_s"] = old


def last_outage() -> tuple[float, float] | None:
    """(first failure, recovery) of the last store outage a retry in this process waited out, unix times."""
    return _STORE["outage"]


# Attempts of a call by default: 12 to 24 s in all with the backoff below (a test sets fewer for a shorter
# schedule; read at each call).
ATTEMPTS = 8


def retry(fn: Callable[[], T], *, what: str = "storage call", attempts: int | None = None, base_s: float = 0.25,
          max_s: float = 8.0, url: str | None = None) -> T:
    """Run ``fn``, retrying transient database errors with jittered exponential backoff.

    12 to 24 s in total with the defaults: long enough for a PostgreSQL restart, short enough that a
    database that is really gone fails the caller instead of hanging it. Within :func:`patience`, it goes
    on past the attempts until that many seconds have passed since the first failure.
    """
    attempts = ATTEMPTS if attempts is None else attempts
    first: float | None = None
    attempt = 0
    while True:
        try:
            out = fn()
        except Exception as e:
            if not is_transient(e):
                raise
            first = first or time.time()
            waited = time.time() - first
            limit = _STORE["patience_s"]
            if attempt >= attempts - 1 and (limit is None or waited >= limit):
                raise
            delay = min(max_s, base_s * 2**attempt) * (0.5 + random.random() / 2)
            if limit is not None:
                delay = max(0.0, min(delay, limit - waited))
            attempt += 1
            log.warning("%s failed (%s); retry %d%s in %.1fs", what, scrub(first_line(e), url), attempt,
                        f"/{attempts - 1}" if limit is None else f" ({waited:.0f} of {limit:g} s waited)", delay)
            time.sleep(delay)
            continue
        if first is not None:
            _STORE["outage"] = (first, time.time())
        return out




def first_line(e: BaseException) -> str:
    """One line that says what went wrong (the database's own words where it has them); not redacted."""
    if type(e).__module__.startswith("grpc") and callable(getattr(e, "code", None)):
        with contextlib.suppress(Exception):  # a gRPC error's str() is a multi-line dump
            return f"gRPC {e.code().name}: {(e.details() or '').strip().splitlines()[0]}"  # type: ignore[attr-defined]
    cause = e.__cause__ or e.__context__
    if type(e).__name__ == "StorageInternalError" and cause is not None:
        return first_line(cause)  # Optuna's wrapper says only "an exception is raised during the commit"
    if type(e).__module__.startswith("sqlalchemy") and getattr(e, "orig", None) is not None:
        e = e.orig  # the driver's own message, without SQLAlchemy's statement and background link
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"

