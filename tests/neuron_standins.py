"""Stand-ins for the Neuron SDK, for child processes on a machine without Trainium.

:func:`install` writes them under a directory and puts them first on ``PYTHONPATH`` and ``PATH``:

- ``torch_neuronx``: ``tests/neuron_standin/torch_neuronx``, TorchNeuron's device, process-group and NEFF-cache
  rules as its source has them, each citing its line (the ``neuron`` device on the CPU, the ``neuron`` process
  group, ``torch.compile(backend="neuron")`` and its persistent cache). Tensors stay on the CPU.
- ``nki``: ``kernels._fake_nki`` under the real package's name (kernels run through ``nki.simulate``, so
  ``NKI_SIMULATOR=1`` is set).
- ``neuron-ls`` and ``neuron-monitor`` executables printing their documented JSON.

``FAKE_NEURON`` (comma-separated) breaks them the ways the preflight guards against: ``unavailable``,
``few-cores`` (one core), ``share-core`` (every rank on core 0), ``cache-elsewhere`` (NEFFs written
outside the cache variable), ``no-hit`` (every compile a new NEFF), ``wrong-kernels`` (NKI outputs off
by 10%), ``silent-monitor`` (neuron-monitor prints nothing), ``model-compile-error`` (a model's graph fails
to compile, small graphs do not).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

# `neuron-ls --json-output` of a two-chip node at LNC 2: 4 logical cores per device.
NEURON_LS = [
    {"neuron_device": 0, "bdf": "0000:00:1e.0", "cpu_affinity": "0-23", "numa_node": "0", "connected_to": [1],
     "nc_count": 4, "memory_size": 103079215104, "neuroncore_ids": [0, 1, 2, 3], "neuron_processes": []},
    {"neuron_device": 1, "bdf": "0000:00:1f.0", "cpu_affinity": "24-47", "numa_node": "0", "connected_to": [0],
     "nc_count": 4, "memory_size": 103079215104, "neuroncore_ids": [4, 5, 6, 7], "neuron_processes": []},
]

FAKE_LS = """\
#!{python}
import json, sys
if "--json-output" not in sys.argv:
    sys.exit("neuron-ls stand-in: only --json-output")
print(json.dumps({devices}, indent=4))
"""


def write_tools(bin_dir: Path, monitor: str) -> Path:
    """Executable stand-ins in a new ``bin_dir``: neuron-ls listing NEURON_LS, and the neuron-monitor
    script ``monitor`` (a template filled with this interpreter's path)."""
    bin_dir.mkdir()
    for name, text in (("neuron-ls", FAKE_LS.format(python=sys.executable, devices=repr(NEURON_LS))),
                       ("neuron-monitor", monitor.format(python=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


STANDIN = Path(__file__).resolve().parent / "neuron_standin"
PACKAGES_DIR = "py"  # where install() writes the stand-in torch_neuronx and nki

NKI = '''\
"""nki stand-in (tests/neuron_standins.py): kernels._fake_nki under the real name."""
import os
import sys

import numpy as np

from kernels import _fake_nki as fake

if "wrong-kernels" in os.environ.get("FAKE_NEURON", ""):
    _simulate = fake.nki.simulate

    def simulate(kernel):
        run = _simulate(kernel)
        def wrong(*args):
            out = run(*args)
            return tuple(np.asarray(o) * 1.1 for o in out) if isinstance(out, tuple) else np.asarray(out) * 1.1
        return wrong

    fake.nki.simulate = simulate
sys.modules[__name__] = fake.nki
sys.modules[__name__ + ".language"] = fake.nl
sys.modules[__name__ + ".isa"] = fake.nisa
'''

MONITOR = '''\
#!{python}
import json, os, sys, time
config = json.load(open(sys.argv[sys.argv.index("-c") + 1]))
assert config["neuron_runtimes"][0]["metrics"]
if "silent-monitor" in os.environ.get("FAKE_NEURON", ""):
    time.sleep(60)
while True:
    print(json.dumps({{"neuron_runtime_data": [], "system_data": {{}}, "instance_info": {{}},
                      "neuron_hardware_info": {{"neuron_device_count": 2, "neuroncore_per_device_count": 4}}}}),
          flush=True)
    time.sleep(0.2)
'''


# What pip would have installed: the Neuron 2.33.0 set for this machine's torch 2.13 (sweep/neuron/versions.py).
VERSIONS = {"torch-neuronx": "2.13.3.0.1", "neuronx-cc": "2.28.7631.0", "nki": "0.7.0"}


def install(root: Path, monkeypatch, versions: dict[str, str] | None = None) -> Path:
    """Write the stand-ins under ``root`` and put them first on PYTHONPATH and PATH; returns ``root``.

    Their package metadata (``versions``, default :data:`VERSIONS`) goes to ``root/meta``, on this process's
    sys.path and the children's PYTHONPATH, so ``importlib.metadata`` finds them without their code.
    """
    meta = root / "meta"
    for name, version in (VERSIONS if versions is None else versions).items():
        info = meta / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(meta))
    pkg = root / PACKAGES_DIR
    pkg.mkdir(parents=True)
    (pkg / "torch_neuronx").symlink_to(STANDIN / "torch_neuronx", target_is_directory=True)
    (pkg / "nki").mkdir()
    (pkg / "nki" / "__init__.py").write_text(NKI)
    bin_dir = write_tools(root / "bin", MONITOR)
    repo = Path(__file__).resolve().parents[1]
    path = [str(pkg), str(meta), str(repo), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NKI_SIMULATOR", "1")
    monkeypatch.setenv("FAKE_NEURON_ELSEWHERE", str(root / "elsewhere"))
    monkeypatch.delenv("FAKE_NEURON", raising=False)
    return root


def drop_packages(monkeypatch: Any) -> None:
    """Take the stand-in torch_neuronx and nki off the children's PYTHONPATH, as on a node without them."""
    paths = os.environ["PYTHONPATH"].split(os.pathsep)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if Path(p).name != PACKAGES_DIR))
