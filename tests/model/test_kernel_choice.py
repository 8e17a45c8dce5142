"""model/kernel_choice.py: kernels="auto" runs the NKI kernels only where this node's preflight report says
they passed at this LNC, records why, and a trial whose kernels fail at the first step goes on with the
PyTorch ops and records that (the NKI kernels run on the stand-in, kernels/_fake_nki.py)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import _nki
from model import device as devices
from model import kernel_choice
from model.config import GPTConfig, parse_config
from model.gpt import GPT
from model.train import Events, train
from tests.nki_standin import forget_kernels_module, use_fake_nki


def write_report(path, kernels_ok: bool = True, lnc: int = 2, **extra) -> None:
    checks = [{"name": "versions", "ok": True}, {"name": "kernels", "ok": kernels_ok, "tolerance": 2e-2}]
    path.write_text(json.dumps({"ok": kernels_ok, "checks": checks, "lnc": lnc, **extra}))


@pytest.fixture
def report(tmp_path, monkeypatch):
    path = tmp_path / "preflight.json"
    monkeypatch.setenv(kernel_choice.REPORT_ENV, str(path))
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)  # the node's default: LNC 2
    return path


@pytest.fixture
def standin(monkeypatch):
    use_fake_nki(monkeypatch)
    yield
    forget_kernels_module()


def test_report_path_defaults_under_the_users_cache(monkeypatch):
    monkeypatch.delenv(kernel_choice.REPORT_ENV, raising=False)
    assert str(kernel_choice.report_path()).endswith(".cache/trnsweep/preflight.json")


def test_verdict_needs_a_passed_kernels_check_at_this_lnc(report):
    cases = [
        (None, "no preflight report"),
        ("not json", "unreadable"),
        ({"ok": True, "lnc": 2}, "no checks list"),
        ({"ok": True, "checks": [{"name": "versions", "ok": True}], "lnc": 2}, "no kernels check"),
    ]
    for content, why in cases:
        if content is not None:
            report.write_text(content if isinstance(content, str) else json.dumps(content))
        allowed, reason = kernel_choice.preflight_verdict(2)
        assert not allowed and why in reason and "\n" not in reason
    write_report(report, kernels_ok=False)
    failed = f"the preflight's kernels check failed on this node ({report})"
    assert kernel_choice.preflight_verdict(2) == (False, failed)
    write_report(report, lnc=1)
    allowed, reason = kernel_choice.preflight_verdict(2)
    assert not allowed and "LNC 1, this trial at LNC 2" in reason
    write_report(report)
    assert kernel_choice.preflight_verdict(2)[0]


def test_auto_is_plain_torch_without_a_passing_report(report, standin):
    assert GPT(GPTConfig(kernels="auto")).ops.impl == "torch"
    write_report(report, kernels_ok=False)
    model = GPT(GPTConfig(kernels="auto"))
    assert model.ops.impl == "torch" and "failed" in model.kernel_choice.record()["kernels_reason"]


def test_auto_without_the_nki_package_stays_torch_even_with_a_report(report, monkeypatch):
    write_report(report)
    monkeypatch.setattr(_nki, "NKI_AVAILABLE", False)
    choice = kernel_choice.resolve("auto", 64, 256)
    assert choice.impl == "torch" and "not importable" in choice.reason


def test_auto_runs_the_nki_kernels_where_the_preflight_passed(report, standin):
    write_report(report)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, depth=1, model_dim=32, head_dim=16, seq_len=16, kernels="auto")
    model = GPT(cfg)
    assert model.ops.impl == "nki"
    passed = f"the preflight's kernels check passed at LNC 2 ({report})"
    assert model.kernel_choice.record() == {"kernels_impl": "nki", "kernels_mlp": "nki", "kernels_reason": passed}
    plain = GPT(GPTConfig(**{**cfg.to_dict(), "kernels": "torch"}))
    plain.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(model(idx, idx), plain(idx, idx), rtol=1e-4, atol=1e-4)


def test_a_width_without_an_nki_mlp_plan_runs_the_torch_mlp_recorded(report, standin, monkeypatch):
    write_report(report)
    monkeypatch.setattr(kernel_choice, "mlp_plan", lambda *shape: None)
    choice = kernel_choice.resolve("auto", 1024, 4096)
    assert (choice.impl, choice.mlp, choice.record()["kernels_mlp"]) == ("nki", "torch", "torch")
    assert choice.ops().mlp == "torch"


def run_tiny(tiny_config) -> dict:
    cfg = parse_config({**tiny_config, "kernels": "auto", "max_steps": 3, "eval_fractions": [],
                        "final_eval_tokens": 4096, "save_checkpoint": False})
    rt = devices.setup("cpu")
    try:
        return train(cfg, rt, Events(False, False), None)
    finally:
        devices.teardown()


def test_a_trial_trains_on_the_nki_kernels_and_records_them(report, standin, tiny_config):
    write_report(report)
    result = run_tiny(tiny_config)
    assert result["status"] == "ok" and result["steps"] == 3
    assert result["kernels_impl"] == "nki" and "kernels_fallback" not in result


def test_kernels_failing_at_the_first_step_fall_back_to_torch_and_say_so(report, standin, tiny_config, monkeypatch):
    write_report(report)
    launches = []

    def broken(kernel, *args):
        launches.append(kernel)
        raise RuntimeError("neuronx-cc: NCC_EVRF066 kernel LNC mismatch\nmore lines")

    monkeypatch.setattr(_nki, "launch", broken)
    result = run_tiny(tiny_config)
    assert len(launches) == 1  # the first kernel call failed; none was tried again
    assert result["status"] == "ok" and result["steps"] == 3 and result["val_bpb"] > 0
    assert result["kernels_impl"] == "torch"
    assert result["kernels_fallback"] == "RuntimeError: neuronx-cc: NCC_EVRF066 kernel LNC mismatch"
