"""Stand-ins for the Neuron SDK, for child processes on a machine without Trainium.

:func:`install` writes them under a directory and puts them first on ``PYTHONPATH`` and ``PATH``:

- ``torch_neuronx``: registers ``torch.neuron`` (``is_available``, ``device_count`` at the process's
  ``NEURON_LOGICAL_NC_CONFIG``, ``current_device``, ``synchronize``) and the ``"neuron"`` backend of
  ``torch.compile``, which keeps one ``.neff`` per graph under ``TORCH_NEURONX_NEFF_CACHE_DIR`` and finds it
  again on the next run. As TorchNeuron does in a distributed run (``WORLD_SIZE`` > 1), it sets
  ``NEURON_RT_VISIBLE_CORES`` to the local rank where unset and refuses a process holding more than one
  core. Tensors stay on the CPU.
- ``nki``: ``kernels._fake_nki`` under the real package's name (kernels run through ``nki.simulate``, so
  ``NKI_SIMULATOR=1`` is set).
- ``neuron-ls`` and ``neuron-monitor`` executables printing their documented JSON.

``FAKE_NEURON`` (comma-separated) breaks them the ways the preflight guards against: ``unavailable``,
``few-cores`` (one core), ``share-core`` (every rank on core 0), ``cache-elsewhere`` (NEFFs written
outside the cache variable), ``no-hit`` (every compile a new NEFF), ``wrong-kernels`` (NKI outputs off
by 10%), ``silent-monitor`` (neuron-monitor prints nothing).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.sweep.neuron.test_neuron import FAKE_LS, NEURON_LS

TORCH_NEURONX = '''\
"""torch-neuronx stand-in (tests/neuron_standins.py)."""
import hashlib
import os
import sys
import types

import torch

MODES = set(filter(None, os.environ.get("FAKE_NEURON", "").split(",")))
CORES = "NEURON_RT_VISIBLE_CORES"


def _parse(text):
    out = []
    for item in text.split(","):
        lo, _, hi = item.strip().partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    if "share-core" in MODES:
        os.environ[CORES] = "0"
    os.environ.setdefault(CORES, os.environ.get("LOCAL_RANK", "0"))
    if len(_parse(os.environ[CORES])) != 1:
        raise RuntimeError("torch-neuronx stand-in: a distributed run takes one NeuronCore per process, got "
                           + CORES + "=" + os.environ[CORES])


def device_count():
    lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2"))
    if "few-cores" in MODES:
        return 1
    visible = os.environ.get(CORES)
    return len(_parse(visible)) if visible else 8 // lnc


neuron = types.ModuleType("torch.neuron")
neuron.is_available = lambda: "unavailable" not in MODES
neuron.device_count = device_count
neuron.current_device = lambda: 0
neuron.synchronize = lambda device=None: None
torch.neuron = neuron
sys.modules["torch.neuron"] = neuron


def _backend(gm, example_inputs):
    cache = os.environ.get("TORCH_NEURONX_NEFF_CACHE_DIR", "/var/tmp/neuron-compile-cache")
    if "cache-elsewhere" in MODES:
        cache = os.path.join(os.environ["FAKE_NEURON_ELSEWHERE"])
    key = hashlib.sha256(gm.code.encode()).hexdigest()[:16]
    if "no-hit" in MODES:
        key += "-" + str(os.getpid())
    path = os.path.join(cache, "MODULE_" + key, "model.neff")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(gm.code)
    return gm.forward


from torch._dynamo import register_backend  # noqa: E402

register_backend(_backend, name="neuron")
'''

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


def install(root: Path, monkeypatch) -> Path:
    """Write the stand-ins under ``root`` and put them first on PYTHONPATH and PATH; returns ``root``."""
    pkg = root / "py"
    (pkg / "torch_neuronx").mkdir(parents=True)
    (pkg / "torch_neuronx" / "__init__.py").write_text(TORCH_NEURONX)
    (pkg / "nki").mkdir()
    (pkg / "nki" / "__init__.py").write_text(NKI)
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, text in (("neuron-ls", FAKE_LS.format(python=sys.executable, devices=repr(NEURON_LS))),
                       ("neuron-monitor", MONITOR.format(python=sys.executable))):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(pkg), str(repo), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("NKI_SIMULATOR", "1")
    monkeypatch.setenv("FAKE_NEURON_ELSEWHERE", str(root / "elsewhere"))
    monkeypatch.delenv("FAKE_NEURON", raising=False)
    return root
