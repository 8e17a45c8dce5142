"""The pinned Neuron set and the check of what is installed (torch-free, so it runs anywhere)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest

from sweep.neuron import versions

ROOT = Path(__file__).resolve().parents[3]
GOOD = {"torch": "2.14.0", "torch-neuronx": "2.14.3.0.1234+abcdef", "neuronx-cc": "2.28.7631.0+0a1b2c3",
        "nki": "0.7.0"}


def test_the_pinned_set_passes_and_the_other_documented_family_too():
    assert versions.problems(GOOD) == []
    assert versions.problems({**GOOD, "torch": "2.13.0+cpu", "torch-neuronx": "2.13.3.0.77"}) == []


@pytest.mark.parametrize("name", versions.REQUIRED)
def test_each_missing_package_is_named_with_its_pin(name):
    lines = versions.problems({k: v for k, v in GOOD.items() if k != name})
    assert len(lines) == 1 and lines[0].startswith(f"{name}: not installed")
    assert versions.PINS[name] in lines[0] and versions.NEURON_PIP_INDEX in lines[0]


@pytest.mark.parametrize(("name", "version"), [("torch-neuronx", "1.0"), ("neuronx-cc", "1.0.post1"), ("nki", "0.0.1")])
def test_public_index_placeholders_are_called_out(name, version):
    lines = versions.problems({**GOOD, name: version})
    assert len(lines) == 1 and "placeholder" in lines[0] and lines[0].startswith(f"{name} {version}")


def test_the_xla_line_and_a_mismatched_family_are_incompatible():
    lines = versions.problems({**GOOD, "torch-neuronx": "2.9.0.2.15.32035"})
    assert lines == ["torch-neuronx 2.9.0.2.15.32035: the PyTorch/XLA line, which has no `neuron` device "
                     "(TorchNeuron for torch 2.14.0 is 2.14.3.0.*)"]
    # With torch 2.9 itself, torch is the line reported: no TorchNeuron family exists for it.
    (xla_torch,) = versions.problems({**GOOD, "torch": "2.9.0", "torch-neuronx": "2.9.0.2.15.32035"})
    assert xla_torch.startswith("torch 2.9.0: Neuron 2.33.0 builds TorchNeuron for torch 2.13.0, 2.14.0 only")
    (mismatch,) = versions.problems({**GOOD, "torch": "2.13.0"})
    assert "torch-neuronx 2.14.3.0.1234+abcdef does not match torch 2.13.0" in mismatch


def test_another_releases_compiler_or_nki_is_reported():
    lines = versions.problems({**GOOD, "neuronx-cc": "2.26.63.0", "nki": "0.5.0"})
    assert [line.split(":")[0] for line in lines] == ["neuronx-cc 2.26.63.0", "nki 0.5.0"]


def test_names_are_normalised_and_release_parses_local_labels():
    assert versions.problems({k.replace("-", "_"): v for k, v in GOOD.items()}) == []
    assert versions.release("2.28.7631.0+0a1b") == (2, 28, 7631, 0)
    assert versions.release("1.0.post1") == (1, 0)
    assert versions.release("garbage") == ()


def test_installed_versions_reads_metadata_and_skips_missing():
    found = versions.installed_versions(["torch", "no-such-distribution-here"])
    assert found == {"torch": importlib.metadata.version("torch")}
    assert versions.installed_versions().keys() <= set(versions.REQUIRED)


def test_pyproject_neuron_extra_is_the_pinned_set():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["neuron"]
    assert sorted(extra) == sorted(versions.requirements())


def test_dlami_names_agree():
    assert versions.DLAMI_SSM_PARAMETER.startswith("/aws/service/neuron/dlami/")
    assert versions.DLAMI_SSM_PARAMETER.endswith("/latest/image_id")
    assert versions.DLAMI_VENV.endswith(versions.TORCH.replace(".", "_"))
    assert versions.TORCHNEURON_FAMILIES[versions.TORCH] == versions.TORCH_NEURONX_FAMILY
