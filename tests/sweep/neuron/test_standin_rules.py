"""The stand-in torch_neuronx keeps the rules of TorchNeuron's source it cites, so tests fail where a chip would.

Each case runs a short program in a child process with the stand-in first on PYTHONPATH, as trials see it.
Only the stand-in is exercised here; tests/model/test_device.py and tests/sweep/run/test_preflight.py run the
trainer and the preflight on it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sweep import neuron
from tests.neuron_standins import STANDIN
from tests.sweep_fixtures import ROOT


def run(code: str, env: dict[str, str] | None = None, ranks: int = 1) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NEURON_", "TORCH_NEURONX", "FAKE_NEURON"))}
    base.update(PYTHONPATH=f"{STANDIN}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1", **(env or {}))
    if ranks == 1:
        cmd = [sys.executable, "-c", textwrap.dedent(code)]
    else:
        script = Path(base["STANDIN_SCRIPT_DIR"]) / "prog.py"
        script.write_text(textwrap.dedent(code))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", str(script)]
    return subprocess.run(cmd, cwd=ROOT, env=base, capture_output=True, text=True, timeout=120)


COMPILE = """
import torch, torch_neuronx
f = torch.compile(lambda x: (x * 3).sin().sum(), backend="neuron", fullgraph=True)
f(torch.ones(8, device="neuron"))
print("compiled", len(torch_neuronx.COMPILED))
"""


def test_the_neff_cache_is_sharded_by_key_and_hit_by_a_later_process(tmp_path):
    env = {neuron.NEFF_CACHE_VAR: str(tmp_path / "neff")}
    first, second = run(COMPILE, env), run(COMPILE, env)
    assert (first.stdout.split(), second.stdout.split()) == (["compiled", "1"], ["compiled", "0"]), first.stderr
    (path,) = neuron.cache_entries([str(tmp_path / "neff")])
    rel = Path(path).relative_to(tmp_path / "neff")
    assert re.fullmatch(r"([0-9a-f]{2})/([0-9a-f]{2})/\1\2[0-9a-f]{28}\.neff", str(rel)), rel
    assert not list((tmp_path / "neff").rglob(".tmp.*"))  # written through a temporary file and a rename


@pytest.mark.parametrize("var, value, persistent", [
    ("TORCH_NEURONX_NEFF_DISABLE_CACHE", "1", False),  # PersistentCacheBackend.cpp: exactly "1"
    ("TORCH_NEURONX_NEFF_DISABLE_CACHE", "true", True),
    ("TORCH_NEURONX_DISABLE_NEFF_CACHE", "1", True),  # utils.py: the in-process cache only
])
def test_the_two_disable_variables(tmp_path, var, value, persistent):
    env = {neuron.NEFF_CACHE_VAR: str(tmp_path / "neff"), var: value}
    assert run(COMPILE, env).returncode == 0
    second = run(COMPILE, env)
    assert bool(neuron.cache_entries([str(tmp_path / "neff")])) is persistent
    assert second.stdout.split() == ["compiled", "0" if persistent else "1"], second.stderr


def test_the_default_cache_directory_is_tmp_neff_cache():
    out = run("import torch_neuronx; print(torch_neuronx.DEFAULT_NEFF_CACHE)")
    assert out.stdout.strip() == "/tmp/neff_cache", out.stderr


def test_the_runtime_may_not_start_before_init_process_group(tmp_path):
    code = """
    import torch, torch.distributed as dist, torch_neuronx
    torch.zeros(1, device="neuron")  # starts the runtime
    dist.init_process_group("neuron")
    """
    out = run(code, {"STANDIN_SCRIPT_DIR": str(tmp_path)}, ranks=2)
    assert out.returncode != 0
    assert "Neuron runtime should not be initialized before the init_process_group." in out.stderr


def test_under_a_process_group_each_rank_owns_the_index_of_its_local_rank(tmp_path):
    code = """
    import os, torch, torch.distributed as dist
    import torch_neuronx  # the real one loads with torch (its entry point); the stand-in has none
    dist.init_process_group("neuron")
    rank = int(os.environ["LOCAL_RANK"])
    cores = os.environ["NEURON_RT_VISIBLE_CORES"]
    say = lambda line: os.write(1, (line + os.linesep).encode())  # one write a line: the ranks share stdout
    say(f"rank {rank} {torch.neuron.current_device()} {torch.neuron.device_count()} {cores}")
    torch.zeros(1, device=torch.device("neuron", rank))
    try:
        torch.zeros(1, device=torch.device("neuron", 0))
        say(f"rank {rank} index 0 ok")
    except RuntimeError as e:
        say(f"rank {rank} index 0: {e}")
    """
    out = run(code, {"STANDIN_SCRIPT_DIR": str(tmp_path)}, ranks=2)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank"))
    assert lines[:2] == ["rank 0 0 2 0", "rank 0 index 0 ok"]
    assert lines[2] == "rank 1 1 2 1"
    assert lines[3].startswith("rank 1 index 0: Attempted to access device that doesn't attach to this process")
