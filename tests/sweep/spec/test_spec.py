"""Study specs: the shipped ones load and fit the trainer; every bad spec exits 2 with one line."""

from __future__ import annotations

import random

import pytest

from sweep import cli
from sweep.neuron.launch import LAUNCH_KEYS
from sweep.spec import SpecError, load
from sweep.spec import objective as obj
from tests.sweep_fixtures import FIXED, run_sweep, spec_toml, sweep_env, tiny_spec, write_spec


@pytest.mark.parametrize("name", ["demo", "phase1", "phase1-short", "phase2", "phase2-short", "demo-phase2"])
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
        trainer = {k: v for k, v in config.items() if k not in LAUNCH_KEYS}
        parse_config(trainer, budget_s=spec.budget_s)  # raises ConfigError on an unknown or mistyped key


def test_phase1_short_is_phase1_with_a_short_budget():
    long, short = load("phase1"), load("phase1-short")
    assert short.budget_s < long.budget_s
    assert [p.name for p in short.space.params] == [p.name for p in long.space.params]
    assert short.resources == long.resources and short.ranks == long.ranks
    assert short.pruner.options["max_resource"] == round(short.budget_s)
    assert long.resources.neuron_cores == 4 and long.space.fixed["lnc"] == 2 and not long.env


@pytest.mark.parametrize("name", ["phase1", "phase2"])
def test_the_parameter_cap_counts_what_the_trainer_builds(name):
    """_params is the trainer's exact count for every sampled point (model.counts), GQA included."""
    from model.config import GPTConfig
    from model.counts import num_params

    space, rng = load(name).space, random.Random(0)
    seen_gqa = 0
    for _ in range(200):
        env, _ = space.complete(space.sample(rng))
        heads = env["model_dim"] // env["head_dim"]
        if env["model_dim"] % env["head_dim"] or (env["_gqa"] and heads % env["n_kv_head"]):
            continue  # a shape the constraints refuse
        recipe = {k: env[k] for k in ("value_embeds", "residual_scalars", "smear", "backout", "ve_gate_channels")
                  if k in env}  # searched or fixed; else the trainer's defaults
        cfg = GPTConfig(vocab_size=env["vocab_size"], depth=env["depth"], model_dim=env["model_dim"],
                        head_dim=env["head_dim"], n_kv_head=env["n_kv_head"] if env["_gqa"] else 0,
                        mlp_ratio=env["mlp_ratio"], **recipe)
        assert env["_params"] == num_params(cfg), env
        plain = GPTConfig(vocab_size=env["vocab_size"], depth=env["depth"], model_dim=env["model_dim"],
                          head_dim=env["head_dim"], n_kv_head=env["n_kv_head"] if env["_gqa"] else 0,
                          mlp_ratio=env["mlp_ratio"], value_embeds=False, residual_scalars=False)
        assert env["_compute_params"] == num_params(plain), env  # what the caps weigh
        seen_gqa += bool(env["_gqa"])
    assert seen_gqa > 10


def test_phase1_takes_a_gqa_shape_the_old_estimate_refused():
    """Depth 16, width 1024, one K/V head of 128: 12·16·1024² + 2·8192·1024 = 218.1M counted every head's
    K/V; with one K/V head the two K/V projections are 2·1024·128 per layer instead of 2·1024², 29.4M fewer
    over 16 layers, so the point fits phase1's 200M cap."""
    space = load("phase1").space
    point = {"depth": 16, "model_dim": 1024, "head_dim": 128, "_gqa": True, "n_kv_head": 1}
    env, _ = space.complete({**space.sample(random.Random(1)), **point})
    old = 12 * 16 * 1024**2 + 2 * 8192 * 1024
    saved = 16 * 2 * 1024 * (1024 - 128)
    assert old > 200e6 and old - saved <= 200e6
    plain = env["_compute_params"]  # the cap weighs the shape without value embeddings (lookups, no FLOPs)
    assert old - saved <= plain < old - saved + 16 * 4 * 1024  # + the norms' and scalars' few weights
    assert plain <= 200e6


