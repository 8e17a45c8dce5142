"""``sweep export``: the bundled train.py runs alone (no repo on the path), trains, checkpoints and loads for
evaluation; the upload limit, the launch line, provenance and bad input."""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sweep import cli
from sweep import store as st
from sweep.ship import bundle, rehearse
from sweep.store.artifacts import code_version
from tests.sweep_fixtures import tiny_spec, write_spec

PARAMS = {"depth": 1, "model_dim": 32, "matrix_lr": 0.02}

# Runs a script with the repository unreachable: no PYTHONPATH (the caller drops it) and the editable install's
# finder removed, checked before anything runs.
ISOLATED = """
import importlib.util, runpy, sys
sys.path[:] = [p for p in sys.path if "__editable__" not in p]
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path_importer_cache.clear()
for name in ("model", "kernels", "sweep"):
    assert importlib.util.find_spec(name) is None, f"{name} is importable from {importlib.util.find_spec(name).origin}"
"""

RUN = ISOLATED + "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"

EVAL = ISOLATED + """
import torch
spec = importlib.util.spec_from_file_location("submission", sys.argv[1])
sub = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sub)
model = sub.load_for_eval(sys.argv[2], "cpu")
x = torch.randint(0, model.config.vocab_size, (2, 16))
with torch.no_grad():
    logits = model(x)
print(__import__("json").dumps({"shape": list(logits.shape), "finite": bool(torch.isfinite(logits).all()),
      "model_file": sys.modules["model"].__file__, "training": model.training}))
"""


def isolated_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture
def study(tmp_path, tiny_config, monkeypatch):
    """A study with a complete trial whose record holds the trainer's own resolved config, a failed trial
    without a record, a complete trial that ran on 2 ranks and one whose config the trainer now refuses;
    SWEEP_STORAGE points at it."""
    import optuna
    from optuna.trial import TrialState

    from model.config import parse_config

    spec_path = write_spec(tmp_path, "exp", tiny_spec(tiny_config["cache_dir"]))
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    monkeypatch.setenv("SWEEP_STORAGE", url)
    from sweep.spec import load

    spec = load(spec_path)
    config = parse_config({**spec.space.trainer_config(PARAMS), "budget_s": spec.budget_s}).to_dict()
    s = optuna.create_study(study_name="exp", storage=st.open_storage(url))
    dists = spec.space.distributions(PARAMS)
    record = {"status": "ok", "val_bpb": 2.5, "config": config, "device": "cpu"}
    attrs = {**record, "record_fields": sorted(record), "launch_ranks": 1, "git_commit": "0" * 40, "git_dirty": False,
             "spec_hash": "abc"}
    s.add_trial(optuna.trial.create_trial(params=PARAMS, distributions=dists, value=2.5, user_attrs=attrs))
    s.add_trial(optuna.trial.create_trial(params=PARAMS, distributions=dists, state=TrialState.FAIL,
                                          user_attrs={"fail_reason": "crash: exit code 3"}))
    s.add_trial(optuna.trial.create_trial(params=PARAMS, distributions=dists, value=2.9,
                                          user_attrs={**attrs, "launch_ranks": 2}))
    s.add_trial(optuna.trial.create_trial(params=PARAMS, distributions=dists, value=3.1,
                                          user_attrs={**attrs, "config": {**config, "final_eval_rows": -1}}))
    s.add_trial(optuna.trial.create_trial(params=PARAMS, distributions=dists, value=3.2,
                                          user_attrs={**attrs, "neuron_cc_flags": "--optlevel=1",
                                                      "neuron_opt_level": "-O1"}))
    return spec_path


def export(study_path: Path, out: Path, *extra: str) -> int:
    return cli.main(["export", str(study_path), "--out", str(out), *extra])


