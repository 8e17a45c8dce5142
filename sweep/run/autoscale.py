"""What a study asks of a Ray cluster: trial slots that follow the nodes, and a standing autoscaler request.

A cluster that autoscales from zero starts nodes only for work it can see. A driver that counted only
the nodes that exist (``concurrency = "auto"``) would keep one trial pending, get one node, and run
one trial at a time. So on a cluster the driver tells the autoscaler what the study needs
(``ray.autoscaler.sdk.request_resources``: one bundle of the trial's resources per trial it wants to
run at once, capped by the spec's concurrency and by the trials still to run), and counts its slots
afresh every :data:`POLL_S` seconds from the resources of the nodes alive then: slots grow as nodes
join and shrink as they leave. The request is replaced as the study's need changes and withdrawn
(an empty request) when the run ends, however it ends, so idle workers can be scaled away.

A local Ray the driver started itself has no autoscaler: nothing is requested there, and the slots
are counted once, as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sweep.run.health import GCS_PROBE_S, call_with_timeout
from sweep.spec import StudySpec

POLL_S = 5.0  # how often "auto" recounts the cluster's slots (an autoscaler adds nodes in minutes)


def bundle(spec: StudySpec) -> dict[str, float]:
    """One trial's resources as an autoscaler bundle (the keys Ray schedules the trial's task by)."""
    return spec.resources.as_dict() or {"CPU": 1.0}


def fitting(total: dict[str, float], need: dict[str, float]) -> int:
    """How many trials of ``need`` the resources ``total`` hold (0 when one is missing)."""
    return min(int(total.get(k, 0) // v) for k, v in need.items())


class Capacity:
    """The driver's slots and its autoscaler request for one run.

    ``cluster``: the driver joined a cluster (``RAY_ADDRESS``) rather than starting a local Ray.
    ``say``: where a change of slots, or a request Ray refused, is reported (one line). Every call into
    Ray here gives up after ``GCS_PROBE_S``: a GCS that is gone is :mod:`sweep.run.health`'s to judge.
    """

    def __init__(self, spec: StudySpec, cluster: bool, say: Callable[[str], None], poll_s: float = POLL_S) -> None:
        self.spec = spec
        self.cluster = cluster
        self.say = say
        self.poll_s = poll_s
        self.need = bundle(spec)
        self._slots: int | None = None
        self._counted = 0.0
        self.requested: int | None = None  # bundles in the standing request; None: never asked

    # -- slots ----------------------------------------------------------------------------------

    @property
    def cap(self) -> int | None:
        """The most trials the spec lets run at once (``concurrency``; "auto": ``max_concurrency``)."""
        return self.spec.concurrency or self.spec.max_concurrency

    def slots(self) -> int:
        """Trials to keep in flight now: the spec's integer concurrency, or what the nodes alive hold."""
        if self.spec.concurrency is not None:
            return self.spec.concurrency
        now = time.monotonic()
        if self._slots is not None and (not self.cluster or now - self._counted < self.poll_s):
            return self._slots
        self._counted = now
        total = self._cluster_resources()
        if total is None:  # no answer: keep the count there was
            return self._slots or 1
        n = max(1, fitting(total, self.need))  # one pending trial at least: it is the autoscaler's cue too
        if self.cap:
            n = min(n, self.cap)
        if self._slots is not None and n != self._slots:
            word = "joined" if n > self._slots else "left"
            self.say(f"slots: {self._slots} -> {n} (nodes {word}; the cluster holds {describe(total, self.need)})")
        self._slots = n
        return n

    def _cluster_resources(self) -> dict[str, float] | None:
        import ray

        ok, total = call_with_timeout(ray.cluster_resources, GCS_PROBE_S)
        return total if ok else None

    # -- the autoscaler request -----------------------------------------------------------------

    def demand(self, trials: int) -> None:
        """Ask the autoscaler for room for ``trials`` trials at once (capped), when that number changed."""
        if not self.cluster:
            return
        n = max(0, trials if self.cap is None else min(trials, self.cap))
        if n == self.requested:
            return
        first = self.requested is None
        self.requested = n  # also on failure: a cluster that refuses is not asked again every poll
        refused = self._request([dict(self.need) for _ in range(n)])
        if refused:  # the sweep runs on the nodes there are; the request is only a hint
            self.say(f"warning: could not ask the autoscaler for {n} trials' resources: {refused}")
            return
        if first and n:
            self.say(f"autoscaler: asked for {n} x {describe(self.need, self.need)} (one per trial slot)")

    def release(self) -> None:
        """Withdraw the standing request (idle workers may then go); never raises, never hangs long."""
        if not self.requested:
            return
        self.requested = 0
        refused = self._request([])
        if refused:
            self.say(f"autoscaler: could not withdraw the resource request ({refused}); "
                     "`python -m infra scale --workers 0` on the head withdraws it")

    @staticmethod
    def _request(bundles: list[dict[str, float]]) -> str | None:
        """Replace the standing request with ``bundles``; None when done, else why not (one line)."""
        from ray.autoscaler import sdk

        ok, error = call_with_timeout(lambda: sdk.request_resources(bundles=bundles), GCS_PROBE_S)
        if ok:
            return None
        return f"{type(error).__name__}: {error}" if error else f"no answer in {GCS_PROBE_S:g} s"


def describe(res: dict[str, float], keys: dict[str, float]) -> str:
    """``CPU=3, neuron_cores=8``: the resources of ``res`` named in ``keys``."""
    return ", ".join(f"{k}={res.get(k, 0):g}" for k in keys)
