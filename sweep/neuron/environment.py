"""Environment profiles: where a study's trials run, and with which Python.

- ``competition``: the organisers' image, by id (:data:`COMPETITION_AMI`), and its venv
  (:data:`COMPETITION_VENV` by default), which the kit forbids adding packages to. Nothing is ever installed
  into that venv: the service (Ray, Optuna, the supervisor, psycopg2, boto3) lives in a venv of its own, and
  only the trainer's process runs with the image venv's python, our pure-Python packages on its
  ``PYTHONPATH`` (the supervisor puts the checkout there). What the venv holds is read on the node
  (:func:`read_versions` through the preflight), never assumed: the image's package list is not published.
- ``latest-sdk``: the TorchNeuron DLAMI of the release sweep/neuron/versions.py pins, with our pins installed
  into a worker venv layered on the DLAMI's (infra/ray/worker_venv.sh). Kept for teams that want the newer
  stack; it is not where the scorer runs.

Torch-free: the driver, the preflight and ``infra`` read it in the service venv.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPETITION, LATEST_SDK = "competition", "latest-sdk"
PROFILES = (COMPETITION, LATEST_SDK)
DEFAULT_PROFILE = LATEST_SDK  # the phase studies name `competition` themselves (sweep/studies/phase*.toml)
COMPETITION_AMI = "ami-0d5703e99c1589f8d"  # the kit's README
COMPETITION_VENV = "neurips-torchneuronx-native-beta-2.11.3-20260824"  # the kit's README
# Where a venv of that name is looked for on the node. The kit names the venv, not its directory: the DLAMIs
# keep theirs under /opt (versions.DLAMI_VENV), so /opt comes first; the others are guesses.
VENV_ROOTS = ("/opt", "~", "/home/ubuntu", "/opt/conda/envs")

# What the trial's environment carries (sweep/run/driver.py sets them; sweep/run/remote.py reads them).
PROFILE_VAR = "TRNSWEEP_ENV_PROFILE"
VENV_VAR = "TRNSWEEP_IMAGE_VENV"  # the venv's name, or an absolute path to it
ATTR_PROFILE = "environment"  # trial and study user attributes
ATTR_VENV = "environment_venv"
ATTR_VERSIONS = "environment_versions"

# The third-party modules our trainer (model.train, model.preflight_train and what they import) imports, with
# the distribution that provides each and when it is needed. tests/sweep/neuron/test_environment.py checks
# this list against the trainer's real import closure and against the image venv's package list (a fixture).
TRAINER_IMPORTS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "required"),
    "numpy": ("numpy", "required"),
    "pyarrow": ("pyarrow", "required"),  # the data shards are parquet
    "tiktoken": ("tiktoken", "required"),  # the tokenizer (the kit's prepare.py serves it the same way)
    "filelock": ("filelock", "required"),  # a dependency of torch itself
    "yaml": ("pyyaml", "required"),  # model.core_bundle, imported by model.train at load
    "torch_neuronx": ("torch-neuronx", "neuron"),  # the `neuron` device
    "nki": ("nki", "optional"),  # the NKI kernels; without it kernels = "auto" runs the PyTorch ops
    "rustbpe": ("rustbpe", "optional"),  # only to train a tokenizer, which a trial never does
}

# Versions the preflight reads in the venv: pip distributions (either TorchNeuron name), and apt packages.
PIP_VERSIONS = ("torch", "torch-neuronx", "torchneuron", "neuronx-cc", "nki")
APT_VERSIONS = ("aws-neuronx-runtime-lib", "aws-neuronx-collectives")


class ProfileError(ValueError):
    """A profile that cannot run here, in one line."""


@dataclass(frozen=True)
class Environment:
    """The spec's ``[environment]`` table."""

    profile: str = DEFAULT_PROFILE
    venv: str = COMPETITION_VENV  # the image venv's name (competition only)

    @property
    def competition(self) -> bool:
        return self.profile == COMPETITION

    def trial_env(self) -> dict[str, str]:
        """What a trial's environment carries so the worker picks the trainer's python."""
        return {PROFILE_VAR: self.profile, **({VENV_VAR: self.venv} if self.competition else {})}

    def attrs(self) -> dict[str, str]:
        """Recorded with every trial."""
        return {ATTR_PROFILE: self.profile, **({ATTR_VENV: self.venv} if self.competition else {})}


