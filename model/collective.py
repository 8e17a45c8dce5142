"""Small host-side values made the same on every rank, exactly, on any device.

The trainer agrees on its clock, stop requests and data digests once a step, and evaluation adds its
float64 totals over ranks. Those are host values (seconds, codes, 62-bit digests, float64 sums), but the
process group's collectives run on the device, and a NeuronCore holds no float64 (Neuron data types:
FP32/TF32/FP16/BF16/FP8 and 8-32-bit integers) while neuronx-cc downcasts int64 to int32 unless told
otherwise (compiler 2.32.0 notes: --native-int64, --implicit-integer-downcast). So every value travels
as float32 pieces that float32 holds exactly, in one float32 SUM all-reduce (the collective the Neuron
torch.distributed guide shows), each rank filling only its own slot: adding zeros is exact, so every rank
receives every rank's pieces bit for bit and reduces them on the host in float64, as before.

- A float64 is three float32s: hi = fl32(x), mid = fl32(x - hi), lo = x - hi - mid (at most 5 bits), and
  hi + mid + lo rebuilds x exactly in float64 (for |x| within float32's normal range).
- An integer of up to 62 bits is three 21-bit limbs of x + 2^62 (a float32 holds integers below 2^24).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

INT_BIAS = 1 << 62  # ints are sent as x + INT_BIAS, so |x| < 2^62
LIMB_BITS = 21
PIECES = 3


def split_floats(values: Sequence[float]) -> torch.Tensor:
    """(n, 3) float32 pieces whose float64 sum is each value exactly."""
    x = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if bool((torch.isfinite(x) & (x.abs() > torch.finfo(torch.float32).max)).any()):
        raise ValueError(f"{values}: beyond float32's range, which the collective's pieces need")
    hi = x.float().double()
    rest = x - hi  # exact: the rounding error of hi
    mid = rest.float().double()
    lo = rest - mid  # exact, and at most 5 significant bits: float32 holds it
    out = torch.stack([hi, mid, lo], dim=1)
    finite = torch.isfinite(x)  # inf/nan go as they are, in hi alone
    out[~finite] = torch.stack([x, torch.zeros_like(x), torch.zeros_like(x)], dim=1)[~finite]
    return out.float()


def join_floats(pieces: torch.Tensor) -> list[float]:
    """The values :func:`split_floats` split, exactly."""
    p = pieces.double()
    return ((p[..., 0] + p[..., 1]) + p[..., 2]).tolist()


def split_ints(values: Sequence[int]) -> torch.Tensor:
    """(n, 3) float32 limbs of each integer (|x| < 2^62), each below 2^21."""
    rows = []
    for v in values:
        u = int(v) + INT_BIAS
        if not 0 <= u < 1 << (LIMB_BITS * PIECES):
            raise ValueError(f"{v} does not fit the collective's 62-bit integers")
        rows.append([(u >> (LIMB_BITS * k)) & ((1 << LIMB_BITS) - 1) for k in reversed(range(PIECES))])
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), PIECES)


def join_ints(limbs: torch.Tensor) -> list[int]:
    out = []
    for row in limbs.reshape(-1, PIECES).tolist():
        u = 0
        for limb in row:
            u = (u << LIMB_BITS) | int(limb)
        out.append(u - INT_BIAS)
    return out


def _gather(pieces: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Every rank's (n, 3) pieces, as a (world, n, 3) CPU tensor, through one float32 SUM all-reduce."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return pieces.unsqueeze(0)
    slots = torch.zeros(dist.get_world_size(), *pieces.shape, dtype=torch.float32)
    slots[dist.get_rank()] = pieces
    on_device = slots.to(device)
    dist.all_reduce(on_device)  # SUM: each slot is one rank's pieces plus zeros, exactly
    return on_device.cpu()


def gather_floats(values: Sequence[float], device: torch.device) -> list[list[float]]:
    """``values`` of every rank, rank by rank, exactly (float64)."""
    gathered = _gather(split_floats(values), device)
    return [join_floats(gathered[r]) for r in range(gathered.size(0))]


def gather_ints(values: Sequence[int], device: torch.device) -> list[list[int]]:
    """``values`` (integers, |x| < 2^62) of every rank, rank by rank, exactly."""
    gathered = _gather(split_ints(values), device)
    return [join_ints(gathered[r]) for r in range(gathered.size(0))]


def max_floats(values: Sequence[float], device: torch.device) -> list[float]:
    """The elementwise maximum over ranks, as a float64 MAX all-reduce would give it."""
    return [max(column) for column in zip(*gather_floats(values, device), strict=True)]


def sum_floats(values: Sequence[float], device: torch.device) -> list[float]:
    """The elementwise sum over ranks, correctly rounded in float64 (the same on every rank)."""
    return [math.fsum(column) for column in zip(*gather_floats(values, device), strict=True)]
