"""Telling the infrastructure's failures from a trial's, and whether Ray is still there to launch into.

A trial that crashed, diverged, ran out of memory or hit its deadline is a result of its point. A Ray
node, a raylet or the GCS going away under it, or a store it could not reach, is not: such a trial is
FAIL ``infra`` (:data:`sweep.run.outcome.INFRA`), never counted, and run again with its parameters.

What Ray 2.60 raises from ``ray.get`` of a trial's task, and what it says:

- ``LocalRayletDiedError`` (the raylet this driver submits through is gone), ``NodeDiedError``,
  ``RaySystemError`` (among others when a raylet is killed), ``RpcError``, ``ObjectLostError`` and its
  kinds (``OwnerDiedError``, ...), ``OutOfDiskError``, ``ObjectStoreFullError``: the infrastructure.
- ``WorkerCrashedError``: the supervisor's worker process died. Its node's death does that, and so does
  the trial itself (the kernel's OOM killer, a kill from outside): it is the infrastructure's only when
  the node the trial ran on (:data:`sweep.run.outcome.ATTR_NODE`) is dead or its raylet is gone, as known
  when the error arrives (the GCS marks a cluster's node dead some health checks after it went).
  A node removed from a cluster mid-trial raises ``NodeDiedError`` (seen on ``ray.cluster_utils.Cluster``).
- ``OutOfMemoryError`` (Ray's memory monitor killed the worker): the trial's memory, kind ``oom``.
- ``RayTaskError`` whose cause is a transient store error (the supervisor could not reach the study after
  its retries): the infrastructure. Any other: the trial's (``lost``, retried once).

A local Ray dies with its processes: this driver started them, so :class:`RayWatch` knows their pids
and says at once when one is gone. Ray itself ends a driver whose GCS has been unreachable for 60 s
(``gcs_rpc_server_reconnect_timeout_s``), so the driver must notice well before that and stop cleanly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sweep import store as st
from sweep.run.liveness import process_start_time
from sweep.run.outcome import INFRA
from sweep.run.printing import one_line

# Ray's exception classes (by name, so this module imports no Ray) that mean the infrastructure failed.
INFRA_ERRORS = ("LocalRayletDiedError", "NodeDiedError", "RaySystemError", "RpcError", "ObjectLostError",
                "OutOfDiskError", "ObjectStoreFullError")
# The processes of a local Ray this driver started, by the name the kernel gives them (/proc/PID/comm).
RAY_PROCESSES = {"raylet": "raylet", "gcs_server": "GCS"}
GCS_PROBE_S = 10.0  # how long a GCS call may take before the GCS counts as unreachable


@dataclass(frozen=True)
class Verdict:
    """Why a trial's task did not return: ``kind`` is its fail kind (:data:`INFRA` when not the trial's)."""

    kind: str
    reason: str

    @property
    def infra(self) -> bool:
        return self.kind == INFRA


def _names(e: BaseException) -> set[str]:
    return {c.__name__ for c in type(e).__mro__}


def worker_crashed(e: BaseException) -> bool:
    """Ray's ``WorkerCrashedError``: the one error that is the infrastructure's only if the node died."""
    return "WorkerCrashedError" in _names(e)


def classify(e: BaseException, node_dead: bool | None = None) -> Verdict:
    """The verdict on a trial whose task raised ``e`` from ``ray.get`` (not cancelled by the driver).

    ``node_dead``: whether the node the trial ran on is known dead (its raylet gone), None if unknown;
    it decides a ``WorkerCrashedError``.
    """
    names = _names(e)
    if "OutOfMemoryError" in names:
        return Verdict("oom", f"Ray's memory monitor killed the worker: {one_line(e)}")
    if names & set(INFRA_ERRORS):
        return Verdict(INFRA, f"lost to the infrastructure: {one_line(e)}")
    if worker_crashed(e) and node_dead:
        return Verdict(INFRA, f"lost to the infrastructure: its node died ({one_line(e)})")
    cause = getattr(e, "cause", None)
    if "RayTaskError" in names and isinstance(cause, BaseException) and st.is_transient(cause):
        return Verdict(INFRA, f"lost to the infrastructure: the store was unreachable ({one_line(cause)})")
    return Verdict("lost", f"worker died: {one_line(e)}")


# -- is Ray there ----------------------------------------------------------------------------------------

def child_processes(parent: int, names: set[str]) -> dict[str, int]:
    """The children of ``parent`` whose kernel name is one of ``names``: {name: pid}."""
    found: dict[str, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            comm = (d / "comm").read_text().strip()
        except OSError:
            continue
        if comm in names and int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found[comm] = int(d.name)
    return found


def process_tree(roots: list[int]) -> dict[int, int | None]:
    """{pid: kernel start time} of ``roots`` and every live process below them."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    found: dict[int, int | None] = {}
    todo = [r for r in roots if process_start_time(r) is not None]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = process_start_time(pid)
            todo += children.get(pid, [])
    return found


