"""The Neuron tools are found where aws-neuronx-tools puts them, and their absence is said in one line."""

from __future__ import annotations

import logging
import sys

import pytest

from sweep import neuron
from sweep.neuron import monitor

LS = "#!{python}\nimport json\nprint(json.dumps([{{'neuron_device': 0, 'nc_count': 4, 'memory_size': 1}}]))\n"


@pytest.fixture
def tool_dir(tmp_path, monkeypatch):
    """An empty stand-in for /opt/aws/neuron/bin, and no word said yet in this process."""
    opt = tmp_path / "opt-aws-neuron-bin"
    opt.mkdir()
    monkeypatch.setattr(monitor, "TOOL_DIRS", (str(opt),))
    monkeypatch.setattr(monitor, "_said", set())
    return opt


def test_tools_in_the_neuron_bin_directory_are_found_off_path(tool_dir):
    exe = tool_dir / "neuron-ls"
    exe.write_text(LS.format(python=sys.executable))
    exe.chmod(0o755)
    assert neuron.TOOL_DIRS == ("/opt/aws/neuron/bin",)  # the package's documented place
    assert monitor.find_tool("neuron-ls", {"PATH": ""}) == str(exe)
    devices = monitor.neuron_ls({"PATH": ""})
    assert devices is not None and devices[0].cores == (0, 1, 2, 3)


def test_a_missing_tool_is_said_once_in_one_line_and_recorded_with_the_trial(tool_dir, tmp_path, caplog,
                                                                             monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    caplog.set_level(logging.WARNING, logger="sweep.neuron")
    node_env = {"PATH": str(tmp_path / "nothing-here"), neuron.CORES_VAR: "0-3",
                neuron.NODE_CACHE_VAR: str(tmp_path / "nc")}
    plans = [neuron.TrialLaunch.prepare({"device": "neuron"}, 1, {}, "", node_env=node_env) for _ in range(2)]
    for plan in plans:
        plan.started()
        assert plan.attrs[neuron.ATTR_TOOLS_MISSING] == ["neuron-ls", "neuron-monitor"]
        plan.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "sweep.neuron"]
    assert len(lines) == 2 and all("\n" not in line for line in lines)  # once per tool, not per trial
    assert lines[0] == (f"neuron-ls not found on PATH or in {tool_dir} (package aws-neuronx-tools): the trial's "
                        "cores are not checked against the node's devices")
    assert lines[1].startswith("neuron-monitor not found on PATH") and "utilisation" in lines[1]
