"""Who vouches for a RUNNING trial, and when nobody does any more.

A trial is RUNNING while someone vouches for it. The driver that asked it records itself
(:data:`~sweep.run.outcome.ATTR_DRIVER`) and writes the heartbeat while the task waits in Ray's queue;
the supervisor marks the start (:data:`~sweep.run.outcome.ATTR_STARTED`) and writes the heartbeat every
``heartbeat_s`` from then on. A RUNNING trial nobody owns in this process is lost when its heartbeat is
older than ``stale_after_s``; one still queued in Ray also at once when the driver that asked it ran on
this host and that process is gone. A started trial is never failed while its supervisor's heartbeat is
fresh, whatever became of its driver (:func:`orphaned`). A trial of the driver's own is overdue past its
hard deadline plus grace, or when its supervisor's heartbeat goes stale.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from sweep import store as st
from sweep.run.outcome import ATTR_ADHOC, ATTR_DRIVER, ATTR_HEARTBEAT, ATTR_NODE, ATTR_STARTED, ATTR_SUGGESTED, INFRA

log = logging.getLogger("sweep.run.liveness")


# -- processes ----------------------------------------------------------------------------------------

def host_identity() -> dict[str, Any]:
    """Who this process is, precisely enough to tell later whether it is still alive."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": process_start_time(os.getpid())}


