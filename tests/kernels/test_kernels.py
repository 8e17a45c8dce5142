"""kernels/: the reference ops against plain PyTorch (values and gradients), get_ops' choices, and the NKI
kernels run on the CPU.

The NKI kernels run through `kernels._fake_nki` (a NumPy stand-in for the API subset they use), or through the
real `nki.simulate` instead in a run started with NKI_SIMULATOR=1 where AWS's nki package is installed (docs/neuron.md;
docs/testing.md says what no run here exercises).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck

import kernels
from kernels import _nki
from kernels import ops as ops_module
from kernels.ops import Ops, get_ops
from kernels.relu2_mlp import relu2_mlp
from kernels.rmsnorm import rms_norm
from kernels.softcap_ce import softcap_cross_entropy

KERNELS_DIR = Path(kernels.__file__).parent


def plain_mlp(x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> torch.Tensor:
    return F.linear(F.relu(F.linear(x, w_fc)).square(), w_proj)


def plain_ce(logits: torch.Tensor, targets: torch.Tensor, softcap: float, reduction: str) -> torch.Tensor:
    z = logits.float() if logits.dtype != torch.float64 else logits
    if softcap > 0:
        z = softcap * torch.tanh(z / softcap)
    out = F.cross_entropy(z.reshape(-1, z.size(-1)), targets.reshape(-1), ignore_index=-1, reduction=reduction)
    return out.view(targets.shape) if reduction == "none" else out


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Elementwise closeness relative to the tensor's scale: sums over many terms have no per-element ulp bound."""
    scale = expected.detach().abs().max().item() or 1.0
    torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale)


# ------------------------------------------------------------------------------------------------ get_ops
def test_get_ops_reference_and_auto_on_a_cpu_machine(monkeypatch):
    monkeypatch.setattr(_nki, "neuron_device_available", lambda: False)
    assert get_ops("reference") == Ops("reference")
    assert get_ops("auto").impl == "torch"
    monkeypatch.setattr(_nki, "NKI_AVAILABLE", True)  # nki importable but no NeuronCore: still plain torch
    assert get_ops("auto").impl == "torch"


def test_plain_torch_ops_match_the_reference_ops_and_their_gradients():
    torch.manual_seed(0)
    plain, ref = get_ops("torch"), get_ops("reference")
    x = torch.randn(2, 16, 32, dtype=torch.float64, requires_grad=True)
    w_fc = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    w_proj = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(24, 50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (24,))
    targets[:3] = -1
    for reduction in ("mean", "none"):
        outs = []
        for ops in (plain, ref):
            y = ops.relu2_mlp(ops.rms_norm(x), w_fc, w_proj).sum()
            loss = ops.softcap_cross_entropy(logits, targets, 15.0, reduction).sum()
            grads = torch.autograd.grad(y + loss, (x, w_fc, w_proj, logits))
            outs.append((y.detach(), loss.detach(), grads))
        (y0, l0, g0), (y1, l1, g1) = outs
        torch.testing.assert_close(y0, y1)
        torch.testing.assert_close(l0.double(), l1.double())
        for a, b in zip(g0, g1, strict=True):
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-6)


def test_get_ops_nki_without_nki_raises_one_line(monkeypatch):
    monkeypatch.setattr(_nki, "NKI_AVAILABLE", False)
    monkeypatch.setattr(_nki, "NKI_IMPORT_ERROR", "ModuleNotFoundError: No module named 'nki'")
    with pytest.raises(ValueError) as info:
        get_ops("nki")
    message = str(info.value)
    assert "\n" not in message and "nki" in message and "not importable" in message


def test_get_ops_nki_needs_a_device_or_the_simulator(monkeypatch):
    monkeypatch.setattr(_nki, "NKI_AVAILABLE", True)
    monkeypatch.setattr(_nki, "neuron_device_available", lambda: False)
    monkeypatch.delenv("NKI_SIMULATOR", raising=False)
    with pytest.raises(ValueError, match="NeuronCore"):
        get_ops("nki")
    monkeypatch.setenv("NKI_SIMULATOR", "1")
    assert get_ops("nki").impl == "nki"


