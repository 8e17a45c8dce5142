"""model.counts against real models: the count and FLOPs of every shape option the phase specs search.

The grid covers sweep/studies/phase1.toml and phase2.toml's options (depth 8-28, width 512-2048, head_dim
64 and 128, n_kv_head 1, 2, 4, 8 or all, vocab 8192) plus what the trainer offers beyond them (value
embeddings, residual scalars, qk_norm off, a width from aspect_ratio, an mlp_ratio that rounds). Models are
built on the meta device: real modules and parameter shapes, no memory, so even phase-2 sizes build fast.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
import torch

from model import counts
from model.config import GPTConfig
from model.gpt import GPT
from sweep.spec.expr import gpt_params
from tests.conftest import ROOT

# Small shapes take every n_kv_head that divides their heads and every (value_embeds, residual_scalars).
SMALL = [(1, 32, 16), (2, 64, 16), (3, 96, 32), (5, 64, 8)]  # (depth, model_dim, head_dim)
# Phase-1 (depth 8-16, width 512-1024, heads of 64 or 128, n_kv_head 1, 2, 4) and phase-2 (depth 16-28, width
# 1024-2048, heads of 128, n_kv_head 2, 4, 8) corners, each with a few K/V head counts (meta builds of these
# are the slow part).
PHASES = [((8, 512, 64), (0, 1, 4)), ((10, 640, 128), (0, 5)), ((16, 1024, 128), (0, 1, 2, 4, 8)),
          ((28, 2048, 128), (0, 8))]
KV_HEADS = (0, 1, 2, 4, 8)  # 0: one K/V head per query head
EXTRAS = list(itertools.product((False, True), (False, True)))  # (value_embeds, residual_scalars)
VOCABS = (300, 512, 8192)
MLP_RATIOS = (4.0, 2.6, 3.0)  # 2.6 x 96 = 249.6 rounds up, 2.6 x 32 = 83.2 down


def grid() -> list[GPTConfig]:
    points = [(shape, kv, extras) for shape, kv, extras in itertools.product(SMALL, KV_HEADS, EXTRAS)
              if not kv or (shape[1] // shape[2]) % kv == 0]
    points += [(shape, kv, EXTRAS[(3 * j + k) % 4]) for shape, kvs in PHASES for j, kv in enumerate(kvs)
               for k in range(2)]
    out = []
    for i, ((depth, dim, hd), kv, (ve, rs)) in enumerate(points):
        out.append(GPTConfig(vocab_size=8192 if depth >= 8 else VOCABS[i % 3], depth=depth, model_dim=dim,
                             head_dim=hd, n_kv_head=kv, value_embeds=ve, residual_scalars=rs, qk_norm=i % 2 == 0,
                             mlp_ratio=MLP_RATIOS[i % 3], seq_len=(32, 1024, 2048)[i % 3]))
    out.append(GPTConfig(vocab_size=300, depth=3, model_dim=0, aspect_ratio=24, head_dim=16, n_kv_head=1,
                         value_embeds=True, residual_scalars=True))  # width 72 rounded up to 80
    # The other recipe options: gate widths (0: ungated), smear (a gate narrower than 24 at width 16), backout,
    # attention windows (FLOPs per layer's window).
    out += [GPTConfig(vocab_size=300, depth=depth, model_dim=dim, head_dim=16, n_kv_head=kv, ve_gate_channels=ch,
                      smear=sm, backout=bo, window_pattern=wp, short_window=sw, seq_len=64)
            for depth, dim, kv, ch, sm, bo, wp, sw in [(1, 16, 0, 0, True, True, "S", 0), (4, 64, 2, 12, True, False,
                                                       "SSSL", 0), (5, 32, 0, 32, False, True, "SL", 20),
                                                      (2, 64, 1, 64, True, True, "ls", 100),
                                                      (3, 16, 0, 32, False, False, "L", 0)]]  # gate as wide as d
    return out


def built(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def reference_flops(model: GPT) -> float:
    """The trainer's FLOPs/token as GPT computed it from its own parameters before model.counts existed."""
    cfg = model.config
    lookup = model.wte.weight.numel() + sum(ve.weight.numel() for ve in model.value_embeds.values())
    groups = model.param_groups()
    scalars = sum(p.numel() for role in ("scalar", "resid", "x0") for p in groups[role])
    matmul = sum(p.numel() for p in model.parameters()) - lookup - scalars
    windows = [w or cfg.seq_len for w in model.windows]  # 0: a full layer
    assert len(windows) == cfg.depth and windows[-1] == cfg.seq_len
    return 6.0 * matmul + sum(12 * cfg.n_head * cfg.head_dim * w for w in windows)


@pytest.mark.parametrize("cfg", grid(), ids=lambda c: (f"d{c.depth}w{c.model_dim}h{c.head_dim}kv{c.n_kv_head}"
                                                        f"{'ve' * c.value_embeds}{'rs' * c.residual_scalars}"))
def test_counts_equal_the_built_model(cfg: GPTConfig) -> None:
    model = built(cfg)
    assert counts.num_params(cfg) == sum(p.numel() for p in model.parameters())
    assert counts.flops_per_token(cfg) == reference_flops(model)
    args = (cfg.depth, cfg.model_dim, cfg.vocab_size, cfg.mlp_ratio, cfg.head_dim, cfg.n_kv_head, cfg.value_embeds,
            cfg.residual_scalars)
    if cfg.smear or cfg.backout or cfg.ve_gate_channels != GPTConfig.ve_gate_channels:
        return  # gpt_params counts those at the trainer's defaults
    assert gpt_params(*args) == counts.num_params(cfg)
    if cfg.n_kv_head == cfg.n_head and not cfg.value_embeds:  # then head_dim may be left out (0)
        assert gpt_params(*args[:4], 0, 0, False, cfg.residual_scalars) == counts.num_params(cfg)


