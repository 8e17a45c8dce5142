"""model.preflight's kernel probe in this process, through kernels._fake_nki (the NKI stand-in): every kernel
within the tolerance at good widths, a width the buffer plan refuses recorded as refused, a wrong kernel caught.
The device and compile probes run as child processes in tests/sweep/run/test_preflight.py."""

from __future__ import annotations

import sys

import pytest

import kernels
from kernels import _nki, relu2_mlp
from model import preflight


@pytest.fixture
def fake_nki(monkeypatch):
    from kernels import _fake_nki

    for name in ("nki", "nl", "nisa"):
        monkeypatch.setattr(_nki, name, getattr(_fake_nki, name))
    monkeypatch.setattr(_nki, "NKI_AVAILABLE", True)
    monkeypatch.setattr(_nki, "_kernels", None)
    monkeypatch.setenv("NKI_SIMULATOR", "1")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    sys.modules.pop("kernels.nki_kernels", None)
    yield _fake_nki
    sys.modules.pop("kernels.nki_kernels", None)
    if hasattr(kernels, "nki_kernels"):
        delattr(kernels, "nki_kernels")


def test_every_kernel_within_tolerance_and_a_refused_width_recorded(fake_nki):
    out = preflight.probe_kernels("cpu", [128, 1024], 4.0, 512, 15.0, preflight.DEFAULT_TOL)
    rows = {(r["kernel"], r["width"]): r for r in out["results"]}
    assert set(rows) == {("rms_norm", 128), ("relu2_mlp", 128), ("rms_norm", 1024), ("relu2_mlp", 1024),
                         ("softcap_cross_entropy", 512)}
    assert all(r["ok"] for r in rows.values())
    # The stand-in's usable SBUF (trn2's 224 KiB) holds width 1024's weights resident: measured, not refused.
    plan = relu2_mlp.mlp_plan(1024, 4096, 1024, 2)
    assert plan is not None and plan.resident
    assert all("refused" not in r and 0 < r["err"] <= preflight.DEFAULT_TOL for r in rows.values()), rows
    assert set(rows[("relu2_mlp", 128)]["errs"]) == {"out", "grad0", "grad1", "grad2"}


def test_a_width_the_buffer_plan_refuses_is_recorded_as_refused(fake_nki, monkeypatch):
    # A part with 16 KiB of usable SBUF per partition: no plan holds even one token block of width 1024.
    monkeypatch.setattr(fake_nki.nl.tile_size, "sbuf_fmax_bytes", 16 * 1024)
    assert relu2_mlp.mlp_plan(1024, 4096, 1024, 2) is None
    out = preflight.probe_kernels("cpu", [1024], 4.0, 512, 15.0, preflight.DEFAULT_TOL)
    rows = {r["kernel"]: r for r in out["results"]}
    assert rows["relu2_mlp"]["ok"] and "no SBUF plan for dim 1024" in rows["relu2_mlp"]["refused"], rows
    assert "err" not in rows["relu2_mlp"]
    assert "refused" not in rows["rms_norm"] and rows["rms_norm"]["ok"], rows


def test_a_wrong_kernel_is_caught(fake_nki, monkeypatch):
    real = fake_nki.simulate

    def off_by_a_tenth(kernel):
        run = real(kernel)
        return lambda *a: (lambda o: tuple(x * 1.1 for x in o) if isinstance(o, tuple) else o * 1.1)(run(*a))

    monkeypatch.setattr(fake_nki.nki, "simulate", off_by_a_tenth)
    out = preflight.probe_kernels("cpu", [128], 4.0, 512, 15.0, preflight.DEFAULT_TOL)
    assert not any(r["ok"] for r in out["results"])
    assert all(r["err"] > 0.09 for r in out["results"])