def test_get_ops_rejects_unknown_impl():
    with pytest.raises(ValueError, match="reference, nki, auto"):
        get_ops("triton")


def test_only_the_import_check_imports_nki():
    """`import kernels` must work without the Neuron SDK: no module but kernels/_nki.py imports nki."""
    for path in KERNELS_DIR.glob("*.py"):
        if path.name == "_nki.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "nki" or n.startswith("nki.") for n in names), f"{path.name} imports nki"
    assert "kernels.nki_kernels" not in sys.modules or _nki.NKI_AVAILABLE


# ------------------------------------------------------------------------------------------------ RMSNorm
def test_rms_norm_gradcheck_float64():
    x = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    assert gradcheck(rms_norm, (x,))
    torch.testing.assert_close(rms_norm(x), F.rms_norm(x, (8,)), rtol=0, atol=0)


@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_functional(dtype, rel):
    x = torch.randn(4, 256, 640).mul(3).to(dtype)
    x, xr = leaves(x, x)
    y, yr = rms_norm(x), F.rms_norm(xr, (640,))
    assert y.dtype == dtype
    torch.testing.assert_close(y, yr, rtol=0, atol=0)  # same ops in the same order: bitwise
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    assert x.grad.dtype == dtype
    assert_close_scaled(x.grad.float(), xr.grad.float(), rel)


# ------------------------------------------------------------------------------------------------ ReLU² MLP
def test_relu2_mlp_gradcheck_float64():
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w_fc = torch.randn(16, 8, dtype=torch.float64, requires_grad=True)
    w_proj = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    assert gradcheck(relu2_mlp, (x, w_fc, w_proj))


