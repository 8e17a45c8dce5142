"""Which fused-op implementation a trial runs: `kernels = "auto"` resolved against this node's preflight report.

Phase-1 defaults must not gamble chip-hours on kernels nobody has run on the node: "auto" means the NKI
kernels only when `python -m sweep preflight` wrote a report (path in TRNSWEEP_PREFLIGHT_REPORT, default
~/.cache/trnsweep/preflight.json) whose "kernels" check passed at the LNC this trial runs at; otherwise the
plain PyTorch ops. The report's shape is the contract with the preflight:
`{"ok": bool, "checks": [{"name": "kernels", "ok": bool, ...}, ...], "lnc": int}`.

Whatever runs, the choice and its reason go into the result record (`record()`): `kernels_impl`,
`kernels_reason`, `kernels_mlp` (the MLP's own implementation: "torch" where the width has no NKI buffer
plan) and, when the NKI kernels failed to compile or run at the first step and the trial went on with the
PyTorch ops, `kernels_fallback` (the error's first line).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kernels.neuron import logical_cores
from kernels.ops import Ops, get_ops
from kernels.relu2_mlp import mlp_plan

REPORT_ENV = "TRNSWEEP_PREFLIGHT_REPORT"
DEFAULT_REPORT = Path("~/.cache/trnsweep/preflight.json")
MLP_PLAN_ITEMSIZE = 4  # size the MLP plan for float32: a plan that fits float32 fits bfloat16


@dataclass(frozen=True)
class KernelChoice:
    """The resolved implementation (`impl`: torch, reference or nki), why, and the MLP's own if it differs."""

    impl: str
    reason: str
    mlp: str = ""
    fallback: str = ""

    def ops(self) -> Ops:
        return get_ops(self.impl) if not self.mlp else Ops(self.impl, mlp=self.mlp)

    def record(self) -> dict[str, Any]:
        """The result record's fields for this choice."""
        fields = {"kernels_impl": self.impl, "kernels_reason": self.reason, "kernels_mlp": self.mlp or self.impl}
        if self.fallback:
            fields["kernels_fallback"] = self.fallback
        return fields


def report_path() -> Path:
    """Where this node's preflight report is: $TRNSWEEP_PREFLIGHT_REPORT, else ~/.cache/trnsweep/preflight.json."""
    return Path(os.environ.get(REPORT_ENV) or DEFAULT_REPORT).expanduser()


def preflight_verdict(lnc: int, path: Path | None = None) -> tuple[bool, str]:
    """(may this node run the NKI kernels at `lnc`, why): the report exists, its kernels check passed, lnc matches."""
    path = path or report_path()
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        return False, f"no preflight report at {path} (python -m sweep preflight writes it)"
    except (OSError, ValueError) as e:
        return False, f"preflight report {path} is unreadable: {type(e).__name__}"
    if not isinstance(report, dict) or not isinstance(report.get("checks"), list):
        return False, f"preflight report {path} has no checks list"
    kernels = [c for c in report["checks"] if isinstance(c, dict) and c.get("name") == "kernels"]
    if not kernels:
        return False, f"preflight report {path} has no kernels check"
    if kernels[0].get("ok") is not True:
        return False, f"the preflight's kernels check failed on this node ({path})"
    if report.get("lnc") != lnc:
        return False, f"the preflight ran at LNC {report.get('lnc')}, this trial at LNC {lnc} ({path})"
    return True, f"the preflight's kernels check passed at LNC {lnc} ({path})"


def resolve(requested: str, model_dim: int, mlp_dim: int) -> KernelChoice:
    """The implementation for a trial's `kernels` setting; "auto" follows the preflight report.

    An explicit "nki" is taken as asked (get_ops refuses it where it cannot run); a width whose MLP has no NKI
    buffer plan runs the PyTorch MLP either way, recorded in `mlp`.
    """
    if requested == "auto":
        allowed, reason = preflight_verdict(logical_cores())
        impl = "nki" if allowed else "torch"
    else:
        impl, reason = requested, f"kernels={requested!r} in the trial's configuration"
    choice = KernelChoice(impl, reason)
    if impl == "nki":
        try:
            get_ops("nki")
        except ValueError as e:
            if requested != "auto":
                raise
            return KernelChoice("torch", f"{reason}, but {e}")
        if mlp_plan(model_dim, mlp_dim, model_dim, MLP_PLAN_ITEMSIZE) is None:
            choice = replace(choice, mlp="torch")
    return choice


def fall_back(choice: KernelChoice, error: BaseException) -> KernelChoice:
    """The choice after the NKI kernels failed at the first step: the PyTorch ops, with the error recorded."""
    first = str(error).splitlines()[0] if str(error) else ""
    return KernelChoice("torch", f"NKI kernels failed at the first step; was: {choice.reason}",
                        fallback=f"{type(error).__name__}: {first}")
