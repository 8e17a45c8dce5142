"""Fixtures of the kernel tests: the NKI kernels runnable on CPU tensors, and the LNC degree."""

from __future__ import annotations

import os
import sys

import pytest

from kernels import _nki
from tests.nki_standin import forget_kernels_module, use_fake_nki


@pytest.fixture
def nki_cpu(monkeypatch):
    """get_ops("nki") runnable on CPU tensors: through the NumPy stand-in; through the real NKI simulator
    instead when the run was started with NKI_SIMULATOR=1 on a machine with AWS's nki package (docs/neuron.md
    says how). Either way every case runs: nothing is skipped."""
    if os.environ.get("NKI_SIMULATOR") == "1":
        if not _nki.NKI_AVAILABLE:
            pytest.fail("NKI_SIMULATOR=1 asks for the real NKI simulator, but the nki package is not importable")
        monkeypatch.setattr(_nki, "_kernels", None)
        sys.modules.pop("kernels.nki_kernels", None)
        yield "simulator"
    else:
        use_fake_nki(monkeypatch)
        yield "fake"
    forget_kernels_module()


@pytest.fixture
def fake_nki(monkeypatch):
    """The NumPy stand-in alone (tests of its own rules, and of what only it can measure)."""
    use_fake_nki(monkeypatch)
    from kernels import _fake_nki

    yield _fake_nki
    forget_kernels_module()


@pytest.fixture(params=["1", "2"])
def lnc(request, monkeypatch):
    """Logical-core degree: LNC=2 runs each kernel once per physical core, each on its share of the rows."""
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", request.param)
    return int(request.param)
