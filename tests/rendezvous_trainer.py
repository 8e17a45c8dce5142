"""The real trainer (``model.train``), held at its start until N trainers of a sweep are up at once.

A spec names it as ``trial.trainer = "tests.rendezvous_trainer"`` and sets
``TRNSWEEP_TEST_RENDEZVOUS = "DIR:N:TIMEOUT_S"`` in ``trial.env``. Each trainer leaves its pid in DIR
and waits until DIR holds N of them (or TIMEOUT_S passes), then trains as ``model.train`` would.
Trials then overlap exactly when the driver really ran N at once, whatever the node start-up times:
a test measures concurrency from the trials' recorded start and end times instead of racing clocks.
When the driver never reaches N, every trainer waits out the timeout and the trials still finish.
"""

from __future__ import annotations

import os
import runpy
import time
from pathlib import Path

ENV = "TRNSWEEP_TEST_RENDEZVOUS"


def rendezvous(spec: str) -> int:
    """Join the rendezvous ``DIR:N:TIMEOUT_S``; the number of trainers seen there when it ended."""
    where, n, timeout_s = spec.rsplit(":", 2)
    d = Path(where)
    d.mkdir(parents=True, exist_ok=True)
    (d / str(os.getpid())).touch()
    end = time.monotonic() + float(timeout_s)
    while (seen := len(list(d.iterdir()))) < int(n) and time.monotonic() < end:
        time.sleep(0.2)
    return seen


if __name__ == "__main__":
    rendezvous(os.environ[ENV])
    runpy.run_module("model.train", run_name="__main__", alter_sys=True)
