"""The public recipe's features in the trainer (docs/recipe.md): shapes, placement, counts, what each changes,
that a few steps with each one on still fit a batch, and one-line refusals of bad settings."""

from __future__ import annotations

import pytest
import torch

from model import counts
from model.config import ConfigError, GPTConfig, OptimConfig, parse_config
from model.gpt import GPT, window_mask
from model.optim import AdamW, Muon, Optimizers, normuon


def tiny(**overrides) -> GPTConfig:
    base = dict(vocab_size=300, depth=4, model_dim=64, head_dim=32, seq_len=32)
    return GPTConfig(**{**base, **overrides})


def test_the_defaults_carry_the_recipe():
    cfg, opt = GPTConfig(), OptimConfig()
    assert cfg.value_embeds and cfg.residual_scalars and cfg.ve_gate_channels == 32 and cfg.ve_gate_scale == 2.0
    assert cfg.x0_init == 0.1 and cfg.softcap == 15.0 and cfg.window_pattern == "SSSL"
    assert opt.normuon and opt.muon_beta2 == 0.95 and opt.x0_beta1 == 0.96


@pytest.mark.parametrize("depth, layers", [(1, {0}), (3, {0, 2}), (4, {1, 3}), (5, {0, 2, 4})])
def test_value_embeddings_alternate_back_from_the_last_layer_with_gates(depth, layers):
    model = GPT(tiny(depth=depth, n_kv_head=1))
    assert {int(k) for k in model.value_embeds} == layers and counts.value_embed_layers(model.config) == len(layers)
    for i, block in enumerate(model.blocks):
        gate = block.attn.ve_gate
        assert (gate is not None) == (i in layers)
        if gate is not None:  # one output per K/V head, reading the first 32 channels; zero: a neutral start
            assert gate.weight.shape == (1, 32) and not gate.weight.any()
    assert sum(p.numel() for p in model.parameters()) == counts.num_params(model.config)


def test_the_gate_scales_the_value_embedding_per_token():
    torch.manual_seed(0)
    x = torch.randint(0, 300, (2, 32))
    ungated = GPT(tiny(ve_gate_channels=0))
    with torch.no_grad():  # output projections start at zero: give attention something to say
        for b in ungated.blocks:
            b.attn.c_proj.weight.normal_(std=0.1)
    gated = GPT(tiny())
    state = {k: v for k, v in ungated.state_dict().items()}
    missing = gated.load_state_dict(state, strict=False).missing_keys
    assert sorted(missing) == ["blocks.1.attn.ve_gate.weight", "blocks.3.attn.ve_gate.weight"]
    # A zero gate is 2 * sigmoid(0) = 1: the same as no gate at all.
    assert torch.allclose(gated(x), ungated(x), atol=1e-5)
    with torch.no_grad():
        gated.blocks[3].attn.ve_gate.weight.fill_(-50.0)  # the last layer's share near 0 for most tokens
    assert not torch.allclose(gated(x), ungated(x), atol=1e-3)


def test_residual_scalars_start_at_one_and_x0_init_and_train_at_their_own_rates():
    model = GPT(tiny(x0_init=0.25))
    assert torch.equal(model.resid_lambdas.data, torch.ones(4))
    assert torch.equal(model.x0_lambdas.data, torch.full((4,), 0.25))
    groups = model.param_groups()
    assert groups["resid"] == [model.resid_lambdas] and groups["x0"] == [model.x0_lambdas]
    opt = Optimizers(groups, 64, OptimConfig(scalar_lr=0.4, x0_beta1=0.9), torch.device("cpu"))
    rates = {id(g["params"][0]): (float(g["lr"]), g["betas"]) for g in opt.adamw.param_groups}
    assert rates[id(model.resid_lambdas)][0] == pytest.approx(0.004)
    assert rates[id(model.x0_lambdas)] == (pytest.approx(0.4), (0.9, 0.95))


def test_windows_tile_the_pattern_and_keep_the_last_layer_full():
    assert tiny(depth=6, window_pattern="SSSL", seq_len=256).window_sizes() == [128, 128, 128, 256, 128, 256]
    assert tiny(depth=3, window_pattern="s", short_window=40, seq_len=64).window_sizes() == [40, 40, 64]
    assert tiny(depth=2, window_pattern="SL", short_window=999).window_sizes() == [32, 32]
    mask = window_mask(5, 2, torch.device("cpu"))
    assert mask.tolist() == [[j in (i - 1, i) for j in range(5)] for i in range(5)]
    assert window_mask(5, 5, torch.device("cpu")) is None and window_mask(5, 0, torch.device("cpu")) is None


def test_a_window_changes_what_attention_sees_and_a_window_of_the_whole_sequence_does_not():
    torch.manual_seed(0)
    base = GPT(tiny(depth=2, window_pattern="L"))
    with torch.no_grad():  # output projections start at zero: give attention something to say
        for b in base.blocks:
            b.attn.c_proj.weight.normal_(std=0.1)
    x = torch.randint(0, 300, (2, 32))
    for pattern, short, same in (("SL", 32, True), ("SL", 4, False)):
        other = GPT(tiny(depth=2, window_pattern=pattern, short_window=short))
        other.load_state_dict(base.state_dict())
        assert torch.allclose(other(x), base(x), atol=1e-5) == same, (pattern, short)
    # A longer input than seq_len: the windowed layer keeps its window, the full layer stays full.
    longer = GPT(tiny(depth=2, window_pattern="SL", short_window=4))
    assert longer.windows == [4, 0] and longer(torch.randint(0, 300, (1, 64))).shape == (1, 64, 300)