def test_phase2_is_whole_servers_scored_half_val_bpb_half_core():
    spec, short = load("phase2"), load("phase2-short")
    assert spec.chips == 16 and spec.resources.neuron_cores == 64 and spec.budget_s == 14400
    assert spec.objective.kind == "composite" and spec.direction == "maximize" and spec.directions == ["maximize"]
    assert {t.metric: t.weight for t in spec.objective.terms} == {"val_bpb": 0.5, "core": 0.5}
    assert spec.space.fixed["core_max_seconds"] == 3600 and spec.space.fixed["core_bundle"]
    assert spec.eval_timeout_s >= 1200 + 3600  # val_bpb's timeout and CORE's hour both fit the deadline
    import random

    rng = random.Random(0)
    for _ in range(20):
        config = spec.space.trainer_config(spec.space.sample_feasible(rng))
        assert config["ranks"] == 64 and config["lnc"] == 2  # one rank per logical core of 16 chips
        assert config["total_batch_tokens"] % (config["batch_size"] * config["seq_len"] * 64) == 0
    assert short.objective == spec.objective and short.chips == 16 and short.budget_s < spec.budget_s
    assert [p.name for p in short.space.params] == [p.name for p in spec.space.params]
    assert short.space.fixed["core_max_examples"] > 0 and short.space.fixed["core_max_seconds"] < 3600
    demo = load("demo-phase2")
    assert demo.objective.kind == "pareto" and demo.directions == ["minimize", "maximize"]
    assert demo.space.fixed["core_bundle"] == "demo" and demo.space.fixed["ranks"] == 2


CHIP_TRIAL = {"budget_s": 4, "eval_timeout_s": 5}


@pytest.mark.parametrize("chips, lnc, ranks", [(1, None, 4), (2, 2, 8), (16, 2, 64), (16, 1, 128), (3, 1, 24)])
def test_chips_set_cores_and_one_rank_per_logical_core(tmp_path, chips, lnc, ranks):
    fixed = {**FIXED, **({"lnc": lnc} if lnc else {})}
    spec = load(write_spec(tmp_path, "k", tiny_spec(trial={**CHIP_TRIAL, "chips": chips}, fixed=fixed,
                                                    constraints={"r": "ranks >= 4"})))
    assert spec.chips == chips and spec.resources.neuron_cores == chips * 4  # Ray counts at the cluster's LNC 2
    assert spec.resources.ray_options()["resources"] == {"neuron_cores": chips * 4}
    config = spec.space.trainer_config({"depth": 1, "model_dim": 32, "matrix_lr": 0.02})
    assert config["ranks"] == ranks


def test_chips_keep_explicit_ranks_and_agreeing_cores(tmp_path):
    both = {**CHIP_TRIAL, "chips": 2, "ranks": 2}
    spec = load(write_spec(tmp_path, "k", tiny_spec(trial=both, **{"trial.resources": {"neuron_cores": 8}})))
    assert spec.ranks == 2 and "ranks" not in spec.space.trainer_config({"depth": 1, "model_dim": 32,
                                                                         "matrix_lr": 0.02})
    lnc_param = {"params.lnc": {"type": "categorical", "choices": [1, 2]}}
    spec = load(write_spec(tmp_path, "k", tiny_spec(trial={**CHIP_TRIAL, "chips": 1}, **lnc_param)))
    for lnc, ranks in ((1, 8), (2, 4)):
        assert spec.space.trainer_config({"depth": 1, "model_dim": 32, "matrix_lr": 0.02, "lnc": lnc})["ranks"] == ranks


