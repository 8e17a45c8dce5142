"""Trainium plumbing on the CPU: launch plans and core mapping, the compile cache and its graph keys,
precompile, and utilisation sampling. The trainer, supervisor and sweep are real; only the Neuron tools
(``neuron-ls``, ``neuron-monitor``) are stand-in executables written here and put first on PATH, printing
JSON in their documented layouts."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from argparse import Namespace
from dataclasses import fields
from pathlib import Path

import optuna
import pytest

from sweep import neuron
from sweep import store as st
from sweep.run import precompile, supervisor
from sweep.run.remote import run_trial
from sweep.run.supervisor import Supervisor, TrialTask
from sweep.run.warm import WarmPicker, pick_warm
from sweep.spec import SpecError, load
from tests.neuron_standins import FAKE_LS, NEURON_LS, write_tools
from tests.sweep_fixtures import FIXED, ROOT, tiny_spec, write_spec

# -- stand-in Neuron tools ----------------------------------------------------------------------------

# neuron-monitor: one report per period; the trial's trainer (found by the marker in its command line)
# appears as a runtime on cores 4 and 5, beside a runtime of another process that must not count.
FAKE_MONITOR = """\
#!{python}
import json, os, sys, time
config = json.load(open(sys.argv[sys.argv.index("-c") + 1]))
assert {{m["type"] for m in config["neuron_runtimes"][0]["metrics"]}} >= {{"neuroncore_counters", "memory_used"}}
marker = os.environ["FAKE_MONITOR_MARKER"].encode()
dump = os.environ.get("FAKE_MONITOR_ENV_DUMP")

def runtime(pid, utils, device_bytes):
    return {{"pid": pid, "neuron_runtime_tag": str(pid), "error": "", "report": {{
        "neuroncore_counters": {{"period": 1.0, "error": "", "neuroncores_in_use": {{
            str(c): {{"neuroncore_utilization": u}} for c, u in utils.items()}}}},
        "memory_used": {{"period": 1.0, "error": "", "neuron_runtime_used_bytes": {{
            "host": 4096, "neuron_device": device_bytes, "usage_breakdown": {{"host": {{}},
            "neuroncore_memory_usage": {{}}}}}}}}}}}}

i = 0
while True:
    mine = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{{entry}}/cmdline", "rb").read()
            environ = open(f"/proc/{{entry}}/environ", "rb").read().split(b"\\0")
        except OSError:
            continue
        if marker in cmdline and b"model.train" in cmdline:
            mine.append(int(entry))
            if dump:
                env = dict(e.decode().split("=", 1) for e in environ if b"=" in e)
                json.dump({{k: v for k, v in env.items() if k.startswith(("NEURON", "TORCH_NEURONX"))}},
                          open(dump, "w"))
    data = [runtime(p, {{4: 40.0, 5: 60.0}}, 2_000_000 + 1_000_000 * (i % 2)) for p in mine]
    data.append(runtime(1, {{0: 99.0}}, 10**12))
    print(json.dumps({{"neuron_runtime_data": data, "system_data": {{}}, "instance_info": {{}},
                      "neuron_hardware_info": {{"neuron_device_count": 2, "neuroncore_per_device_count": 4}}}}),
          flush=True)
    i += 1
    time.sleep(0.1)
