"""Each torchrun rank of a Neuron trial holds exactly its own NeuronCore.

The launches are real torchrun runs of the supervisor's command line with the trial's launch
environment; what they run is a trainer stand-in that joins the ``neuron`` process group through the stand-in
``torch_neuronx`` (tests/neuron_standin), which refuses a rank that sees more than one core there, as
TorchNeuron's source does, and reserves each core as the Neuron runtime does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sweep import neuron
from sweep.neuron import rank
from sweep.run import supervisor
from sweep.run.supervisor import TrialTask
from tests.sweep_fixtures import ROOT

STANDIN = ROOT / "tests" / "neuron_standin"
TRAINER = "tests.neuron_standin.report_core"


def plan_for(tmp_path: Path, visible: str, ranks: int, lnc: int | None = None) -> neuron.TrialLaunch:
    node_env = {"PATH": os.environ["PATH"], neuron.CORES_VAR: visible, neuron.NODE_CACHE_VAR: str(tmp_path / "nc")}
    config = {"ranks": ranks, "device": "neuron", **({"lnc": lnc} if lnc else {})}
    return neuron.TrialLaunch.prepare(config, 1, {}, "", node_env=node_env)


def launch(tmp_path: Path, plan: neuron.TrialLaunch, rank_module: str | None) -> subprocess.CompletedProcess[str]:
    """Start the plan's command line the way the supervisor does (Ray's core range in the environment)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    locks = tmp_path / "locks"
    locks.mkdir(exist_ok=True)
    task = TrialTask(study="r", storage_url="", number=0, trial_id=0, params={}, config=plan.config, budget_s=1,
                     deadline_s=30, eval_fractions=(0.5,), ranks=plan.ranks, trainer=TRAINER)
    cmd = supervisor.trainer_command(task, tmp_path / "config.json", out, rank_module=rank_module)
    env = {**os.environ, **plan.env, "PYTHONPATH": f"{STANDIN}{os.pathsep}{ROOT}",
           "TORCH_NEURONX_STANDIN_LOCKS": str(locks), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def held(tmp_path: Path) -> dict[int, list[int]]:
    return {r["rank"]: r["cores"] for r in (json.loads(p.read_text()) for p in (tmp_path / "out").glob("rank-*.json"))}


@pytest.mark.parametrize("visible, lnc, cores", [
    ("4-7", None, [4, 5, 6, 7]),  # Ray's second chip at LNC 2: one rank per logical core
    ("2-3", 1, [4, 5, 6, 7]),  # two LNC-2 cores split into four LNC-1 cores
])
def test_four_rank_launch_gives_each_rank_its_own_core(tmp_path, visible, lnc, cores):
    plan = plan_for(tmp_path, visible, 4, lnc)
    try:
        assert plan.rank_module == neuron.RANK_MODULE and plan.env[neuron.RANK_CORES_VAR] == ",".join(map(str, cores))
        proc = launch(tmp_path, plan, plan.rank_module)
    finally:
        plan.close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert held(tmp_path) == {r: [c] for r, c in enumerate(cores)}


def test_the_old_shared_range_is_refused_by_torchneuron(tmp_path):
    """Every rank handed the trial's whole range (the launch before the fix) fails as it joins the process group."""
    plan = plan_for(tmp_path, "4-7", 4)
    try:
        proc = launch(tmp_path, plan, rank_module=None)
    finally:
        plan.close()
    assert proc.returncode != 0
    assert "Attempted to have more than one device per process in distributed setup" in proc.stderr


def test_the_stand_in_also_refuses_two_ranks_on_one_core(tmp_path):
    """The stand-in is strict both ways: a per-rank list naming one core twice collides in the runtime."""
    plan = plan_for(tmp_path, "4-7", 4)
    plan.env[neuron.RANK_CORES_VAR] = "4,5,5,7"
    try:
        proc = launch(tmp_path, plan, plan.rank_module)
    finally:
        plan.close()
    assert proc.returncode != 0 and "NeuronCore 5 is already reserved" in proc.stderr


def test_a_single_rank_trial_sees_one_core_and_needs_no_wrapper(tmp_path):
    plan = plan_for(tmp_path, "4-7", 1)
    plan.close()
    assert plan.env[neuron.CORES_VAR] == "4" and plan.rank_module is None and neuron.RANK_CORES_VAR not in plan.env


def test_rank_env_picks_the_local_ranks_core_and_names_a_bad_list():
    env = {neuron.RANK_CORES_VAR: "8,9,10,11", "LOCAL_RANK": "2"}
    assert neuron.rank_env(env) == {neuron.CORES_VAR: "10"}
    assert neuron.rank_env({"LOCAL_RANK": "2"}) == {}  # outside the sweep TorchNeuron's default applies
    with pytest.raises(neuron.LaunchError, match="LOCAL_RANK=4 has no core"):
        neuron.rank_env({**env, "LOCAL_RANK": "4"})
    with pytest.raises(neuron.LaunchError, match="expected integers"):
        neuron.rank_env({**env, neuron.RANK_CORES_VAR: "8,x"})


def test_rank_module_runs_the_trainer_as_main(tmp_path, monkeypatch, capsys):
    script = tmp_path / "probe_main.py"
    script.write_text("import os, sys\nprint(os.environ['NEURON_RT_VISIBLE_CORES'], __name__, sys.argv[1:])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # rank.main hands the trainer its own argv
    monkeypatch.setenv(neuron.RANK_CORES_VAR, "6,7")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(neuron.CORES_VAR, "6-7")
    assert rank.main(["probe_main", "--x", "1"]) == 0
    assert capsys.readouterr().out.strip() == "7 __main__ ['--x', '1']"
    assert rank.main([]) == 2
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert rank.main(["probe_main"]) == 2 and "LOCAL_RANK=5 has no core" in capsys.readouterr().err


@pytest.mark.slow
def test_the_real_trainer_runs_behind_the_rank_module_on_two_ranks(tmp_path, tiny_config, monkeypatch):
    """The supervisor's command line with the rank module in front of model.train (gloo on the CPU): each
    rank narrows its cores, then trains, and the ranks agree as one run."""
    monkeypatch.setenv(neuron.CORES_VAR, "2-3")  # as Ray sets it: the wrapper is used, the device stays cpu
    monkeypatch.setenv(neuron.NODE_CACHE_VAR, str(tmp_path / "nc"))
    config = {**tiny_config, "depth": 1, "model_dim": 32, "seq_len": 32, "batch_size": 4, "eval_tokens": 512,
              "final_eval_tokens": 1024, "eval_fractions": [1.0], "max_steps": 3, "device": "cpu", "ranks": 2,
              "lnc": 2}
    task = TrialTask(study="r", storage_url="", number=0, trial_id=0, params={}, config=config, budget_s=60,
                     deadline_s=240, eval_fractions=(1.0,), stop_grace_s=5, heartbeat_s=1,
                     artifact_dir=str(tmp_path / "art"))
    sup = supervisor.Supervisor(task)
    try:
        out = sup.run()
    finally:
        sup.close()
    assert out.state == "COMPLETE", out.reason
    assert sup.launch is not None and sup.launch.rank_module == neuron.RANK_MODULE
    assert sup.launch_attrs["neuron_rank_cores"] == "2-3" and sup.record["world_size"] == 2
