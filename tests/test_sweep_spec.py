"""Study specs: the shipped ones load and fit the trainer; every bad spec exits 2 with one line."""

from __future__ import annotations

import random

import pytest

from sweep import cli
from sweep.neuron import LAUNCH_KEYS
from sweep.spec import SpecError, load
from tests.sweep_fixtures import FIXED, run_sweep, spec_toml, sweep_env, tiny_spec, write_spec


@pytest.mark.parametrize("name", ["demo", "phase1", "phase1-short"])
def test_shipped_specs_load_and_fit_the_trainer_config(name):
    from model.config import parse_config

    spec = load(name)
    assert spec.name == name
    assert len(spec.eval_steps) == len(set(spec.eval_steps))
    rng = random.Random(1)
    for _ in range(20):
        point = spec.space.sample_feasible(rng)
        assert point is not None
        config = {**spec.space.trainer_config(point), "startup_allowance_s": spec.startup_allowance_s,
                  "eval_fractions": list(spec.eval_fractions)}
        assert not any(k.startswith("_") for k in config)
        trainer = {k: v for k, v in config.items() if k not in LAUNCH_KEYS}  # the worker's launch settings
        parse_config(trainer, budget_s=spec.budget_s)  # raises ConfigError on an unknown or mistyped key


def test_phase1_short_is_phase1_with_a_short_budget():
    long, short = load("phase1"), load("phase1-short")
    assert short.budget_s < long.budget_s
    assert [p.name for p in short.space.params] == [p.name for p in long.space.params]
    assert short.resources == long.resources and short.ranks == long.ranks
    assert short.pruner.options["max_resource"] == round(short.budget_s)
    assert long.resources.neuron_cores == 4 and long.space.fixed["lnc"] == 2 and not long.env


def test_spec_values(tmp_path):
    fixed = {k: v for k, v in FIXED.items() if k != "head_dim"}
    sections = tiny_spec(**{
        "fixed": fixed,
        "params.head_dim": {"type": "categorical", "choices": [16, 32]},
        "params._wide": {"type": "categorical", "choices": [False, True]},
        "params.mlp_ratio": {"type": "float", "low": 2.0, "high": 6.0, "step": 1.0, "when": "_wide"},
        "derived": {"unembedding_lr": "matrix_lr / 10", "_p": "gpt_params(depth, model_dim, vocab_size)"},
        "constraints": {"divides": "model_dim % head_dim == 0", "cap": "_p < 1e6"},
    })
    spec = load(write_spec(tmp_path, "ok", sections))
    assert spec.name == "ok" and spec.n_trials == 4 and spec.concurrency == 2
    assert spec.deadline_s == 4 + 20 + 20
    assert spec.eval_steps == (2,) and spec.final_step == 4
    names = [p.name for p in spec.space.params]
    assert names.index("mlp_ratio") > names.index("_wide")
    config = spec.space.trainer_config({"depth": 1, "model_dim": 32, "matrix_lr": 0.02, "head_dim": 16,
                                        "_wide": False})
    assert config["unembedding_lr"] == pytest.approx(0.002)
    assert "_wide" not in config and "_p" not in config and "mlp_ratio" not in config


