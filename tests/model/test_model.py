"""The GPT, its optimiser and schedules, and val_bpb on hand-made inputs (no data pipeline needed)."""

import math

import pytest
import torch

from model.config import ConfigError, GPTConfig, OptimConfig, parse_config
from model.evaluate import evaluate_bpb
from model.gpt import GPT
from model.optim import Optimizers, orthogonalize
from model.schedule import lr_multiplier, muon_momentum


def tiny(**overrides) -> GPTConfig:
    base = dict(vocab_size=300, depth=2, model_dim=64, head_dim=16, seq_len=32)
    return GPTConfig(**{**base, **overrides})


def test_zero_head_gives_uniform_loss_and_bpb_identity():
    torch.manual_seed(0)
    model = GPT(tiny(head_init_std=0.0))
    vocab = model.config.vocab_size
    token_bytes = torch.randint(1, 5, (vocab,), dtype=torch.int32)
    token_bytes[0] = 0  # a special token: neither its nats nor its bytes count
    x = torch.randint(0, vocab, (3, 4, 32))
    y = torch.randint(0, vocab, (3, 4, 32))
    y[0, 0, :5] = 0
    y[1, 1, -3:] = -1  # padding
    res = evaluate_bpb(model, list(zip(x, y, strict=True)), token_bytes, torch.device("cpu"))
    counted = (y >= 0) & (token_bytes[y.clamp(min=0)] > 0)
    assert res.tokens == int(counted.sum())
    assert res.bytes == int(token_bytes[y[y >= 0]].sum())
    assert res.val_loss == pytest.approx(math.log(vocab), rel=1e-6)
    assert res.val_bpb == pytest.approx(res.val_loss * res.tokens / (math.log(2) * res.bytes), rel=1e-9)


def test_bpb_rows_and_standard_error_of_a_sample():
    # Hand-made rows: row i's targets have losses losses[i] (nats) and bytes of 1 each; row 3 is padding.
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 0.5], [2.0, 0.0, 2.0, 0.0], [9.0, 9.0, 9.0, 9.0]])

    class Fixed(torch.nn.Module):
        def forward(self, x, y, reduction="mean"):
            return losses.reshape(-1)

    y = torch.ones(4, 4, dtype=torch.long)
    y[3] = -1
    res = evaluate_bpb(Fixed(), [(torch.zeros(4, 4, dtype=torch.long), y)], torch.ones(5, dtype=torch.int32),
                       torch.device("cpu"))
    assert (res.rows, res.tokens, res.bytes, res.nats) == (3, 12, 12, 16.0)
    # Worked by hand: rows' nats 10, 2, 4 over 4 bytes each; r = 16/12; residuals 10 - 16/3, 2 - 16/3,
    # 4 - 16/3 = 14/3, -10/3, -4/3; s² = (196 + 100 + 16) / 9 / 2 = 52/3; out of 10 rows:
    # se = sqrt((1 - 3/10) * 52/3 / 3) / 4 / ln 2.
    assert res.stderr(10) == pytest.approx(math.sqrt(0.7 * 52 / 9) / 4 / math.log(2), rel=1e-12)
    assert res.stderr(3) == 0.0  # every row scored: exact


def test_bpb_totals_are_the_float64_sums_the_device_used_to_hold():
    """The totals moved to the host (no float64 on a NeuronCore) are bit for bit the old float64 sums."""
    torch.manual_seed(1)
    model = GPT(tiny(head_init_std=0.02))
    token_bytes = torch.randint(0, 6, (300,), dtype=torch.int32)
    batches = [(torch.randint(0, 300, (4, 32)), torch.randint(-1, 300, (4, 32))) for _ in range(3)]
    # fast=False: the old loop's own cross-entropy (the fast path's chunked one agrees to float rounding,
    # tests/model/test_evaluate.py), so that only the accumulation is compared here.
    res = evaluate_bpb(model, batches, token_bytes, torch.device("cpu"), fast=False)
    nats = torch.zeros((), dtype=torch.float64)
    xx = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for x, y in batches:  # the old accumulation, written out
            nbytes = torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0)
            row_nats = (model(x, y, reduction="none").double().reshape(4, -1) * (nbytes > 0)).sum(1)
            nats += row_nats.sum()
            xx += (row_nats * row_nats).sum()
    assert res.nats == float(nats) and res.row_moments[0] == float(xx)


def test_a_model_evaluates_past_its_training_length_as_a_longer_one_does():
    torch.manual_seed(0)
    short = GPT(tiny(seq_len=16, head_init_std=0.02))
    longer = GPT(tiny(seq_len=64))
    longer.load_state_dict(short.state_dict())
    x = torch.randint(0, 300, (2, 64))
    assert torch.equal(short(x), longer(x))  # the tables grow to 64 with the values a 64-table has
    assert short.cos.size(1) == 64 and torch.equal(short.cos, longer.cos)
    assert torch.equal(short(x[:, :16]), longer(x[:, :16]))


def test_baseline_parameter_count_matches_competition_formula():
    # depth 10, width 640, vocab 8192: 2*8192*640 + 10*12*640^2 (docs/competition.md), without the recipe's extras
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=8192, depth=10, model_dim=640, head_dim=128, seq_len=2048,
                              value_embeds=False, residual_scalars=False))
    assert model.num_params() == 2 * 8192 * 640 + 10 * 12 * 640**2
    assert model.flops_per_token() > 6 * 10 * 12 * 640**2