def find_venv(name: str, roots: Iterable[str] = VENV_ROOTS) -> Path | None:
    """The venv directory of that name (or absolute path) holding ``bin/python``, or None."""
    candidates = [Path(name)] if os.path.isabs(name) else [Path(r).expanduser() / name for r in roots]
    return next((c for c in candidates if (c / "bin" / "python").exists()), None)


def trainer_python(env: Mapping[str, str], roots: Iterable[str] = VENV_ROOTS) -> str | None:
    """The python a trial's trainer runs with: the image venv's under ``competition``, None (the service's own)
    otherwise. A competition trial on a node without that venv is refused in one line."""
    if env.get(PROFILE_VAR, DEFAULT_PROFILE) != COMPETITION:
        return None
    name = env.get(VENV_VAR) or COMPETITION_VENV
    found = find_venv(name, roots)
    if found is None:
        where = name if os.path.isabs(name) else f"{name} under {', '.join(roots)}"
        raise ProfileError(f"environment competition: no venv {where} on this node (boot the image "
                                f"{COMPETITION_AMI}, or set [environment] venv)")
    return str(found / "bin" / "python")


_READ = """
import importlib.metadata as m, json, subprocess
out = {}
for name in %r:
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        pass
for name in %r:
    try:
        r = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", name], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and r.stdout.strip():
            out[name] = r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
print(json.dumps(out))
"""


def read_versions(python: str, timeout: float = 120.0) -> dict[str, str]:
    """The venv's Neuron stack as that python sees it: pip distributions through importlib.metadata, the
    runtime and collectives through dpkg (the apt packages; absent where they were not installed by apt)."""
    try:
        r = subprocess.run([python, "-c", _READ % (PIP_VERSIONS, APT_VERSIONS)], capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        raise ProfileError(f"could not read the venv's versions with {python}: {e}") from None
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise ProfileError(f"could not read the venv's versions with {python}: {tail}")
    return {str(k): str(v) for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def version_difference(study: Mapping[str, str], node: Mapping[str, str]) -> str | None:
    """One line naming each package whose version on this node differs from the study's first node, or None."""
    diffs = [f"{name} {study.get(name, 'absent')} there, {node.get(name, 'absent')} here"
             for name in sorted(set(study) | set(node)) if study.get(name) != node.get(name)]
    return "; ".join(diffs) if diffs else None


_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*(\S+))?")


def parse_package_list(text: str) -> dict[str, str]:
    """``pip list --format=freeze`` / ``pip freeze`` text as {normalised name: version}; comments ignored."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        match = _REQ.match(line)
        if match:
            found[normalise(match.group(1))] = match.group(2) or ""
    return found


def normalise(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_for_trainer(packages: Mapping[str, str], device: str = "neuron") -> list[str]:
    """The trainer's required distributions (and, on Neuron, torch-neuronx) a venv's package list lacks."""
    have = {normalise(n) for n in packages}
    need = [dist for dist, when in TRAINER_IMPORTS.values()
            if when == "required" or (when == "neuron" and device == "neuron")]
    return [d for d in need if normalise(d) not in have and not (d == "torch-neuronx" and "torchneuron" in have)]


def describe(profile: Environment, extra: Mapping[str, Any] | None = None) -> str:
    """One line for ``sweep show``."""
    text = profile.profile + (f" (venv {profile.venv})" if profile.competition else "")
    versions = (extra or {}).get(ATTR_VERSIONS)
    if versions:
        text += "; " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    return text


def admit(url: str, study_name: str, found: Mapping[str, str], role: str = "driver") -> tuple[str | None, bool]:
    """Whether a node whose image venv holds ``found`` may serve the study: (one-line refusal or None, whether
    this call recorded ``found`` as the study's, being its first node). A study not created yet admits anyone;
    its first trial records the versions. Two first nodes at once: the last to write is the study's."""
    import optuna

    from sweep import store as st

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = st.open_storage(url, role)
    try:
        study = st.retry(lambda: optuna.load_study(study_name=study_name, storage=storage), url=url)
    except KeyError:
        return None, False
    recorded = study.user_attrs.get(ATTR_VERSIONS)
    if not recorded:
        st.retry(lambda: study.set_user_attr(ATTR_VERSIONS, dict(found)), url=url)
        return None, True
    diff = version_difference(recorded, found)
    if diff is None:
        return None, False
    return f"this node's image venv differs from study {study_name}'s first node: {diff}", False
