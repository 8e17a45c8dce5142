"""Validation bits per byte, as the competition defines it; and CORE (model.core), exposed here.

bpb = sum of cross-entropy (nats) over target tokens whose byte length is positive, divided by
ln 2 times the sum of those byte lengths. Special tokens have length 0 and so count in neither sum;
padding targets (-1) are ignored. Sums are reduced over all ranks, so every rank returns the same figure.

final_val_bpb gives a run's result-record fields: it scores the rows the competition's evaluate_bpb
scores (model.data.scoring_set). When the rows scored are a uniform random sample of those, val_bpb
estimates their figure; BpbResult.stderr(population) is the estimate's standard error, from
per-row sums kept alongside (the rows' nats and bytes and their products).

Scoring is made cheap without changing which tokens count or their sums beyond float rounding: inference
mode (no autograd bookkeeping; on the CPU the softcapped cross-entropy then runs a chunk of logits at a time,
kernels.ops.scoring_cross_entropy), and consecutive batches joined into wider ones (eval_batch_rows, bounded
by a memory estimate). Precision is the caller's autocast: the final val_bpb's is the training's; the
pruning evaluations may use bfloat16 on the CPU (pruning_autocast), within 1e-4 of float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from model import collective
from model.core import CoreResult, Task, evaluate_core, load_bundle
from model.data import scoring_set, validation_batches

__all__ = ["BpbResult", "CoreResult", "Task", "eval_batch_rows", "evaluate_bpb", "evaluate_core", "final_val_bpb",
           "load_bundle", "pruning_autocast", "pruning_batches", "widen"]


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


# Memory an evaluation batch may take: a share of the accelerator's free memory. The CPU keeps the training
# batch: on a quiet 2-core machine, widening to 80 rows was slower than 8 (2.9 s against 2.5 s per 32k tokens,
# bench/eval_bench.py), its caches favouring the small batch; a budget passed in still widens there.
EVAL_MEMORY_FRACTION = 0.25


def eval_bytes_per_row(config: Any, seq_len: int, logit_copies: int = 4) -> int:
    """An upper estimate of the bytes one row of `seq_len` tokens needs in an inference forward, float32
    throughout: `logit_copies` copies of the logits (the plain softcapped cross-entropy holds the logits, the
    capped ones and their log-softmax at once; the CPU's chunked one only the first) plus the widest moment
    of a block (residual, q/k/v, attention scores in case the backend materialises them, the MLP's hidden
    twice) and the targets' bookkeeping."""
    block = (6 * config.model_dim + 2 * config.mlp_dim) * seq_len + config.n_head * seq_len * seq_len
    return 4 * (logit_copies * config.vocab_size * seq_len + block) + 8 * seq_len


def eval_batch_rows(config: Any, seq_len: int, batch_size: int, device: torch.device,
                    budget_bytes: int | None = None) -> int:
    """The widest evaluation batch (rows, a multiple of batch_size) whose estimated activations fit the
    memory budget: EVAL_MEMORY_FRACTION of the accelerator's free memory on CUDA. The CPU keeps batch_size
    unless a budget is given (measured slower wider), and so do other devices (Neuron): their graphs are
    compiled per shape, and the training's is compiled already."""
    if device.type not in ("cpu", "cuda"):
        return batch_size
    if budget_bytes is None:
        if device.type == "cpu":
            return batch_size
        free, _ = torch.cuda.mem_get_info(device)
        budget_bytes = int(free * EVAL_MEMORY_FRACTION)
    rows = budget_bytes // eval_bytes_per_row(config, seq_len, 1 if device.type == "cpu" else 4)
    return max(batch_size, rows // batch_size * batch_size)


def pruning_autocast(device: torch.device, train_dtype: torch.dtype | None) -> Any:
    """The precision of the intermediate (pruning) evaluations: the training's where it has an autocast dtype;
    on a CPU that computes bfloat16 natively (AVX512-BF16/AMX) bfloat16, which moved val_bpb by 2-3e-5 in
    bench/eval_bench.py and the tests (1e-4 allowed) at over twice the speed; else None (float32). The final
    val_bpb keeps the training's precision: it is the figure the scorer's own loop gives, to float rounding."""
    if train_dtype is not None:
        return torch.autocast(device.type, dtype=train_dtype)
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    if device.type == "cpu" and native():
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return None


Batch = tuple[torch.Tensor, torch.Tensor]


def widen(batches: Iterable[Batch], rows: int) -> Iterator[Batch]:
    """Consecutive (x, y) batches joined along the rows, up to `rows` rows each (0: as given). Every row is
    scored on its own, so the sums over rows are unchanged."""
    group: list[Batch] = []
    held = 0
    for x, y in batches:
        if group and rows and held + x.size(0) > rows:
            yield _joined(group)
            group, held = [], 0
        group.append((x, y))
        held += x.size(0)
        if not rows:
            yield _joined(group)
            group, held = [], 0
    if group:
        yield _joined(group)


def _joined(group: list[Batch]) -> Batch:
    if len(group) == 1:
        return group[0]
    return torch.cat([x for x, _ in group]), torch.cat([y for _, y in group])


def evaluate_bpb(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    token_bytes: torch.Tensor,
    device: torch.device,
    autocast=None,
    batch_rows: int = 0,
    fast: bool = True,
) -> BpbResult:
    """Score `model` on fixed (x, y) batches; `token_bytes[id]` is the UTF-8 length of token id. batch_rows
    > 0 joins consecutive batches into wider ones of up to that many rows (eval_batch_rows picks it).
    fast=False scores as the scorer's own loop does, under no_grad with the model's plain cross-entropy: the
    yardstick the fast path is held to (1e-4 by test, float rounding in practice) and measured against."""
    batches = list(batches)
    was_training = model.training
    model.eval()
    if batches and hasattr(model, "grow_rotary"):
        # Grown here, not under inference mode: tables made there could not serve a later training step.
        model.grow_rotary(max(x.size(1) for x, _ in batches))
    try:
        with torch.inference_mode() if fast else torch.no_grad():
            totals = _score(model, widen(batches, batch_rows), token_bytes, device, autocast).tolist()
    finally:
        model.train(was_training)
    if dist.is_initialized():  # model.collective adds them over ranks (a NeuronCore holds no float64)
        totals = collective.sum_floats(totals, device)
    nats, tokens, nbytes, rows, xx, xy, yy = totals
    return BpbResult(nats=nats, tokens=int(tokens), bytes=int(nbytes), rows=int(rows), row_moments=(xx, xy, yy))


def _score(model: torch.nn.Module, batches: Iterable[Batch], token_bytes: torch.Tensor, device: torch.device,
           autocast: Any) -> torch.Tensor:
    """nats, tokens, bytes, rows, and over rows: nats², nats*bytes, bytes²; float64 on the host.

    The device only runs the model; the totals are float64 on the host, where the per-token losses are
    summed exactly as before (a NeuronCore holds no float64)."""
    token_bytes = token_bytes.cpu()
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
    return totals


def pruning_batches(ds: Any, batch_size: int, seq_len: int, n_tokens: int, span_tokens: int, rank: int = 0,
                    world_size: int = 1, same_on_all_ranks: Any = None) -> list[Batch]:
    """The intermediate (pruning) evaluations' batches: a fixed uniform sample of n_tokens // seq_len rows of
    the first span_tokens // seq_len (the final evaluation's span, at the training's seq_len), the same in
    every run, rather than the first rows, which stand for whatever text the shard opens with. On the kit's
    data, or when the span is no wider, the first rows (model.data.validation_batches)."""
    if getattr(ds, "is_kit", False) or span_tokens <= n_tokens:
        return validation_batches(ds, batch_size, seq_len, n_tokens, rank, world_size,
                                  same_on_all_ranks=same_on_all_ranks)
    return scoring_set(ds, batch_size, seq_len, span_tokens, max(1, n_tokens // seq_len), 0, rank, world_size,
                       same_on_all_ranks=same_on_all_ranks).batches


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
        if ds.eval_seq_len and hasattr(model, "grow_rotary"):
            model.grow_rotary(ds.eval_seq_len)  # as evaluate_bpb does, before inference mode
        with torch.inference_mode():  # its batch size stays: the rows it scores depend on it
            bpb, seen = ds.evaluate(model, batch_size, device, autocast)
        return {"val_bpb": bpb, "val_loss": seen["nats"] / max(seen["tokens"], 1), "val_tokens": seen["tokens"],
                "val_bytes": seen["bytes"], "val_rows": seen["rows"], "val_population_rows": seen["rows"],
                "val_seq_len": ds.eval_seq_len, "val_bpb_stderr": 0.0}
    rows = eval_batch_rows(model.config, scoring.seq_len, batch_size, device) if hasattr(model, "config") else 0
    res = evaluate_bpb(model, scoring.batches, ds.token_bytes, device, autocast, rows)
    return {"val_bpb": res.val_bpb, "val_loss": res.val_loss, "val_tokens": res.tokens, "val_bytes": res.bytes,
            "val_rows": res.rows, "val_population_rows": scoring.population, "val_seq_len": scoring.seq_len,
            "val_bpb_stderr": res.stderr(scoring.population)}
