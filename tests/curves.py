"""Learning curves drawn from the learning-curve pruner's own model family (sweep.spec.pruners), with a known
truth: for the pruner's tests and the replay's."""

from __future__ import annotations

import random

from sweep.spec.pruners import Schedule

BUDGET = 100
STEPS = list(range(10, BUDGET, 10))  # intermediate evals at 10%..90% of the charged budget
TRUE_C, TRUE_K = 0.5, 4.0


def synthetic(lr: float, warmdown: float, b: float | None = None, noise: float = 0.0, seed: int = 0
              ) -> tuple[Schedule, dict[int, float], float]:
    """A curve from the model family itself: a plateau raised by the lr that annealing removes,
    and a higher lr that learns faster (smaller b). Returns the schedule, intermediate values, final."""
    rng = random.Random(seed)
    sched = Schedule(0.0, warmdown, 0.0, lr)
    b = 0.3 * (0.04 / lr) ** 0.3 if b is None else b
    a = 1.0 + TRUE_K * lr

    def at(p: float) -> float:
        s, d = sched.features(p, TRUE_C)
        return a + b * s + TRUE_K * d + rng.gauss(0.0, noise)

    return sched, {step: at(step / BUDGET) for step in STEPS}, at(1.0)
