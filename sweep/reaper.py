"""Kill a trial's process group if its supervisor dies: ``python -m sweep.reaper FD PGID DEADLINE``.

The supervisor (a Ray worker) can be SIGKILLed, OOM-killed or torn down with its driver, and then
its ``finally`` never runs. Trainers live in their own session so that one signal reaches every
rank; nothing else would ever stop them, and an orphaned Neuron process keeps its cores.

The reaper detaches (double fork, so Ray's cleanup of a dead worker's children does not take it
first) and watches a pipe whose write end only the supervisor holds: ``done`` on the pipe means
the supervisor cleaned up itself; end-of-file without it means the supervisor died, so the group
gets SIGKILL. Past DEADLINE (unix time) the group is killed regardless, a last line of defence
for a supervisor that is alive but stuck.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time


def watch(fd: int, pgid: int, deadline: float) -> str:
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
    fd, pgid, deadline = int(argv[0]), int(argv[1]), float(argv[2])
    if os.fork() > 0:
        os._exit(0)
    verdict = watch(fd, pgid, deadline)
    if verdict != "done":
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
