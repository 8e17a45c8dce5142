"""The infrastructure's failures told from a trial's, re-runs of trials it lost, and the circuit breaker."""

from __future__ import annotations

import os
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
from tests.sweep_fixtures import ROOT, wait_for


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


# -- the circuit breaker in a real sweep (local Ray, the embedded store) -----------------------------------


def _driver(tmp_path, monkeypatch, name: str, study: dict, trial: dict | None = None, cache_dir: str | None = None,
            storage: str | None = None):
    import io

    from sweep.run.driver import Driver
    from sweep.spec import load
    from tests.sweep_fixtures import tiny_spec, write_spec

    monkeypatch.setenv(st.ENV_STORAGE, storage or f"journal:{tmp_path / 'j.log'}")
    monkeypatch.setenv("SWEEP_ARTIFACTS", str(tmp_path / "art"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    spec = write_spec(tmp_path, name, tiny_spec(cache_dir, study=study, **({"trial": trial} if trial else {})))
    return Driver(load(spec), out=io.StringIO(), poll_s=0.2)


def test_on_a_cluster_the_driver_waits_for_nodes_up_to_infra_wait_s(tmp_path):
    # The driver's own steps beside a cluster whose nodes come and go: in a process of its own (the scenario's
    # asserts are this test's), so that no Ray driver runs in the pytest process.
    proc = subprocess.run([sys.executable, "-m", "tests.ray_scenarios", "infra_wait", str(tmp_path)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (proc.stdout + proc.stderr)[-6000:]


def _child_driver(spec, env: dict[str, str], *assignments: str, poll_s: float = 0.2,
                  timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The spec's driver in a process of its own (tests.driver_child), with the module settings given."""
    cmd = [sys.executable, "-m", "tests.driver_child", str(spec), "--poll-s", str(poll_s)]
    for a in assignments:
        cmd += ["--set", a]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_a_sweep_whose_trials_all_fail_alike_stops_before_the_study_is_spent(tmp_path, monkeypatch, ray_cluster):
    from sweep.run.driver import EXIT_STOPPED
    from tests.sweep_fixtures import head_env

    # Every trainer dies at import: each trial crashes, the same way.
    d = _driver(tmp_path, monkeypatch, "breaker", {"n_trials": 20, "concurrency": 1, "seed": 0,
                                                   "max_failures_in_a_row": 3},
                {"budget_s": 2, "eval_timeout_s": 5, "eval_fractions": [0.5], "trainer": "sweep.no_such_trainer"})
    spec = d.spec.path
    url = f"journal:{tmp_path / 'j.log'}"
    run = _child_driver(spec, head_env(ray_cluster, url, tmp_path / "art"))
    rc, log = run.returncode, run.stdout
    assert rc == EXIT_STOPPED, log + run.stderr[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("sweep stopped: circuit breaker: 3 trials in a row ended FAIL (crash)"), log
    assert "[study] max_failures_in_a_row" in last and last.endswith(f"-m sweep run {spec}"), last
    trials = optuna.load_study(study_name="breaker", storage=st.open_storage(url)).get_trials()
    ran = [t for t in trials if t.state != TrialState.WAITING]
    assert len(ran) == 3 and all(t.user_attrs["fail_kind"] == "crash" for t in ran), log
    assert sum(counts(t) for t in trials) == 1  # the study is far from spent: resume once the cause is fixed


def _proxy(url: str, port: int) -> subprocess.Popen[bytes]:
    """Optuna's gRPC storage proxy in front of ``url`` on ``port``: the only way this sweep reaches its store."""
    import os

    env = {**os.environ, st.ENV_STORAGE: url}
    env.pop(st.ENV_PROXY, None)
    return subprocess.Popen([sys.executable, "-m", "sweep.store", "proxy", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


@pytest.mark.slow
def test_the_driver_waits_out_a_store_outage_longer_than_its_retries(tmp_path, monkeypatch, data_cache,
                                                                       ray_cluster):
    import socket
    import threading
    import time

    from tests.sweep_fixtures import head_env, load_trials, pg_available, pg_database

    if not pg_available():
        pytest.skip("PostgreSQL on 127.0.0.1:5432 is not running")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The driver's shorter schedule: each storage call tries 3 times (about 1 s, not 12 to 24), and its
    # patience (sweep.store.patience) gives up after 2 s, not 300. An outage of outage_s outlasts both, so
    # what is left of it is the driver's to wait out, launching nothing, up to infra_wait_s.
    outage_s = 8
    settings = ("sweep.run.driver:STORE_WAIT_S=2.0", "sweep.store.retry:ATTEMPTS=3")
    with pg_database() as pg:
        st.open_storage(pg).engine.dispose()  # the schema, as a driver's first open makes it
        proxy = _proxy(pg, port)
        try:
            url = f"grpc://127.0.0.1:{port}"
            d = _driver(tmp_path, monkeypatch, "outage", {"n_trials": 2, "concurrency": 1, "seed": 0},
                        {"budget_s": 3, "startup_allowance_s": 30, "eval_timeout_s": 20, "eval_fractions": [0.5],
                         "heartbeat_s": 1, "stale_after_s": 60}, cache_dir=data_cache, storage=url)
            wait_for(lambda: proxy.poll() is None and _listening(port), 60, what="the proxy")
            outage: dict[str, float] = {}

            def cut() -> None:  # once trial 0 runs: the store away for outage_s
                nonlocal proxy
                wait_for(lambda: [t for t in load_trials(pg, "outage", missing_ok=True)
                                   if t.state.name == "RUNNING"], 120,
                         what="a trial running")
                proxy.kill()
                proxy.wait()
                outage["t0"] = time.time()
                time.sleep(outage_s)
                proxy = _proxy(pg, port)
                outage["t1"] = time.time()

            th = threading.Thread(target=cut, daemon=True)
            th.start()
            run = _child_driver(d.spec.path, head_env(ray_cluster, url, tmp_path / "art"), *settings)
            th.join(timeout=120)
        finally:
            proxy.kill()
            proxy.wait()
        log = run.stdout
        assert run.returncode == 0 and "t1" in outage, log + run.stderr[-3000:]
        assert "store: unreachable (" in log and "store: reachable again after" in log, log
        trials = load_trials(pg, "outage")
        assert sum(counts(t) for t in trials) == 2 and not [t for t in trials if not t.state.is_finished()], log


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
