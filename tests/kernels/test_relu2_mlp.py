"""kernels/relu2_mlp.py: the NKI forward's SBUF plan covers every width the phase-1 and phase-2 studies search,
and the kernel runs at every phase-1 width on the stricter stand-in within the plan's own byte count."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels.relu2_mlp import SBUF_BUDGET_BYTES, SBUF_PARTITION_BYTES, mlp_plan, relu2_mlp

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
