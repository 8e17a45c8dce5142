"""The infrastructure's failures told from a trial's, re-runs of trials it lost, and the circuit breaker."""

from __future__ import annotations

import subprocess
import sys

import optuna
import pytest
import ray.exceptions as rex
import sqlalchemy.exc as sa_exc
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from sweep import store as st
from sweep.run.health import CircuitBreaker, RayWatch, classify
from sweep.run.outcome import (
    ATTR_SUGGESTED,
    INFRA,
    counts,
    enqueue_rerun,
    fail_infra,
    needs_retry,
    rerun_params,
    reruns_due,
)


def _server_gone() -> sa_exc.OperationalError:
    return sa_exc.OperationalError("SELECT 1", {}, Exception("server closed the connection unexpectedly"))


@pytest.mark.parametrize("error", [rex.LocalRayletDiedError(), rex.NodeDiedError("node 3 is dead"),
                                   rex.RaySystemError("raylet gone"), rex.RpcError("GCS unavailable"),
                                   rex.OwnerDiedError("ab" * 14, None, "")])
def test_ray_losing_the_task_is_the_infrastructure(error):
    v = classify(error)
    assert v.infra and v.kind == INFRA and type(error).__name__ in v.reason


def test_a_crashed_worker_is_the_infrastructure_only_when_its_node_died():
    crashed = rex.WorkerCrashedError()
    assert classify(crashed, node_dead=True).infra
    assert classify(crashed, node_dead=False).kind == "lost"  # killed on a live node: the trial's, retried once
    assert classify(crashed, node_dead=None).kind == "lost"


def test_the_trials_own_failures_stay_its_own():
    assert classify(rex.OutOfMemoryError("memory monitor")).kind == "oom"
    assert classify(rex.RayTaskError("run_trial_task", "tb", ValueError("bad"))).kind == "lost"


def test_a_supervisor_that_could_not_reach_the_store_was_lost_to_the_infrastructure():
    err = rex.RayTaskError("run_trial_task", "tb", _server_gone()).as_instanceof_cause()
    v = classify(err)
    assert v.infra and "store was unreachable" in v.reason


def test_ray_watch_names_the_local_process_that_is_gone():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        watch = RayWatch(local=True, pids={"raylet": proc.pid})
        assert watch.process_gone() is None
    finally:
        proc.kill()
        proc.wait()
    gone = watch.process_gone()
    assert gone is not None and f"raylet, pid {proc.pid}" in gone
    assert watch.node_dead("any") is True and watch.problem() == gone


def test_circuit_breaker_trips_on_the_same_failure_in_a_row_only():
    b = CircuitBreaker(3)
    assert not b.record("FAIL", "crash") and not b.record("FAIL", "crash")
    assert not b.record("COMPLETE", None)  # a result resets the streak
    assert not b.record("FAIL", "crash") and not b.record("FAIL", "oom") and not b.record("FAIL", "oom")
    assert b.record("FAIL", "oom", "out of memory") and b.tripped and b.streak == 3 and b.kind == "oom"
    never = CircuitBreaker(0)
    assert not any(never.record("FAIL", INFRA) for _ in range(50))


# -- re-runs: trials lost to the infrastructure, in a real (journal) study ----------------------------------


@pytest.fixture
def study(tmp_path):
    return optuna.create_study(study_name="s", storage=st.open_storage(f"journal:{tmp_path / 'j.log'}"))


def _lose(study, trial) -> None:
    assert fail_infra(study, trial._trial_id, trial.number, "lost to the infrastructure: test", "")


def test_a_trial_lost_to_the_infrastructure_never_counts_and_reruns_its_point_once(study):
    t = study.ask()
    t.suggest_int("depth", 1, 8)
    study._storage.set_trial_system_attr(t._trial_id, ATTR_SUGGESTED, 1.0)
    _lose(study, t)
    (lost,) = study.get_trials()
    assert not counts(lost) and not needs_retry(lost) and reruns_due([lost]) == [lost]
    enqueue_rerun(study, lost, "")
    trials = study.get_trials()
    assert reruns_due(trials) == []  # enqueued once, never twice
    rerun = trials[1]
    assert rerun.state == TrialState.WAITING and rerun.user_attrs == {"rerun_of": 0}
    assert rerun.system_attrs["fixed_params"] == lost.params


def test_a_retry_lost_to_the_infrastructure_is_rerun_as_the_retry(study):
    study.enqueue_trial({"depth": 3}, user_attrs={"retry_of": 7})
    t = study.ask()
    t.suggest_int("depth", 1, 8)
    _lose(study, t)  # never suggested by a driver, but an enqueued point is whole from the start
    (lost,) = study.get_trials()
    assert rerun_params(lost) == {"depth": 3}
    enqueue_rerun(study, lost, "")
    assert study.get_trials()[1].user_attrs == {"retry_of": 7, "rerun_of": 0}


def test_a_sampled_trial_whose_parameters_were_never_all_drawn_is_not_rerun(study):
    t = study.ask()
    t.suggest_int("depth", 1, 8)  # the driver died here, before the rest and before its claim
    _lose(study, t)
    (lost,) = study.get_trials()
    assert rerun_params(lost) is None and reruns_due([lost]) == [] and not counts(lost)
    with pytest.raises(ValueError, match="no complete parameters"):
        enqueue_rerun(study, lost, "")


def test_counts_leaves_out_infra_failures_of_retries_too():
    lost_retry = create_trial(state=TrialState.FAIL, params={"d": 1}, distributions={"d": IntDistribution(1, 2)},
                              user_attrs={"fail_kind": INFRA, "retry_of": 0})
    assert not counts(lost_retry)
