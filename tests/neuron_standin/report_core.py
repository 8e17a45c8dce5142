"""Trainer stand-in for launch tests: import (stand-in) torch_neuronx, record which core this rank holds.

Run as the trainer module (``-m tests.neuron_standin.report_core ... --out-dir DIR``); writes
DIR/rank-RANK.json with the rank, local rank and visible cores, then waits until every rank of the run
has written its file, so all ranks hold their cores at the same time, as trainers do.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch_neuronx


def main() -> int:
    out = Path(sys.argv[sys.argv.index("--out-dir") + 1])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    record = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "cores": torch_neuronx.VISIBLE_CORES}
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    deadline = time.monotonic() + 30
    while len(list(out.glob("rank-*.json"))) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