def test_relu2_mlp_matches_plain_float32():
    x, w_fc, w_proj = leaves(torch.randn(4, 128, 256), torch.randn(1024, 256) / 16, torch.randn(256, 1024) / 32)
    xr, wfr, wpr = leaves(x, w_fc, w_proj)
    y, yr = relu2_mlp(x, w_fc, w_proj), plain_mlp(xr, wfr, wpr)
    assert_close_scaled(y, yr, 1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    for a, b in ((x, xr), (w_fc, wfr), (w_proj, wpr)):
        assert_close_scaled(a.grad, b.grad, 1e-5)


def test_relu2_mlp_under_bf16_autocast_matches_linear():
    x, w_fc, w_proj = leaves(torch.randn(2, 64, 128), torch.randn(512, 128) / 11, torch.randn(128, 512) / 22)
    xr, wfr, wpr = leaves(x, w_fc, w_proj)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, yr = relu2_mlp(x, w_fc, w_proj), plain_mlp(xr, wfr, wpr)
    assert y.dtype == yr.dtype == torch.bfloat16
    assert_close_scaled(y.float(), yr.float(), 1e-2)
    g = torch.randn_like(y)
    y.backward(g)
    yr.backward(g)
    for a, b in ((x, xr), (w_fc, wfr), (w_proj, wpr)):
        assert a.grad.dtype == b.grad.dtype == torch.float32
        assert_close_scaled(a.grad, b.grad, 2e-2)


# ------------------------------------------------------------------------------------------------ softcapped CE
@pytest.mark.parametrize("softcap", [15.0, 0.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_softcap_ce_gradcheck_float64(softcap, reduction):
    logits = (torch.randn(2, 5, 11, dtype=torch.float64) * 4).requires_grad_()
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 1] = targets[1, 3] = -1
    assert gradcheck(lambda lg: softcap_cross_entropy(lg, targets, softcap, reduction), (logits,))
    torch.testing.assert_close(softcap_cross_entropy(logits, targets, softcap, reduction),
                               plain_ce(logits, targets, softcap, reduction))


@pytest.mark.parametrize("softcap", [15.0, 0.0])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_softcap_ce_matches_plain_float32(softcap, reduction):
    targets = torch.randint(0, 8192, (2, 256))
    targets[:, :9] = -1
    logits = torch.randn(2, 256, 8192) * 6
    logits, lr = leaves(logits, logits)
    loss, ref = softcap_cross_entropy(logits, targets, softcap, reduction), plain_ce(lr, targets, softcap,
                                                                                             reduction)
    assert loss.dtype == torch.float32 and loss.shape == ref.shape
    assert_close_scaled(loss, ref, 1e-6)
    g = torch.rand_like(loss)
    loss.backward(g)
    ref.backward(g)
    assert_close_scaled(logits.grad, lr.grad, 1e-5)


def test_softcap_ce_ignored_targets_contribute_nothing():
    logits = torch.randn(3, 4, 50, requires_grad=True)
    targets = torch.randint(0, 50, (3, 4))
    targets[1] = -1
    per_token = softcap_cross_entropy(logits, targets, 15.0, "none")
    assert torch.all(per_token[1] == 0) and torch.all(per_token[0] > 0)
    per_token.sum().backward()
    assert torch.all(logits.grad[1] == 0)
    mean = softcap_cross_entropy(logits, targets, 15.0, "mean")
    torch.testing.assert_close(mean, per_token.sum() / 8)


def test_softcap_ce_bf16_logits_compute_in_float32():
    logits = (torch.randn(4, 64, 1000) * 5).bfloat16()
    logits, lr = leaves(logits, logits)
    targets = torch.randint(0, 1000, (4, 64))
    loss, ref = softcap_cross_entropy(logits, targets, 15.0), plain_ce(lr, targets, 15.0, "mean")
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    loss.backward()
    ref.backward()
    assert logits.grad.dtype == torch.bfloat16
    assert_close_scaled(logits.grad.float(), lr.grad.float(), 1e-2)


def test_softcap_ce_rejects_bad_arguments():
    logits, targets = torch.randn(2, 7), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="reduction"):
        softcap_cross_entropy(logits, targets, 15.0, "max")
    with pytest.raises(ValueError, match="softcap"):
        softcap_cross_entropy(logits, targets, -1.0)


def test_reference_ops_compile_without_graph_breaks():
    ops = get_ops("reference")

    def step(x, w_fc, w_proj, targets):
        return ops.softcap_cross_entropy(ops.relu2_mlp(ops.rms_norm(x), w_fc, w_proj), targets, 15.0)

    args = (torch.randn(2, 8, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True),
            torch.randn(16, 32, requires_grad=True), torch.randint(0, 16, (2, 8)))
    torch._dynamo.reset()
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    loss.backward()
    torch.testing.assert_close(loss, step(*args))


# ------------------------------------------------------------------------------------------ NKI kernels on the CPU
def run_both(fn, *inputs: torch.Tensor) -> tuple[tuple[torch.Tensor, list], tuple[torch.Tensor, list]]:
    """fn(impl, *inputs) on the nki and reference paths, each with its own leaves; (output, input grads) per path."""
    results = []
    grad = None
    for impl in ("nki", "reference"):
        args = leaves(*inputs)
        out = fn(impl, *args)
        grad = torch.randn_like(out) if grad is None else grad
        out.backward(grad)
        results.append((out, [a.grad for a in args if a.requires_grad]))
    return results[0], results[1]


@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_nki_rms_norm(nki_cpu, lnc, dtype, rel):
    """bfloat16 goes into the kernel as bfloat16 (the stand-in holds it so; nki.simulate takes torch tensors)."""
    assert get_ops("nki").impl == "nki"
    for shape in ((300, 96), (2, 70, 640)):  # ragged row tiles; a width over 512
        (y, grads), (yr, grads_r) = run_both(lambda impl, x: rms_norm(x, impl=impl),
                                             (torch.randn(shape) * 2).to(dtype))
        assert y.dtype == dtype and grads[0].dtype == dtype
        assert not torch.isnan(y).any()
        assert_close_scaled(y.float(), yr.float(), rel)
        assert_close_scaled(grads[0].float(), grads_r[0].float(), rel)


@pytest.mark.parametrize("dtype, rel", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_nki_relu2_mlp(nki_cpu, lnc, dtype, rel):
    # 1200 tokens: two full 512-token blocks and a ragged one; dim 160 and mlp_dim 400 are not multiples of 128.
    inputs = (torch.randn(2, 600, 160), torch.randn(400, 160) / 13, torch.randn(160, 400) / 20)
    (y, grads), (yr, grads_r) = run_both(lambda impl, *a: relu2_mlp(*a, impl=impl), *(t.to(dtype) for t in inputs))
    assert y.dtype == dtype
    assert not torch.isnan(y).any()
    assert_close_scaled(y.float(), yr.float(), rel)
    for g, gr in zip(grads, grads_r, strict=True):
        assert_close_scaled(g.float(), gr.float(), rel)


@pytest.mark.parametrize("softcap", [15.0, 0.0])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_nki_softcap_ce(nki_cpu, lnc, softcap, reduction):
    # 300 rows (ragged tile), 5000 classes (two full 2048-column chunks and a ragged one), some ignored.
    targets = torch.randint(0, 5000, (3, 100))
    targets[0, :7] = -1
    targets[2, 50] = 4999

    def ce(impl, logits):
        return softcap_cross_entropy(logits, targets, softcap, reduction, impl=impl)

    (loss, grads), (ref, grads_r) = run_both(ce, torch.randn(3, 100, 5000) * 5)
    assert not torch.isnan(loss).any()
    assert_close_scaled(loss, ref, 1e-5)
    assert_close_scaled(grads[0], grads_r[0], 1e-5)


def test_nki_softcap_ce_bf16_logits(nki_cpu):
    """bfloat16 logits straight into the kernel: float32 loss, bfloat16 gradient, as the reference gives."""
    targets = torch.randint(0, 3000, (2, 150))
    targets[1, :5] = -1

    def ce(impl, logits):
        return softcap_cross_entropy(logits, targets, 15.0, "mean", impl=impl)

    (loss, grads), (ref, grads_r) = run_both(ce, (torch.randn(2, 150, 3000) * 5).bfloat16())
    assert loss.dtype == torch.float32 and grads[0].dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    assert_close_scaled(grads[0].float(), grads_r[0].float(), 2e-2)


def test_get_ops_auto_is_plain_torch_even_with_a_neuron_core(monkeypatch):
    """Only the trainer (model.kernel_choice, which reads the node's preflight report) may pick the NKI kernels."""
    monkeypatch.setattr(_nki, "NKI_AVAILABLE", True)
    monkeypatch.setattr(_nki, "neuron_device_available", lambda: True)
    assert get_ops("auto") == Ops("torch")


def test_ops_mlp_override_uses_the_torch_op():
    torch.manual_seed(0)
    ops = Ops("reference", mlp="torch")
    x, w_fc, w_proj = torch.randn(3, 8), torch.randn(16, 8), torch.randn(8, 16)
    torch.testing.assert_close(ops.relu2_mlp(x, w_fc, w_proj), plain_mlp(x, w_fc, w_proj), rtol=0, atol=0)


@pytest.mark.parametrize("softcap,dtype", [(15.0, torch.float32), (0.0, torch.float32), (15.0, torch.bfloat16)])
def test_scoring_cross_entropy_is_the_plain_chain_a_chunk_at_a_time(monkeypatch, softcap, dtype):
    # 7 rows per chunk over 40 rows: five full chunks and a short one; ignored targets among them.
    monkeypatch.setattr(ops_module, "SCORING_CHUNK_ELEMENTS", 7 * 300)
    torch.manual_seed(0)
    logits = (torch.randn(40, 300) * 20).to(dtype)
    targets = torch.randint(0, 300, (40,))
    targets[[0, 13, 39]] = -1
    with torch.no_grad():
        plain = get_ops("torch").softcap_cross_entropy(logits, targets, softcap, "none")
    with torch.inference_mode():
        chunked = get_ops("torch").softcap_cross_entropy(logits, targets, softcap, "none")
        assert torch.equal(chunked, ops_module.scoring_cross_entropy(logits, targets, softcap))
    assert chunked.dtype == torch.float32 and torch.all(chunked[[0, 13, 39]] == 0)
    # Log-sum-exp less the target's logit against log-softmax at the target: a few float32 ulps of the logits'
    # scale (up to ~80 here, an ulp 8e-6) apart, however small the loss.
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=3e-5)
