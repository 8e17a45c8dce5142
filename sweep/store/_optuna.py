"""The one module that touches Optuna's private internals; every other module reaches them through it.

Pinned: ``optuna==5.0.0`` (pyproject.toml). A new Optuna may move or rename any name below: upgrade by
reading this file against the new release, then run tests/sweep/store/test_storage.py and the proxy and cache
tests of tests/faults/test_faults.py. Optuna is imported inside the functions (start-up time of processes that
never open a database); each function names the private parts it uses.

Private names used, and why:

- ``optuna.storages._cached_storage._CachedStorage``: the in-process trial cache over an RDBStorage, which
  ``optuna.load_study`` would otherwise build anew at every load (:func:`cached`), and the base of the
  worker's throttled cache (:func:`throttled_cache`). The throttled cache overrides its hooks
  ``_read_trials_from_remote_storage`` and ``_add_trials_to_cache`` and uses its state ``_studies`` (per
  study: ``trials``, ``unfinished_trial_ids``, ``last_finished_trial_id``), ``_lock`` and ``_backend``,
  whose ``_get_trials(study_id, states, included_trial_ids, trial_id_greater_than)`` is the read the cache
  is built on.
- ``optuna.storages._grpc.client.GrpcClientCache``: the gRPC client's trial cache, base of the throttled
  twin (:func:`throttle_grpc_client`); it overrides ``_read_trials_from_remote_storage`` and
  ``_add_trial_to_cache`` and uses ``studies``, ``lock`` and ``grpc_client``. ``GrpcClientCacheEntry``:
  one study's entry, which :func:`seed_grpc_cache` fills (bench/storage_load.py).
- ``GrpcStorageProxy._cache`` and ``GrpcStorageProxy._stub``: to put the throttled cache in place of the
  client's own.
- ``optuna.storages._grpc.auto_generated.api_pb2`` (``GetTrialsRequest``, ``GetTrialsReply``) and
  ``api_pb2_grpc.add_StorageServiceServicer_to_server``: the proxy's wire messages and server registration.
- ``optuna.storages._grpc.servicer.OptunaStorageProxyService``, ``_to_proto_trial``, ``_from_proto_trial``:
  Optuna's own gRPC service, whose ``GetTrials`` the proxy answers from its coalesced snapshot
  (:func:`add_proxy_service`), and its trial <-> message conversions.
- ``Study._storage``, ``Study._study_id``, ``Trial._trial_id`` / ``FrozenTrial._trial_id``: a study's
  storage and ids, for the storage calls the public API lacks (:func:`study_storage`, :func:`study_id`,
  :func:`trial_id`).
- ``Trial._cached_frozen_trial``: the steps a live trial has reported, without a storage read
  (:func:`reported_steps`).
- ``Study._thread_local.cached_all_trials``: the study's per-thread trial list, dropped after a trial is
  claimed straight through the storage so the next ``ask`` sees it (:func:`forget_cached_trials`).
"""

from __future__ import annotations

import functools
import time
from typing import Any


def study_storage(study: Any) -> Any:
    """The storage behind an ``optuna.Study`` (``Study._storage``)."""
    return study._storage


def study_id(study: Any) -> int:
    """The storage's id of an ``optuna.Study`` (``Study._study_id``)."""
    return study._study_id


def trial_id(trial: Any) -> int:
    """The storage's id of a Trial or FrozenTrial (``_trial_id``), unique across studies, unlike its number."""
    return trial._trial_id


def reported_steps(trial: Any) -> set[int]:
    """The steps a live ``optuna.Trial`` has reported, from its in-memory copy (``_cached_frozen_trial``)."""
    return set(trial._cached_frozen_trial.intermediate_values)


def forget_cached_trials(study: Any) -> None:
    """Drop the study's per-thread trial list (``_thread_local.cached_all_trials``) so the next read is fresh."""
    study._thread_local.cached_all_trials = None


def engine_of(storage: Any) -> Any:
    """The SQLAlchemy engine of an RDBStorage, bare or inside Optuna's cache (``_backend``); None otherwise."""
    return getattr(storage, "engine", None) or getattr(getattr(storage, "_backend", None), "engine", None)


def cached(storage: Any) -> Any:
    """Optuna's in-process cache around an RDB storage, kept (optuna wraps a bare RDBStorage anew each load)."""
    from optuna.storages import RDBStorage
    from optuna.storages._cached_storage import _CachedStorage

    return _CachedStorage(storage) if isinstance(storage, RDBStorage) else storage


def cached_study(storage: Any, study: int) -> tuple[dict[int, Any], int]:
    """(trials by number, last finished trial id) that Optuna's in-process cache holds for a study."""
    entry = storage._studies[study]
    return entry.trials, entry.last_finished_trial_id


def seed_grpc_cache(client: Any, study: int, trials: dict[int, Any], last_finished: int) -> None:
    """Fill a gRPC client's cache with a study's trials, as a long-lived worker would hold them."""
    from optuna.storages._grpc.client import GrpcClientCacheEntry

    entry = GrpcClientCacheEntry()
    entry.trials, entry.last_finished_trial_id = dict(trials), last_finished
    client._cache.studies[study] = entry


