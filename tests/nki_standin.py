"""The NKI stand-in swapped in for the nki package (kernels/_fake_nki.py), for tests anywhere in the suite."""

from __future__ import annotations

import sys

import pytest

import kernels
from kernels import _nki


def use_fake_nki(monkeypatch: pytest.MonkeyPatch) -> None:
    """Swap the NumPy stand-in in for the nki package, in simulator mode, with the kernels module reloaded."""
    from kernels import _fake_nki

    for name in ("nki", "nl", "nisa"):
        monkeypatch.setattr(_nki, name, getattr(_fake_nki, name))
    monkeypatch.setattr(_nki, "NKI_AVAILABLE", True)
    monkeypatch.setenv("NKI_SIMULATOR", "1")
    monkeypatch.setattr(_nki, "_kernels", None)
    sys.modules.pop("kernels.nki_kernels", None)


def forget_kernels_module() -> None:
    """Drop the kernels module built on the stand-in, so a later test imports it against whatever nki it sets."""
    sys.modules.pop("kernels.nki_kernels", None)
    if hasattr(kernels, "nki_kernels"):
        delattr(kernels, "nki_kernels")
