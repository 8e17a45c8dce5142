"""Whether PyTorch's native Neuron backend is here and sees a NeuronCore: the one check for it.

`kernels.ops.get_ops("auto")` asks it to choose the NKI kernels, and `model.device` to choose the "neuron"
device; both import it from here (kernels sit below model and may not import it).
"""

from __future__ import annotations

import torch


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
