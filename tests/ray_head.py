"""A Ray head of a test's own, in its own processes: the pytest process never connects a Ray driver.

Ray in the pytest process left native threads (its GCS client's I/O thread, gRPC core's) running through the
interpreter's teardown, which once crashed a finished run. Every sweep a test runs therefore runs its driver
in a subprocess (``python -m sweep run``, or :mod:`tests.driver_child` where a test changes the driver's
settings), joined to a head started here by ``ray start --head`` in a session of its own, and stopped by
signalling exactly that session's processes: never ``ray stop``, which signals every Ray on the machine.
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
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).parent / "ray")


@dataclass
class Head:
    address: str  # the GCS, 127.0.0.1:PORT: what RAY_ADDRESS names for a driver
    dashboard: str  # the Jobs API, http://127.0.0.1:PORT ("" without a dashboard)
    env: dict[str, str] = field(default_factory=dict)  # what a process joining it needs: its token
    session: int = 0  # the session id of every process of the head

    def pids(self) -> list[int]:
        return session_members(self.session)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_members(sid: int) -> list[int]:
    """Live processes (zombies excluded) of the session ``sid``: the head and all it started."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(d.name))
    return pids


def stop_session(sid: int) -> None:
    """SIGTERM, then SIGKILL, to every process of the session ``ray start`` opened, and nothing else."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        for pid in session_members(sid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        end = time.monotonic() + wait_s
        while session_members(sid) and time.monotonic() < end:
            time.sleep(0.2)
    left = session_members(sid)
    assert not left, f"ray head processes survived SIGKILL: {left}"


@contextlib.contextmanager
def ray_head(num_cpus: int = 2, dashboard: bool = False, node_env: dict[str, str] | None = None) -> Iterator[Head]:
    """A head of ``num_cpus`` CPUs on loopback with token authentication, as on a cluster (``ray start`` turns
    it on by itself, with a token in ~/.ray/auth_token, unless told; each head here has its own token).
    ``node_env``: the node's own environment beyond this process's (what its workers see, as a cluster node's
    settings)."""
    temp = tempfile.mkdtemp(prefix="rh-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    extra = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env = {**os.environ, **(node_env or {}), **extra, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    port = free_port()
    cmd = [RAY, "start", "--head", "--port", str(port), "--node-ip-address", "127.0.0.1",
           "--num-cpus", str(num_cpus), "--temp-dir", temp, "--disable-usage-stats",
           "--ray-client-server-port", str(free_port()), "--object-store-memory", str(100 * 1024**2),
           "--dashboard-agent-listen-port", str(free_port())]
    dash = ""
    if dashboard:
        dport = free_port()
        cmd += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(dport)]
        dash = f"http://127.0.0.1:{dport}"
    else:
        cmd += ["--include-dashboard", "false"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out[-4000:]
        yield Head(f"127.0.0.1:{port}", dash, extra, proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stop_session(proc.pid)  # its address file lies in its temp dir (ray._common.utils), removed with it
        shutil.rmtree(temp, ignore_errors=True)


def free_cpus(head: Head, timeout: float = 30) -> dict[str, float]:
    """Wait (in a driver process of its own) until every CPU of the head is free; its CPU counts."""
    code = ("import json, sys, time, ray\n"
            "ray.init(address=sys.argv[1], log_to_driver=False)\n"
            "end = time.monotonic() + float(sys.argv[2])\n"
            "while True:\n"
            "    free, total = ray.available_resources().get('CPU', 0), ray.cluster_resources().get('CPU', 0)\n"
            "    if free >= total or time.monotonic() > end:\n"
            "        break\n"
            "    time.sleep(0.5)\n"
            "print(json.dumps({'free': free, 'total': total}))\n")
    env = {**os.environ, **head.env, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", code, head.address, str(timeout)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout + 90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