def throttled_cache(backend: Any, refresh_s: float, lists: Any) -> Any:
    """An RDBStorage behind a cache that re-reads unfinished trials at most every ``refresh_s`` seconds.

    ``lists``: a :class:`sweep.store.caches.SortedLists`, told of every trial the cache takes in.
    """
    return _throttled_classes()[0](backend, refresh_s, lists)


def throttle_grpc_client(client: Any, refresh_s: float, lists: Any) -> None:
    """Replace a ``GrpcStorageProxy``'s cache by one that re-reads unfinished trials at most every ``refresh_s``."""
    client._cache = _throttled_classes()[1](client._stub, refresh_s, lists)


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
        def __init__(self, backend: Any, refresh_s: float, lists: Any) -> None:
            super().__init__(backend)
            self._refresh_s = refresh_s
            self._full_at: dict[int, float] = {}
            self._sorted = lists

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
        def __init__(self, stub: Any, refresh_s: float, lists: Any) -> None:
            super().__init__(stub)
            self._refresh_s = refresh_s
            self._full_at: dict[int, float] = {}
            self._sorted = lists

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


def add_proxy_service(server: Any, storage: Any) -> None:
    """Register Optuna's storage service on a gRPC ``server``, in front of ``storage``.

    Optuna's own service (``run_grpc_proxy_server`` builds the same), with one change: a client's trial
    read is answered by ``storage.trials_after(study_id, greater_than, included)`` (the proxy's coalesced
    snapshot, by bisection) rather than by filtering every trial of the study on each call.
    """
    import grpc
    from optuna.storages._grpc.auto_generated import api_pb2, api_pb2_grpc
    from optuna.storages._grpc.servicer import OptunaStorageProxyService, _to_proto_trial

    class Service(OptunaStorageProxyService):
        def GetTrials(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC's method name
            try:
                trials = storage.trials_after(request.study_id, request.trial_id_greater_than,
                                              set(request.included_trial_ids))
            except KeyError as e:
                context.abort(code=grpc.StatusCode.NOT_FOUND, details=str(e))
            return api_pb2.GetTrialsReply(trials=[_to_proto_trial(t) for t in trials])

    api_pb2_grpc.add_StorageServiceServicer_to_server(Service(storage), server)


# -- the proxy's client token ------------------------------------------------------------------------

PROXY_TOKEN_HEADER = "x-sweep-proxy-token"  # gRPC metadata keys are lower case


def token_grpc_client(host: str, port: int, token: str) -> Any:
    """A ``GrpcStorageProxy`` that sends ``token`` with every call (the proxy refuses calls without it).

    Private names: ``GrpcStorageProxy._setup`` (overridden), ``_channel``, ``_stub``, ``_cache``, and
    ``optuna.storages._grpc.client.create_insecure_channel`` (Optuna's channel options).
    """
    return _token_client_class()(host=host, port=port, token=token)


@functools.cache
def _token_client_class() -> type:
    import collections

    import grpc
    from optuna.storages import GrpcStorageProxy
    from optuna.storages._grpc.auto_generated import api_pb2_grpc
    from optuna.storages._grpc.client import GrpcClientCache, create_insecure_channel

    class Details(collections.namedtuple("Details", ("method", "timeout", "metadata", "credentials",
                                                     "wait_for_ready", "compression")),
                  grpc.ClientCallDetails):
        pass

    class AddToken(grpc.UnaryUnaryClientInterceptor):  # every call of Optuna's storage service is unary
        def __init__(self, token: str) -> None:
            self.token = token

        def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            metadata = [*(details.metadata or ()), (PROXY_TOKEN_HEADER, self.token)]
            return continuation(Details(details.method, details.timeout, metadata, details.credentials,
                                        details.wait_for_ready, details.compression), request)

    class TokenClient(GrpcStorageProxy):
        def __init__(self, *, host: str, port: int, token: str) -> None:
            self._token = token
            super().__init__(host=host, port=port)

        def _setup(self) -> None:
            self._channel = grpc.intercept_channel(create_insecure_channel(self._host, self._port),
                                                   AddToken(self._token))
            self._stub = api_pb2_grpc.StorageServiceStub(self._channel)
            self._cache = GrpcClientCache(self._stub)

    return TokenClient


def token_check(token: str) -> Any:
    """A gRPC server interceptor that answers UNAUTHENTICATED to a call without ``token``."""
    import hmac

    import grpc

    def refuse(_request: Any, context: Any) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, "sweep storage proxy: missing or wrong client token")

    denied = grpc.unary_unary_rpc_method_handler(refuse)

    class TokenCheck(grpc.ServerInterceptor):
        def intercept_service(self, continuation: Any, details: Any) -> Any:
            given = dict(details.invocation_metadata or ()).get(PROXY_TOKEN_HEADER, "")
            if isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode()):
                return continuation(details)
            return denied

    return TokenCheck()
