"""The trainer's schedules as pure functions of training progress, without torch.

Progress is charged seconds / budget in [0, 1] (model.train). `model.optim` fills its per-step scalars
from these, and the sweep's learning-curve pruner (`sweep.spec.pruners`) integrates the same learning-rate
multiplier, so the schedule the pruner models is the one the trainer runs, written once.
"""

from __future__ import annotations


def lr_multiplier(progress: float, warmup_ratio: float, warmdown_ratio: float, final_lr_frac: float) -> float:
    """Linear warmup, flat, then linear warmdown to final_lr_frac at progress 1."""
    progress = min(max(progress, 0.0), 1.0)
    if warmup_ratio > 0 and progress < warmup_ratio:
        return (progress + 1e-8) / warmup_ratio
    if warmdown_ratio > 0 and progress > 1.0 - warmdown_ratio:
        left = (1.0 - progress) / warmdown_ratio
        return final_lr_frac + (1.0 - final_lr_frac) * left
    return 1.0


def muon_momentum(progress: float, start: float, end: float, warmup_ratio: float) -> float:
    """Muon's momentum: linear from `start` to `end` over the first `warmup_ratio` of the run, then `end`."""
    if warmup_ratio <= 0:
        return end
    frac = min(progress / warmup_ratio, 1.0)
    return start + frac * (end - start)


def weight_decay_multiplier(progress: float) -> float:
    """Muon's weight decay decays linearly from its full value to 0 at progress 1."""
    return 1.0 - min(max(progress, 0.0), 1.0)


def lr_area(progress: float, warmup_ratio: float, warmdown_ratio: float, final_lr_frac: float) -> float:
    """The integral of `lr_multiplier` over [0, progress], exact for its piecewise-linear shape."""
    p = min(max(progress, 0.0), 1.0)
    cuts = sorted({0.0, p, *(x for x in (warmup_ratio, 1.0 - warmdown_ratio) if 0.0 < x < p)})
    # The midpoint rule is exact on each linear piece and never evaluates the jump points.
    return sum((b - a) * lr_multiplier((a + b) / 2, warmup_ratio, warmdown_ratio, final_lr_frac)
               for a, b in zip(cuts, cuts[1:], strict=False))


def lr_drop(progress: float, warmup_ratio: float, warmdown_ratio: float, final_lr_frac: float) -> float:
    """How far the multiplier has annealed below its peak of 1 at `progress`: 0 during warmup."""
    if progress < warmup_ratio:
        return 0.0
    return max(0.0, 1.0 - lr_multiplier(progress, warmup_ratio, warmdown_ratio, final_lr_frac))