def test_smear_and_backout_start_neutral_and_count():
    torch.manual_seed(0)
    plain = GPT(tiny())
    extras = GPT(tiny(smear=True, backout=True))
    assert extras.smear_gate.weight.shape == (1, 24) and float(extras.smear_lambda.detach()) == 0.0
    assert float(extras.backout_lambda.detach()) == pytest.approx(0.2)
    extras.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        extras.backout_lambda.zero_()
    assert torch.allclose(extras(x), plain(x), atol=1e-5)  # smear's lambda starts at 0; backout zeroed
    assert counts.num_params(extras.config) - counts.num_params(plain.config) == 24 + 1 + 1
    assert counts.num_params(GPTConfig(vocab_size=50, depth=1, model_dim=16, head_dim=16, smear=True,
                                       value_embeds=False, residual_scalars=False)) == 2 * 50 * 16 + 12 * 16**2 + 17


def test_qk_scale_and_init_scales():
    torch.manual_seed(0)
    cfg = tiny(embed_init_std=0.5, fc_init_scale=0.25, qk_scale=1.2)
    model = GPT(cfg)
    assert model.wte.weight.std().item() == pytest.approx(0.5, rel=0.05)
    bound = 3**0.5 * 64**-0.5
    assert model.blocks[0].mlp.c_fc.weight.abs().max().item() <= bound * 0.25
    assert model.blocks[0].attn.c_q.weight.abs().max().item() > bound * 0.9
    base = GPT(tiny())
    with torch.no_grad():
        for b in base.blocks:
            b.attn.c_proj.weight.normal_(std=0.1)
    sharper = GPT(tiny(qk_scale=1.2))
    sharper.load_state_dict(base.state_dict())
    x = torch.randint(0, 300, (1, 32))
    assert not torch.allclose(sharper(x), base(x), atol=1e-4)


def test_normuon_keeps_the_update_norm_and_evens_out_rows():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 16))
    w.grad = torch.randn(64, 16) * torch.linspace(0.1, 3, 64)[:, None]  # rows of very different scales
    second = torch.zeros(64, 1)
    update = torch.randn(64, 16) * torch.linspace(0.5, 2, 64)[:, None]
    out = normuon(update, second, torch.tensor(0.0))  # beta2 0: this step's own mean squares
    assert out.norm().item() == pytest.approx(update.norm().item(), rel=1e-4)
    row_rms = out.square().mean(dim=1).sqrt()
    assert (row_rms.max() / row_rms.min()).item() == pytest.approx(1.0, rel=1e-3)
    wide = Muon([torch.nn.Parameter(torch.randn(8, 32))], torch.tensor(0.01), torch.tensor(0.9), torch.tensor(0.0),
                beta2=torch.tensor(0.95))
    assert next(iter(wide.state.values()))["second_moment"].shape == (1, 32)


def test_adamw_matches_torchs():
    torch.manual_seed(0)
    ours_p, ref_p = torch.nn.Parameter(torch.randn(20, 8)), None
    ref_p = torch.nn.Parameter(ours_p.detach().clone())
    ours = AdamW([ours_p], lr=torch.tensor(0.01), betas=(0.8, 0.95), eps=1e-10, weight_decay=torch.tensor(0.1))
    ref = torch.optim.AdamW([ref_p], lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)
    for _ in range(5):
        g = torch.randn(20, 8)
        ours_p.grad, ref_p.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.allclose(ours_p, ref_p, atol=1e-6)


@pytest.mark.parametrize("overrides", [
    {}, {"smear": True, "backout": True}, {"window_pattern": "SSSL", "short_window": 8}, {"qk_scale": 1.2},
    {"ve_gate_channels": 0}, {"normuon": False}, {"value_embeds": False, "residual_scalars": False},
    {"ve_gate_channels": 12, "ve_gate_scale": 3.0, "embed_init_std": 0.8, "fc_init_scale": 0.4, "rope_base": 1e5},
], ids=lambda o: ",".join(o) or "defaults")
def test_a_few_steps_fit_a_batch_with_each_feature(overrides):
    torch.manual_seed(0)
    cfg = parse_config({"vocab_size": 300, "depth": 4, "model_dim": 64, "head_dim": 32, "seq_len": 32, **overrides})
    model = GPT(cfg.model)
    opt = Optimizers(model.param_groups(), cfg.model.model_dim, cfg.optim, torch.device("cpu"))
    x = torch.randint(0, 300, (4, 32))
    y = torch.roll(x, -1, dims=1)
    losses = []
    for step in range(12):
        opt.set_progress(step / 12)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("values, message", [
    ({"window_pattern": "SXL"}, "window_pattern must be a non-empty string of S and L"),
    ({"window_pattern": ""}, "window_pattern"),
    ({"ve_gate_channels": -1}, "ve_gate_channels must not be negative"),
    ({"short_window": -1}, "short_window must not be negative"),
    ({"qk_scale": 0.0}, "qk_scale must be positive"),
    ({"fc_init_scale": -1.0}, "fc_init_scale must be positive"),
    ({"muon_beta2": 1.5}, "muon_beta2 must lie in"),
    ({"x0_beta1": 2.0}, "x0_beta1 must lie in"),
    ({"smear": "yes"}, "config key 'smear' expects bool"),
    ({"window_pattern": 4}, "config key 'window_pattern' expects str"),
])
def test_bad_recipe_settings_are_refused_in_one_line(values, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_config(values)
    assert "\n" not in str(err.value)
