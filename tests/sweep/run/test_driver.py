"""Driver bookkeeping without Ray: what counts, lost-trial detection, retries, constraint rejections."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import time

import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from sweep import store as st
from sweep.run import driver as drv
from sweep.run.driver import Driver
from sweep.run.liveness import host_identity
from sweep.run.outcome import ATTR_DRIVER, ATTR_HEARTBEAT, ATTR_STARTED, ATTR_SUGGESTED, counts, needs_retry
from sweep.spec import load
from tests.sweep_fixtures import tiny_spec, write_spec


def _t(state, **attrs):
    value = 1.0 if state == TrialState.COMPLETE else None
    return create_trial(state=state, value=value, params={"d": 1}, distributions={"d": IntDistribution(1, 2)},
                        user_attrs=attrs)


def test_what_counts_towards_n_trials():
    C, P, F = TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL
    assert counts(_t(C)) and counts(_t(P)) and counts(_t(P, fail_kind="diverged"))
    assert counts(_t(F, fail_kind="deadline")) and counts(_t(F, fail_kind="oom"))
    assert not counts(_t(F, fail_kind="constraint"))
    assert not counts(_t(F, fail_kind="crash")) and needs_retry(_t(F, fail_kind="crash"))
    assert counts(_t(F, fail_kind="lost", retry_of=3)) and not needs_retry(_t(F, fail_kind="lost", retry_of=3))
    assert not counts(_t(C, adhoc=True))
    assert not counts(_t(TrialState.RUNNING)) and not counts(_t(TrialState.WAITING))


@pytest.fixture
def driver(tmp_path, monkeypatch):
    def make(**sections) -> Driver:
        monkeypatch.setenv(st.ENV_STORAGE, f"journal:{tmp_path / 'j.log'}")
        monkeypatch.setenv("SWEEP_ARTIFACTS", str(tmp_path / "art"))
        d = Driver(load(write_spec(tmp_path, "drv", tiny_spec(**sections))), out=io.StringIO())
        d.open_study()
        return d

    return make


def _running(study, owner: dict, heartbeat: float, depth: int, started: bool = False, suggested: bool = True) -> int:
    attrs = {ATTR_DRIVER: owner, ATTR_HEARTBEAT: heartbeat}
    attrs |= {ATTR_STARTED: heartbeat - 1} if started else {}
    attrs |= {ATTR_SUGGESTED: heartbeat - 2} if suggested else {}
    frozen = create_trial(state=TrialState.RUNNING, params={"depth": depth},
                          distributions={"depth": IntDistribution(1, 2)}, system_attrs=attrs)
    return study._storage.create_new_trial(study._study_id, template_trial=frozen)


def test_reconcile_fails_lost_trials_once_and_leaves_live_ones(driver):
    d = driver()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here_dead = {**host_identity(), "pid": dead.pid, "run": "old"}
    elsewhere = {"host": socket.gethostname() + "-other", "pid": 1, "pid_start": 1, "run": "other"}
    now = time.time()
    _running(d.study, here_dead, now, 1)  # 0: queued, its driver is gone: lost to the infrastructure at once
    _running(d.study, elsewhere, now - 3600, 2)  # 1: queued, nobody has vouched for it in an hour: infra too
    _running(d.study, elsewhere, now, 1)  # 2: another driver's live trial: untouched
    _running(d.study, here_dead, now, 2, started=True)  # 3: its supervisor still beats: untouched, driver or not
    _running(d.study, here_dead, now, 1, suggested=False)  # 4: driver died mid-suggest: failed, never re-run
    _running(d.study, elsewhere, now - 3600, 2, started=True)  # 5: its supervisor went silent: lost, retried
    d.reconcile()
    d.reconcile()
    trials = d.study.get_trials()
    assert [t.state.name for t in trials[:6]] == ["FAIL", "FAIL", "RUNNING", "RUNNING", "FAIL", "FAIL"]
    assert [trials[n].user_attrs["fail_kind"] for n in (0, 1, 4, 5)] == ["infra", "infra", "infra", "lost"]
    assert "driver" in trials[0].user_attrs["fail_reason"] and "heartbeat" in trials[1].user_attrs["fail_reason"]
    assert not any(counts(t) for t in trials)
    reruns = {t.user_attrs["rerun_of"]: t for t in trials if "rerun_of" in t.user_attrs}
    retries = {t.user_attrs["retry_of"]: t for t in trials if "retry_of" in t.user_attrs}
    assert sorted(reruns) == [0, 1] and sorted(retries) == [5]
    for n, t in [*reruns.items(), *retries.items()]:
        assert t.state.name == "WAITING" and t.system_attrs["fixed_params"] == trials[n].params


def test_constraint_rejections_fail_without_counting_and_cannot_stall(driver, monkeypatch):
    monkeypatch.setattr(drv, "MAX_CONSTRAINT_REJECTS", 5)
    d = driver(constraints={"rare": "matrix_lr < 0.0101"})
    submitted = []
    monkeypatch.setattr(d, "submit", lambda number, trial_id, params, attrs, placement=None: submitted.append(params))
    for _ in range(30):
        if d.launch_next():
            break
    assert submitted and submitted[0]["matrix_lr"] < 0.0101
    trials = d.study.get_trials()
    rejected = [t for t in trials if t.user_attrs.get("fail_kind") == "constraint"]
    assert rejected and all(t.state.name == "FAIL" and "rare" in t.user_attrs["fail_reason"] for t in rejected)
    assert not any(counts(t) for t in rejected)


def test_resumed_driver_reseeds_its_sampler(driver):
    d = driver()
    first = d.study.ask()
    d.spec.space.suggest(first)
    d.study.tell(first, 1.0)
    again = driver()
    second = again.study.ask()
    assert again.spec.space.suggest(second) != first.params


def test_interrupt_fails_in_flight_trials_as_lost(driver, monkeypatch):
    import ray

    d = driver()
    trial = d.study.ask()
    d.inflight["ref"] = drv.InFlight(trial.number, trial._trial_id, {}, time.monotonic())
    cancelled = []
    monkeypatch.setattr(ray, "cancel", lambda ref, force=False: cancelled.append((ref, force)))
    d.abandon("driver interrupted (SIGTERM)")
    t = d.study.get_trials()[0]
    assert t.state.name == "FAIL" and t.user_attrs["fail_kind"] == "lost" and needs_retry(t)
    assert cancelled == [("ref", True)] and not d.inflight


def test_driver_stores_an_outcome_the_supervisor_could_not(driver):
    d = driver()
    trial = d.study.ask()
    trial.suggest_int("depth", 1, 2)
    slot = drv.InFlight(trial.number, trial._trial_id, {}, time.monotonic())
    result = {"number": trial.number, "state": "COMPLETE", "value": 1.25, "fail_kind": None, "reason": None,
              "slot_seconds": 9.0, "told": False, "record": {"status": "ok", "val_bpb": 1.25, "steps": 7}}
    d._tell_from_outcome(slot, result)
    d._tell_from_outcome(slot, result)  # idempotent: the trial is finished now
    t = d.study.get_trials()[0]
    assert t.state.name == "COMPLETE" and t.value == 1.25
    from sweep.study import record_of

    assert record_of(t) == result["record"] and t.user_attrs["slot_seconds"] == 9.0


def test_resume_under_another_objective_is_refused_in_one_line(driver):
    composite = {"type": "composite", "terms": {"val_bpb": {"weight": 1.0, "best": 0.9, "worst": 1.1}}}
    d = driver(objective=composite)
    assert d.study.metric_names == ["composite"] and d.study.user_attrs["direction"] == "maximize"
    assert d.study.user_attrs["objective"] == "maximize 1 x val_bpb[1.1->0.9]"
    # Same single direction (maximize), another objective: the stored names tell them apart.
    with pytest.raises(drv.SweepAborted) as e:
        driver(study={"n_trials": 4, "direction": "maximize"})
    assert str(e.value) == "study 'drv' exists with objective composite, spec says val_bpb"
    with pytest.raises(drv.SweepAborted, match="^study 'drv' exists with direction maximize, spec says minimize$"):
        driver()
    assert driver(objective=composite).study.metric_names == ["composite"]  # the same objective resumes


def test_a_heartbeat_missed_while_the_store_was_away_is_judged_from_its_return():
    from sweep.run import liveness
    from sweep.run.outcome import ATTR_STARTED

    now = 1000.0
    owned = _t(TrialState.RUNNING)
    owned.system_attrs = {ATTR_STARTED: now - 100, ATTR_HEARTBEAT: now - 70}  # silent 70 s: the store was away
    assert "heartbeat lost" in liveness.overdue(owned, now, 600, 5, 8)
    assert liveness.overdue(owned, now, 600, 5, 8, store_back=now - 3) is None  # back 3 s ago: not yet stale
    assert "heartbeat lost" in liveness.overdue(owned, now, 600, 5, 8, store_back=now - 9)  # back 9 s, still silent
    foreign = _t(TrialState.RUNNING)
    foreign.system_attrs = {ATTR_DRIVER: {"run": "other"}, ATTR_STARTED: now - 100, ATTR_HEARTBEAT: now - 70}
    assert liveness.orphaned(foreign, now, 8, "mine") == ("lost", "lost: no heartbeat for 70 s (worker or driver died)")
    assert liveness.orphaned(foreign, now, 8, "mine", store_back=now - 3) is None


def test_a_trial_left_running_by_a_dead_driver_is_waited_for_by_the_next():
    """A resumed driver must not call the study done while a dead driver's trial is RUNNING: its
    supervisor may still store it, or it goes stale and is lost and re-run by this driver."""
    from sweep.run import liveness

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = {**host_identity(), "run": "old", "pid": dead.pid, "pid_start": None}
    alive = {**host_identity(), "run": "other"}
    elsewhere = {"host": "not-" + socket.gethostname(), "pid": 1, "run": "far"}

    def running(owner):
        t = _t(TrialState.RUNNING)
        t.system_attrs = {ATTR_DRIVER: owner}
        return t

    assert liveness.orphan_of_dead_driver(running(gone), "mine")
    assert not liveness.orphan_of_dead_driver(running(alive), "mine")  # a live driver sees its own to the end
    assert not liveness.orphan_of_dead_driver(running(elsewhere), "mine")  # cannot tell: only staleness judges
    assert not liveness.orphan_of_dead_driver(running({**gone, "run": "mine"}), "mine")
    assert not liveness.orphan_of_dead_driver(_t(TrialState.COMPLETE), "mine")


def test_a_stale_view_of_its_own_finished_trial_never_ends_the_study_short(driver):
    """The proxy serves a read up to its ttl old: a trial this run just finished may still look RUNNING.
    Counted as running, the driver would stop one trial short; it is read again from the store instead.
    One of its own that is RUNNING in the store but not in flight lost its launch: re-run, not counted."""
    d = driver()
    now = time.time()
    mine = {**host_identity(), "run": d.run_id}
    finished = _running(d.study, mine, now, 1)
    stale = d.study.get_trials()[0]
    d.study.tell(0, 1.5)
    assert stale.state.name == "RUNNING"
    [seen] = d._settled([stale])
    assert seen.state.name == "COMPLETE" and st.trial_id(seen) == finished
    _running(d.study, mine, now, 2)  # 1: asked, suggested, never submitted (a store outage cut its launch)
    _running(d.study, {**mine, "run": "other"}, now, 1)  # 2: another live driver's: left to it
    settled = d._settled(d.study.get_trials())
    assert [t.state.name for t in settled] == ["COMPLETE", "FAIL", "RUNNING"]
    assert settled[1].user_attrs["fail_kind"] == "infra" and not counts(settled[1])
    [rerun] = [t for t in d.study.get_trials() if t.user_attrs.get("rerun_of") == 1]
    assert rerun.state.name == "WAITING" and rerun.system_attrs["fixed_params"] == {"depth": 2}
    assert "lost to the infrastructure (not counted): its launch was cut off" in d.out.getvalue()


def test_a_launch_cut_before_its_claim_is_lost_not_counted_as_running(driver, monkeypatch):
    """A store outage that starts between ``ask`` and the claim leaves a RUNNING trial that names no driver.
    The run that asked it remembers it: once the store is back it is lost to the infrastructure (never
    re-run: its parameters were never drawn), so the study asks another instead of ending one short."""
    import importlib

    import sqlalchemy.exc

    from sweep.run import liveness

    retry = importlib.import_module("sweep.store.retry")  # the module; sweep.store.retry is its function

    d = driver()
    away = sqlalchemy.exc.OperationalError("UPDATE trial_system_attributes", {},
                                           Exception("server closed the connection unexpectedly"))

    def claim(*_args: object) -> None:
        raise away

    with monkeypatch.context() as m, pytest.raises(sqlalchemy.exc.OperationalError):  # the store away, then back
        m.setattr(retry, "ATTEMPTS", 1)
        m.setattr(liveness, "claim", claim)
        d.launch_next()
    [cut] = d.study.get_trials()
    assert cut.state.name == "RUNNING" and ATTR_DRIVER not in cut.system_attrs
    [settled] = d._settled([cut])
    assert settled.state.name == "FAIL" and settled.user_attrs["fail_kind"] == "infra" and not counts(settled)
    assert [t.number for t in d.study.get_trials()] == [0]  # nothing to run again: no parameter was drawn


def test_a_trial_no_driver_claimed_is_waited_for_until_it_is_lost(driver):
    """The reply to an ``ask`` lost in an outage: the trial exists, no driver knows it or vouches for it.
    Counted as running it would end the study short with the trial RUNNING for ever; the driver waits
    until it is stale, loses it to the infrastructure, and only then is the study's count its to judge."""
    d = driver(study={"n_trials": 1, "concurrency": 1, "seed": 0})
    d.poll_s = 0.05
    d.study.tell(d.study.ask(), 1.0)  # one COMPLETE trial: n_trials is met, were the orphan not there
    orphan = create_trial(state=TrialState.RUNNING, params={"depth": 1}, distributions={"depth": IntDistribution(1, 2)})
    d.study._storage.create_new_trial(d.study._study_id, template_trial=orphan)
    assert d.step(), "the study was called done with a RUNNING trial nobody will ever end"
    deadline = time.monotonic() + 30
    while d.step():
        assert time.monotonic() < deadline, d.out.getvalue()
    lost = d.study.get_trials()[1]
    assert lost.state.name == "FAIL" and lost.user_attrs["fail_kind"] == "infra"
    assert "no driver claimed it" in lost.user_attrs["fail_reason"]
