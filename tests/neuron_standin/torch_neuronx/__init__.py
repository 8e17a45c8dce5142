"""Stand-in for TorchNeuron's start-up rule on NeuronCores; no device, no torch.

What it mirrors:
- In a distributed run (WORLD_SIZE > 1) TorchNeuron sets NEURON_RT_VISIBLE_CORES to LOCAL_RANK only
  where it is unset, and refuses a process that sees other than exactly one core.
- The Neuron runtime reserves a process's cores until it exits; a second process asking for a
  reserved core fails (Neuron Runtime configuration guide, "NeuronCore allocation"). Reservations are
  lock files under $TORCH_NEURONX_STANDIN_LOCKS (one per core, held while the process lives), checked
  only where that variable is set.

``VISIBLE_CORES`` holds the cores this process got.
"""

from __future__ import annotations

import fcntl
import os

CORES_VAR = "NEURON_RT_VISIBLE_CORES"
LOCKS_VAR = "TORCH_NEURONX_STANDIN_LOCKS"


def _parse(text: str) -> list[int]:
    cores: list[int] = []
    for item in text.split(","):
        lo, _, hi = item.strip().partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def _start() -> list[int]:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        os.environ.setdefault(CORES_VAR, os.environ.get("LOCAL_RANK", "0"))
    visible = os.environ.get(CORES_VAR)
    cores = _parse(visible) if visible else [0]
    if world_size > 1 and len(cores) != 1:
        raise RuntimeError(f"torch_neuronx stand-in: a distributed run needs exactly one NeuronCore per process, "
                           f"rank {os.environ.get('RANK')} sees {CORES_VAR}={visible}")
    locks = os.environ.get(LOCKS_VAR)
    if locks:
        for core in cores:
            handle = open(os.path.join(locks, f"nc{core}.lock"), "a")  # noqa: SIM115 - held until exit
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(f"torch_neuronx stand-in: NeuronCore {core} is already reserved by another "
                                   "process") from None
            _HELD.append(handle)
    return cores


_HELD: list = []
VISIBLE_CORES = _start()
