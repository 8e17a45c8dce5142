"""The one place that imports the Neuron Kernel Interface, and the one place that launches its kernels.

Everything NKI in this package goes through here: `NKI_AVAILABLE` says whether `import nki` worked, and
`kernels()` loads `kernels.nki_kernels` (the `@nki.jit` functions) on first use only, so `import kernels`
works on machines without the Neuron SDK. `launch` calls a kernel at the node's LNC degree either on Neuron
tensors (eager or inside `torch.compile(backend="neuron")`) or, when `NKI_SIMULATOR=1`, through `nki.simulate`;
`define_op` makes the ops that call it PyTorch custom operators (`torch_neuronx.nki_op` on TorchNeuron).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kernels.neuron import logical_cores, neuron_available

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


def usable_sbuf_bytes() -> int | None:
    """NKI's own usable SBUF per partition, in bytes (``nl.tile_size.sbuf_fmax_bytes``, NKI 0.4+; the older
    ``total_available_sbuf_size`` holds the same figure), or None where nki is not importable or does not
    give it outside a kernel; kernels.relu2_mlp then plans with its documented fallback."""
    if not NKI_AVAILABLE:
        return None
    for name in ("sbuf_fmax_bytes", "total_available_sbuf_size"):
        try:
            value = getattr(nl.tile_size, name)
        except Exception:  # absent in this NKI, or it needs a kernel's target to answer
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def kernels() -> ModuleType:
    """The module of `@nki.jit` kernels, imported on first use (its decorators need nki)."""
    global _kernels
    if not NKI_AVAILABLE:
        raise ValueError(f"NKI kernels cannot run: {unavailable_reason()}")
    if _kernels is None:
        import importlib

        _kernels = importlib.import_module("kernels.nki_kernels")
    return _kernels


def _to_torch(value: Any) -> Any:
    """A kernel output as a torch tensor: NumPy bfloat16 (ml_dtypes) comes back as torch.bfloat16 bit for bit."""
    if isinstance(value, tuple | list):
        return tuple(_to_torch(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value
    arr = np.ascontiguousarray(np.asarray(value))
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def launch(kernel: Any, *args: Any) -> Any:
    """Run `kernel(*args)` at the LNC degree of `logical_cores()`; outputs come back as torch tensors.

    The degree is always given in brackets, `kernel[lnc](...)`, as nki.jit documents: a bare call runs at
    LNC=1. On Neuron tensors the call goes through torch-neuronx's `wrap_nki` where it exists (one graph node
    under torch.compile; a raw call inside an `nki_op` is invisible to its tracing). Under
    NKI_SIMULATOR=1 the torch tensors go straight into `nki.simulate`, bfloat16 included (the simulator takes
    PyTorch tensors and holds bfloat16 as bfloat16: docs nki/guides/nki_simulator); the caller moves the
    outputs back to its device.
    """
    lnc = logical_cores()
    if simulating():
        return _to_torch(nki.simulate(kernel[lnc])(*args))
    wrap = _wrap_nki()
    if wrap is not None:
        return _wrapped(wrap, kernel)[lnc](*args)
    return kernel[lnc](*args)


_WRAPPED: dict[int, tuple[Any, Any]] = {}


def _wrapped(wrap: Callable[..., Any], kernel: Any) -> Any:
    """`wrap(kernel)`, made once per kernel: TorchNeuron's `wrap_nki` traces and registers the kernel each call."""
    held = _WRAPPED.get(id(kernel))
    if held is None or held[0] is not kernel:
        held = _WRAPPED[id(kernel)] = (kernel, wrap(kernel))
    return held[1]


def _wrap_nki() -> Callable[..., Any] | None:
    """torch_neuronx.wrap_nki where TorchNeuron has it, else None.

    TorchNeuron's `nki_op` traces its function with dispatcher-based tracing, which cannot see a raw kernel
    call; its source calls kernels inside an `nki_op` through `wrap_nki` (a higher-order op the trace records),
    and so does `launch` (docs/neuron.md cites the lines)."""
    try:
        from torch_neuronx import wrap_nki
    except Exception:  # no TorchNeuron here, or one without wrap_nki
        return None
    return wrap_nki


def _nki_op() -> Callable[..., Any] | None:
    """torch_neuronx.nki_op where TorchNeuron is installed (the documented way to make an NKI kernel a PyTorch
    operator: docs torch/guides/how-to-work-with-nki), else None."""
    try:
        from torch_neuronx import nki_op
    except Exception:  # no TorchNeuron here, or an install that fails to import
        return None
    return nki_op


def define_op(name: str, impl: Callable[..., Any], fake: Callable[..., Any], nki_backed: bool) -> Any:
    """Register `impl` as the custom operator `trnsweep::name`; returns its CustomOpDef.

    NKI-backed ops go through `torch_neuronx.nki_op` where TorchNeuron is installed (it registers `impl`
    itself as the fake kernel and lets torch.compile trace into it); everywhere else, and for the reference
    ops, through `torch.library.custom_op` with `fake` for shapes. Both return a CustomOpDef, so the caller
    registers the same autograd formula (`register_autograd`) on either: the CPU path (reference ops, the
    NKI ops on the stand-in or the simulator) runs the registration the device runs.
    """
    qualname = f"trnsweep::{name}"
    nki_op = _nki_op() if nki_backed else None
    if nki_op is not None:
        return nki_op(qualname, impl, mutates_args=())
    op = torch.library.custom_op(qualname, impl, mutates_args=())
    op.register_fake(fake)
    return op
