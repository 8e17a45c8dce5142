"""Validation bits per byte, as the competition defines it; and CORE (model.core), exposed here.

bpb = sum of cross-entropy (nats) over target tokens whose byte length is positive, divided by
ln 2 times the sum of those byte lengths. Special tokens have length 0 and so count in neither sum;
padding targets (-1) are ignored. Sums are reduced over all ranks, so every rank returns the same figure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.core import CoreResult, Task, evaluate_core, load_bundle

__all__ = ["BpbResult", "CoreResult", "Task", "evaluate_bpb", "evaluate_core", "load_bundle"]


@dataclass(frozen=True)
class BpbResult:
    nats: float  # summed over counted targets
    tokens: int  # counted targets
    bytes: int

    @property
    def val_loss(self) -> float:
        """Mean nats per counted target token."""
        return self.nats / max(self.tokens, 1)

    @property
    def val_bpb(self) -> float:
        return self.nats / (math.log(2) * self.bytes) if self.bytes else float("nan")


@torch.no_grad()
def evaluate_bpb(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    token_bytes: torch.Tensor,
    device: torch.device,
    autocast=None,
) -> BpbResult:
    """Score `model` on fixed (x, y) batches; `token_bytes[id]` is the UTF-8 length of token id."""
    was_training = model.training
    model.eval()
    token_bytes = token_bytes.to(device)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # nats, tokens, bytes
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if autocast is None:
            loss = model(x, y, reduction="none")
        else:
            with autocast:
                loss = model(x, y, reduction="none")
        y = y.reshape(-1)
        nbytes = torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0)
        counted = nbytes > 0
        totals[0] += (loss.double().reshape(-1) * counted).sum()  # a mask, not an index: static shapes
        totals[1] += counted.sum()
        totals[2] += nbytes.sum()
    if dist.is_initialized():
        dist.all_reduce(totals)
    model.train(was_training)
    nats, tokens, nbytes = totals.tolist()
    return BpbResult(nats=nats, tokens=int(tokens), bytes=int(nbytes))