def process_start_time(pid: int) -> int | None:
    """Kernel start time of ``pid`` (clock ticks since boot), to tell a live pid from a reused one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_alive(identity: dict[str, Any]) -> bool | None:
    """True/False for a process on this host; None when it ran elsewhere (cannot tell)."""
    if identity.get("host") != socket.gethostname():
        return None
    pid = identity.get("pid")
    if not isinstance(pid, int):
        return None
    start = process_start_time(pid)
    if start is None:
        return False
    return identity.get("pid_start") in (None, start)


# -- writing ------------------------------------------------------------------------------------------

def claim_attrs(owner: dict[str, Any], suggested: bool = True) -> dict[str, Any]:
    """The system attributes of a trial the driver ``owner`` just asked: who it is, a first heartbeat, and
    whether its parameters are complete already (:data:`ATTR_SUGGESTED`; see :func:`mark_suggested`)."""
    now = time.time()
    return {ATTR_DRIVER: owner, ATTR_HEARTBEAT: now, **({ATTR_SUGGESTED: now} if suggested else {})}


def claim(storage: Any, trial_id: int, owner: dict[str, Any]) -> None:
    """Record the asking driver on a trial and vouch for it until its supervisor starts (parameters to come)."""
    for k, v in claim_attrs(owner, suggested=False).items():
        storage.set_trial_system_attr(trial_id, k, v)


def mark_suggested(storage: Any, trial_id: int) -> None:
    """Every parameter of the trial is drawn: only from now on may it be re-run with them. A trial whose
    driver died before this point never ran, and is never run with parameters drawn anew."""
    storage.set_trial_system_attr(trial_id, ATTR_SUGGESTED, time.time())


def beat(storage: Any, trial_id: int, at: float) -> None:
    """One heartbeat at unix time ``at`` (the driver's, for its trial still queued in Ray)."""
    storage.set_trial_system_attr(trial_id, ATTR_HEARTBEAT, at)


def mark_started(storage: Any, trial_id: int, url: str, node: str | None = None) -> None:
    """The supervisor has the trial: from now on its heartbeat, not the driver's, keeps it alive.
    ``node``: the Ray node it runs on, so the driver can tell the node's death from the trial's."""
    now = time.time()
    if node:
        st.retry(lambda: storage.set_trial_system_attr(trial_id, ATTR_NODE, node), what="mark node", url=url)
    st.retry(lambda: storage.set_trial_system_attr(trial_id, ATTR_STARTED, now), what="mark started", url=url)


def keep_alive(storage: Any, trial_id: int, number: int, url: str) -> bool:
    """The supervisor's heartbeat; False when the trial has been finished by someone else.

    A database outage must not kill a healthy trial: any other failure is logged and ignored.
    """
    from optuna.exceptions import UpdateFinishedTrialError

    try:
        st.retry(lambda: storage.set_trial_system_attr(trial_id, ATTR_HEARTBEAT, time.time()),
                 what="heartbeat", url=url, attempts=3)
    except (UpdateFinishedTrialError, RuntimeError) as e:
        if "finished" in str(e).lower():
            return False
        log.warning("heartbeat of trial %d failed: %s", number, st.scrub(str(e), url))
    except Exception as e:
        log.warning("heartbeat of trial %d failed: %s", number, st.scrub(str(e), url))
    return True


# -- judging ------------------------------------------------------------------------------------------

def started_at(t: Any) -> float | None:
    """When the trial's supervisor started, or None while it waits in Ray's queue."""
    return t.system_attrs.get(ATTR_STARTED)


def overdue(t: Any, wall: float, deadline_s: float, stop_grace_s: float, stale_after_s: float,
            store_back: float = 0.0) -> str | None:
    """Why the driver's own started trial must be cancelled at unix time ``wall``, or None while it is fine.
    No heartbeat could be written while the store was away: its silence counts from ``store_back`` at most."""
    started = t.system_attrs[ATTR_STARTED]
    beat_at = t.system_attrs.get(ATTR_HEARTBEAT, started)
    if wall - started > deadline_s + stop_grace_s + stale_after_s:
        return f"hard deadline {deadline_s:g} s exceeded and the supervisor did not stop it"
    if wall - max(beat_at, started, store_back) > stale_after_s:
        return f"heartbeat lost: none for {wall - max(beat_at, started):.0f} s"
    return None


def orphaned(t: Any, wall: float, stale_after_s: float, run_id: str, store_back: float = 0.0
             ) -> tuple[str, str] | None:
    """``(fail kind, reason)`` when a RUNNING trial that driver run ``run_id`` does not hold is lost at unix
    time ``wall``, or None while someone may still vouch for it.

    A trial whose supervisor started is its supervisor's: only its heartbeat going stale loses it, whatever
    became of the driver that asked it (a supervisor may outlive its driver long enough to store its
    result). One still queued in Ray is its driver's: lost at once when that driver is known gone. A
    trial the infrastructure took (its driver died before it could run, or took its task with it) is
    kind ``infra``: re-run, never counted; one whose own supervisor went silent is ``lost``. As in
    :func:`overdue`, a heartbeat's silence counts from ``store_back`` (the store's return) at most.
    """
    if asked_by(t, run_id):
        return None  # asked by this driver but not in flight: only between ask and submit
    owner = t.system_attrs.get(ATTR_DRIVER) or {}
    beat_at = t.system_attrs.get(ATTR_HEARTBEAT)
    if beat_at is None and t.datetime_start is not None:
        beat_at = t.datetime_start.timestamp()
    stale = beat_at is not None and wall - max(beat_at, store_back) > stale_after_s
    alive = process_alive(owner) if owner else None
    driver = f"its driver (pid {owner.get('pid')} on {owner.get('host')})"
    if started_at(t) is not None:
        if not stale:
            return None
        if alive is False:
            return INFRA, f"lost: {driver} died and took its task with it (no heartbeat for {wall - beat_at:.0f} s)"
        return "lost", f"lost: no heartbeat for {wall - beat_at:.0f} s (worker or driver died)"
    if alive is False:
        return INFRA, f"lost before it ran: {driver} is gone"
    if stale and not owner:
        return INFRA, f"lost before it ran: no driver claimed it in {wall - beat_at:.0f} s (its ask was cut off)"
    if stale:
        return INFRA, f"lost before it ran: no heartbeat for {wall - beat_at:.0f} s (its driver died)"
    return None


def asked_by(t: Any, run_id: str) -> bool:
    """Whether driver run ``run_id`` asked the trial."""
    return (t.system_attrs.get(ATTR_DRIVER) or {}).get("run") == run_id


def orphan_of_dead_driver(t: Any, run_id: str) -> bool:
    """Whether a RUNNING trial's driver, not run ``run_id``, is known gone: nobody else will see it end, so
    the driver of ``run_id`` waits for it (its supervisor may still store a result, else it goes stale and
    :func:`orphaned` loses it) before calling the study done."""
    owner = t.system_attrs.get(ATTR_DRIVER)
    return t.state.name == "RUNNING" and bool(owner) and not asked_by(t, run_id) and process_alive(owner) is False


def unclaimed(t: Any) -> bool:
    """Whether a RUNNING trial was asked but never claimed by its driver: a store outage cut the launch
    between ``ask`` and the claim, or lost the reply to an ``ask`` that had created it (a retried ask then
    creates another, and the first is known to nobody). Only its staleness (:func:`orphaned`) ends it, so
    a driver waits for that before calling the study done; a live driver's claim follows its ask within
    one storage call, so waiting on one costs a poll."""
    return t.state.name == "RUNNING" and not t.system_attrs.get(ATTR_DRIVER) and not t.user_attrs.get(ATTR_ADHOC)


def vouched(t: Any, now: float, stale_after_s: float) -> bool:
    """Whether someone wrote the trial's heartbeat within ``stale_after_s`` of unix time ``now``."""
    return now - t.system_attrs.get(ATTR_HEARTBEAT, 0) < stale_after_s
