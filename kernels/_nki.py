"""The one place that imports the Neuron Kernel Interface, and the one place that launches its kernels.

Everything NKI in this package goes through here: `NKI_AVAILABLE` says whether `import nki` worked, and
`kernels()` loads `kernels.nki_kernels` (the `@nki.jit` functions) on first use only, so `import kernels`
works on machines without the Neuron SDK. `launch` calls a kernel either on Neuron tensors (eager or inside
`torch.compile(backend="neuron")`) or, when `NKI_SIMULATOR=1`, through `nki.simulate` on NumPy copies.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kernels.neuron import neuron_available

try:  # the single import check; nothing else in the package imports nki at module load
    import nki
    import nki.isa as nisa
    import nki.language as nl

    NKI_AVAILABLE = True
    NKI_IMPORT_ERROR = ""
except Exception as exc:  # ImportError, or a broken SDK install that fails while importing
    nki = nisa = nl = None
    NKI_AVAILABLE = False
    NKI_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

_kernels: ModuleType | None = None


def unavailable_reason() -> str:
    """One line saying why the NKI path cannot run here ("" when it can)."""
    if NKI_AVAILABLE:
        return ""
    return f"the Neuron SDK's nki package is not importable ({NKI_IMPORT_ERROR})"


def simulating() -> bool:
    """True when kernels run in the NKI CPU simulator (NKI_SIMULATOR=1) rather than on a NeuronCore."""
    return os.environ.get("NKI_SIMULATOR", "") == "1"


def neuron_device_available() -> bool:
    """Whether a NeuronCore is usable (kernels.neuron's check; a function here so tests can stand one in)."""
    return neuron_available()


def logical_cores() -> int:
    """The kernels' LNC degree: it must equal the runtime's NEURON_LOGICAL_NC_CONFIG (1 or 2), or compilation fails.

    The competition's launch line always sets the variable; unset means 1, as NKI itself assumes.
    """
    value = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1").strip() or "1"
    lnc = int(value)
    if lnc not in (1, 2):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got {value!r}")
    return lnc


def kernels() -> ModuleType:
    """The module of `@nki.jit` kernels, imported on first use (its decorators need nki)."""
    global _kernels
    if not NKI_AVAILABLE:
        raise ValueError(f"NKI kernels cannot run: {unavailable_reason()}")
    if _kernels is None:
        import importlib

        _kernels = importlib.import_module("kernels.nki_kernels")
    return _kernels


def _to_numpy(value: Any) -> Any:
    """A torch tensor as a NumPy array the simulator accepts: float32 for floating types (NumPy has no
    bfloat16), int32 for integers; other arguments (Python scalars) pass unchanged."""
    if not isinstance(value, torch.Tensor):
        return value
    t = value.detach().cpu().contiguous()
    if t.is_floating_point():
        return t.float().numpy()
    return t.to(torch.int32).numpy()


def _to_torch(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return tuple(_to_torch(v) for v in value)
    arr = np.asarray(value)
    if arr.dtype.kind == "f" and arr.dtype != np.float64:
        arr = arr.astype(np.float32)  # also turns ml_dtypes.bfloat16 into something torch reads
    return torch.from_numpy(np.ascontiguousarray(arr))


def launch(kernel: Any, *args: Any) -> Any:
    """Run `kernel(*args)` with the right LNC degree; outputs come back as torch tensors.

    On Neuron tensors the call goes to torch-neuronx (one graph node under torch.compile). Under
    NKI_SIMULATOR=1 the inputs are copied to NumPy and run through `nki.simulate`; the caller casts the
    outputs back to its dtypes and device.
    """
    lnc = logical_cores()
    target = kernel[lnc] if lnc > 1 else kernel
    if simulating():
        return _to_torch(nki.simulate(target)(*(_to_numpy(a) for a in args)))
    return target(*args)
