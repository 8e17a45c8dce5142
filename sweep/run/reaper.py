"""Killing every process of a trial, and a watchdog that does it if the supervisor dies.

Trainers run in their own session so one signal reaches the whole group, but torchrun starts each
rank in a session of its own, and a rank whose torchrun died is re-parented away from the tree. So
every process of a trial also carries ``SWEEP_TRIAL_TOKEN=<uuid>`` in its environment, which every
descendant inherits whatever its session or parent; :func:`kill_trial` signals the group and then
every process whose initial environment holds the token.

``python -m sweep.run.reaper FD PGID TOKEN DEADLINE``: the supervisor (a Ray worker) can be SIGKILLed,
OOM-killed or torn down with its driver, and then its ``finally`` never runs, while an orphaned
Neuron process keeps its cores. The reaper detaches (double fork, so Ray's cleanup of a dead
worker's children does not take it first) and watches a pipe whose write end only the supervisor
holds: ``done`` means the supervisor cleaned up itself; end-of-file without it means the supervisor
died, so the trial's processes get SIGKILL. Past DEADLINE (unix time) they are killed regardless,
a last line of defence for a supervisor that is alive but stuck.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from pathlib import Path

TOKEN_VAR = "SWEEP_TRIAL_TOKEN"


def tagged_pids(token: str) -> list[int]:
    """Live processes whose environment carries this trial's token (zombies have none)."""
    needle = f"{TOKEN_VAR}={token}".encode()
    me = os.getpid()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def kill_trial(pgid: int | None, token: str | None, sig: int = signal.SIGKILL, rounds: int = 5) -> int:
    """Signal the trial's process group and every process carrying its token; return how many."""
    n = 0
    if pgid is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
            n += 1
    if not token:
        return n
    for _ in range(rounds if sig == signal.SIGKILL else 1):
        pids = tagged_pids(token)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
                n += 1
        if sig == signal.SIGKILL:
            time.sleep(0.05)  # a process forked mid-scan shows up in the next round
    return n


def watch(fd: int, deadline: float) -> str:
    """Block until the supervisor says done, dies, or the deadline passes; return which."""
    buf = b""
    while True:
        remaining = deadline - time.time()
        if remaining <= 0:
            return "deadline"
        ready, _, _ = select.select([fd], [], [], min(remaining, 60.0))
        if not ready:
            continue
        chunk = os.read(fd, 64)
        if not chunk:
            return "done" if b"done" in buf else "orphaned"
        buf += chunk


def main(argv: list[str]) -> int:
    fd, pgid, token, deadline = int(argv[0]), int(argv[1]), argv[2], float(argv[3])
    if os.fork() > 0:
        os._exit(0)
    if watch(fd, deadline) != "done":
        kill_trial(pgid, token)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
