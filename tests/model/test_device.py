"""The device picker and accelerator peaks, with a stand-in torch.neuron (no Neuron SDK here)."""

import json
import os
import subprocess
import types

import pytest
import torch

from model import device as devices
from tests.conftest import ROOT


@pytest.fixture
def fake_neuron(monkeypatch):
    state = {"available": True}
    monkeypatch.setattr(torch, "neuron", types.SimpleNamespace(is_available=lambda: state["available"]),
                        raising=False)
    return state


def test_auto_picks_neuron_when_the_backend_says_it_is_available(fake_neuron):
    assert devices.neuron_available()
    assert devices.pick_kind("auto") == "neuron"
    assert devices.BACKENDS["neuron"] == "neuron" and devices.AUTOCAST["neuron"] is torch.bfloat16


def test_auto_falls_back_when_neuron_is_not_available(fake_neuron):
    fake_neuron["available"] = False
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert devices.pick_kind("auto") == expected


def test_cpu_runtime_has_gloo_float32_and_no_peak():
    rt = devices.setup("cpu")
    assert (rt.kind, rt.backend, rt.autocast_dtype, rt.world_size) == ("cpu", "gloo", None, 1)
    assert rt.peak_flops() is None and rt.peak_memory_bytes() > 0


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match="device must be"):
        devices.pick_kind("tpu")


@pytest.mark.parametrize("world_size, lnc, chips", [(1, "2", 1), (4, "2", 1), (8, "1", 1), (8, "2", 2)])
def test_neuron_peak_counts_the_chips_a_run_holds(monkeypatch, world_size, lnc, chips):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", lnc)
    rt = devices.Runtime(torch.device("cpu"), "neuron", "neuron", torch.bfloat16, world_size=world_size)
    assert rt.peak_flops() == pytest.approx(667e12 * chips)


@pytest.mark.parametrize("local_rank", [0, 3, 63])
def test_every_rank_trains_on_the_device_its_local_rank_numbers(local_rank):
    """Under a process group TorchNeuron numbers each rank's one visible core by the local rank, as CUDA does."""
    assert devices.device_index("neuron", local_rank) == local_rank
    assert devices.device_index("cuda", local_rank) == local_rank
    assert devices.device_index("cpu", local_rank) is None


def test_two_neuron_ranks_train_on_the_standin_device(tiny_config, tmp_path, monkeypatch):
    """The real trainer, two torchrun ranks, device "neuron" on the stand-in torch_neuronx, which follows
    TorchNeuron's source: rank 1 allocating on neuron:0 (every rank on index 0, the rule before the fix) raised
    "Attempted to access device that doesn't attach to this process" there, and here."""
    from tests.conftest import subprocess_env, trainer_command
    from tests.neuron_standins import STANDIN

    config = {**tiny_config, "device": "neuron", "kernels": "torch", "max_steps": 4, "batch_size": 4}
    env = subprocess_env(PYTHONPATH=f"{STANDIN}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1")
    for var in ("NEURON_RT_VISIBLE_CORES", "FAKE_NEURON", "TORCH_NEURONX_STANDIN_LOCKS"):
        env.pop(var, None)
    proc = subprocess.run(trainer_command(config, 10, ranks=2), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["status"], result["device"], result["world_size"], result["steps"]) == ("ok", "neuron", 2, 4)
    assert "doesn't attach" not in proc.stderr