def test_objectives_from_records():
    single = obj.Objective()
    assert single.values({"val_bpb": 1.25}) == [1.25] and single.intermediate(1.5) == 1.5 and single.reports
    pareto = obj.Objective("pareto", ("val_bpb", "core"), ("minimize", "maximize"))
    assert pareto.multi and pareto.intermediate(1.0) is None and not pareto.reports
    assert pareto.values({"val_bpb": 1.0, "core": 0.2}) == [1.0, 0.2]
    for record, why in (({"val_bpb": 1.0}, "core is missing"), ({"val_bpb": 1.0, "core": None}, "core is None"),
                        ({"val_bpb": float("nan"), "core": 0.1}, "val_bpb is nan")):
        with pytest.raises(obj.MissingMetric, match=why) as e:
            pareto.values(record)
        assert "\n" not in str(e.value) and "pareto objective" in str(e.value)
    terms = (obj.Term("val_bpb", 0.5, best=0.8, worst=1.0), obj.Term("core", 0.5, best=0.3, worst=0.1))
    comp = obj.Objective("composite", ("val_bpb", "core"), ("maximize",), terms)
    assert comp.values({"val_bpb": 0.8, "core": 0.3}) == [pytest.approx(1.0)]
    assert comp.values({"val_bpb": 1.0, "core": 0.1}) == [pytest.approx(0.0)]
    assert comp.values({"val_bpb": 0.9, "core": 0.35}) == [pytest.approx(0.25 + 0.625)]  # past best: above 1
    assert comp.intermediate(0.85) == pytest.approx(0.75) and comp.intermediate(1.2) == pytest.approx(-1.0)
    assert comp.names == ["composite"] and pareto.names == ["val_bpb", "core"]
    mm = ("minimize", "maximize")
    assert obj.dominates([1.0, 0.3], [1.1, 0.3], mm) and not obj.dominates([1.0, 0.3], [1.0, 0.3], mm)
    assert not obj.dominates([1.0, 0.2], [1.1, 0.3], mm)


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
    "more chips than a node": ({"trial": {**CHIP_TRIAL, "chips": 17}}, "trial.chips"),
    "zero chips": ({"trial": {**CHIP_TRIAL, "chips": 0}}, "trial.chips"),
    "chips against neuron_cores": ({"trial": {**CHIP_TRIAL, "chips": 2}, "trial.resources": {"neuron_cores": 4}},
                                   "trial.resources.neuron_cores"),
    "chips with gpus": ({"trial": {**CHIP_TRIAL, "chips": 1}, "trial.resources": {"num_gpus": 1}},
                        "trial.resources.num_gpus"),
    "chips with ranks that do not fit": ({"trial": {**CHIP_TRIAL, "chips": 1, "ranks": 3}}, "trial.ranks"),
    "unknown objective type": ({"objective": {"type": "weighted"}}, "objective.type"),
    "unknown objective key": ({"objective": {"type": "pareto", "metric": ["val_bpb"]}}, "objective.metric"),
    "metrics for single": ({"objective": {"metrics": ["val_bpb", "core"]}}, "objective.metrics"),
    "pareto of one metric": ({"objective": {"type": "pareto", "metrics": ["val_bpb"]}}, "objective.metrics"),
    "pareto metric without a direction": ({"objective": {"type": "pareto", "metrics": ["val_bpb", "steps"]}},
                                          "objective.metrics"),
    "pareto metric twice": ({"objective": {"type": "pareto", "metrics": ["val_bpb", "val_bpb"]}},
                            "objective.metrics"),
    "pareto with a direction": ({"study": {"n_trials": 2, "direction": "minimize"},
                                 "objective": {"type": "pareto", "metrics": ["val_bpb", "params"]}},
                                "study.direction"),
    "pareto with a pruner": ({"objective": {"type": "pareto", "metrics": ["val_bpb", "params"]},
                              "pruner": {"name": "median"}}, "pruner.name"),
    "pareto over core without CORE": ({"objective": {"type": "pareto", "metrics": ["val_bpb", "core"]}},
                                      "fixed.core_bundle"),
    "composite without terms": ({"objective": {"type": "composite"}}, "objective.terms"),
    "composite minimised": ({"study": {"n_trials": 2, "direction": "minimize"}, "objective": {
        "type": "composite", "terms": {"val_bpb": {"weight": 1.0, "best": 0.9, "worst": 1.1}}}}, "study.direction"),
    "composite bounds backwards": ({"objective": {"type": "composite", "terms": {
        "val_bpb": {"weight": 1.0, "best": 1.1, "worst": 0.9}}}}, "objective.terms.val_bpb.best"),
    "composite core bounds backwards": ({"fixed": {**FIXED, "core_bundle": "demo"}, "objective": {
        "type": "composite", "terms": {"core": {"weight": 1.0, "best": 0.1, "worst": 0.3}}}},
        "objective.terms.core.best"),
    "composite zero weight": ({"objective": {"type": "composite", "terms": {
        "val_bpb": {"weight": 0, "best": 0.9, "worst": 1.1}}}}, "objective.terms.val_bpb.weight"),
    "composite unknown metric": ({"objective": {"type": "composite", "terms": {
        "bpb": {"weight": 1, "best": 0.9, "worst": 1.1}}}}, "objective.terms.bpb"),
    "composite over core without CORE": ({"objective": {"type": "composite", "terms": {
        "core": {"weight": 1, "best": 0.3, "worst": 0.1}}}}, "fixed.core_bundle"),
    "composite pruned without val_bpb": ({"fixed": {**FIXED, "core_bundle": "demo"}, "pruner": {"name": "median"},
                                          "objective": {"type": "composite", "terms": {
                                              "core": {"weight": 1, "best": 0.3, "worst": 0.1}}}}, "pruner.name"),
    "learning_curve on a maximised composite": ({"pruner": {"name": "learning_curve"}, "objective": {
        "type": "composite", "terms": {"val_bpb": {"weight": 1, "best": 2.0, "worst": 3.0}}}}, "pruner.name"),
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
    # An objective of another type replaces its base's table instead of inheriting its keys.
    composite = {"type": "composite", "terms": {"val_bpb": {"weight": 1.0, "best": 0.9, "worst": 1.1}}}
    write_spec(tmp_path, "comp", tiny_spec(objective=composite))
    (tmp_path / "par.toml").write_text('extends = "comp"\n' + spec_toml(
        {"objective": {"type": "pareto", "metrics": ["val_bpb", "params"]}}))
    assert load(tmp_path / "par.toml").objective.metrics == ("val_bpb", "params")


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
