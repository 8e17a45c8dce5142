"""kernels/_nki.py's define_op: every fused op is a PyTorch custom operator with its autograd formula, the
reference and the NKI paths registered by the same code, so torch.compile sees one node per kernel call."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from kernels import _nki
from kernels.ops import get_ops

OP_NAMES = ("rmsnorm", "rmsnorm_bwd", "relu2_mlp", "softcap_ce", "softcap_ce_bwd")


def test_both_paths_are_registered_custom_ops_with_autograd():
    for impl in ("reference", "nki"):
        for name in OP_NAMES:
            assert hasattr(torch.ops.trnsweep, f"{name}_{impl}"), (name, impl)
    x2 = torch.randn(6, 8, dtype=torch.float64)
    torch.library.opcheck(torch.ops.trnsweep.rmsnorm_reference.default, (x2,))
    logits, t = torch.randn(5, 7, dtype=torch.float64), torch.tensor([1, -1, 3, 0, 6])
    torch.library.opcheck(torch.ops.trnsweep.softcap_ce_reference.default, (logits, t, 15.0))
    x, wf, wp = torch.randn(4, 8), torch.randn(16, 8), torch.randn(8, 16)
    torch.library.opcheck(torch.ops.trnsweep.relu2_mlp_reference.default, (x, wf, wp))


def test_define_op_takes_torch_neuronx_nki_op_where_it_exists(monkeypatch):
    """On TorchNeuron the NKI ops go through the documented nki_op; the reference ops never do."""
    calls = []

    def nki_op(name, fn, mutates_args):
        calls.append((name, mutates_args))
        return torch.library.custom_op(name, fn, mutates_args=mutates_args)

    monkeypatch.setattr(_nki, "_nki_op", lambda: nki_op)

    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    op = _nki.define_op("test_define_op_double", double, lambda x: torch.empty_like(x), nki_backed=True)
    assert calls == [("trnsweep::test_define_op_double", ())]
    assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0))
    _nki.define_op("test_define_op_ref", double, lambda x: torch.empty_like(x), nki_backed=False)
    assert len(calls) == 1


@pytest.mark.parametrize("impl", ["reference", "nki"])
def test_a_training_step_compiles_to_one_graph_with_the_ops_as_nodes(fake_nki, impl):
    """fullgraph: no graph break around any kernel call; the NKI path runs on the stand-in inside the graph."""
    ops = get_ops(impl)

    def step(x, w_fc, w_proj, targets):
        return ops.softcap_cross_entropy(ops.relu2_mlp(ops.rms_norm(x), w_fc, w_proj), targets, 15.0)

    torch.manual_seed(0)
    args = (torch.randn(2, 64, 32, requires_grad=True), (torch.randn(96, 32) / 6).requires_grad_(),
            (torch.randn(32, 96) / 10).requires_grad_(), torch.randint(0, 32, (2, 64)))
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    loss = torch.compile(step, fullgraph=True, backend=counter)(*args)
    grads = torch.autograd.grad(loss, args[:3])
    assert counter.frame_count == 1
    eager = step(*args)
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-5)
    for g, ge in zip(grads, torch.autograd.grad(eager, args[:3]), strict=True):
        torch.testing.assert_close(g, ge, rtol=1e-4, atol=1e-5)
    graph_ops = {str(n.target) for g in counter.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert {f"trnsweep.rmsnorm_{impl}.default", f"trnsweep.relu2_mlp_{impl}.default",
            f"trnsweep.softcap_ce_{impl}.default"} <= graph_ops


def test_launch_calls_kernels_through_torch_neuronx_wrap_nki_where_it_exists(monkeypatch):
    """Inside an nki_op TorchNeuron's tracing cannot see a raw kernel call; its source wraps kernels in
    wrap_nki (a higher-order op), so launch does too, once per kernel, at the node's LNC degree."""
    monkeypatch.delenv("NKI_SIMULATOR", raising=False)
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "2")
    calls: list[tuple[object, ...]] = []

    class Launcher:
        def __init__(self, tag: str) -> None:
            self.tag = tag

        def __getitem__(self, lnc: int):
            return lambda *args: calls.append((self.tag, lnc, args)) or self.tag

    kernel = Launcher("raw")
    wrapped: list[object] = []

    def wrap_nki(k):
        wrapped.append(k)
        return Launcher("wrapped")

    monkeypatch.setattr(_nki, "_WRAPPED", {})
    monkeypatch.setattr(_nki, "_wrap_nki", lambda: wrap_nki)
    assert _nki.launch(kernel, 1) == "wrapped" and _nki.launch(kernel, 2) == "wrapped"
    assert wrapped == [kernel] and calls == [("wrapped", 2, (1,)), ("wrapped", 2, (2,))]
    monkeypatch.setattr(_nki, "_wrap_nki", lambda: None)  # no TorchNeuron: the kernel itself
    assert _nki.launch(kernel, 3) == "raw" and calls[-1] == ("raw", 2, (3,))
