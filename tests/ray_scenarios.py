"""Scenarios that drive a Driver's own steps against a Ray cluster they build, run in a process of their own.

The pytest process never connects to Ray (tests.ray_head says why), so a test that needs the driver's
internals beside a cluster it changes (nodes added and removed) runs the whole scenario here:
``python -m tests.ray_scenarios NAME DIR``. Its asserts are the test's: a failed one exits 1 with its
traceback on stderr, which the calling test shows; success prints ``ok`` last.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from pathlib import Path


def _driver(directory: Path, name: str, study: dict, trial: dict | None = None):
    from sweep import store as st
    from sweep.run.driver import Driver
    from sweep.spec import load
    from tests.sweep_fixtures import tiny_spec, write_spec

    os.environ[st.ENV_STORAGE] = f"journal:{directory / 'j.log'}"
    os.environ["SWEEP_ARTIFACTS"] = str(directory / "art")
    os.environ.pop("RAY_ADDRESS", None)
    spec = write_spec(directory, name, tiny_spec(None, study=study, **({"trial": trial} if trial else {})))
    return Driver(load(spec), out=io.StringIO(), poll_s=0.2)


def infra_wait(directory: Path) -> None:
    """On a cluster (a head that runs no trial), the driver waits for a node up to ``infra_wait_s``: it launches
    nothing while none can hold a trial, goes on when one is back, and stops in one line when the wait runs out."""
    import ray
    from ray.cluster_utils import Cluster

    from sweep.run import driver as drv
    from tests.sweep_fixtures import wait_for

    drv.PROBE_EVERY_S = 0.0
    d = _driver(directory, "waits", {"n_trials": 2, "concurrency": 1, "infra_wait_s": 3})
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        worker = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, namespace="sweep-health", log_to_driver=False)
        d.open_study()
        d.connect_ray()
        assert not d.watch.local and d.check_ray()
        t = d.study.ask()
        assert d.lost_to_infra(t.number, t._trial_id, "lost to the infrastructure: its node died")
        cluster.remove_node(worker)
        wait_for(lambda: d.watch.fits({"CPU": 1.0}) is False, 60, what="the node to be gone")
        assert not d.check_ray()  # no node can hold a trial: launch nothing, wait
        assert "waiting up to 3 s for nodes ([study] infra_wait_s)" in d.out.getvalue()
        cluster.add_node(num_cpus=1)
        wait_for(d.check_ray, 60, what="the driver to launch again")
        assert "nodes are back" in d.out.getvalue()
        d.lost_to_infra(d.study.ask().number, d.study.get_trials()[-1]._trial_id, "lost again")
        for n in list(cluster.worker_nodes):
            cluster.remove_node(n)
        try:
            wait_for(lambda: d.check_ray() and False, 60, what="the wait to run out")
        except drv.SweepStopped as e:
            assert str(e).startswith("no live Ray node can hold a trial for 3 s ([study] infra_w"), str(e)
        else:
            raise AssertionError("the driver never stopped waiting for nodes")
    finally:
        ray.shutdown()
        cluster.shutdown()
        _forget_cluster(cluster.address)


def _forget_cluster(address: str) -> None:
    """Ray's head writes its address where a later ``ray.init()`` without one would join it; a test's cluster
    that is gone must not be joined by the next local Ray of this machine."""
    current = Path("/tmp/ray/ray_current_cluster")
    if current.exists() and current.read_text().strip() == address:
        current.unlink()


SCENARIOS: dict[str, Callable[[Path], None]] = {"infra_wait": infra_wait}


def main(argv: list[str]) -> int:
    name, directory = argv
    SCENARIOS[name](Path(directory))
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
