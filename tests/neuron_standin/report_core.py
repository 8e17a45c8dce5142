"""Trainer stand-in for launch tests: start as a Neuron trainer does, record which core this rank holds.

Run as the trainer module (``-m tests.neuron_standin.report_core ... --out-dir DIR``): under torchrun it joins
the ``neuron`` process group first (where the stand-in torch_neuronx sets up the runtime, as TorchNeuron
does), then allocates on its own device, ``neuron:LOCAL_RANK``; writes DIR/rank-RANK.json with the rank, local
rank and the cores its runtime reserved, then waits until every rank of the run has written its file, so all
ranks hold their cores at the same time, as trainers do.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch_neuronx


def main() -> int:
    out = Path(sys.argv[sys.argv.index("--out-dir") + 1])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1:
        dist.init_process_group("neuron")
    torch.zeros(1, device=torch.device("neuron", local_rank))
    record = {"rank": rank, "local_rank": local_rank, "cores": list(torch_neuronx.VISIBLE_CORES)}
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    deadline = time.monotonic() + 30
    while len(list(out.glob("rank-*.json"))) < world and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