BAD = {
    "unknown top-level key": ({"studdy": {"n_trials": 1}}, "studdy"),
    "unknown study key": ({"study": {"n_trials": 2, "n_trails": 3}}, "study.n_trails"),
    "unknown param key": ({"params.depth": {"type": "int", "low": 1, "hi": 2}}, "params.depth.hi"),
    "empty int range": ({"params.depth": {"type": "int", "low": 3, "high": 2}}, "params.depth.high"),
    "empty float range": ({"params.matrix_lr": {"type": "float", "low": 0.1, "high": 0.01}}, "params.matrix_lr.high"),
    "log with zero low": ({"params.matrix_lr": {"type": "float", "low": 0.0, "high": 0.1, "log": True}},
                          "params.matrix_lr.low"),
    "no choices": ({"params.head_dim": {"type": "categorical", "choices": []}}, "params.head_dim.choices"),
    "unknown param type": ({"params.depth": {"type": "integer", "low": 1, "high": 2}}, "params.depth.type"),
    "unsatisfiable constraint": ({"constraints": {"too_wide": "model_dim > 1000"}}, "constraints.too_wide"),
    "unknown name in constraint": ({"constraints": {"c": "widht > 1"}}, "constraints.c"),
    "unsafe expression": ({"derived": {"x": "__import__('os').system('true')"}}, "derived.x"),
    "attribute access": ({"derived": {"x": "depth.real"}}, "derived.x"),
    "unknown sampler": ({"sampler": {"name": "bayes"}}, "sampler.name"),
    "unknown sampler option": ({"sampler": {"name": "tpe", "n_start": 3}}, "sampler.n_start"),
    "unknown pruner": ({"pruner": {"name": "asha"}}, "pruner.name"),
    "bad pruner option value": ({"pruner": {"name": "median", "n_startup_trials": -1}}, "pruner"),
    "wrong type": ({"study": {"n_trials": "8"}}, "study.n_trials"),
    "missing budget": ({"trial": {"eval_timeout_s": 5}}, "trial.budget_s"),
    "colliding eval points": ({"trial": {"budget_s": 2, "eval_timeout_s": 5, "eval_fractions": [0.5, 0.6]}},
                              "trial.eval_fractions"),
    "param also fixed": ({"params.vocab_size": {"type": "int", "low": 256, "high": 512}}, "params.vocab_size"),
    "ranks beyond cores": ({"trial.resources": {"neuron_cores": 2}, "trial": {"budget_s": 4, "eval_timeout_s": 5,
                                                                             "ranks": 4}}, "trial.ranks"),
    "condition cycle": ({"params.a": {"type": "int", "low": 1, "high": 2, "when": "b > 1"},
                         "params.b": {"type": "int", "low": 1, "high": 2, "when": "a > 1"}}, "when"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_spec_is_one_line_naming_key_and_file(tmp_path, case, capsys):
    change, key = BAD[case]
    path = write_spec(tmp_path, "bad", tiny_spec(**change))
    with pytest.raises(SpecError) as e:
        load(path)
    message = str(e.value)
    assert str(path) in message and key in message and "\n" not in message
    assert cli.main(["run", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and key in err and str(path) in err


def test_bad_toml_and_missing_spec_exit_2(tmp_path, capsys):
    broken = tmp_path / "broken.toml"
    broken.write_text("[study\nn_trials = 1\n")
    assert cli.main(["status", str(broken)]) == 2
    assert "invalid TOML" in capsys.readouterr().err
    assert cli.main(["best", "no-such-study-anywhere", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no-such-study-anywhere" in err and "\n" not in err


def test_extends_merges_tables_and_rejects_cycles(tmp_path):
    write_spec(tmp_path, "base", tiny_spec())
    (tmp_path / "child.toml").write_text('extends = "base"\n' + spec_toml({"trial": {"budget_s": 6}}))
    child = load(tmp_path / "child.toml")
    assert child.name == "child" and child.budget_s == 6 and child.eval_timeout_s == 20
    (tmp_path / "a.toml").write_text('extends = "b"\n')
    (tmp_path / "b.toml").write_text('extends = "a"\n')
    with pytest.raises(SpecError, match="cycle"):
        load(tmp_path / "a.toml")


def test_cli_subprocess_bad_spec_exit_code(tmp_path):
    path = write_spec(tmp_path, "bad", tiny_spec(sampler={"name": "annealing"}))
    env = sweep_env(f"journal:{tmp_path / 'j.log'}", tmp_path / "art")
    for args in (["run", str(path)], ["status", str(path), "--json"]):
        proc = run_sweep(*args, env=env, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "sampler.name" in lines[0] and str(path) in lines[0]
    proc = run_sweep("frobnicate", env=env, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
