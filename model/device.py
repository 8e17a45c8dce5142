"""Which device a run trains on, and the process-group backend and autocast dtype that go with it.

Neuron is PyTorch's native Neuron backend (device "neuron", process group "neuron"), present only where
torch-neuronx is installed on Trainium hardware; `neuron_available` (from kernels.neuron, shared with the
kernels' own choice) is the one check for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.neuron import neuron_available

TRN2_CHIP_BF16_FLOPS = 667e12  # dense BF16 per Trainium2 chip (AWS; docs/competition.md)
CUDA_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense BF16, NVIDIA datasheets


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    kind: str  # "neuron", "cuda" or "cpu"
    backend: str  # process-group backend
    autocast_dtype: torch.dtype | None  # None: train in float32
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def synchronize(self) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.kind == "neuron":
            torch.neuron.synchronize()

    def autocast(self):
        if self.autocast_dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def peak_flops(self) -> float | None:
        """Dense bf16 peak of the accelerators this run holds, for model-FLOPs utilisation; None on the CPU.

        A trn2 run holds whole chips: ranks x logical cores per rank (NEURON_LOGICAL_NC_CONFIG, default 2)
        out of 8 physical cores per chip, rounded up.
        """
        if self.kind == "neuron":
            lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", 2))
            chips = -(-self.world_size * lnc // 8)
            return TRN2_CHIP_BF16_FLOPS * chips
        if self.kind == "cuda":
            name = torch.cuda.get_device_name(self.device)
            peak = next((v for k, v in CUDA_BF16_FLOPS.items() if k in name), None)
            return peak * self.world_size if peak else None
        return None

    def peak_memory_bytes(self) -> int:
        if self.kind == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def pick_kind(requested: str = "auto") -> str:
    if requested not in ("auto", "neuron", "cuda", "cpu"):
        raise ValueError(f"device must be auto, neuron, cuda or cpu, got {requested!r}")
    if requested != "auto":
        return requested
    if neuron_available():
        return "neuron"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def device_index(kind: str, local_rank: int) -> int | None:
    """The device index this process trains on: the local rank, on CUDA and on Neuron alike.

    CUDA: one process per GPU, all GPUs visible. Neuron: each process sees only its own NeuronCore, yet once
    the ``neuron`` process group exists TorchNeuron numbers the PyTorch device by the local rank (it sets the
    local device start index to LOCAL_RANK, and an allocation on a lower index raises "Attempted to access
    device that doesn't attach to this process"; docs/neuron.md, "Runtime, ranks and devices"). Alone, the
    local rank is 0, TorchNeuron's default device.
    """
    return local_rank if kind in ("cuda", "neuron") else None


BACKENDS = {"neuron": "neuron", "cuda": "nccl", "cpu": "gloo"}
AUTOCAST = {"neuron": torch.bfloat16, "cuda": torch.bfloat16, "cpu": None}


def setup(requested: str = "auto") -> Runtime:
    """Pick the device and, under torchrun (WORLD_SIZE > 1), join the process group."""
    kind = pick_kind(requested)
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if kind == "cuda":
        device = torch.device("cuda", device_index(kind, local_rank))
        torch.cuda.set_device(device)
    elif kind == "neuron":
        device = torch.device("neuron", device_index(kind, local_rank))
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=BACKENDS[kind])
    return Runtime(device, kind, BACKENDS[kind], AUTOCAST[kind], rank, local_rank, world_size)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
