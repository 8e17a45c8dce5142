"""kernels/relu2_mlp.py: the NKI forward's SBUF plan covers every width the phase-1 and phase-2 studies search,
budgets NKI's own usable SBUF figure where nki gives one, and the kernel runs at every phase-1 width on the
stricter stand-in within the plan's own byte count."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import _nki
from kernels.relu2_mlp import SBUF_BUDGET_BYTES, SBUF_PARTITION_BYTES, mlp_plan, relu2_mlp, sbuf_budget

STUDIES = Path(__file__).resolve().parents[2] / "sweep" / "studies"


def searched_widths(study: str) -> tuple[list[int], float]:
    """(every model_dim the study's spec can draw, its fixed mlp_ratio), read from the spec file itself."""
    spec = tomllib.loads((STUDIES / f"{study}.toml").read_text())
    p = spec["params"]["model_dim"]
    return list(range(p["low"], p["high"] + 1, p.get("step", 1))), float(spec["fixed"]["mlp_ratio"])


@pytest.mark.parametrize("study", ["phase1", "phase2"])
def test_every_searched_width_has_a_plan_in_bf16_and_fp32(study):
    widths, ratio = searched_widths(study)
    assert 1024 in widths  # the width the old all-weights-resident plan refused
    for dim in widths:
        for itemsize in (2, 4):
            plan = mlp_plan(dim, int(round(ratio * dim)), dim, itemsize)
            assert plan is not None, (study, dim, itemsize)
            assert plan.sbuf_bytes <= SBUF_BUDGET_BYTES < SBUF_PARTITION_BYTES


def test_plan_streams_weights_once_they_no_longer_fit_and_refuses_past_any_plan():
    small, wide = mlp_plan(640, 2560, 640, 2), mlp_plan(2048, 8192, 2048, 4)
    assert small.resident and not wide.resident
    assert mlp_plan(65536, 4096, 65536, 4) is None  # x^T alone would overflow SBUF


def test_nki_mlp_refuses_a_shape_without_a_plan_in_one_line(fake_nki):
    x, w_fc, w_proj = torch.randn(4, 65536), torch.randn(2, 65536), torch.randn(65536, 2)
    with pytest.raises(ValueError, match="no SBUF plan") as info:
        relu2_mlp(x, w_fc, w_proj, impl="nki")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("dim", searched_widths("phase1")[0])
def test_nki_mlp_at_every_phase1_width_on_the_strict_stand_in(fake_nki, dim):
    """bf16 at the node's default LNC (2): matches the PyTorch op, and never holds more SBUF than planned."""
    torch.manual_seed(dim)
    hidden = 4 * dim
    x = torch.randn(130, dim).bfloat16()  # a ragged block, split across the two cores
    w_fc = (torch.randn(hidden, dim) / dim**0.5).bfloat16()
    w_proj = (torch.randn(dim, hidden) / hidden**0.5).bfloat16()
    y = relu2_mlp(x, w_fc, w_proj, impl="nki")
    ref = F.linear(F.relu(F.linear(x.float(), w_fc.float())).square(), w_proj.float())
    assert y.dtype == torch.bfloat16
    scale = ref.abs().max().item()
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * scale)
    plan = mlp_plan(dim, hidden, dim, 2)
    assert fake_nki.LAST_LAUNCH["lnc"] == 2
    assert 0 < fake_nki.LAST_LAUNCH["peak_sbuf"] <= plan.sbuf_bytes


def test_without_nki_the_plan_budgets_the_documented_fallback(monkeypatch):
    monkeypatch.setattr(_nki, "NKI_AVAILABLE", False)
    assert _nki.usable_sbuf_bytes() is None and sbuf_budget() == SBUF_BUDGET_BYTES == 192 * 1024


def test_the_plan_budgets_nkis_usable_sbuf_figure_and_the_stand_in_gives_trn2s(fake_nki, monkeypatch):
    """sbuf_fmax_bytes is NKI's usable SBUF per partition; the stand-in reports trn2's 224 KiB and holds to it."""
    tile = fake_nki.nl.tile_size
    assert tile.sbuf_fmax_bytes == tile.total_available_sbuf_size == SBUF_PARTITION_BYTES == 224 * 1024
    assert sbuf_budget() == SBUF_PARTITION_BYTES
    roomy = mlp_plan(640, 2560, 640, 2)
    assert roomy.resident  # ~73 KiB with both weights resident
    monkeypatch.setattr(tile, "sbuf_fmax_bytes", 64 * 1024)  # a smaller chip, or a larger reserve
    assert sbuf_budget() == 64 * 1024
    tight = mlp_plan(640, 2560, 640, 2)
    assert not tight.resident and tight.sbuf_bytes <= 64 * 1024  # the plan follows: weights streamed
    torch.manual_seed(0)
    x = torch.randn(130, 640).bfloat16()
    w_fc, w_proj = (torch.randn(2560, 640) / 640**0.5).bfloat16(), (torch.randn(640, 2560) / 2560**0.5).bfloat16()
    relu2_mlp(x, w_fc, w_proj, impl="nki")  # the stand-in's ledger holds the same 64 KiB and the plan fits it
    assert 0 < fake_nki.LAST_LAUNCH["peak_sbuf"] <= tight.sbuf_bytes
    monkeypatch.setattr(tile, "sbuf_fmax_bytes", 8 * 1024)
    with pytest.raises(ValueError, match=r"no SBUF plan .* \(budget 8 KiB per partition\)"):
        relu2_mlp(x, w_fc, w_proj, impl="nki")


def test_an_nki_that_cannot_answer_outside_a_kernel_leaves_the_fallback(fake_nki, monkeypatch):
    class Unanswered:
        @property
        def sbuf_fmax_bytes(self):
            raise RuntimeError("no target outside a kernel")

        total_available_sbuf_size = property(sbuf_fmax_bytes.fget)

    monkeypatch.setattr(fake_nki.nl, "tile_size", Unanswered())
    assert _nki.usable_sbuf_bytes() is None and sbuf_budget() == SBUF_BUDGET_BYTES
