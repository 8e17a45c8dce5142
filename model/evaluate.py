"""Validation bits per byte, as the competition defines it; and CORE (model.core), exposed here.

bpb = sum of cross-entropy (nats) over target tokens whose byte length is positive, divided by
ln 2 times the sum of those byte lengths. Special tokens have length 0 and so count in neither sum;
padding targets (-1) are ignored. Sums are reduced over all ranks, so every rank returns the same figure.

final_val_bpb gives a run's result-record fields: it scores the rows the competition's evaluate_bpb
scores (model.data.scoring_set). When the rows scored are a uniform random sample of those, val_bpb
estimates their figure; BpbResult.stderr(population) is the estimate's standard error, from
per-row sums kept alongside (the rows' nats and bytes and their products).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from model import collective
from model.core import CoreResult, Task, evaluate_core, load_bundle
from model.data import scoring_set

__all__ = ["BpbResult", "CoreResult", "Task", "evaluate_bpb", "evaluate_core", "final_val_bpb", "load_bundle"]


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
    # The device only runs the model; the totals are float64 on the host, where the per-token losses are
    # summed exactly as before (a NeuronCore holds no float64; model.collective adds them over ranks).
    token_bytes = token_bytes.cpu()
    # nats, tokens, bytes, rows, and over rows: nats², nats*bytes, bytes²
    totals = torch.zeros(7, dtype=torch.float64)
    for x, y in batches:
        x = x.to(device, non_blocking=True)
        if autocast is None:
            loss = model(x, y.to(device, non_blocking=True), reduction="none")
        else:
            with autocast:
                loss = model(x, y.to(device, non_blocking=True), reduction="none")
        y = y.cpu()
        rows = y.size(0)
        nbytes = torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0).reshape(rows, -1)
        counted = nbytes > 0
        # A mask, not an index: static shapes.
        row_nats = (loss.detach().cpu().double().reshape(rows, -1) * counted).sum(1)
        row_bytes = nbytes.sum(1).double()
        totals[0] += row_nats.sum()
        totals[1] += counted.sum()
        totals[2] += row_bytes.sum()
        totals[3] += (y.reshape(rows, -1) >= 0).any(1).sum()
        totals[4] += (row_nats * row_nats).sum()
        totals[5] += (row_nats * row_bytes).sum()
        totals[6] += (row_bytes * row_bytes).sum()
    if dist.is_initialized():
        totals = torch.tensor(collective.sum_floats(totals.tolist(), device), dtype=torch.float64)
    model.train(was_training)
    nats, tokens, nbytes, rows, xx, xy, yy = totals.tolist()
    return BpbResult(nats=nats, tokens=int(tokens), bytes=int(nbytes), rows=int(rows), row_moments=(xx, xy, yy))


def final_val_bpb(
    model: torch.nn.Module, ds: Any, batch_size: int, seq_len: int, n_tokens: int, sample_rows: int,
    eval_seq_len: int, device: torch.device, autocast: Any = None, rank: int = 0, world_size: int = 1,
    same_on_all_ranks: Any = None,
) -> dict[str, Any]:
    """The result record's val_* fields over model.data.scoring_set's rows (the arguments are its): the rows
    the competition's evaluate_bpb scores, or a fixed sample of them, whose standard error val_bpb_stderr
    gives (0 when every row is scored)."""
    scoring = scoring_set(ds, batch_size, seq_len, n_tokens, sample_rows, eval_seq_len, rank, world_size,
                          same_on_all_ranks=same_on_all_ranks)
    if scoring is None:  # a kit that does not say which rows it scores: its own evaluate_bpb, on every rank
        bpb, seen = ds.evaluate(model, batch_size, device, autocast)
        return {"val_bpb": bpb, "val_loss": seen["nats"] / max(seen["tokens"], 1), "val_tokens": seen["tokens"],
                "val_bytes": seen["bytes"], "val_rows": seen["rows"], "val_population_rows": seen["rows"],
                "val_seq_len": ds.eval_seq_len, "val_bpb_stderr": 0.0}
    res = evaluate_bpb(model, scoring.batches, ds.token_bytes, device, autocast)
    return {"val_bpb": res.val_bpb, "val_loss": res.val_loss, "val_tokens": res.tokens, "val_bytes": res.bytes,
            "val_rows": res.rows, "val_population_rows": scoring.population, "val_seq_len": scoring.seq_len,
            "val_bpb_stderr": res.stderr(scoring.population)}