"""


@pytest.fixture
def tools(tmp_path, monkeypatch) -> Path:
    """Stand-in neuron-ls and neuron-monitor first on PATH."""
    bin_dir = write_tools(tmp_path / "bin", FAKE_MONITOR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return bin_dir


# -- launch plans -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,cores", [("0-3", [0, 1, 2, 3]), ("4,5,6,7", [4, 5, 6, 7]), ("0-1,4-5", [0, 1, 4, 5]),
                                        (" 6 , 2-3 ", [2, 3, 6])])
def test_visible_cores_in_every_form(text, cores):
    assert neuron.parse_cores(text) == cores
    assert neuron.parse_cores(neuron.format_cores(cores)) == cores


@pytest.mark.parametrize("text", ["", "0-", "3-1", "a", "0,0"])
def test_bad_visible_cores_are_one_line(text):
    with pytest.raises(neuron.LaunchError) as e:
        neuron.parse_cores(text)
    assert "\n" not in str(e.value) and neuron.CORES_VAR in str(e.value)


def test_cores_are_renumbered_between_logical_core_configs():
    assert neuron.to_trial_lnc([2, 3], node_lnc=2, lnc=1) == [4, 5, 6, 7]  # a LNC-2 core is a physical pair
    assert neuron.to_trial_lnc([4, 5, 6, 7], node_lnc=1, lnc=2) == [2, 3]
    with pytest.raises(neuron.LaunchError, match="splits LNC-2 pairs"):
        neuron.to_trial_lnc([1, 2, 3, 4], node_lnc=1, lnc=2)


@pytest.mark.parametrize("cores,ranks,mapped", [([0, 1, 2, 3], 4, [0, 1, 2, 3]), ([4, 5, 6, 7], 1, [4]),
                                                (list(range(8)), 4, [0, 2, 4, 6])])
def test_ranks_take_even_shares_of_the_cores(cores, ranks, mapped):
    assert neuron.map_ranks(cores, ranks, 2) == mapped


def test_a_plan_that_does_not_fit_is_refused_in_one_line():
    with pytest.raises(neuron.LaunchError) as e:
        neuron.map_ranks([0, 1, 2, 3], 3, 2)
    assert str(e.value) == ("3 rank(s) do not fit the 4 LNC-2 NeuronCore(s) assigned (0-3): "
                            "ranks must divide the core count")


def test_launch_plan_maps_ray_cores_and_strips_launch_keys(tools, tmp_path):
    config = {"depth": 2, "lnc": 1, "ranks": 8, "neuron_cc_flags": "--optlevel=1", "device": "neuron"}
    plan = neuron.TrialLaunch.prepare(config, 1, {}, str(tmp_path / "cache"),
                                      node_env={**os.environ, neuron.CORES_VAR: "4-7"})
    assert plan.config == {"depth": 2, "device": "neuron"} and plan.ranks == 8
    assert plan.env[neuron.CORES_VAR] == "8-15" and plan.env[neuron.LNC_VAR] == "1"  # LNC-2 cores 4-7 at LNC 1
    assert plan.env[neuron.CC_FLAGS_VAR] == "--optlevel=1"
    assert plan.env[neuron.NEFF_CACHE_VAR] == str(tmp_path / "cache" / "neff")
    assert plan.env[neuron.XLA_CACHE_VAR] == str(tmp_path / "cache" / "xla")
    assert plan.attrs["neuron_trial_devices"] == [1] and plan.attrs["neuron_node_cores"] == 8
    assert plan.attrs["graph_key"] == neuron.graph_key(config)
    plan.close()
    with pytest.raises(neuron.LaunchError, match="core.s. 8-9 are not on this node"):
        neuron.TrialLaunch.prepare({"ranks": 2}, 1, {}, "", node_env={**os.environ, neuron.CORES_VAR: "8,9"})
    with pytest.raises(neuron.LaunchError, match="--cache_dir"):
        neuron.TrialLaunch.prepare({"neuron_cc_flags": "-O1 --cache_dir=/tmp/x"}, 1, {}, "", node_env={})


# `neuron-ls --json-output` of a trn2.48xlarge at LNC 2: 16 devices of 4 logical cores.
NEURON_LS_48XL = [{**NEURON_LS[0], "neuron_device": d, "connected_to": [],
                   "neuroncore_ids": list(range(4 * d, 4 * d + 4))} for d in range(16)]


@pytest.mark.parametrize("chips, lnc, visible, rank_cores, devices", [
    (16, 2, "0-63", "0-63", list(range(16))),  # the whole server: 64 ranks, one per logical core
    (16, 1, "0-63", "0-127", list(range(16))),  # LNC 1: each LNC-2 core is two, 128 ranks
    (2, 2, "8-15", "8-15", [2, 3]),  # two chips in the middle of the node
])
def test_multi_chip_trial_launches_one_rank_per_core_over_all_its_cores(tmp_path, monkeypatch, chips, lnc, visible,
                                                                        rank_cores, devices):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "neuron-ls").write_text(FAKE_LS.format(python=sys.executable, devices=repr(NEURON_LS_48XL)))
    (bin_dir / "neuron-ls").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    fixed = {**FIXED, "lnc": lnc, "device": "neuron"}
    spec = load(write_spec(tmp_path, "chips", tiny_spec(trial={**NEURON_TRIAL, "chips": chips}, fixed=fixed)))
    assert spec.resources.ray_options()["resources"] == {"neuron_cores": 4 * chips}  # what Ray hands out
    config = spec.space.trainer_config({"depth": 1, "model_dim": 32, "matrix_lr": 0.02})
    plan = neuron.TrialLaunch.prepare(config, spec.ranks, spec.env, str(tmp_path / "cache"),
                                      node_env={**os.environ, neuron.CORES_VAR: visible})
    ranks = chips * 8 // lnc
    assert plan.ranks == ranks and "ranks" not in plan.config and "lnc" not in plan.config
    assert plan.env[neuron.CORES_VAR] == rank_cores and len(neuron.parse_cores(rank_cores)) == ranks
    assert plan.env[neuron.LNC_VAR] == str(lnc)
    assert plan.attrs["neuron_trial_devices"] == devices and plan.attrs["launch_ranks"] == ranks
    task = TrialTask(study="k", storage_url="", number=0, trial_id=0, params={}, config=plan.config,
                     budget_s=4, deadline_s=9, eval_fractions=(0.5,), ranks=plan.ranks)
    cmd = supervisor.trainer_command(task, tmp_path / "c.json", tmp_path, rank_module=plan.rank_module)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node"] and cmd[5] == str(ranks)
    # Each rank narrows to its own core before the trainer starts (TorchNeuron: one core per process).
    assert cmd[6:9] == ["-m", neuron.RANK_MODULE, task.trainer]
    assert plan.env[neuron.RANK_CORES_VAR].split(",") == [str(c) for c in neuron.parse_cores(rank_cores)]
    plan.close()


def test_neuron_ls_both_layouts_and_foreign_processes():
    devices = neuron.parse_neuron_ls({"neuron_devices": [{**d, "neuroncore_ids": None} for d in NEURON_LS]})
    assert [d.cores for d in devices] == [(0, 1, 2, 3), (4, 5, 6, 7)]  # ids follow device order without them
    busy = [NEURON_LS[0], {**NEURON_LS[1], "neuron_processes": [{"pid": 4242, "command": "python train.py"}]}]
    attrs = neuron.check_node(neuron.parse_neuron_ls(busy), [4, 5])
    assert attrs["neuron_foreign_pids"] == [4242] and attrs["neuron_device_memory_bytes"] == 103079215104


# -- specs ----------------------------------------------------------------------------------------------

NEURON_TRIAL = {"budget_s": 4, "eval_timeout_s": 5}


@pytest.mark.parametrize("change,key,words", [
    ({"fixed": {**FIXED, "ranks": 3}, "trial.resources": {"neuron_cores": 4}}, "fixed.ranks", "3 rank(s) do not fit"),
    ({"fixed": {**FIXED, "ranks": 4}, "trial": {**NEURON_TRIAL, "ranks": 4}}, "trial.ranks", "keep one"),
    ({"fixed": {**FIXED, "lnc": 3}}, "fixed.lnc", "lnc must be 1 or 2"),
    ({"params.ranks": {"type": "categorical", "choices": [4, 8]}, "trial.resources": {"neuron_cores": 2}},
     "params.ranks", "do not fit"),
    ({"fixed": {**FIXED, "neuron_cc_flags": "--cache_dir=/x"}}, "fixed.neuron_cc_flags", "--cache_dir"),
    ({"fixed": {**FIXED, "neuron_cc_flags": "--optlevel=1 --lnc=1"}}, "fixed.neuron_cc_flags", "--lnc in the compiler"),
    ({"fixed": {**FIXED, "neuron_cc_flags": "-lnc 2"}}, "fixed.neuron_cc_flags", "set the lnc parameter"),
    ({"params.neuron_cc_flags": {"type": "categorical", "choices": ["--optlevel=2", "--logical-nc-config=2"]}},
     "params.neuron_cc_flags", "--logical-nc-config in the compiler flags"),
    ({"trial": {**NEURON_TRIAL, "env": {"NEURON_CC_FLAGS": "--lnc 1"}}}, "trial.env.NEURON_CC_FLAGS", "NCC_EVRF066"),
    ({"trial": {**NEURON_TRIAL, "compile_cache": "cache"}}, "trial.compile_cache", "absolute path"),
])
def test_bad_launch_settings_fail_the_spec_in_one_line(tmp_path, change, key, words):
    path = write_spec(tmp_path, "bad", tiny_spec(**change))
    with pytest.raises(SpecError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}: {key}: ") and words in str(e.value) and "\n" not in str(e.value)


def test_phase1_searches_nothing_it_cannot_launch():
    spec = load("phase1")
    assert spec.space.fixed["lnc"] == 2 and "neuron_cc_flags" in spec.space.fixed
    config = spec.space.trainer_config(spec.space.sample_feasible(__import__("random").Random(0)))
    assert neuron.launch_values(config, spec.ranks, spec.env)[:2] == (4, 2)  # one rank per logical core


# -- graph keys -----------------------------------------------------------------------------------------

def test_graph_defaults_are_the_trainers_and_every_trainer_key_is_classified():
    from model.config import DEFAULTS, GPTConfig, OptimConfig, RunConfig, parse_config

    trainer = {f.name: f.default for cls in (GPTConfig, OptimConfig) for f in fields(cls)}
    trainer.update({f.name: getattr(RunConfig(), f.name) for f in fields(RunConfig)})
    trainer.update(DEFAULTS)
    assert trainer == neuron.TRAINER_DEFAULTS
    resolved = parse_config({}).to_dict()  # what the trainer runs with when a config leaves a key out
    for k, v in neuron.GRAPH_DEFAULTS.items():
        assert trainer[k] == v, k
        assert resolved[k] == v or k in ("model_dim", "n_kv_head"), k  # those two resolve from the others
    # Every trainer key is in exactly one of the two, and nothing in either is not a trainer key.
    assert not set(neuron.GRAPH_DEFAULTS) & set(neuron.NOT_IN_GRAPH_KEY)
    assert len(set(neuron.NOT_IN_GRAPH_KEY)) == len(neuron.NOT_IN_GRAPH_KEY)
    assert set(trainer) == set(neuron.GRAPH_DEFAULTS) | set(neuron.NOT_IN_GRAPH_KEY)
    assert RunConfig().excluded_steps == precompile.EXCLUDED_STEPS_DEFAULT


def test_graph_shape_resolves_widths_as_the_trainer_does():
    from model.config import parse_config

    for config in ({}, {"depth": 6, "aspect_ratio": 40, "head_dim": 64, "n_kv_head": 2, "mlp_ratio": 3.5},
                   {"depth": 3, "model_dim": 96, "head_dim": 48}):
        model = parse_config(config).model
        shape = neuron.graph_shape(config)
        assert (shape["model_dim"], shape["n_kv_head"], shape["mlp_dim"]) == (model.model_dim, model.n_kv_head,
                                                                              model.mlp_dim), config
    # A config the trainer refuses still has a shape (its key is recorded on the failed trial).
    assert neuron.graph_shape({"model_dim": 100, "head_dim": 32})["mlp_dim"] == 400


def test_graph_key_is_stable_and_changes_exactly_with_what_is_compiled():
    base = {"depth": 4, "model_dim": 256, "head_dim": 64, "seq_len": 256, "batch_size": 8, "matrix_lr": 0.02,
            "lnc": 2, "ranks": 4, "neuron_cc_flags": "--optlevel=1", "device": "neuron", "compile": True}
    key = neuron.graph_key(base)
    assert key == neuron.graph_key(dict(reversed(list(base.items())))) and len(key) == 16
    # The same model written another way, and run-time settings, keep the key.
    assert neuron.graph_key({**base, "model_dim": 0, "aspect_ratio": 64}) == key  # 4 x 64 = 256
    assert neuron.graph_key({**base, "n_kv_head": 4}) == key  # one KV head per query head anyway
    assert neuron.graph_key({**base, "neuron_cc_flags": " --optlevel=1 "}) == key
    assert neuron.graph_key({**base, "neuron_opt_level": "-O1"}) == neuron.graph_key({**base, "neuron_opt_level": 1})
    assert neuron.graph_key({k: v for k, v in base.items() if k != "ranks"}, default_ranks=4) == key
    for k, v in {"matrix_lr": 0.05, "weight_decay": 0.1, "warmdown_ratio": 0.3, "grad_accum": 4, "seed": 3,
                 "rope_base": 5e5, "eval_tokens": 1, "budget_s": 9, "head_init_std": 0.01, "x0_init": 0.2,
                 "embed_init_std": 0.8, "fc_init_scale": 0.4, "muon_beta2": 0.9}.items():
        assert neuron.graph_key({**base, k: v}) == key, k
    # Each compiled-graph setting changes it.
    changes = {"vocab_size": 4096, "depth": 5, "model_dim": 384, "head_dim": 128, "n_kv_head": 2, "mlp_ratio": 3.0,
               "seq_len": 512, "batch_size": 16, "ranks": 1, "lnc": 1, "neuron_cc_flags": "--optlevel=2",
               "kernels": "nki", "compile": False, "device": "cpu", "qk_norm": False, "value_embeds": False,
               "residual_scalars": False, "cautious_wd": False, "softcap": 0.0, "adam_beta1": 0.9,
               "adam_beta2": 0.99, "tokenizer": "/data/tok.json", "qk_scale": 1.2, "ve_gate_channels": 12,
               "ve_gate_scale": 3.0, "window_pattern": "L", "short_window": 64, "smear": True, "backout": True,
               "normuon": False, "x0_beta1": 0.9, "neuron_opt_level": 1}
    keys = {k: neuron.graph_key({**base, k: v}) for k, v in changes.items()}
    assert key not in keys.values() and len(set(keys.values())) == len(keys)
    assert set(changes) == set(neuron.GRAPH_INPUTS) - {"aspect_ratio"}


# Keys computed before graph.py derived its defaults and widths from model.config: stored studies hold
# graph keys (trial attributes, precompiled_graph_keys), so the same config must keep its key.
PINNED_GRAPH_KEYS = [
    ({}, 1, {}, "42597d2d0b26659f"),
    ({"depth": 4, "model_dim": 256, "head_dim": 64, "seq_len": 256, "batch_size": 8, "matrix_lr": 0.02, "lnc": 2,
      "ranks": 4, "neuron_cc_flags": "--optlevel=1", "device": "neuron", "compile": True}, 1, {}, "01e21be65d422d05"),
    ({"depth": 6, "aspect_ratio": 40, "head_dim": 64, "n_kv_head": 2, "mlp_ratio": 3.5, "value_embeds": True,
      "softcap": 0, "kernels": "nki", "tokenizer": "/data/tok.json", "seq_len": 512.0}, 2,
     {"NEURON_LOGICAL_NC_CONFIG": "1"}, "77302d01097a0665"),
    # Configs the trainer refuses still get a key (recorded on the failed trial; precompile lists them).
    ({"depth": 3, "model_dim": 100, "head_dim": 32, "n_kv_head": 3}, 1, {}, "5a19a646f01c701d"),
    ({"depth": 3, "aspect_ratio": 20, "head_dim": 48, "kernels": "bogus", "seed": 7}, 1, {}, "e2386b8584822a73"),
]


# The recipe's defaults (docs/recipe.md) compile other graphs than those keys were stored for; written with the
# settings of the trainer they were stored by, the same configs keep their keys.
LEGACY_TRAINER = {"value_embeds": False, "residual_scalars": False, "normuon": False, "ve_gate_channels": 0,
                  "window_pattern": "L"}


@pytest.mark.parametrize("config,ranks,env,key", PINNED_GRAPH_KEYS)
def test_graph_keys_of_stored_studies_stay_the_same(config, ranks, env, key):
    assert neuron.graph_key({**LEGACY_TRAINER, **config}, ranks, env) == key
    assert neuron.graph_key(config, ranks, env) != key  # today's defaults: other graphs, another key


def test_warm_trials_go_first():
    assert pick_warm([None, "a", "b"], {"b"}) == 2
    assert pick_warm(["a", "b"], set()) is None


def test_driver_prefers_a_waiting_trial_whose_graphs_are_compiled(tmp_path):
    spec = load(write_spec(tmp_path, "warm", tiny_spec()))
    study = optuna.create_study(study_name="warm", storage=st.open_storage(st.resolve_url(f"journal:{tmp_path}/j")))
    cold = {"depth": 1, "model_dim": 32, "matrix_lr": 0.02}
    warm = {"depth": 2, "model_dim": 48, "matrix_lr": 0.02}
    study.enqueue_trial(cold)
    study.enqueue_trial(warm)
    picker = WarmPicker(spec)
    assert picker.claim(study) is None  # nothing is known compiled: the queue's order stands
    study.set_user_attr(neuron.ATTR_PRECOMPILED, [picker.key_of(warm)])
    picker = WarmPicker(spec)
    trial = picker.claim(study)
    assert trial is not None and trial.number == 1 and trial.params == {} and spec.space.suggest(trial) == warm
    assert study.ask().number == 0  # the cold one is next


# -- compile cache --------------------------------------------------------------------------------------

def test_cache_locations_follow_the_node_layout(tmp_path):
    node = {neuron.NODE_CACHE_VAR: "/home/u/neuron-cache", neuron.NEFF_CACHE_VAR: "/home/u/neuron-cache/neff",
            neuron.XLA_CACHE_VAR: "/home/u/neuron-cache/xla"}  # what infra's cluster.env exports
    assert neuron.cache_location("", node).env() == {k: node[k] for k in (neuron.NEFF_CACHE_VAR, neuron.XLA_CACHE_VAR)}
    s3 = neuron.cache_location("s3://bkt/neuron-cache/", node)  # TorchNeuron takes no URL: a node mirror
    assert s3.env() == {neuron.NEFF_CACHE_VAR: "/home/u/neuron-cache-s3/bkt/neuron-cache/neff",
                        neuron.XLA_CACHE_VAR: "s3://bkt/neuron-cache/xla"} and s3.local_dirs() == [s3.neff_dir]
    assert s3.remote == "s3://bkt/neuron-cache/neff"
    shared = neuron.cache_location("/fsx/cache", {})
    assert shared.kind == "shared" and shared.env()[neuron.NEFF_CACHE_VAR] == "/fsx/cache/neff"
    assert neuron.cache_location("", {}).neff_dir == f"{neuron.DEFAULT_NODE_CACHE}/neff"


def test_cache_hits_and_misses_are_read_off_the_cache(tmp_path):
    cache = tmp_path / "cache"
    (cache / "neff" / "ab" / "cd").mkdir(parents=True)
    (cache / "neff" / "ab" / "cd" / "abcd01.neff").write_bytes(b"x")
    record = {"device": "neuron", "steps": 4, "excluded_steps": 3, "excluded_seconds": 95.0,
              "step_seconds_median": 0.5}
    plan = neuron.TrialLaunch.prepare({"device": "neuron"}, 1, {}, str(cache), node_env={"PATH": ""})
    attrs = plan.finished(record, launch_unix=100.0, first_step_unix=200.0)
    assert attrs["graph_cache"] == "hit" and attrs["graph_cache_entries"] == 1
    assert attrs["compile_seconds"] == 93.5 and attrs["startup_wall_seconds"] == 100.0
    plan = neuron.TrialLaunch.prepare({"device": "neuron"}, 1, {}, str(cache), node_env={"PATH": ""})
    (cache / "xla" / "neuronxcc-2.21" / "MODULE_1+ab").mkdir(parents=True)
    (cache / "xla" / "neuronxcc-2.21" / "MODULE_1+ab" / "model.neff").write_bytes(b"y")
    attrs = plan.finished(record, 100.0, 200.0)
    assert attrs["graph_cache"] == "miss" and attrs["graph_cache_new_entries"] == 1
    plan = neuron.TrialLaunch.prepare({"device": "neuron"}, 1, {}, str(cache), node_env={"PATH": ""})
    assert plan.finished({}, 100.0, None)["graph_cache"] == "none"  # died before compiling anything


# -- utilisation ----------------------------------------------------------------------------------------

def test_monitor_reports_keep_the_trials_runtimes_only():
    report = {"neuron_runtime_data": [
        {"pid": 10, "report": {"neuroncore_counters": {"neuroncores_in_use": {"0": {"neuroncore_utilization": 30.0},
                                                                              "1": {"neuroncore_utilization": 50.0}}},
                               "memory_used": {"neuron_runtime_used_bytes": {"host": 5, "neuron_device": 700}}}},
        {"pid": 11, "report": {"neuroncore_counters": {"neuroncores_in_use": {"2": {"neuroncore_utilization": 90.0}}},
                               "memory_used": {"neuron_runtime_used_bytes": {"host": 1, "neuron_device": 300}}}}]}
    assert neuron.monitor_sample(report, {10}) == ([30.0, 50.0], 700, 5)
    assert neuron.monitor_sample(report, None) == ([30.0, 50.0, 90.0], 1000, 6)
    assert neuron.monitor_sample(report, {99}) is None
    sampler = neuron.MonitorSampler(pids=lambda: [10])
    for line in (json.dumps(report), "not json", json.dumps({**report, "neuron_runtime_data": []})):
        sampler.feed(line)
    assert sampler.stop() == {"neuron_monitor_samples": 1, "neuron_device_memory_peak_bytes": 700,
                              "neuron_host_memory_peak_bytes": 5, "neuron_util_mean": 40.0}


# -- the supervisor on the real trainer -----------------------------------------------------------------

@pytest.fixture
def trial_config(tiny_config) -> dict:
    return {**tiny_config, "depth": 1, "model_dim": 32, "seq_len": 32, "batch_size": 4, "eval_tokens": 512,
            "final_eval_tokens": 2048, "eval_fractions": [0.5], "startup_allowance_s": 20, "device": "cpu"}


def make_task(tmp_path: Path, config: dict, **kw) -> TrialTask:
    return TrialTask(study="n", storage_url=kw.pop("storage_url", ""), number=kw.pop("number", 0),
                     trial_id=kw.pop("trial_id", 0), params={}, config=config, budget_s=kw.pop("budget_s", 3),
                     deadline_s=60, eval_fractions=tuple(config["eval_fractions"]), stop_grace_s=5, heartbeat_s=1,
                     artifact_dir=str(tmp_path / "art"), **kw)


@pytest.mark.slow
def test_trial_records_launch_cache_and_utilisation(tools, tmp_path, trial_config, monkeypatch):
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    study = optuna.create_study(study_name="n", storage=st.open_storage(url))
    trial = study.ask()
    dump = tmp_path / "trainer-env.json"
    monkeypatch.setenv(neuron.CORES_VAR, "4-7")  # as Ray sets it for a task holding 4 neuron_cores
    monkeypatch.setenv("FAKE_MONITOR_MARKER", str(tmp_path / "art"))
    monkeypatch.setenv("FAKE_MONITOR_ENV_DUMP", str(dump))
    config = {**trial_config, "lnc": 2, "ranks": 1, "neuron_cc_flags": "--optlevel=1"}
    task = make_task(tmp_path, config, storage_url=url, number=trial.number, trial_id=trial._trial_id,
                     compile_cache=str(tmp_path / "cache"))
    out = run_trial(task)
    assert out.state == "COMPLETE", out.reason  # the trainer never saw lnc, ranks or neuron_cc_flags
    attrs = study.get_trials()[0].user_attrs
    assert not set(neuron.LAUNCH_KEYS) & set(json.loads((tmp_path / "art" / "config.json").read_text()))
    assert attrs["graph_key"] == neuron.graph_key(config) and attrs["launch_ranks"] == 1 and attrs["launch_lnc"] == 2
    assert attrs["neuron_cores_assigned"] == "4-7" and attrs["neuron_rank_cores"] == "4"
    assert attrs["neuron_trial_devices"] == [1] and attrs["compile_cache"] == str(tmp_path / "cache")
    assert attrs["neuron_util_mean"] == 50.0 and attrs["neuron_device_memory_peak_bytes"] == 3_000_000
    assert attrs["neuron_monitor_samples"] >= 2
    env = json.loads(dump.read_text())
    assert env[neuron.CORES_VAR] == "4" and env[neuron.LNC_VAR] == "2" and env[neuron.CC_FLAGS_VAR] == "--optlevel=1"
    assert env[neuron.NEFF_CACHE_VAR] == str(tmp_path / "cache" / "neff")
    assert not any("neuron-monitor" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")
                   for p in os.listdir("/proc") if p.isdigit() and Path(f"/proc/{p}/cmdline").exists()
                   and str(tools) in Path(f"/proc/{p}/cmdline").read_text(errors="replace"))


def test_supervisor_refuses_a_plan_that_does_not_fit(tmp_path, trial_config, monkeypatch):
    monkeypatch.setenv(neuron.CORES_VAR, "0-3")
    sup = Supervisor(make_task(tmp_path, {**trial_config, "ranks": 3}))
    try:
        out = sup.run()
    finally:
        sup.close()
    assert out.state == "FAIL" and out.fail_kind == "config" and sup.proc is None
    assert out.reason == ("launch plan refused: 3 rank(s) do not fit the 4 LNC-2 NeuronCore(s) assigned (0-3): "
                          "ranks must divide the core count")


# -- precompile -----------------------------------------------------------------------------------------

def shapes_spec(tmp_path: Path, **extra) -> Path:
    sections = tiny_spec(**{
        "params.model_dim": {"type": "categorical", "choices": [32, 64]},
        "params.seq_len": {"type": "int", "low": 16, "high": 32, "step": 16},
        "fixed": {k: v for k, v in FIXED.items() if k != "seq_len"}, **extra})
    return write_spec(tmp_path, "shapes", sections)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sweep", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=120)


def test_precompile_dry_run_lists_the_studys_graph_shapes(tmp_path):
    # depth 1-2 x model_dim {32, 64} x seq_len {16, 32}, less the constraint's (2, 64, *) points.
    path = shapes_spec(tmp_path, constraints={"small": "depth * model_dim <= 64"})
    r = run_cli("precompile", str(path), "--dry-run")
    assert r.returncode == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["graph_params"] == ["depth", "model_dim", "seq_len"] and body["count"] == 6
    seen = {(s["values"]["depth"], s["values"]["model_dim"], s["values"]["seq_len"]) for s in body["shapes"]}
    assert seen == {(d, m, t) for d in (1, 2) for m in (32, 64) for t in (16, 32) if d * m <= 64}
    spec = load(path)
    for s in body["shapes"]:
        point = {**s["values"], "matrix_lr": 0.02}
        assert s["graph_key"] == neuron.graph_key(spec.space.trainer_config(point), spec.ranks, spec.env)


def test_precompile_refuses_what_it_cannot_enumerate(tmp_path):
    out = io.StringIO()
    spec = load(shapes_spec(tmp_path, **{"params.mlp_ratio": {"type": "float", "low": 2.0, "high": 4.0}}))
    args = Namespace(dry_run=True, max_shapes=64)
    assert precompile.main(spec, None, args, out) == 2 and not out.getvalue()
    spec = load(shapes_spec(tmp_path))
    assert precompile.main(spec, None, Namespace(dry_run=True, max_shapes=3), out) == 2
    r = run_cli("precompile", str(shapes_spec(tmp_path)), "--max-shapes", "3", "--dry-run")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "more than 3 graph shapes" in r.stderr


def test_precompile_without_neuron_cores_says_it_runs_on_the_cluster(tmp_path):
    path = [p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "neuron-ls").exists()]
    env = {"PATH": os.pathsep.join(path), "RAY_ADDRESS": ""}
    r = run_cli("precompile", str(shapes_spec(tmp_path)), env=env)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "no neuron_cores" in r.stderr and "precompiling happens on the cluster" in r.stderr


@pytest.mark.slow
def test_precompile_runs_one_compile_only_trainer_per_shape(tmp_path, data_cache):
    """precompile.run without the Neuron check, in a process of its own joined to a Ray head of the test's
    own: each shape's trainer stops after its uncharged steps + 1."""
    from tests.ray_head import ray_head
    from tests.sweep_fixtures import head_env

    fixed = {**{k: v for k, v in FIXED.items() if k != "seq_len"}, "cache_dir": data_cache, "depth": 1,
             "model_dim": 32}
    path = write_spec(tmp_path, "pc", tiny_spec(**{
        "fixed": fixed, "params.depth": None, "params.model_dim": None,
        "params.seq_len": {"type": "categorical", "choices": [16, 32]}}))
    names, shapes = precompile.enumerate_shapes(load(path))
    assert names == ["seq_len"] and len(shapes) == 2
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    code = ("import sys\nfrom sweep.run import precompile\nfrom sweep.spec import load\n"
            "spec = load(sys.argv[1])\n_, shapes = precompile.enumerate_shapes(spec)\n"
            "sys.exit(precompile.run(spec, shapes, sys.argv[2], sys.stdout, require=None))\n")
    with ray_head(node_env={"SWEEP_ARTIFACTS": str(tmp_path / "art")}) as head:  # the node's, as precompile reads
        r = subprocess.run([sys.executable, "-c", code, str(path), url], capture_output=True, text=True, cwd=ROOT,
                           env=head_env(head, url, tmp_path / "art"), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    assert {r["graph_key"] for r in lines[:-1]} == {s.key for s in shapes} and all(r["ok"] for r in lines[:-1])
    assert lines[-1] == {"study": "pc", "compiled": 2, "failed": 0}
    study = optuna.load_study(study_name="pc", storage=st.open_storage(url))
    assert sorted(study.user_attrs[neuron.ATTR_PRECOMPILED]) == sorted(s.key for s in shapes)
    for s in shapes:
        events = (tmp_path / "art" / "pc" / "precompile" / s.key / "events.jsonl").read_text().splitlines()
        result = json.loads(events[-1])
        assert result["status"] == "ok" and result["steps"] == 4  # excluded_steps 3 + 1


def test_the_native_stacks_opt_level_is_a_launch_key_recorded_and_set_for_the_compiler(tmp_path):
    """neuron_opt_level (NEURON_COMPILER_OPT_LEVEL) is searched, checked and set like neuron_cc_flags."""
    assert "neuron_opt_level" in neuron.LAUNCH_KEYS
    assert [neuron.opt_level_value({"neuron_opt_level": v}) for v in (1, "2", "-O3")] == ["-O1", "-O2", "-O3"]
    assert neuron.opt_level_value({}, {"NEURON_COMPILER_OPT_LEVEL": "-O1"}) == "-O1"
    assert neuron.opt_level_value({}) is None
    with pytest.raises(neuron.LaunchError, match="neuron_opt_level must be 1, 2 or 3"):
        neuron.opt_level_value({"neuron_opt_level": "--optlevel=1"})
    config = {"model_dim": 128, "neuron_opt_level": 1, "neuron_cc_flags": "--optlevel=1"}
    launch = neuron.TrialLaunch.prepare(config, 1, {}, str(tmp_path / "cache"), node_env={})
    assert launch.env["NEURON_COMPILER_OPT_LEVEL"] == "-O1" and launch.env["NEURON_CC_FLAGS"] == "--optlevel=1"
    assert launch.attrs["neuron_opt_level"] == "-O1" and launch.config == {"model_dim": 128}
    assert launch.attrs["graph_key"] != neuron.graph_key({**config, "neuron_opt_level": 2})
    launch.close()
    spec = {"study": {"n_trials": 1}, "trial": {"budget_s": 4, "eval_timeout_s": 20},
            "params.neuron_opt_level": {"type": "categorical", "choices": [1, 2]}}  # searched like any knob
    assert load(write_spec(tmp_path, "opt", spec)).space.params[0].name == "neuron_opt_level"
    with pytest.raises(SpecError, match="neuron_opt_level must be 1, 2 or 3"):
        load(write_spec(tmp_path, "opt", {**spec, "params.neuron_opt_level": {"type": "categorical",
                                                                              "choices": [1, 5]}}))