def test_a_tiny_config_counted_by_hand() -> None:
    """Every option that adds parameters, counted on paper: the figures come from no code of the project."""
    cfg = GPTConfig(vocab_size=10, depth=2, model_dim=8, head_dim=4, n_kv_head=1, mlp_ratio=2.0, value_embeds=True,
                    ve_gate_channels=3, residual_scalars=True, smear=True, backout=True, window_pattern="SL",
                    short_window=2, seq_len=6, kernels="torch")
    # 2 query heads of 4 (q_dim 8), 1 K/V head (kv_dim 4), mlp_dim 2.0 x 8 = 16.
    # wte 10 x 8 = 80; lm_head 8 x 10 = 80.
    # A block: c_q 8 x 8 = 64, c_k 8 x 4 = 32, c_v 8 x 4 = 32, c_proj 8 x 8 = 64, c_fc 8 x 16 = 128,
    #   mlp c_proj 16 x 8 = 128: 448; two blocks 896.
    # Value embeddings on every other layer ending with the last: layer 1 only, a table 10 x 4 = 40 and its gate
    #   3 channels -> 1 K/V head = 3.
    # Residual scalars 2 per layer = 4; smear gate min(24, 8) = 8 channels + its lambda 1 = 9; backout 1.
    # 80 + 80 + 896 + 40 + 3 + 4 + 9 + 1 = 1113.
    params = 1113
    # FLOPs per token: 6 per weight a token multiplies through (forward 2, backward 4): the blocks 896, the gate 3
    #   and lm_head 80 = 979 weights, 6 x 979 = 5874 (the tables are looked up; the scalars are not matmuls).
    # Attention: per layer and head, q.k over the window and the weighted sum of v, 2 x head_dim each forward
    #   (4 x 4 = 16 per key), three times that with backward: 12 x n_head x head_dim = 96 per key. Windows "SL":
    #   layer 0 short, 2 keys; layer 1 (the last, always full) seq_len 6 keys: 96 x (2 + 6) = 768.
    # 5874 + 768 = 6642.
    flops = 6642.0
    model = GPT(cfg)
    assert sum(p.numel() for p in model.parameters()) == params
    assert counts.num_params(cfg) == params and model.num_params() == params
    assert counts.flops_per_token(cfg) == flops and model.flops_per_token() == flops


def test_the_grid_covers_every_phase_option() -> None:
    configs = grid()
    big = [c for c in configs if c.depth >= 8]
    assert {c.n_kv_head == c.n_head for c in big} == {True, False}
    assert {1, 2, 4, 8} <= {c.n_kv_head for c in big if c.n_kv_head != c.n_head}
    assert {(c.value_embeds, c.residual_scalars) for c in big} == set(EXTRAS)
    assert {64, 128} == {c.head_dim for c in big} and {c.qk_norm for c in big} == {True, False}
    assert {8, 16, 28} <= {c.depth for c in big} and {512, 1024, 2048} <= {c.model_dim for c in big}
    assert {c.vocab_size for c in big} == {8192}
    assert any(c.mlp_dim != c.mlp_ratio * c.model_dim for c in configs)  # an mlp_dim that was rounded


def test_a_cpu_built_model_counts_alike() -> None:
    cfg = GPTConfig(vocab_size=300, depth=3, model_dim=64, head_dim=16, n_kv_head=2, value_embeds=True,
                    residual_scalars=True, seq_len=32)
    model = GPT(cfg)
    assert counts.num_params(cfg) == sum(p.numel() for p in model.parameters())


def test_gpt_params_positional_forms() -> None:
    base = 12 * 10 * 640**2 + 2 * 8192 * 640  # the competition baseline's 59.6M (COMPETITION.md)
    assert gpt_params(10, 640, 8192) == base == gpt_params(10.0, 640, 8192, 4) == gpt_params(10, 640, 8192, 4, 128)
    assert gpt_params(10, 640, 8192, 4, 64) == base  # every head size gives the same count without GQA
    gqa = GPTConfig(vocab_size=8192, depth=10, model_dim=640, head_dim=128, n_kv_head=1, value_embeds=False,
                    residual_scalars=False)
    assert gpt_params(10, 640, 8192, 4, 128, 1) == counts.num_params(gqa) < base
    assert gpt_params(10, 640, 8192, 4, 128, 0, False, True) == base + 2 * 10
    for misuse in [(10, 640, 8192, 4, 0, 2), (10, 640, 8192, 4, 0, 0, True)]:  # GQA, value embeds: head_dim needed
        with pytest.raises(ValueError, match="need head_dim"):
            gpt_params(*misuse)


@pytest.mark.parametrize("args", [(10, 641, 8192), (10, 640.5, 8192), (2, 48, 512, 4, 32), (1, 0, 512), (0, 64, 512),
                                  (10, 640, 8192, 4, 96, 3), (-1, 64, 512), (True, 64, 512)])
def test_gpt_params_counts_shapes_the_trainer_refuses_without_an_error(args):
    """Derived values are evaluated before constraints: a shape a constraint will reject must still count."""
    value = gpt_params(*args)
    assert isinstance(value, (int, float)) and math.isfinite(value)
    assert math.isnan(gpt_params(10, math.inf, 8192)) and math.isnan(gpt_params(10, 640, 8192, math.nan))


def test_the_trainers_knowledge_imports_without_torch() -> None:
    """The sweep reads model.config/counts/schedule in processes that never load torch (nor must they)."""
    code = ("import sys\n"
            "import sweep.spec, sweep.spec.expr, sweep.spec.pruners, model.config, model.counts, model.schedule\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, loaded\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
