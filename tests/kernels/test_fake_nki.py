"""kernels/_fake_nki.py: the stand-in fails a kernel that breaks a rule of the trn2 hardware or of NKI, with a
message naming the rule (SBUF and PSUM capacity, float32 accumulation, bfloat16 kept as bfloat16, no float64,
no Python branching on tile values, program ids only inside a launch grid)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import _fake_nki as fk
from kernels import _nki

nl, nisa, nki = fk.nl, fk.nisa, fk.nki


def run(kernel_fn, *args, lnc: int = 1):
    return nki.simulate(nki.jit(kernel_fn)[lnc])(*args)


def copy_kernel(x):
    """The smallest correct kernel: HBM -> SBUF -> shared HBM."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_sbuf_overflow_fails_with_the_trn2_capacity():
    def kernel(x):
        keep = [nl.ndarray((128, 64 * 1024), dtype=nl.float32, buffer=nl.sbuf) for _ in range(1)]  # 256 KiB
        return keep

    with pytest.raises(fk.NkiConstraintError, match=r"SBUF overflow: .* \(trn2 has 229376\)"):
        run(kernel, np.zeros((4, 4), np.float32))


def test_sbuf_is_counted_while_alive_only():
    def kernel(x):
        for _ in range(4):  # 4 x 128 KiB, one at a time: fits
            nl.ndarray((128, 32 * 1024), dtype=nl.float32, buffer=nl.sbuf)
        live = [nl.ndarray((128, 32 * 1024), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]  # 256 KiB live
        return live

    with pytest.raises(fk.NkiConstraintError, match="SBUF overflow"):
        run(kernel, np.zeros((4, 4), np.float32))


def test_psum_has_eight_banks():
    def kernel(x):
        banks = [nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum) for _ in range(8)]  # 8 x 2 KiB: full
        banks.append(nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.psum))  # even 4 bytes takes a bank
        return banks

    with pytest.raises(fk.NkiConstraintError, match=r"PSUM overflow: 9 banks .* \(trn2 has 8 per partition\)"):
        run(kernel, np.zeros((4, 4), np.float32))


def test_matmul_accumulates_in_float32_psum():
    def kernel(x):
        ps = nl.ndarray((128, 128), dtype=nl.bfloat16, buffer=nl.psum)
        a = nl.ndarray((128, 128), dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x)
        nisa.nc_matmul(dst=ps, stationary=a, moving=a, accumulate=False)

    with pytest.raises(fk.NkiConstraintError, match="accumulates in float32.*bfloat16"):
        run(kernel, np.zeros((128, 128), fk.BF16))


def test_bfloat16_is_held_as_bfloat16():
    """A bf16 tile rounds like the chip: 1 + 2^-9 is not representable (7 mantissa bits) and becomes 1."""
    x = torch.full((2, 3), 1 + 2.0**-9, dtype=torch.float32)

    def kernel(x):
        out = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, dtype=nl.bfloat16, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)  # DMA casts float32 -> bfloat16
        assert t.dtype == nl.bfloat16
        nisa.dma_copy(dst=out, src=t)
        return out

    out = run(kernel, x)
    assert out.dtype == fk.BF16 and (out.astype(np.float32) == 1.0).all()


def test_float64_is_refused():
    with pytest.raises(fk.NkiConstraintError, match="no float64"):
        run(copy_kernel, np.zeros((4, 4), np.float64))
    with pytest.raises(fk.NkiConstraintError, match="no float64"):
        run(lambda x: nl.ndarray((4, 4), dtype=np.float64, buffer=nl.sbuf), np.zeros((4, 4), np.float32))


def test_python_branching_on_a_tile_value_fails():
    def kernel(x):
        t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        if t[0:1, 0:1]:  # a value NKI does not know while it specializes the kernel
            pass

    with pytest.raises(fk.NkiConstraintError, match="control flow on a tile's value"):
        run(kernel, np.ones((4, 4), np.float32))


def test_program_id_only_inside_a_launch_grid():
    seen = []

    def kernel(x):
        seen.append((nl.num_programs(0), nl.program_id(0)))
        return copy_kernel(x)

    run(kernel, np.ones((4, 4), np.float32), lnc=2)
    assert seen == [(2, 0), (2, 1)]
    with pytest.raises(fk.NkiConstraintError, match="needs a launch grid"):
        run(kernel, np.ones((4, 4), np.float32), lnc=1)
    with pytest.raises(fk.NkiConstraintError, match="outside a kernel launch"):
        nl.num_programs(0)
    with pytest.raises(fk.NkiConstraintError, match="LNC degree is 1 or 2"):
        nki.jit(copy_kernel)[4]


def test_launch_passes_bf16_torch_tensors_straight_in_at_the_default_lnc(fake_nki, monkeypatch):
    """kernels._nki.launch: no widening to float32 on the way in, kernel[2] when NEURON_LOGICAL_NC_CONFIG is unset."""
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    seen = []

    def kernel(x):
        seen.append((x.dtype, nl.num_programs(0)))
        return copy_kernel(x)

    x = torch.randn(5, 7).bfloat16()
    out = _nki.launch(nki.jit(kernel), x)
    assert seen == [(fk.BF16, 2), (fk.BF16, 2)]
    assert out.dtype == torch.bfloat16 and torch.equal(out, x)


def test_lnc_defaults_to_trn2s_two(monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert _nki.logical_cores() == 2
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert _nki.logical_cores() == 1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "4")
    with pytest.raises(ValueError, match="must be 1 or 2"):
        _nki.logical_cores()
