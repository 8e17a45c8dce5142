"""Fixed-shape evaluation batches from rows, shared by our validation path and the kit's adapter.

    batches = batch_rows(xs, ys, batch_size=B, rank=r, world_size=W, pad_id=bos)
    idx = sample_indices(population=N, n=n)      # the rows a sampled final evaluation scores
    ScoringSet(batches, rows, population, seq_len)

The final val_bpb must be the competition's number: its evaluate_bpb scores a fixed set of rows (the
first EVAL_TOKENS // MAX_SEQ_LEN of its validation stream, at MAX_SEQ_LEN). A ScoringSet is that set,
or a uniform random sample of it: the sample is drawn with a fixed seed, so every trial of a study
scores the same rows, and model.evaluate.BpbResult.stderr(population) gives the estimate's standard
error. The first rows of a best-fit stream are no such sample: the packer fills them with the longest
documents of its buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["IGNORE_INDEX", "SAMPLE_SEED", "ScoringSet", "batch_rows", "sample_indices"]

IGNORE_INDEX = -1
SAMPLE_SEED = 16  # fixed: every run and trial that samples N rows draws the same ones


@dataclass
class ScoringSet:
    """The batches of the final evaluation: `rows` rows out of the scorer's `population`, at `seq_len`."""

    batches: list[tuple[torch.Tensor, torch.Tensor]]
    rows: int
    population: int
    seq_len: int

    @property
    def exact(self) -> bool:
        """True when every row of the population is scored (the figure is then the scorer's own)."""
        return self.rows == self.population


def sample_indices(population: int, n: int) -> np.ndarray:
    """Sorted indices of the rows to score: all of them when n is 0 or at least the population, else n
    drawn uniformly without replacement with SAMPLE_SEED."""
    if n <= 0 or n >= population:
        return np.arange(population)
    return np.sort(np.random.default_rng(SAMPLE_SEED).choice(population, size=n, replace=False))


def batch_rows(
    xs: np.ndarray | torch.Tensor,
    ys: np.ndarray | torch.Tensor,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    pad_id: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) int64 batches of exactly (B, T) for `rank`: batch k holds rows [k*W*B + r*B, k*W*B + (r+1)*B).

    Every rank gets the same number of batches, ceil(rows / (W*B)); rows past the end are padding,
    x = pad_id and y = IGNORE_INDEX. x and y are fresh contiguous tensors.
    """
    xs, ys = torch.as_tensor(xs), torch.as_tensor(ys)
    n_rows, seq_len = xs.shape
    step = world_size * batch_size
    batches = []
    for start in range(0, n_rows, step):
        lo = min(start + rank * batch_size, n_rows)
        hi = min(lo + batch_size, n_rows)
        x = torch.full((batch_size, seq_len), pad_id, dtype=torch.int64)
        y = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.int64)
        x[: hi - lo] = xs[lo:hi]
        y[: hi - lo] = ys[lo:hi]
        batches.append((x, y))
    return batches
