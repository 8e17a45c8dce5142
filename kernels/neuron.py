"""Whether PyTorch's native Neuron backend is here and sees a NeuronCore: the one check for it.

`kernels.ops.get_ops("nki")` asks it whether the NKI kernels can run, and `model.device` to choose the "neuron"
device; both import it from here (kernels sit below model and may not import it). `logical_cores` is the
node's LNC degree, which the kernels launch at and the trainer's kernel choice compares with the preflight's.
"""

from __future__ import annotations

import os

import torch

# trn2's default LNC: the runtime groups two physical cores per logical core unless NEURON_LOGICAL_NC_CONFIG
# says otherwise (docs: about-neuron/arch/neuron-features/logical-neuroncore-config), and neuronx-cc compiles
# at LNC=2 on Trn2 and later by default, while an NKI kernel called without a degree runs at LNC=1 (docs:
# compiler/error-codes/EVRF066: the mismatch fails compilation).
TRN2_DEFAULT_LNC = 2


def logical_cores() -> int:
    """This node's LNC degree: NEURON_LOGICAL_NC_CONFIG (1 or 2), and trn2's default of 2 when it is unset.

    The NKI kernels launch at it (kernels._nki.launch): it must equal the degree the graph compiles at, or
    neuronx-cc refuses the kernel (NCC_EVRF066).
    """
    value = os.environ.get("NEURON_LOGICAL_NC_CONFIG", "").strip()
    if not value:
        return TRN2_DEFAULT_LNC
    if value not in ("1", "2"):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got {value!r}")
    return int(value)


def neuron_available() -> bool:
    """True when PyTorch's native Neuron backend is importable and sees a device."""
    neuron = getattr(torch, "neuron", None)
    if neuron is None:
        try:
            import torch_neuronx  # noqa: F401  (registers torch.neuron)
        except ImportError:
            return False
        neuron = getattr(torch, "neuron", None)
    try:
        return bool(neuron is not None and neuron.is_available())
    except Exception:
        return False
