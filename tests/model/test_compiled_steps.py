"""The compiled parts of a training step against the same functions eager: the optimiser's updates
(model.optim.compiled) and the loss (kernels.ops.compiled_cross_entropy) give the same numbers to rounding,
every graph compiles before the clock starts, and the warm-up touches nothing the run holds.

Compiled with inductor on this CPU: one graph per distinct shape, a few seconds each on a cold cache.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import pytest
import torch

from kernels.ops import compiled_cross_entropy, plain_cross_entropy
from model.config import parse_config
from model.gpt import GPT
from model.optim import AdamW, Muon, Optimizers, adamw_update, compiled, muon_update, orthogonalize

SCALAR = torch.tensor  # 0-dim hyperparameters, as the optimisers hold them


@pytest.fixture(autouse=True)
def one_compile_thread() -> Iterator[None]:
    """Inductor compiles in this process, without its pool of compile workers (children the session would
    otherwise end with, on this 2-core machine)."""
    import torch._inductor.config

    with torch._inductor.config.patch(compile_threads=1):
        yield


def _grads(shape: tuple[int, ...], steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * 1e-2 for _ in range(steps)]


def test_a_compiled_muon_update_is_the_eager_one_to_float32_rounding():
    p0 = torch.randn(48, 96, generator=torch.Generator().manual_seed(0)) * 0.1
    runs = []
    for fn in (muon_update, compiled(muon_update)):
        p, buf, second = p0.clone(), torch.zeros_like(p0), torch.zeros(1, 96)
        for g in _grads((48, 96), 4, seed=1):
            fn(p, g, buf, second, SCALAR(0.02), SCALAR(0.9), SCALAR(0.2), SCALAR(0.95), True, True, torch.float32)
        runs.append((p, buf, second))
    (pe, be, se), (pc, bc, sc) = runs
    moved = (pe - p0).abs().max()
    assert moved > 0.01  # four steps of lr 0.02 moved it
    assert (pe - pc).abs().max() <= 1e-4 * moved, ((pe - pc).abs().max(), moved)
    assert torch.allclose(be, bc, rtol=1e-5, atol=1e-8) and torch.allclose(se, sc, rtol=1e-5, atol=1e-12)


def test_muon_steps_same_shape_matrices_as_one_stack_and_lands_where_one_at_a_time_would():
    gen = torch.Generator().manual_seed(6)
    shapes = [(32, 16), (32, 16), (16, 48), (32, 16)]  # three of one shape, one wide
    params = [torch.nn.Parameter(torch.randn(*shape, generator=gen) * 0.1) for shape in shapes]
    alone = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(a) for a in alone]
    seconds = [torch.zeros(r, 1) if r >= c else torch.zeros(1, c) for r, c in shapes]
    hyper = (SCALAR(0.02), SCALAR(0.9), SCALAR(0.2))
    muon = Muon(params, *hyper, beta2=SCALAR(0.95))
    assert sorted(len(stack.params) for stack in muon.stacks[0]) == [1, 3]
    for _ in range(3):
        for p, a, b, s2 in zip(params, alone, bufs, seconds, strict=True):
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
            muon_update(a, p.grad, b, s2, *hyper, SCALAR(0.95), True, True, torch.bfloat16)
        muon.step()
    for p, a, b in zip(params, alone, bufs, strict=True):
        assert torch.equal(p.detach(), a) and torch.equal(muon.state[p]["momentum_buffer"], b)


def test_in_bfloat16_both_orthogonalisations_are_within_the_formats_error_of_the_exact_one():
    g = torch.randn(64, 160, generator=torch.Generator().manual_seed(2)) * 1e-2
    exact = orthogonalize(g.double(), torch.float64).float()
    for x in (orthogonalize(g, torch.bfloat16), compiled(orthogonalize)(g, torch.bfloat16)):
        assert x.dtype == torch.float32
        assert (x - exact).norm() / exact.norm() < 0.08  # bf16 keeps 8 bits; five iterations compound it


def test_a_compiled_adamw_update_is_the_eager_one_to_float32_rounding():
    p0 = torch.randn(40, 24, generator=torch.Generator().manual_seed(3))
    runs = []
    for fn in (adamw_update, compiled(adamw_update)):
        p, m, v, step = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), torch.zeros(())
        for g in _grads((40, 24), 4, seed=4):
            fn(p, g, m, v, step, SCALAR(0.3), 0.8, 0.95, 1e-10, SCALAR(0.1), True)
        runs.append((p, m, v, step))
    (pe, me, ve, se), (pc, mc, vc, sc) = runs
    assert se.item() == sc.item() == 4
    assert torch.allclose(pe, pc, rtol=1e-5, atol=1e-6) and torch.allclose(me, mc) and torch.allclose(ve, vc)
    assert (pe - p0).abs().max() > 0.5  # lr 0.3 for four steps: it moved


# The model of the trainer's compile test below, in its trainer's threads (tiny_config's num_threads):
# inductor's cache keys hold the shapes and the thread count, so that trainer loads this test's optimiser
# graphs instead of compiling them again (about half a minute less on a cold cache, as CI's is).
TRAINER_MODEL = {"depth": 1}


@pytest.fixture
def trainer_threads(tiny_config) -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(tiny_config["num_threads"])
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_optimizers_compile_every_graph_before_the_first_step_and_the_warm_up_changes_nothing(tiny_config,
                                                                                               trainer_threads):
    import torch._dynamo
    from torch._dynamo.utils import counters

    cfg = parse_config({**tiny_config, **TRAINER_MODEL})
    vocab, seq_len, dim = cfg.model.vocab_size, cfg.model.seq_len, cfg.model.model_dim
    torch.manual_seed(0)
    model = GPT(cfg.model)
    eager_model = copy.deepcopy(model)
    opt = Optimizers(model.param_groups(), dim, cfg.optim, torch.device("cpu"))
    eager = Optimizers(eager_model.param_groups(), dim, cfg.optim, torch.device("cpu"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = copy.deepcopy(opt.state_dict())
    torch._dynamo.reset()
    opt.compile()
    assert isinstance(opt.muon, Muon) and isinstance(opt.adamw, AdamW)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the warm-up ran on copies
    after = opt.state_dict()
    for name in ("muon", "adamw"):
        for key, entry in state_before[name]["state"].items():
            assert all(torch.equal(t, after[name]["state"][key][k]) for k, t in entry.items())
    compiled_frames = counters["stats"]["unique_graphs"]
    assert compiled_frames >= 2
    x = torch.randint(0, vocab, (2, seq_len), generator=torch.Generator().manual_seed(5))
    for m, o in ((model, opt), (eager_model, eager)):  # one step from the same weights and the same batch
        m(x, x).backward()
        o.set_progress(0.0)
        o.step()
        o.zero_grad()
    matrices = {id(q) for q in model.param_groups()["matrix"]}
    for (name, a), b, start in zip(eager_model.named_parameters(), model.parameters(), before.values(), strict=True):
        moved, off = (a.detach() - start).abs().max(), (a - b).abs().max()
        # AdamW's tensors to float32 rounding; Muon's within bfloat16's (its Polar Express runs in bfloat16, which
        # inductor rounds once per fused expression where eager rounds after every op)
        assert off <= (0.3 if id(b) in matrices else 1e-5) * moved + 1e-7, (name, off, moved)
    for step in range(1, 3):
        model(x, x).backward()
        opt.set_progress(step / 10)
        opt.step()
        opt.zero_grad()
    assert counters["stats"]["unique_graphs"] == compiled_frames  # nothing compiled once the run began


def test_the_compiled_loss_is_the_plain_chain_to_float32_rounding():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(96, 200, generator=gen) * 4
    targets = torch.randint(0, 200, (96,), generator=gen)
    targets[::11] = -1  # ignored positions, as padding gives them
    runs = []
    for fn in (plain_cross_entropy, compiled_cross_entropy()):
        x = logits.clone().requires_grad_()
        loss = fn(x, targets, 15.0, "mean")
        loss.backward()
        runs.append((loss.detach(), x.grad))
    (le, ge), (lc, gc) = runs
    assert torch.allclose(le, lc, rtol=1e-6) and torch.allclose(ge, gc, rtol=1e-5, atol=1e-9)
    assert not gc[::11].any()  # an ignored target's row has no gradient


@pytest.mark.slow
def test_the_trainer_compiles_before_its_clock_and_records_it(run_trainer, tiny_config):
    """Both compiles on (the defaults outside the tests): their seconds are start-up, the charged steps'
    parts add up to the steps' time, and the run learns as an eager one does."""
    cfg = {**tiny_config, **TRAINER_MODEL, "compile_optimizer": True, "compile_loss": True, "eval_fractions": [0.5]}
    run = run_trainer(cfg, budget_s=4, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    r = run.result
    assert r["status"] == "ok" and r["optimizer_compiled"] and r["loss_compiled"], r
    assert r["startup_seconds"] >= r["optimizer_compile_seconds"] + r["loss_compile_seconds"] > 0
    parts = sum(r[f"{p}_seconds"] for p in ("data", "forward", "backward", "all_reduce", "optimizer", "sync"))
    assert 0.9 * r["step_seconds_sum"] <= parts <= r["step_seconds_sum"]  # the rest: the clock's own instants
    assert r["val_bpb"] < 0.8 * math.log2(tiny_config["vocab_size"])  # a uniform guess is log2(vocab) bits a token
    assert "optimizer compiled in" in run.stderr and "loss compiled in" in run.stderr