def still_running(tree: dict[int, int | None]) -> list[int]:
    """The processes of ``tree`` still alive: the same processes (start time unchanged), zombies aside."""
    return [p for p, start in tree.items() if process_start_time(p) == start and not _zombie(p)]


def end_leftovers(tree: dict[int, int | None], wait_s: float = 5.0) -> list[int]:
    """SIGKILL what of ``tree`` outlives ``wait_s`` (by pid, each checked to be the same process); the pids."""
    end = time.monotonic() + wait_s
    while still_running(tree) and time.monotonic() < end:
        time.sleep(0.1)
    left = still_running(tree)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return left


def call_with_timeout(fn: Any, timeout_s: float) -> tuple[bool, Any]:
    """``(True, fn())`` if it returns within ``timeout_s``, ``(False, error or None)`` if not.

    A call into a dead GCS blocks until Ray gives up on it; a daemon thread lets the driver move on.
    """
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except Exception as e:
            box["error"] = e

    th = threading.Thread(target=body, daemon=True, name="gcs-probe")
    th.start()
    th.join(timeout_s)
    if "value" in box:
        return True, box["value"]
    return False, box.get("error")


class RayWatch:
    """Whether the Ray this driver launches into is still there, and why not.

    ``local``: the driver started this Ray (``ray.init()`` without an address), so its raylet and GCS
    are this process's children, watched by pid; a cluster's are watched through the GCS.
    """

    def __init__(self, local: bool, pids: dict[str, int] | None = None) -> None:
        self.local = local
        self.pids = dict(pids if pids is not None else (child_processes(os.getpid(), set(RAY_PROCESSES))
                                                         if local else {}))
        self._starts = {name: process_start_time(pid) for name, pid in self.pids.items()}

    def tree(self) -> dict[int, int | None]:
        """The local Ray's processes now: its raylet and GCS and all they started (agents, workers)."""
        return process_tree(list(self.pids.values())) if self.local else {}

    def process_gone(self) -> str | None:
        """Which of the local Ray's processes is gone (cheap: reads /proc), or None."""
        for name, pid in self.pids.items():
            start = process_start_time(pid)
            if start is None or start != self._starts.get(name) or _zombie(pid):
                return f"the local Ray's {RAY_PROCESSES[name]} ({name}, pid {pid}) is gone"
        return None

    def alive_nodes(self, timeout_s: float = GCS_PROBE_S) -> dict[str, dict[str, float]] | None:
        """{node id: total resources} of the nodes the GCS holds alive; None when the GCS does not answer."""
        import ray

        ok, nodes = call_with_timeout(ray.nodes, timeout_s)
        if not ok:
            return None
        return {n["NodeID"]: dict(n.get("Resources") or {}) for n in nodes if n.get("Alive")}

    def problem(self, timeout_s: float = GCS_PROBE_S) -> str | None:
        """Why trials cannot run on this Ray now (its processes, the GCS, no live node), or None."""
        gone = self.process_gone()
        if gone:
            return gone
        nodes = self.alive_nodes(timeout_s)
        if nodes is None:
            return f"the Ray GCS does not answer (no reply within {timeout_s:g} s)"
        if not nodes:
            return "no Ray node is alive"
        return None

    def node_dead(self, node_id: str | None) -> bool | None:
        """Whether the node ``node_id`` is dead: True/False, None when it cannot be told."""
        if self.local and self.process_gone():
            return True
        if not node_id:
            return None
        nodes = self.alive_nodes()
        return None if nodes is None else node_id not in nodes

    def fits(self, need: dict[str, float]) -> bool | None:
        """Whether some live node could hold one trial needing ``need``; None when the GCS does not answer."""
        nodes = self.alive_nodes()
        if nodes is None:
            return None
        need = need or {"CPU": 1.0}
        return any(all(res.get(k, 0.0) >= v for k, v in need.items()) for res in nodes.values())


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# -- the circuit breaker ---------------------------------------------------------------------------------

class CircuitBreaker:
    """Trips when ``threshold`` trials in a row ended the same way (FAIL of one kind, whatever the kind,
    lost to the infrastructure included); a trial that completes or is pruned resets it. ``threshold`` 0:
    never trips."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.kind: str | None = None
        self.streak = 0
        self.last_reason = ""

    def record(self, state: str, kind: str | None, reason: str | None = None) -> bool:
        """Note one finished trial; True when the breaker trips on it."""
        if state != "FAIL":
            self.kind, self.streak = None, 0
            return False
        kind = kind or "failed"
        self.streak = self.streak + 1 if kind == self.kind else 1
        self.kind, self.last_reason = kind, reason or ""
        return self.tripped

    @property
    def tripped(self) -> bool:
        return self.threshold > 0 and self.streak >= self.threshold
