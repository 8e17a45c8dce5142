"""The driver on Ray's local autoscaling cluster (the fake multi-node provider), from zero worker nodes.

A study that needs 3 slots, ``concurrency = "auto"``, on a cluster whose head has no CPU and whose
autoscaler may start up to 3 one-CPU workers: the driver asks the autoscaler for 3 trials' resources,
its slots grow as the workers join, and 3 trials run at once. Concurrency is measured from the trials'
recorded start and end times; each trainer waits at a rendezvous (:mod:`tests.rendezvous_trainer`)
until 3 are up, so the trials overlap exactly when the driver really ran 3 at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from sweep.run import liveness
from sweep.run.autoscale import bundle, describe, fitting
from sweep.run.outcome import counts
from sweep.spec import load
from tests.autoscaling_cluster import FakeCluster, autoscaling_cluster
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
TRIAL = {"budget_s": 2, "startup_allowance_s": 60, "eval_timeout_s": 20, "eval_fractions": [0.5],
         "heartbeat_s": 1, "stale_after_s": 30, "stop_grace_s": 3}


@pytest.fixture(scope="module")
def cluster() -> Iterator[FakeCluster]:
    with autoscaling_cluster(NODE_TYPES, max_workers=WORKERS) as c:
        yield c


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at the same instant)."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    open_, most = 0, 0
    for _, step in edges:
        open_ += step
        most = max(most, open_)
    return most


def spans(trials: list[Any]) -> list[tuple[float, float]]:
    """Each finished trial's run on its node: the supervisor's start mark to the trial's completion."""
    return [(liveness.started_at(t), t.datetime_complete.timestamp()) for t in trials
            if liveness.started_at(t) is not None and t.datetime_complete is not None]


def standing_request(c: FakeCluster) -> Any:
    """The autoscaler request stored in the cluster now, read by a client of its own."""
    code = ("import json, ray\nfrom ray.experimental import internal_kv\nray.init(log_to_driver=False, "
            "logging_level='ERROR')\nraw = internal_kv._internal_kv_get('autoscaler_resource_request')\n"
            "print(json.dumps(None if raw is None else json.loads(raw)))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **c.env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_study_reaches_its_concurrency_from_zero_workers(cluster, tmp_path, data_cache):
    storage = f"journal:{tmp_path / 'journal.log'}"
    trial = {**TRIAL, "trainer": "tests.rendezvous_trainer",
             "env": {RENDEZVOUS: f"{tmp_path / 'rendezvous'}:{WORKERS}:45"}}
    spec = write_spec(tmp_path, "scale", tiny_spec(
        data_cache, study={"n_trials": WORKERS, "concurrency": "auto", "seed": 0}, trial=trial,
        **{"params.depth": {"type": "int", "low": 1, "high": 1}, "params.model_dim": {"type": "int", "low": 32,
                                                                                       "high": 32}}))
    env = {**sweep_env(storage, tmp_path / "art"), **cluster.env}  # sweep_env drops RAY_ADDRESS
    run = subprocess.run(sweep_cmd("run", str(spec)), env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    log = run.stdout + run.stderr[-3000:]
    assert run.returncode == 0, log
    trials = load_trials(storage, "scale")
    assert sum(counts(t) for t in trials) == WORKERS and all(t.state.name == "COMPLETE" for t in trials), log
    assert most_at_once(spans(trials)) == WORKERS, f"{spans(trials)}\n{log}"
    assert "1 trial slot(s)" in log and f"autoscaler: asked for {WORKERS} x CPU=1" in log, log
    assert f"-> {WORKERS} (nodes joined" in log, log  # the slots followed the nodes up
    assert standing_request(cluster) == [], log  # withdrawn at the end
    wait_for(lambda: not processes_with(str(tmp_path / "art")), 30, what="the sweep's trainers to be gone")


def test_bundles_and_fitting_follow_the_spec(tmp_path):
    neuron = load(write_spec(tmp_path, "n", tiny_spec(**{"trial.resources": {"num_cpus": 1, "neuron_cores": 4}})))
    assert bundle(neuron) == {"CPU": 1.0, "neuron_cores": 4.0}
    assert fitting({"CPU": 16.0, "neuron_cores": 8.0}, bundle(neuron)) == 2
    assert fitting({"CPU": 16.0}, bundle(neuron)) == 0  # a head without NeuronCores holds no trial
    assert describe({"CPU": 3.0}, {"CPU": 1.0, "GPU": 1.0}) == "CPU=3, GPU=0"


def test_max_concurrency_goes_with_auto_only(tmp_path):
    from sweep.spec import SpecError

    auto = load(write_spec(tmp_path, "a", tiny_spec(study={"n_trials": 4, "concurrency": "auto",
                                                          "max_concurrency": 2})))
    assert auto.concurrency is None and auto.max_concurrency == 2
    with pytest.raises(SpecError, match="study.max_concurrency"):
        load(write_spec(tmp_path, "b", tiny_spec(study={"n_trials": 4, "concurrency": 2, "max_concurrency": 2})))
    with pytest.raises(SpecError, match="study.max_concurrency"):
        load(write_spec(tmp_path, "c", tiny_spec(study={"n_trials": 4, "max_concurrency": 0})))