def test_aspect_ratio_and_gqa_and_extras_build_and_run():
    cfg = tiny(model_dim=0, aspect_ratio=24, depth=3, n_kv_head=1, value_embeds=True, residual_scalars=True)
    assert cfg.model_dim == 80 and cfg.n_head == 5  # 3 * 24 = 72, rounded up to a multiple of 16
    model = GPT(cfg)
    loss = model(torch.randint(0, 300, (2, 32)), torch.randint(0, 300, (2, 32)))
    loss.backward()
    groups = model.param_groups()
    assert sum(p.numel() for g in groups.values() for p in g) == model.num_params()
    assert all(p.ndim == 2 for p in groups["matrix"])
    assert len(groups["embedding"]) == 3  # wte and the value embeddings of layers 0 and 2 (the last)


@pytest.mark.parametrize("overrides, message", [
    (dict(model_dim=70), "not divisible by head_dim"),
    (dict(n_kv_head=3), "does not divide"),
    (dict(head_dim=15, model_dim=60), "even"),
    (dict(depth=0), "depth must be positive"),
])
def test_inconsistent_model_config_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


@pytest.mark.parametrize("shape", [(64, 64), (128, 32), (32, 200), (640, 2560)])
def test_orthogonalize_pushes_singular_values_near_one(shape):
    torch.manual_seed(1)
    s = torch.linalg.svdvals(orthogonalize(torch.randn(*shape)).float())
    assert s.min() > 0.7 and s.max() < 1.3
    assert s.mean() == pytest.approx(1.0, abs=0.08)


def test_schedules_follow_progress():
    assert lr_multiplier(0.0, 0.1, 0.5, 0.0) == pytest.approx(0.0, abs=1e-6)
    assert lr_multiplier(0.05, 0.1, 0.5, 0.0) == pytest.approx(0.5, rel=1e-4)
    assert lr_multiplier(0.3, 0.1, 0.5, 0.0) == 1.0
    assert lr_multiplier(0.75, 0.1, 0.5, 0.1) == pytest.approx(0.55)
    assert lr_multiplier(1.0, 0.1, 0.5, 0.1) == pytest.approx(0.1)
    assert muon_momentum(0.0, 0.85, 0.95, 0.2) == pytest.approx(0.85)
    assert muon_momentum(0.1, 0.85, 0.95, 0.2) == pytest.approx(0.90)
    assert muon_momentum(0.5, 0.85, 0.95, 0.2) == pytest.approx(0.95)
    assert muon_momentum(0.0, 0.85, 0.95, 0.0) == 0.95  # no ramp


def test_scheduled_scalars_are_filled_in_place():
    model = GPT(tiny())
    opt = Optimizers(model.param_groups(), 64, OptimConfig(warmdown_ratio=0.5, weight_decay=0.2),
                     torch.device("cpu"))
    lr_tensor = opt.muon_lr
    opt.set_progress(0.75)
    assert opt.muon_lr is lr_tensor and lr_tensor.ndim == 0
    assert float(lr_tensor) == pytest.approx(0.04 * 0.5)
    assert float(opt.muon_wd) == pytest.approx(0.2 * 0.25)


def test_optimizer_fits_a_fixed_batch():
    torch.manual_seed(0)
    model = GPT(tiny())
    opt = Optimizers(model.param_groups(), 64, OptimConfig(), torch.device("cpu"))
    x = torch.randint(0, 300, (4, 32))
    y = x.roll(-1, dims=1)
    first = None
    for i in range(40):
        opt.set_progress(i / 40)
        loss = model(x, y)
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < first / 4


@pytest.mark.parametrize("values, message", [
    ({"depht": 4}, "unknown config key 'depht'"),
    ({"model_dim": 100, "head_dim": 32}, "not divisible by head_dim"),
    ({"budget_s": -1}, "budget_s must be positive"),
    ({"depth": "four"}, "config key 'depth' expects int"),
    ({"fault": "hang"}, "unknown config key 'fault'"),  # fault injection is TRNSWEEP_FAULT's (model.faults)
    ({"warmup_ratio": 0.6, "warmdown_ratio": 0.6}, "must not exceed 1"),
])
def test_bad_config_is_refused_with_the_key_named(values, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(values)


def test_config_round_trips_through_its_resolved_dict():
    cfg = parse_config({"depth": 3, "matrix_lr": 0.03, "eval_fractions": [0.5]}, budget_s=12)
    resolved = cfg.to_dict()
    assert resolved["budget_s"] == 12.0 and resolved["model_dim"] == 96
    assert parse_config(resolved).to_dict() == resolved


def test_compiled_steps_never_recompile_as_the_schedule_moves():
    """Scheduled scalars are 0-dim tensors, so a moving lr leaves the compiled graphs as they were."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = []

    def counting_backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    model = GPT(tiny())
    opt = Optimizers(model.param_groups(), 64, OptimConfig(warmup_ratio=0.3, warmdown_ratio=0.5),
                     torch.device("cpu"))
    opt.compile(counting_backend)
    step_model = torch.compile(model, backend=counting_backend)
    x = torch.randint(0, 300, (4, 32))
    lrs, graphs_after = [], []
    for i in range(6):
        opt.set_progress(i / 5)
        lrs.append(float(opt.muon_lr))
        step_model(x, x.roll(-1, 1)).backward()
        opt.step()
        opt.zero_grad()
        graphs_after.append(len(compiled))
    assert len(set(lrs)) == 6  # the learning rate really changed every step
    # The model once; the updates once per stack of same-shape matrices and per AdamW tensor shape, all at
    # compile() (Optimizers.warm_up), before the first step.
    shapes = {tuple(s.params[0].shape) for s in opt.muon.stacks[0]}
    adam = {(tuple(p.shape), g["betas"]) for g in opt.adamw.param_groups for p in g["params"]}
    assert graphs_after[0] == 1 + len(shapes) + len(adam) == graphs_after[-1], (graphs_after, shapes, adam)
    assert sum(counters["graph_break"].values()) == 0
