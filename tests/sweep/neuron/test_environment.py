"""Environment profiles (sweep/neuron/environment.py): the spec's [environment] table, the trainer's python
under `competition`, the modules the trainer imports in the image's venv, and the versions a node reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sweep.neuron import environment as envs
from sweep.spec import SpecError, load
from tests.sweep_fixtures import write_spec

FIXTURE = Path(__file__).parent / "fixtures" / "competition_venv_packages.txt"
ROOT = Path(__file__).resolve().parents[3]
SPEC = {"study": {"n_trials": 1}, "trial": {"budget_s": 4, "eval_timeout_s": 20},
        "params.model_dim": {"type": "int", "low": 128, "high": 256, "step": 128}}


def test_phase_studies_run_where_the_scorer_runs_and_others_keep_the_pinned_sdk():
    for name in ("phase1", "phase1-short", "phase2", "phase2-short"):
        assert load(name).environment == envs.Environment("competition", envs.COMPETITION_VENV), name
    assert load("demo").environment.profile == "latest-sdk"
    assert envs.COMPETITION_AMI == "ami-0d5703e99c1589f8d"
    assert envs.COMPETITION_VENV == "neurips-torchneuronx-native-beta-2.11.3-20260824"


@pytest.mark.parametrize("table, key", [({"profile": "scorer"}, "environment.profile"),
                                        ({"profile": "latest-sdk", "venv": "x"}, "environment.venv"),
                                        ({"profile": "competition", "venv": "a b"}, "environment.venv"),
                                        ({"image": "ami-1"}, "environment.image")])
def test_a_bad_environment_table_is_one_line_naming_the_key(tmp_path, table, key):
    with pytest.raises(SpecError) as e:
        load(write_spec(tmp_path, "env", {**SPEC, "environment": table}))
    assert "\n" not in str(e.value) and key in str(e.value)


def test_the_profile_goes_into_every_trials_environment_and_record(tmp_path):
    spec = load(write_spec(tmp_path, "env", {**SPEC, "environment": {"profile": "competition", "venv": "/opt/v"}}))
    assert spec.environment.trial_env() == {envs.PROFILE_VAR: "competition", envs.VENV_VAR: "/opt/v"}
    assert spec.environment.attrs() == {"environment": "competition", "environment_venv": "/opt/v"}
    assert envs.Environment().trial_env() == {envs.PROFILE_VAR: "latest-sdk"}
    assert envs.Environment().attrs() == {"environment": "latest-sdk"}


def test_the_trainer_runs_with_the_image_venvs_python_found_by_name(tmp_path):
    venv = tmp_path / "home" / envs.COMPETITION_VENV
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    roots = (str(tmp_path / "opt"), str(tmp_path / "home"))
    competition = {envs.PROFILE_VAR: "competition"}
    assert envs.trainer_python(competition, roots) == str(venv / "bin" / "python")
    assert envs.trainer_python({**competition, envs.VENV_VAR: str(venv)}, ()) == str(venv / "bin" / "python")
    assert envs.trainer_python({envs.PROFILE_VAR: "latest-sdk"}, roots) is None  # the service's own python
    assert envs.trainer_python({}, roots) is None
    with pytest.raises(envs.ProfileError) as e:
        envs.trainer_python({**competition, envs.VENV_VAR: "other-venv"}, roots)
    assert "\n" not in str(e.value) and "no venv other-venv under" in str(e.value)


def test_the_trainers_import_list_is_its_real_import_closure():
    """TRAINER_IMPORTS names every third-party module the trainer's own modules import, and nothing else."""
    code = """
import ast, json, sys
import model.train, model.preflight_train, sweep.neuron.rank
ours = [m for m in sys.modules if m.split('.')[0] in ('model', 'kernels', 'sweep')]
found = set()
for m in ours:
    f = getattr(sys.modules[m], '__file__', None)
    for node in ast.walk(ast.parse(open(f).read())) if f else ():
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \\
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        found.update(n.split('.')[0] for n in names)
print(json.dumps(sorted(found - set(sys.stdlib_module_names) - {'model', 'kernels', 'sweep', '__future__'})))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == sorted(envs.TRAINER_IMPORTS)


def test_the_image_venvs_package_list_holds_what_the_trainer_imports():
    """Against the fixture (a guess at the venv's list: the image's is not published), and one line per gap."""
    packages = envs.parse_package_list(FIXTURE.read_text())
    assert envs.missing_for_trainer(packages) == []
    assert packages["torch-neuronx"] == "2.11.3.0" and packages["pyyaml"] == "6.0.2"
    without = {k: v for k, v in packages.items() if k not in ("pyyaml", "torch-neuronx")}
    assert envs.missing_for_trainer(without) == ["pyyaml", "torch-neuronx"]
    assert envs.missing_for_trainer(without, device="cpu") == ["pyyaml"]


def test_versions_are_read_with_the_venvs_own_python():
    import torch

    found = envs.read_versions(sys.executable)
    assert found["torch"] == torch.__version__.split("+")[0] or found["torch"] == torch.__version__
    assert set(found) <= set(envs.PIP_VERSIONS) | set(envs.APT_VERSIONS)
    with pytest.raises(envs.ProfileError):
        envs.read_versions("/no/such/python")


def test_a_version_difference_is_one_line_naming_each_package():
    first = {"torch": "2.11.0", "neuronx-cc": "2.26.1.0", "aws-neuronx-runtime-lib": "2.33.10.0"}
    assert envs.version_difference(first, dict(first)) is None
    line = envs.version_difference(first, {**first, "neuronx-cc": "2.28.7631.0", "nki": "0.7.0"})
    assert line == "neuronx-cc 2.26.1.0 there, 2.28.7631.0 here; nki absent there, 0.7.0 here"
