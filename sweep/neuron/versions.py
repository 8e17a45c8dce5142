"""The one place that names the Neuron packages, image and venv a trn2 node must have.

Everything here is a fact from the Neuron SDK 2.33.0 documentation (sources in docs/neuron.md):

- Neuron 2.33.0 ships native TorchNeuron (the ``neuron`` device, ``torch.compile(backend="neuron")``) as
  the ``torch-neuronx`` families 2.13.3.0.* (PyTorch 2.13.0) and 2.14.3.0.* (PyTorch 2.14.0); "install the
  torch-neuronx package family that matches the PyTorch version" (release notes, TorchNeuron 2.33.0).
  The 2.9.x line of torch-neuronx is PyTorch/XLA: it has no ``neuron`` device.
- The same release's compiler is neuronx-cc 2.28.7631.0 and NKI is 0.7.0 (component release index),
  its Neuron Runtime Library 2.35.30.0, Collectives 2.35.43.0 and Developer Tools 2.33.38.0: the apt
  packages an image without the DLAMI needs (torch_neuronx's extension links the runtime's libnrt).
- The AMI that carries it is "Deep Learning AMI Neuron torch-neuronx 2.14.0", with the venv
  /opt/aws_neuronx_venv_torch_neuronx_2_14_0 (setup/pytorch/update-dlami, 2.33.0). We pin the 2.14 family
  because that venv is the one AWS builds and tests; the CPU side (Makefile TORCH_PIN) stays at 2.13.0,
  the wheel on the build machines' disk, and the code uses nothing that differs between the two.
- The DLAMI's SSM parameter follows the documented path structure
  ``/aws/service/neuron/dlami/<framework>-<framework-version>/<os>``; no page lists this DLAMI's exact
  prefix, so :data:`DLAMI_SSM_PARAMETER` is a guess (``infra.ami`` falls back to listing the path).
- PyPI carries empty placeholders under these names (torch-neuronx 1.0, neuronx-cc 1.0.post1, nki 0.0.1;
  they raise "WRONG PACKAGE" or install nothing): the real ones come from AWS's index only.

Torch-free on purpose: the preflight, the worker set-up and ``infra`` read these before torch imports.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Iterable, Mapping

NEURON_SDK = "2.33.0"
NEURON_PIP_INDEX = "https://pip.repos.neuron.amazonaws.com"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # the DLAMI page's second index, for torch itself

TORCH = "2.14.0"
TORCH_NEURONX_FAMILY = "2.14.3.0"  # any build 2.14.3.0.* of this family
NEURONX_CC = "2.28.7631.0"
NKI = "0.7.0"

# The pip requirement of each package, as pyproject.toml's `neuron` extra, the Dockerfile and the
# cluster template state them (tests check they agree with this).
PINS: dict[str, str] = {
    "torch": f"torch=={TORCH}",
    "torch-neuronx": f"torch-neuronx=={TORCH_NEURONX_FAMILY}.*",
    "neuronx-cc": f"neuronx-cc=={NEURONX_CC}",
    "nki": f"nki=={NKI}",
}
REQUIRED = tuple(PINS)

# The apt packages (AWS's apt repository) an image needs beside the pip set, at this release's versions:
# the runtime (libnrt) and collectives that torch_neuronx loads, and the tools. docker/Dockerfile.neuron
# installs each at ``VERSION*`` (the repository's versions carry a build suffix).
APT_PACKAGES: dict[str, str] = {
    "aws-neuronx-runtime-lib": "2.35.30.0",
    "aws-neuronx-collectives": "2.35.43.0",
    "aws-neuronx-tools": "2.33.38.0",
}

# PyTorch release (major.minor.micro) -> the TorchNeuron family built for it, per the 2.33.0 notes.
TORCHNEURON_FAMILIES: dict[str, str] = {"2.13.0": "2.13.3.0", "2.14.0": "2.14.3.0"}

DLAMI_NAME = "Deep Learning AMI Neuron torch-neuronx 2.14.0"
DLAMI_OS = "ubuntu-24.04"
DLAMI_SSM_PARAMETER = f"/aws/service/neuron/dlami/torch-neuronx-2.14.0/{DLAMI_OS}/latest/image_id"  # guess
DLAMI_VENV = "/opt/aws_neuronx_venv_torch_neuronx_2_14_0"
# "Each Neuron DLAMI includes the SDK version in its description" (DLAMI guide, with a describe-images
# filter on "*Neuron SDK 2.32.0*"): how render-cluster checks the image `latest` resolves to against this
# set, and finds this release's image once `latest` has moved on. The OS in the name is a guess.
DLAMI_SDK_MARK = f"Neuron SDK {NEURON_SDK}"
DLAMI_OS_NAME = "Ubuntu 24.04"
DLAMI_OWNER = "amazon"
NEURON_TOOLS_BIN = "/opt/aws/neuron/bin"  # neuron-ls, neuron-top, neuron-monitor

# The public index's placeholders: any of these versions means pip never saw AWS's index.
PLACEHOLDERS: dict[str, frozenset[str]] = {
    "torch-neuronx": frozenset({"1.0"}),
    "neuronx-cc": frozenset({"1.0.post1", "1.0"}),
    "nki": frozenset({"0.0.1"}),
}

_RELEASE = re.compile(r"(\d+(?:\.\d+)*)")


def release(version: str) -> tuple[int, ...]:
    """The numeric release segments of a version string, local label and suffixes dropped."""
    match = _RELEASE.match(version.strip().split("+", 1)[0])
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


def _starts_with(version: str, prefix: str) -> bool:
    want = release(prefix)
    return bool(want) and release(version)[: len(want)] == want


def requirements() -> list[str]:
    """The pinned set as pip arguments (install with ``--extra-index-url`` :data:`NEURON_PIP_INDEX`)."""
    return list(PINS.values())


def problems(installed: Mapping[str, str]) -> list[str]:
    """One line per thing wrong with the installed Neuron packages (empty when the set is right).

    ``installed`` maps a distribution name (``torch-neuronx``, as pip spells it) to its version string.
    The torch / torch-neuronx pair may be either documented family; the compiler and NKI must be this
    release's, since a NEFF compiled by another neuronx-cc misses the shared cache.
    """
    found = {name.lower().replace("_", "-"): version for name, version in installed.items()}
    lines: list[str] = []
    fix = f"pip install {{}} --extra-index-url {NEURON_PIP_INDEX}"
    for name in REQUIRED:
        version = found.get(name)
        if version is None:
            lines.append(f"{name}: not installed ({fix.format(repr(PINS[name]))})")
        elif version.split("+", 1)[0] in PLACEHOLDERS.get(name, ()):
            lines.append(f"{name} {version}: the public index's empty placeholder, not AWS's package "
                         f"({fix.format(repr(PINS[name]))})")
    torch, neuronx = found.get("torch"), found.get("torch-neuronx")
    if torch is not None:
        torch_release = ".".join(map(str, release(torch)[:3]))
        family = TORCHNEURON_FAMILIES.get(torch_release)
        if family is None:
            known = ", ".join(TORCHNEURON_FAMILIES)
            lines.append(f"torch {torch}: Neuron {NEURON_SDK} builds TorchNeuron for torch {known} only "
                         f"(pin {PINS['torch']})")
        elif neuronx is not None and not any(line.startswith("torch-neuronx") for line in lines):
            if release(neuronx)[:2] == (2, 9):
                lines.append(f"torch-neuronx {neuronx}: the PyTorch/XLA line, which has no `neuron` device "
                             f"(TorchNeuron for torch {torch_release} is {family}.*)")
            elif not _starts_with(neuronx, family):
                lines.append(f"torch-neuronx {neuronx} does not match torch {torch}: that torch needs "
                             f"torch-neuronx=={family}.*")
    for name, pinned in (("neuronx-cc", NEURONX_CC), ("nki", NKI)):
        version = found.get(name)
        if version is None or any(line.startswith(f"{name} ") or line.startswith(f"{name}:") for line in lines):
            continue
        if release(version)[: len(release(pinned))] != release(pinned):
            lines.append(f"{name} {version}: Neuron {NEURON_SDK} ships {pinned} ({fix.format(repr(PINS[name]))})")
    return lines


def installed_versions(names: Iterable[str] = REQUIRED) -> dict[str, str]:
    """The installed version of each named distribution; a missing one is left out."""
    versions: dict[str, str] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
