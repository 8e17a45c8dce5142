"""Validation bits per byte, as the competition defines it; and CORE (model.core), exposed here.

bpb = sum of cross-entropy (nats) over target tokens whose byte length is positive, divided by
ln 2 times the sum of those byte lengths. Special tokens have length 0 and so count in neither sum;
padding targets (-1) are ignored. Sums are reduced over all ranks, so every rank returns the same figure.

When the rows scored are a uniform random sample of a larger set, val_bpb estimates that set's figure;
BpbResult.stderr(population) is the estimate's standard error, from per-row sums kept alongside (the
rows' nats and bytes and their products).
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
    rows: int = 0  # rows with at least one target (padding rows left out)
    row_moments: tuple[float, float, float] = (0.0, 0.0, 0.0)  # sums over rows of nats², nats*bytes, bytes²

    @property
    def val_loss(self) -> float:
        """Mean nats per counted target token."""
        return self.nats / max(self.tokens, 1)

    @property
    def val_bpb(self) -> float:
        return self.nats / (math.log(2) * self.bytes) if self.bytes else float("nan")

    def stderr(self, population: int) -> float:
        """Standard error of val_bpb as an estimate of the bpb of `population` rows, of which the rows
        scored are a uniform random sample without replacement: the ratio estimator's linearised
        variance, (1 - n/N) s² / (n b̄²), s² the sample variance of nats - r * bytes over rows, b̄ the mean
        bytes per row. 0 when every row was scored (the figure is then exact)."""
        n = self.rows
        if n >= population or n < 2 or not self.bytes:
            return 0.0
        r = self.nats / self.bytes
        xx, xy, yy = self.row_moments
        s2 = max(0.0, (xx - 2 * r * xy + r * r * yy) / (n - 1))
        mean_bytes = self.bytes / n
        return math.sqrt((1 - n / population) * s2 / n) / (mean_bytes * math.log(2))


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
    # nats, tokens, bytes, rows, and over rows: nats², nats*bytes, bytes²
    totals = torch.zeros(7, dtype=torch.float64, device=device)
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if autocast is None:
            loss = model(x, y, reduction="none")
        else:
            with autocast:
                loss = model(x, y, reduction="none")
        rows = y.size(0)
        nbytes = torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0).reshape(rows, -1)
        counted = nbytes > 0
        # A mask, not an index: static shapes.
        row_nats = (loss.double().reshape(rows, -1) * counted).sum(1)
        row_bytes = nbytes.sum(1).double()
        totals[0] += row_nats.sum()
        totals[1] += counted.sum()
        totals[2] += row_bytes.sum()
        totals[3] += (y.reshape(rows, -1) >= 0).any(1).sum()
        totals[4] += (row_nats * row_nats).sum()
        totals[5] += (row_nats * row_bytes).sum()
        totals[6] += (row_bytes * row_bytes).sum()
    if dist.is_initialized():
        dist.all_reduce(totals)
    model.train(was_training)
    nats, tokens, nbytes, rows, xx, xy, yy = totals.tolist()
    return BpbResult(nats=nats, tokens=int(tokens), bytes=int(nbytes), rows=int(rows), row_moments=(xx, xy, yy))

