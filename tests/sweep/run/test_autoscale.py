"""The driver on Ray's local autoscaling cluster (the fake multi-node provider), from zero worker nodes.

A study that needs 3 slots, ``concurrency = "auto"``, on a cluster whose head has no CPU and whose
autoscaler may start up to 3 one-CPU workers: the driver asks the autoscaler for 3 trials' resources,
its slots grow as the workers join, and 3 trials run at once. Concurrency is measured from the trials'
recorded start and end times; each trainer waits at a rendezvous (:mod:`tests.rendezvous_trainer`)
until 3 are up, so the trials overlap exactly when the driver really ran 3 at once. Once they are up,
the worker node under one of them is taken away: that trial is lost to the infrastructure, re-run
with its parameters and not counted, and the study still ends with exactly 3 counted trials.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sweep.run import liveness
from sweep.run.autoscale import Capacity, bundle, describe, fitting
from sweep.run.outcome import ATTR_RERUN_OF, counts, lost_to_infra
from sweep.spec import SpecError, load
from tests.autoscaling_cluster import FakeCluster, autoscaling_cluster, most_at_once, run_spans
from tests.rendezvous_trainer import ENV as RENDEZVOUS
from tests.sweep_fixtures import (
    ROOT,
    load_trials,
    processes_with,
    sweep_cmd,
    sweep_env,
    tiny_spec,
    wait_for,
    write_spec,
)

pytestmark = [pytest.mark.slow]

WORKERS = 3
NODE_TYPES = {"cpu1": {"resources": {"CPU": 1, "object_store_memory": 80 * 1024**2}, "max_workers": WORKERS}}
TRIAL = {"budget_s": 2, "startup_allowance_s": 120, "eval_timeout_s": 20, "eval_fractions": [0.5],
         "heartbeat_s": 1, "stale_after_s": 30, "stop_grace_s": 3}
TINY = {"params.depth": {"type": "int", "low": 1, "high": 1},
        "params.model_dim": {"type": "int", "low": 32, "high": 32}}


@pytest.fixture(scope="module")
def cluster() -> Iterator[FakeCluster]:
    with autoscaling_cluster(NODE_TYPES, max_workers=WORKERS) as c:
        yield c


def trial_of(pid: int) -> int:
    """The trial number a trainer process runs (its --out-dir ends in the number)."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(Path(args[args.index(b"--out-dir") + 1].decode()).name)


