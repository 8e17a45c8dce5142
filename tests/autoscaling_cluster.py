"""Ray's local autoscaling cluster (the fake multi-node provider), owned by the test that starts it.

``ray.cluster_utils.AutoscalingCluster`` is what Ray's own tests use, but it cannot run here: its
``start`` and ``shutdown`` run ``ray stop --force`` (every Ray process of the user, other runs' too),
its head takes the default ports (6379 is Redis's here), and the wheel lacks the ``example.yaml`` it
builds its config from. This starts the same thing by hand: a head (``ray start --head``) with
``RAY_FAKE_CLUSTER=1`` and an autoscaling config whose provider is ``fake_multinode``; the autoscaler
then starts and stops worker nodes as processes on this machine. Every process of the cluster runs
with the cluster's own temporary directory on its command line, and :meth:`FakeCluster.shutdown`
signals those processes only, by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.sweep_fixtures import ROOT, processes_with, wait_for

HEAD_TYPE = "ray.head.default"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_config(gcs_address: str, worker_types: Mapping[str, Mapping[str, Any]], max_workers: int,
                   idle_timeout_minutes: float) -> dict[str, Any]:
    """An autoscaling config for the fake provider (the keys of Ray's fake_multi_node/example.yaml)."""
    types: dict[str, Any] = {name: {"node_config": {}, "min_workers": 0, **t} for name, t in worker_types.items()}
    types[HEAD_TYPE] = {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0}
    return {
        "cluster_name": "fake_multinode", "max_workers": max_workers,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs_address},
        "available_node_types": types, "head_node_type": HEAD_TYPE, "auth": {}, "upscaling_speed": 1.0,
        "idle_timeout_minutes": idle_timeout_minutes, "docker": {}, "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [], "file_mounts": {},
        "cluster_synced_files": [], "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
    }


@dataclass
class FakeCluster:
    """A running fake autoscaling cluster: its address, the environment a client needs, its processes."""

    address: str
    temp_dir: Path
    env: dict[str, str]  # RAY_ADDRESS and the cluster's own auth token, for drivers joining it

    def pids(self) -> list[int]:
        """Every live process of this cluster: head, autoscaler, worker nodes and their Ray workers."""
        return processes_with(str(self.temp_dir))

    def raylets(self) -> list[int]:
        return [p for p in self.pids() if "/raylet/raylet " in _cmdline(p)]

    def raylet_above(self, pid: int) -> int | None:
        """The raylet ``pid`` runs under (a trainer -> its supervisor's Ray worker -> the node's raylet)."""
        raylets = set(self.raylets())
        while pid > 1:
            if pid in raylets:
                return pid
            try:
                pid = _parent(pid)
            except OSError:
                return None
        return None

    def standing_request(self) -> Any:
        """The autoscaler request stored in the cluster now (v1's key in the GCS), read by a client of its own."""
        code = ("import json, ray\nfrom ray.experimental import internal_kv\nray.init(log_to_driver=False, "
                "logging_level='ERROR')\nraw = internal_kv._internal_kv_get('autoscaler_resource_request')\n"
                "print('REQUEST=' + json.dumps(None if raw is None else json.loads(raw)))")
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **self.env, "PYTHONPATH": str(ROOT)},
                             capture_output=True, text=True, timeout=60, check=True)
        # Ray may print its own warnings (a lagging raylet, say) on the same stdout, before or after.
        line = next(x for x in reversed(out.stdout.splitlines()) if x.startswith("REQUEST="))
        return json.loads(line.removeprefix("REQUEST="))

    def remove_node_of(self, pid: int) -> int:
        """Take away the worker node ``pid`` runs on, as when its instance vanishes: SIGKILL its raylet and
        every process under it (Ray workers, the trial's supervisor and trainer). Returns the raylet's pid."""
        raylet = self.raylet_above(pid)
        assert raylet is not None, f"process {pid} runs on no node of the test cluster"
        for p in [raylet, *descendants(raylet)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        return raylet

    def shutdown(self, grace_s: float = 3.0) -> None:
        """SIGTERM every process of the cluster, SIGKILL what is left after ``grace_s``; remove its files."""
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            with contextlib.suppress(AssertionError):
                wait_for(lambda: not self.pids(), wait, what="the cluster's processes to exit")
        left = self.pids()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        assert not left, f"processes of the test cluster still alive: {left}"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` in the process tree."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(_parent(int(d.name)), []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at the same instant)."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    open_, most = 0, 0
    for _, step in edges:
        open_ += step
        most = max(most, open_)
    return most


def run_spans(trials: list[Any]) -> list[tuple[float, float]]:
    """Each finished trial's time on its node: the supervisor's start mark to the trial's end."""
    from sweep.run import liveness

    return [(liveness.started_at(t), t.datetime_complete.timestamp()) for t in trials
            if liveness.started_at(t) is not None and t.datetime_complete is not None]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@contextlib.contextmanager
def autoscaling_cluster(worker_types: Mapping[str, Mapping[str, Any]], max_workers: int,
                        idle_timeout_minutes: float = 0.1, update_interval_s: float = 1.0) -> Iterator[FakeCluster]:
    """A head without CPUs and an autoscaler that adds ``worker_types`` nodes on demand, from zero.

    ``worker_types``: Ray node types (``resources``, ``max_workers``; ``object_store_memory`` in
    resources sizes a node's store). Nodes inherit this process's environment plus ``PYTHONPATH``
    (the repository), so trials import the code under test.
    """
    ray_cli = Path(sys.executable).with_name("ray")
    temp_dir = Path(tempfile.mkdtemp(prefix="rayas-", dir="/tmp"))  # short: Ray's socket paths live under it
    port = free_port()
    from ray._private.services import get_node_ip_address

    address = f"{get_node_ip_address()}:{port}"
    config = temp_dir / "autoscaling.json"
    config.write_text(json.dumps(cluster_config(address, worker_types, max_workers, idle_timeout_minutes)))
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_FAKE_CLUSTER": "1",
           "AUTOSCALER_UPDATE_INTERVAL_S": f"{update_interval_s:g}", "RAY_USAGE_STATS_ENABLED": "0", **auth}
    env.pop("RAY_ADDRESS", None)
    cmd = [str(ray_cli), "start", "--head", f"--port={port}", f"--autoscaling-config={config}", "--num-cpus=0",
           f"--temp-dir={temp_dir}", "--include-dashboard=false", f"--dashboard-port={free_port()}",
           f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
           "--object-store-memory=80000000", "--disable-usage-stats"]
    cluster = FakeCluster(address, temp_dir, {"RAY_ADDRESS": address, **auth})
    try:
        subprocess.run(cmd, env=env, cwd=ROOT, check=True, capture_output=True, timeout=120)
        yield cluster
    finally:
        cluster.shutdown()

