"""Test-only fault injection, so the sweep's failure handling is exercised on the real trainer.

Not part of the trainer's configuration (a config never carries it, so no study or export can): the
tests set the environment variable TRNSWEEP_FAULT to `KIND@STEP`, optionally followed by `:seed=N`,
where the fault then fires only in a trainer whose config has seed N (a sweep test faults one trial
of several that way). KIND is one of FAULT_KINDS:

- hang: at STEP, ignore SIGTERM and sleep forever;
- crash: at STEP, exit at once with code 3;
- oom: at STEP, allocate until memory runs out;
- diverge: at STEP, the training loss turns NaN;
- core_crash: CORE raises after training (STEP unused).

A malformed value is a ConfigError: the trainer exits 2 with one line before it trains.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

import torch

from model.config import ConfigError

ENV_VAR = "TRNSWEEP_FAULT"
FAULT_KINDS = ("hang", "crash", "oom", "diverge", "core_crash")
_PATTERN = re.compile(r"(?P<kind>[a-z_]+)@(?P<step>\d+)(?::seed=(?P<seed>-?\d+))?")


@dataclass(frozen=True)
class Fault:
    """One fault to inject: `kind` at training step `step` (0-based)."""

    kind: str
    step: int


def parse_fault(value: str, seed: int) -> Fault | None:
    """The fault `value` (TRNSWEEP_FAULT's text) asks of a trainer whose config seed is `seed`; None for
    "" or when it names another seed. Raises ConfigError for a malformed value."""
    value = value.strip()
    if not value:
        return None
    m = _PATTERN.fullmatch(value)
    if m is None or m["kind"] not in FAULT_KINDS:
        raise ConfigError(f"{ENV_VAR} must be KIND@STEP or KIND@STEP:seed=N with KIND one of "
                          f"{', '.join(FAULT_KINDS)}, got {value!r}")
    if m["seed"] is not None and int(m["seed"]) != seed:
        return None
    return Fault(m["kind"], int(m["step"]))


def fault_from_env(seed: int) -> Fault | None:
    """The fault this process's environment asks of a trainer with config seed `seed`, if any."""
    return parse_fault(os.environ.get(ENV_VAR, ""), seed)


def inject(kind: str, loss: torch.Tensor) -> torch.Tensor:
    """Apply a training-step fault to this step's loss (returned, NaN for diverge; the others never return)."""
    if kind == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a truly stuck process ignores polite requests
        while True:
            time.sleep(3600)
    if kind == "crash":
        os._exit(3)
    if kind == "oom":
        hoard = []
        while True:
            hoard.append(torch.ones(64 * 1024 * 1024, dtype=torch.uint8))
    if kind == "diverge":
        return loss * float("nan")
    return loss
