"""Resource limits on a trial's processes, and telling an out-of-memory failure from others.

``SWEEP_TRIAL_MEMORY_MB`` (in a spec's ``[trial.env]`` or the worker's environment) caps the address
space of every trainer process (RLIMIT_AS, set between fork and exec, inherited by torchrun's ranks),
so a trial that allocates without bound fails inside its own process with an allocation error the
trainer reports as out of memory, instead of the kernel's OOM killer taking the Ray worker, the
raylet or a neighbour's trial. The limit is per process, not per group: with several ranks each
rank gets it. A cgroup would bound the group as a whole but needs privileges a Ray worker lacks.
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Mapping

ENV_MEMORY_MB = "SWEEP_TRIAL_MEMORY_MB"

# How allocation failures read in a trainer's result reason or last log line: Python's MemoryError,
# PyTorch's CPU allocator (a RuntimeError under RLIMIT_AS), CUDA and Neuron runtimes.
_OOM_MARKERS = ("out of memory", "memoryerror", "can't allocate memory", "cannot allocate memory",
                "failed to allocate", "resource_exhausted", "nrt_resource")


class LimitError(ValueError):
    """A limit that cannot be applied (bad value); one line naming the variable."""


def memory_limit_bytes(env: Mapping[str, str]) -> int | None:
    """The address-space cap the environment asks for, in bytes; None when unset or 0."""
    raw = str(env.get(ENV_MEMORY_MB, "")).strip()
    if not raw:
        return None
    try:
        mb = float(raw)
    except ValueError:
        raise LimitError(f"{ENV_MEMORY_MB}: want a number of MiB, got {raw!r}") from None
    if not mb == mb or mb < 0 or mb > 2**40:  # NaN, negative or absurd
        raise LimitError(f"{ENV_MEMORY_MB}: want a number of MiB between 0 and 2^40, got {raw!r}")
    return int(mb * 2**20) or None


def preexec(env: Mapping[str, str]) -> Callable[[], None] | None:
    """A ``preexec_fn`` for the trainer's Popen applying the limits in ``env``; None when there are none.

    It runs in the child between fork and exec, so it only calls setrlimit (no allocation, no locks).
    """
    limit = memory_limit_bytes(env)
    if limit is None:
        return None

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


def is_oom(reason: str) -> bool:
    """Whether a failure reason says the process ran out of memory."""
    text = reason.lower()
    return any(m in text for m in _OOM_MARKERS) or "oom" in text.replace(":", " ").split()