@pytest.mark.slow
def test_exported_train_py_trains_alone_and_load_for_eval_reads_its_checkpoint(study, tmp_path, tiny_config,
                                                                                capsys):
    out = tmp_path / "submission"
    assert export(study, out) == 0, capsys.readouterr().err
    printed, warned = capsys.readouterr()
    assert "exported trial 0 of study exp" in printed
    assert "ran code at commit 000000000000" in warned  # the record says another commit trained it
    assert "8192 tokens" in warned  # a 512-token vocabulary cannot use the kit's data

    text = (out / "train.py").read_bytes()
    prov = json.loads((out / "provenance.json").read_text())
    assert len(text) <= bundle.UPLOAD_LIMIT_BYTES and prov["train_py_bytes"] == len(text)
    assert prov["train_py_sha256"] == hashlib.sha256(text).hexdigest()
    assert (prov["study"], prov["trial"], prov["val_bpb"], prov["params"]) == ("exp", 0, 2.5, PARAMS)
    assert prov["code_version"] == code_version() and prov["code_matches_trial"] is False
    assert prov["trial_code_version"] == {"git_commit": "0" * 40, "git_dirty": False}
    # text while the sources fit the limit as text, zlib past it (the model and kernels packages now exceed it)
    assert prov["bundle"]["encoding"] in bundle.ENCODINGS and "model.train" in prov["bundle"]["modules"]
    assert "kernels._fake_nki" not in prov["bundle"]["modules"]
    # The machine's keys are the submission's, the configuration's are the trial's.
    cfg = prov["config"]
    assert (cfg["device"], cfg["data"], cfg["budget_s"], cfg["num_threads"], cfg["eval_fractions"]) == \
        ("neuron", "kit", 1800.0, 0, [])
    assert (cfg["depth"], cfg["model_dim"], cfg["matrix_lr"], cfg["seq_len"]) == (1, 32, 0.02, 32)
    assert cfg["cache_dir"] != tiny_config["cache_dir"]
    launch = "NEURON_LOGICAL_NC_CONFIG=2 torchrun --standalone --nproc_per_node=1 train.py"
    assert prov["launch"] == launch and launch in (out / "launch.sh").read_text()
    assert os.access(out / "launch.sh", os.X_OK)
    assert launch in text.decode() and "device = 'neuron'" in text.decode()

    # Run it as the competition would, from its own directory, with the repository out of reach.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train.py").write_bytes(text)
    overrides = {"device": "cpu", "data": "demo", "budget_s": 2, "cache_dir": tiny_config["cache_dir"],
                 "num_threads": 1}
    proc = subprocess.run([sys.executable, "-c", RUN, "train.py"], cwd=run_dir, capture_output=True, text=True,
                          timeout=240, env=isolated_env(TRAIN_OVERRIDES=json.dumps(overrides)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    summary = [ln.split(":")[0] for ln in lines[lines.index("---") + 1:]]
    # Every field docs/competition.md lists, and the block is the last thing it prints (the record goes to a file).
    assert {"val_bpb", "training_seconds", "startup_allowance_est", "charged_seconds_est", "over_budget", "num_steps",
            "total_tokens_M", "world_size", "seq_len", "num_params_M"} <= set(summary)
    assert lines[-1].startswith("num_params_M:") and not any(ln.startswith("{") for ln in lines)
    result = json.loads((run_dir / "out" / "result.json").read_text())
    assert result["status"] == "ok" and result["steps"] > 3 and result["train_seconds"] <= 2 + 1.0  # generous
    assert result["config"]["depth"] == 1 and result["config"]["excluded_steps"] == 2
    assert (run_dir / "out" / "final.pt").is_file()

    proc = subprocess.run([sys.executable, "-c", EVAL, str(run_dir / "train.py"), str(run_dir / "out" / "final.pt")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=isolated_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["shape"] == [2, 16, 512] and got["finite"] and got["training"] is False
    assert "_bundled_" in got["model_file"]  # served by the bundle, not found on disk

    # Phase 2: the exported inference.py scores CORE on that checkpoint with the same bundled code.
    (run_dir / "inference.py").write_bytes((out / "inference.py").read_bytes())
    proc = subprocess.run([sys.executable, "inference.py", "--checkpoint", "out/final.pt", "--bundle", "demo",
                           "--max-examples", "4", "--cache-dir", tiny_config["cache_dir"], "--num-threads", "1",
                           "--json"], cwd=run_dir, capture_output=True, text=True, timeout=240, env=isolated_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    core = json.loads(proc.stdout.strip().splitlines()[-1])
    assert math.isfinite(core["core"]) and core["core_complete"] and core["examples"] > 0
    assert prov["inference_py_sha256"] == hashlib.sha256((out / "inference.py").read_bytes()).hexdigest()
    assert cfg["core_bundle"] == ""  # the competition runs CORE itself


@pytest.mark.slow
def test_train_py_trains_on_the_kit_beside_it_and_refuses_to_run_without_one(study, tmp_path, capsys):
    from tests.byte_kit import FAKE_PREPARE

    out = tmp_path / "sub"
    assert export(study, out) == 0
    run_dir = tmp_path / "with_kit"
    run_dir.mkdir()
    (run_dir / "train.py").write_bytes((out / "train.py").read_bytes())
    (run_dir / "prepare.py").write_text(FAKE_PREPARE)
    overrides = {"device": "cpu", "budget_s": 1, "num_threads": 1, "vocab_size": 260}  # the stand-in kit's vocabulary
    proc = subprocess.run([sys.executable, "-c", RUN, "train.py"], cwd=run_dir, capture_output=True, text=True,
                          timeout=240, env=isolated_env(TRAIN_OVERRIDES=json.dumps(overrides)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run_dir / "out" / "result.json").read_text())
    assert result["status"] == "ok" and result["config"]["data"] == f"kit:{run_dir / 'prepare.py'}"
    assert (run_dir / "out" / "final.pt").is_file()

    proc = subprocess.run([sys.executable, "-c", RUN, "train.py"], cwd=out, capture_output=True, text=True,
                          timeout=120, env=isolated_env(TRAIN_OVERRIDES='{"device": "cpu"}'))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("train.py: the competition kit's prepare.py was not found")
    proc = subprocess.run([sys.executable, "-c", RUN, "train.py"], cwd=out, capture_output=True, text=True,
                          timeout=120, env=isolated_env(TRAIN_OVERRIDES="[1]"))
    assert proc.returncode == 2 and "TRAIN_OVERRIDES must be a JSON object" in proc.stderr


SCORE = ISOLATED + """
spec = importlib.util.spec_from_file_location("submission", sys.argv[1])
sub = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sub)
kit_spec = importlib.util.spec_from_file_location("kit_prepare", sys.argv[3])
kit = importlib.util.module_from_spec(kit_spec)
kit_spec.loader.exec_module(kit)
model = sub.load_for_eval(sys.argv[2], "cpu")
bpb = kit.evaluate_bpb(model, kit.Tokenizer.from_directory(), int(sys.argv[4]))
print(__import__("json").dumps({"val_bpb": bpb, "max_seq_len": kit.MAX_SEQ_LEN, "seq_len": model.config.seq_len}))
"""


@pytest.mark.slow
def test_an_export_trained_short_is_scored_by_the_kit_at_its_own_length(study, tmp_path, standin_kit):
    # The stand-in kit (autoresearch's prepare.py semantics): its loader takes no rank and its evaluate_bpb
    # runs at MAX_SEQ_LEN 2048, whatever the model trained at (here 32).
    out = tmp_path / "sub"
    assert export(study, out) == 0
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["config"]["eval_seq_len"] == 0  # the kit's length, whatever the trial evaluated at
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "train.py").write_bytes((out / "train.py").read_bytes())
    prepare = standin_kit / "prepare.py"
    overrides = {"device": "cpu", "budget_s": 2, "num_threads": 1, "vocab_size": 512}  # the stand-in's vocabulary
    proc = subprocess.run([sys.executable, "-c", RUN, "train.py"], cwd=run_dir, capture_output=True, text=True,
                          timeout=240, env=isolated_env(TRAIN_OVERRIDES=json.dumps(overrides),
                                                        TRNSWEEP_KIT_PREPARE=str(prepare)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run_dir / "out" / "result.json").read_text())
    assert result["status"] == "ok" and result["config"]["data"] == f"kit:{prepare}"
    assert result["config"]["seq_len"] == 32 and result["val_seq_len"] == 2048 and result["val_bpb_stderr"] == 0

    # Scored as the competition scores it: the kit's evaluate_bpb on the model load_for_eval returns.
    batch = result["config"]["batch_size"]
    proc = subprocess.run([sys.executable, "-c", SCORE, str(run_dir / "train.py"), str(run_dir / "out" / "final.pt"),
                           str(prepare), str(batch)], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env=isolated_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (scored["max_seq_len"], scored["seq_len"]) == (2048, 32)
    assert scored["val_bpb"] == pytest.approx(result["val_bpb"], rel=1e-6)


@pytest.mark.parametrize(("args", "message"), [
    (["--trial", "7"], "--trial 7: study 'exp' has no trial 7"),
    (["--trial", "1"], "trial 1 of study 'exp' has no result record to export (state FAIL; crash: exit code 3)"),
    (["--trial", "2"], "trial 2 ran with 2 rank(s) at LNC 2; the competition launches 1, 4 or 8 ranks"),
    (["--trial", "3"], "trial 3: train.py would refuse its configuration: final_eval_rows must not be negative"),
])
def test_bad_trials_exit_2_with_one_line_and_write_nothing(study, tmp_path, capsys, args, message):
    out = tmp_path / "sub"
    assert export(study, out, *args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()


def test_unknown_study_and_bad_out_exit_2(study, tmp_path, capsys):
    other = write_spec(tmp_path, "nothere", tiny_spec())
    assert export(other, tmp_path / "x") == 2
    assert "no study 'nothere'" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("")
    assert export(study, afile) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert export(tmp_path / "missing.toml", tmp_path / "x") == 2
    assert "no such study spec" in capsys.readouterr().err


def test_over_the_upload_limit_fails_in_one_line(study, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bundle, "UPLOAD_LIMIT_BYTES", 20_000)
    assert export(study, tmp_path / "sub") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "over the upload limit of 20,000" in err and "zlib" in err
    assert not (tmp_path / "sub" / "train.py").exists()


def test_compressed_bundle_when_text_does_not_fit(study, tmp_path, capsys, monkeypatch):
    modules = bundle.collect()
    text_size = len(bundle.render("", "", modules, limit=10**7, encoding="text")[0].encode())
    monkeypatch.setattr(bundle, "UPLOAD_LIMIT_BYTES", text_size - 1)
    assert export(study, tmp_path / "sub") == 0
    prov = json.loads((tmp_path / "sub" / "provenance.json").read_text())
    assert prov["bundle"]["encoding"] == "zlib" and prov["train_py_bytes"] < text_size // 2
    ns: dict = {}
    exec(bundle.boot_source(), ns)
    exec(bundle.modules_block(modules, "zlib"), ns)
    assert {k: v[1] for k, v in ns["BUNDLED_MODULES"].items()} == {m.name: m.source for m in modules}


@pytest.mark.parametrize("source", [
    'x = """a"""\n', "s = '\\\\n'\n", 'q = """""" + "\\""\n', "a = 1  # ü — ✓\n", "tail\\\n",
    "crlf = 1\r\n", "no newline", '""""\n',
])
def test_text_literal_reproduces_any_source(source):
    assert ast.literal_eval(bundle.text_literal(source)) == source


def test_finder_serves_source_to_inspect_and_refuses_a_foreign_package(monkeypatch):
    from sweep.ship import bundle_boot

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in ("tsb_pkg", "tsb_pkg.mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    modules = {"tsb_pkg": (True, "VALUE = 1\n"), "tsb_pkg.mod": (False, "def f():\n    return 42\n")}
    bundle_boot.install(modules, "id1", "/nonexistent/b")
    bundle_boot.install(modules, "id1", "/nonexistent/b")  # once only
    assert sum(getattr(f, "bundle_id", None) == "id1" for f in sys.meta_path) == 1
    import tsb_pkg.mod  # noqa: F401  (served by the finder)

    mod = sys.modules["tsb_pkg.mod"]
    assert mod.f() == 42 and inspect.getsource(mod.f) == modules["tsb_pkg.mod"][1]
    assert mod.__file__ == "/nonexistent/b/tsb_pkg/mod.py" and sys.modules["tsb_pkg"].VALUE == 1
    with pytest.raises(ImportError, match="already imported from"):
        bundle_boot.install({"json": (False, "")}, "id2", "/nonexistent/c")


def _objective_study(tmp_path, monkeypatch, tiny_config, name: str, sections: dict, records: list[dict]) -> Path:
    """Spec ``name`` with the given extra sections and a study of one complete trial per record."""
    import optuna

    from model.config import parse_config
    from sweep.spec import load

    spec_sections = tiny_spec(tiny_config["cache_dir"], **sections)
    spec_sections["fixed"] = {**spec_sections["fixed"], "core_bundle": "demo"}
    spec_path = write_spec(tmp_path, name, spec_sections)
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    monkeypatch.setenv("SWEEP_STORAGE", url)
    spec = load(spec_path)
    config = parse_config({**spec.space.trainer_config(PARAMS), "budget_s": spec.budget_s}).to_dict()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s = optuna.create_study(study_name=name, storage=st.open_storage(url), directions=spec.directions)
    for rec in records:
        record = {"status": "ok", "config": config, "device": "cpu", **rec}
        s.add_trial(optuna.trial.create_trial(
            params=PARAMS, distributions=spec.space.distributions(PARAMS), values=spec.objective.values(record),
            user_attrs={**record, "record_fields": sorted(record), "launch_ranks": 1}))
    return spec_path


def test_pareto_study_needs_trial_and_names_its_front(tmp_path, monkeypatch, tiny_config, capsys):
    path = _objective_study(tmp_path, monkeypatch, tiny_config, "par",
                            {"objective": {"type": "pareto", "metrics": ["val_bpb", "core"]}},
                            [{"val_bpb": 2.5, "core": 0.10}, {"val_bpb": 2.4, "core": 0.05},
                             {"val_bpb": 2.6, "core": 0.04}])  # trial 2 is dominated by both
    out = tmp_path / "sub"
    assert export(path, out) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not out.exists()
    assert err == ("sweep: study 'par' is multi-objective (minimize val_bpb, maximize core): no single best; "
                   "choose a trial of its Pareto front with --trial N (front: trials 0, 1)")
    assert export(path, out, "--trial", "1") == 0, capsys.readouterr().err
    assert "(val_bpb 2.4000, core 0.0500)" in capsys.readouterr().out
    prov = json.loads((out / "provenance.json").read_text())
    assert (prov["trial"], prov["val_bpb"], prov["values"]) == (1, 2.4, {"val_bpb": 2.4, "core": 0.05})
    assert prov["objective"] == "minimize val_bpb, maximize core"


def test_composite_study_exports_its_highest_score(tmp_path, monkeypatch, tiny_config, capsys):
    sections = {"objective": {"type": "composite"},
                "objective.terms.val_bpb": {"weight": 0.5, "best": 1.0, "worst": 3.0},
                "objective.terms.core": {"weight": 0.5, "best": 0.3, "worst": 0.0}}
    # Trial 0 has the lower val_bpb, trial 1 the higher score: 0.5 * 0.15 + 0.5 * 0.2 / 0.3 = 0.4083.
    path = _objective_study(tmp_path, monkeypatch, tiny_config, "comp", sections,
                            [{"val_bpb": 2.5, "core": 0.05}, {"val_bpb": 2.7, "core": 0.2}])
    out = tmp_path / "sub"
    assert export(path, out) == 0, capsys.readouterr().err
    assert "exported trial 1 of study comp (val_bpb 2.7000, composite 0.4083)" in capsys.readouterr().out
    prov = json.loads((out / "provenance.json").read_text())
    assert (prov["trial"], prov["val_bpb"]) == (1, 2.7)
    assert prov["values"]["composite"] == pytest.approx(0.5 * 0.15 + 0.5 * 0.2 / 0.3)
    assert "val_bpb 2.7000" in (out / "train.py").read_text()[:400]


def test_a_replicate_exports_under_the_spec_promote_recorded(tmp_path, monkeypatch, capsys):
    """A promotion under another --spec (its own copy of the script): export of a replicate reads that spec."""
    import optuna

    from sweep.ship import promote
    from sweep.spec import load

    text = "DEPTH = 1\nLEARNING_RATE = 0.01\nSEED = 0\nprint('trains')\n"
    (tmp_path / "screen.py").write_text(text)
    (tmp_path / "full.py").write_text("# the full-budget copy\n" + text)
    sections = {"study": {"n_trials": 2, "concurrency": 1, "seed": 0},
                "trial": {"script": "screen.py", "budget_s": 4, "startup_allowance_s": 20, "eval_timeout_s": 20,
                          "eval_fractions": [0.5]},
                "trial.resources": {"num_cpus": 1}, "pruner": {"name": "none"},
                "params.learning_rate": {"type": "float", "low": 0.001, "high": 0.1, "log": True}}
    src = write_spec(tmp_path, "src", sections)
    full = write_spec(tmp_path, "full", {**sections, "trial": {**sections["trial"], "script": "full.py"}})
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    monkeypatch.setenv("SWEEP_STORAGE", url)
    spec, under = load(src), load(full)
    source = optuna.create_study(study_name="src", storage=st.open_storage(url))
    source.add_trial(optuna.trial.create_trial(params={"learning_rate": 0.02}, value=1.5,
                                               distributions=spec.space.distributions({"learning_rate": 0.02})))
    linked, study = promote.prepare(spec, source, 1, 6.0, 1, url, under=under)
    params = {"learning_rate": 0.02, "seed": 0}
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions=linked.space.distributions(params), value=1.4,
        user_attrs={"record_fields": ["config"], "config": linked.trainer_config(params),
                    "script_sha256": hashlib.sha256((tmp_path / "full.py").read_bytes()).hexdigest()}))
    number = study.get_trials()[-1].number
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    for i, arg in enumerate(("src-promote-6", str(tmp_path / "src-promote-6.toml"))):  # by name, by path
        assert cli.main(["export", arg, "--trial", str(number), "--out", str(tmp_path / f"sub{i}")]) == 0, \
            capsys.readouterr().err
        assert (tmp_path / f"sub{i}" / "train.py").read_text() == (tmp_path / "full.py").read_text().replace(
            "LEARNING_RATE = 0.01", "LEARNING_RATE = 0.02")


def test_the_compiler_settings_a_trial_trained_with_go_into_the_submission(study, tmp_path, capsys):
    """neuron_cc_flags and neuron_opt_level are launch keys: the exported program sets both, as the trial ran."""
    out = tmp_path / "submission"
    assert export(study, out, "--trial", "4") == 0, capsys.readouterr().err
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["launch_env"] == {"NEURON_CC_FLAGS": "--optlevel=1", "NEURON_COMPILER_OPT_LEVEL": "-O1"}
    assert "'NEURON_COMPILER_OPT_LEVEL': '-O1'" in (out / "train.py").read_text()


def test_a_cold_rehearsal_measures_the_start_up_on_an_empty_cache_and_marks_one_over_the_margin(study, tmp_path,
                                                                                                 capsys):
    """The candidate runs once through a trial's launch with a fresh compile cache; its start-up against the margin
    is one line, and the study keeps the rehearsal by trial number."""
    import optuna

    out = tmp_path / "submission"
    assert export(study, out, "--cold-rehearsal", "--margin-s", "0.001") == 0, capsys.readouterr().err
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("trial 0: cold start-up ") and "is over the margin 0.001 s" in printed[0]
    assert "the kit caps it at 900 s" in printed[0] and printed[1].startswith("exported trial 0")
    s = optuna.load_study(study_name="exp", storage=st.open_storage(os.environ["SWEEP_STORAGE"]))
    rehearsal = s.user_attrs["cold_rehearsals"]["0"]
    assert rehearsal["over"] and rehearsal["margin_s"] == 0.001 and rehearsal["environment"] == "latest-sdk"
    cache = Path(rehearsal["cache"])
    assert cache.parent == tmp_path / ".submission-cold-rehearsal" and cache.name.startswith("cold-cache-")
    assert export(study, tmp_path / "again", "--cold-rehearsal") == 0, capsys.readouterr().err
    assert "within the margin 840 s" in capsys.readouterr().out
    assert rehearse.rehearsal_config({"excluded_steps": 2, "batch_size": 4, "seq_len": 8})["max_steps"] == 3
