"""The caches between the sweep's processes and the database: a worker's throttled trial cache, and the
proxy's coalesced reads.

A worker's pruner asks for the study's trials at every report; Optuna's caches then re-read every
unfinished trial and filter and sort the whole study each time, most of a report's cost with many
trials running (see bench/storage_load.py). Here a worker re-reads unfinished trials at most every
``refresh_s`` seconds (new ones at every call) and keeps its sorted lists between calls; the proxy
serves one read to every worker asking within its ``ttl``. The subclasses of Optuna's caches live in
:mod:`sweep.store._optuna`, the one module that touches Optuna's internals; ``optuna`` is imported
inside :func:`throttled` (start-up time of commands that never open a database).
"""

from __future__ import annotations

import bisect
import copy
import gc
import threading
import time
from typing import Any

from sweep.store import _optuna


def throttled(storage: Any, refresh_s: float) -> Any:
    """A worker's storage whose cache re-reads unfinished trials at most every ``refresh_s`` seconds."""
    from optuna.storages import GrpcStorageProxy, RDBStorage

    if isinstance(storage, RDBStorage):
        return _optuna.throttled_cache(storage, refresh_s, SortedLists())
    if isinstance(storage, GrpcStorageProxy):
        _optuna.throttle_grpc_client(storage, refresh_s, SortedLists())
    return storage


class SortedLists:
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
        self.newest[study_id] = max(self.newest.get(study_id, -1), _optuna.trial_id(new))

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



class CoalescedReads:
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
            ids = [_optuna.trial_id(t) for t in trials]
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