def test_study_reaches_its_concurrency_from_zero_workers_and_a_lost_node_costs_no_trial(cluster, tmp_path,
                                                                                         data_cache):
    storage, rendezvous = f"journal:{tmp_path / 'journal.log'}", tmp_path / "rendezvous"
    trial = {**TRIAL, "trainer": "tests.rendezvous_trainer", "env": {RENDEZVOUS: f"{rendezvous}:{WORKERS}:90"}}
    spec = write_spec(tmp_path, "scale", tiny_spec(
        data_cache, study={"n_trials": WORKERS, "concurrency": "auto", "seed": 0}, trial=trial, **TINY))
    env = {**sweep_env(storage, tmp_path / "art"), **cluster.env}  # sweep_env drops RAY_ADDRESS
    log_path = tmp_path / "driver.log"
    with open(log_path, "wb") as log_file:
        driver = subprocess.Popen(sweep_cmd("run", str(spec)), env=env, cwd=ROOT, stdout=log_file,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # Every trainer is up at once (each waits for the others): take away the node under one of them.
        pids = wait_for(lambda: len(list(rendezvous.glob("*"))) >= WORKERS and [int(p.name) for p in
                                                                                rendezvous.iterdir()],
                        180, what=f"{WORKERS} trainers up at once")
        victim = trial_of(pids[0])
        cluster.remove_node_of(pids[0])
        rc = driver.wait(timeout=240)
    finally:
        if driver.poll() is None:
            driver.kill()
    log = log_path.read_text(errors="replace")
    assert rc == 0, log

    trials = load_trials(storage, "scale")
    lost = [t for t in trials if lost_to_infra(t)]
    assert [t.number for t in lost] == [victim], log
    (rerun,) = [t for t in trials if t.user_attrs.get(ATTR_RERUN_OF) == victim]
    assert rerun.state.name == "COMPLETE" and rerun.params == lost[0].params, log
    assert sum(counts(t) for t in trials) == WORKERS, log  # the lost trial took nothing from n_trials
    assert all(t.state.name == "COMPLETE" for t in trials if t.number != victim), log
    assert most_at_once(run_spans(trials)) == WORKERS, f"{run_spans(trials)}\n{log}"
    assert "1 trial slot(s)" in log and f"autoscaler: asked for {WORKERS} x CPU=1" in log, log
    assert f"-> {WORKERS} (nodes joined" in log, log  # the slots followed the nodes up
    assert liveness.started_at(rerun) > liveness.started_at(lost[0])
    assert cluster.standing_request() == [], log  # withdrawn at the end
    wait_for(lambda: not processes_with(str(tmp_path / "art")), 30, what="the sweep's trainers to be gone")


def test_an_interrupted_driver_withdraws_its_request(cluster, tmp_path, data_cache):
    storage = f"journal:{tmp_path / 'journal.log'}"
    spec = write_spec(tmp_path, "ctrlc", tiny_spec(
        data_cache, study={"n_trials": 8, "concurrency": "auto", "max_concurrency": 2, "seed": 0}, trial=TRIAL,
        **TINY))
    env = {**sweep_env(storage, tmp_path / "art"), **cluster.env}
    log_path = tmp_path / "driver.log"
    with open(log_path, "wb") as log_file:
        driver = subprocess.Popen(sweep_cmd("run", str(spec)), env=env, cwd=ROOT, stdout=log_file,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: "autoscaler: asked for" in log_path.read_text(errors="replace"), 120,
                 what="the driver's autoscaler request")
        asked = cluster.standing_request()
        driver.send_signal(signal.SIGINT)
        rc = driver.wait(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    log = log_path.read_text(errors="replace")
    assert asked == [{"CPU": 1.0}] * 2, log  # max_concurrency, not n_trials
    assert rc == 1 and "interrupted" in log, log
    assert cluster.standing_request() == [], log
    wait_for(lambda: not processes_with(str(tmp_path / "art")), 30, what="the sweep's trainers to be gone")


def test_a_refused_request_is_a_warning_and_a_local_ray_is_never_asked(tmp_path):
    import ray

    ray.shutdown()  # Ray's SDK refuses every request without a connection: a real refusal
    spec = load(write_spec(tmp_path, "r", tiny_spec(study={"n_trials": 4, "concurrency": 2})))
    lines: list[str] = []
    local = Capacity(spec, cluster=False, say=lines.append)
    local.demand(4)
    local.release()
    assert lines == [] and local.requested is None and local.slots() == 2
    joined = Capacity(spec, cluster=True, say=lines.append)
    joined.demand(4)
    joined.demand(4)  # the same need: not asked again
    joined.release()  # never raises
    assert joined.requested == 0
    assert len(lines) == 2 and "could not ask the autoscaler for 2 trials' resources" in lines[0], lines
    assert "could not withdraw" in lines[1], lines


def test_bundles_and_fitting_follow_the_spec(tmp_path):
    neuron = load(write_spec(tmp_path, "n", tiny_spec(**{"trial.resources": {"num_cpus": 1, "neuron_cores": 4}})))
    assert bundle(neuron) == {"CPU": 1.0, "neuron_cores": 4.0}
    assert fitting({"CPU": 16.0, "neuron_cores": 8.0}, bundle(neuron)) == 2
    assert fitting({"CPU": 16.0}, bundle(neuron)) == 0  # a head without NeuronCores holds no trial
    assert describe({"CPU": 3.0}, {"CPU": 1.0, "GPU": 1.0}) == "CPU=3, GPU=0"


def test_max_concurrency_goes_with_auto_only(tmp_path):
    auto = load(write_spec(tmp_path, "a", tiny_spec(study={"n_trials": 4, "concurrency": "auto",
                                                          "max_concurrency": 2})))
    assert auto.concurrency is None and auto.max_concurrency == 2
    with pytest.raises(SpecError, match="study.max_concurrency"):
        load(write_spec(tmp_path, "b", tiny_spec(study={"n_trials": 4, "concurrency": 2, "max_concurrency": 2})))
    with pytest.raises(SpecError, match="study.max_concurrency"):
        load(write_spec(tmp_path, "c", tiny_spec(study={"n_trials": 4, "max_concurrency": 0})))
