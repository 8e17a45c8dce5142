"""``sweep export``: the bundled train.py runs alone (no repo on the path), trains, checkpoints and loads for
evaluation; the upload limit, the launch line, provenance and bad input."""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
                                          user_attrs={**attrs, "config": {**config, "batch_size": 0}}))
    s.add_trial(optuna.trial.create_trial(params=PARAMS, distributions=dists, value=3.2,
                                          user_attrs={**attrs, "neuron_cc_flags": "--optlevel=1",
                                                      "neuron_opt_level": "-O1"}))
    return spec_path


def export(study_path: Path, out: Path, *extra: str) -> int:
    return cli.main(["export", str(study_path), "--out", str(out), *extra])


# The kit's summary block, in its order (docs/competition.md); --eval-public adds EVAL_FIELDS.
SUMMARY_FIELDS = ["checkpoint_path", "training_seconds", "budget_seconds", "target_steps", "max_train_seconds",
                  "startup_allowance_est", "charged_seconds_est", "over_budget", "total_seconds", "compiled",
                  "num_steps", "total_tokens_M", "world_size", "lnc", "seq_len", "num_params_M"]
EVAL_FIELDS = ["causality_passed", "causality_max_abs", "public_val_bpb", "eval_seconds", "eval_timeout",
               "eval_over_timeout"]
PROGRESS = re.compile(r"step (\d{5}) \| loss (\d+\.\d{4}) \| lrm \d\.\d{3} \| dt \d+\.\d\ds \| tok/s [\d,]+ \| "
                      r"remaining_steps \d+ \| remaining_time \d+s \| epoch \d+")


def run_dir_beside(kit: Path, tmp_path: Path, train_py: bytes, name: str = "run") -> Path:
    """A team's folder: the kit's prepare.py and the exported train.py (the kit's data stays in `kit`)."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    (run_dir / "prepare.py").write_bytes((kit / "prepare.py").read_bytes())
    (run_dir / "train.py").write_bytes(train_py)
    return run_dir


def kit_env(kit: Path, **extra: str) -> dict[str, str]:
    return isolated_env(NEURON_COMPETITION_R1_CACHE_DIR=str(kit), **extra)


def launch(run_dir: Path, ranks: int, args: list[str], env: dict[str, str],
           timeout: float = 300) -> subprocess.CompletedProcess:
    """torchrun --standalone --nproc_per_node=RANKS train.py ARGS, each rank with the repository unreachable."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "--no-python",
           sys.executable, "-c", RUN, "train.py", *args]
    return subprocess.run(cmd, cwd=run_dir, capture_output=True, text=True, timeout=timeout, env=env)


def summary_of(stdout: str) -> dict[str, str]:
    lines = stdout.splitlines()
    block = lines[lines.index("---") + 1:]
    return dict(line.split(": ", 1) for line in block)


def eval_public(run_dir: Path, kit: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "prepare.py", "eval-public", "--train-py", "train.py",
                           "--checkpoint", "out/final.pt", *args], cwd=run_dir, capture_output=True, text=True,
                          timeout=240, env=kit_env(kit))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_export_trains_beside_the_kit_and_its_scorer_agrees_with_the_record(study, kit_dialect, tmp_path,
                                                                                capsys, ranks):
    out = tmp_path / "sub"
    assert export(study, out) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out.splitlines()
    prov = json.loads((out / "provenance.json").read_text())
    assert printed[1] == "launch: NEURON_LOGICAL_NC_CONFIG=2 torchrun --standalone --nproc_per_node=4 train.py"
    check = "python prepare.py eval-public --train-py train.py --checkpoint out/final.pt --seq-len 32 " \
            "--eval-tokens 2048 --batch-size 4"  # the rows the trial's record scored
    assert printed[2] == f"check:  {check}" and prov["eval_public"] == check
    text = (out / "train.py").read_bytes()
    assert f"train.py {len(text):,} bytes of the upload limit's 262,144" in printed[0]

    run_dir = run_dir_beside(kit_dialect, tmp_path, text)
    step_log = tmp_path / "steps.log"
    # Flags on one run, their NEURON_COMPETITION_R1_* fallbacks on the other.
    flags = ["--device-type", "cpu", "--num-steps", "7", "--eval-public", "--eval-tokens", "4096",
             "--eval-seq-len", "64"]
    fallbacks = {"NEURON_COMPETITION_R1_DEVICE_TYPE": "cpu", "NEURON_COMPETITION_R1_NUM_STEPS": "7",
                 "NEURON_COMPETITION_R1_EVAL_PUBLIC": "1", "NEURON_COMPETITION_R1_EVAL_TOKENS": "4096",
                 "NEURON_COMPETITION_R1_EVAL_SEQ_LEN": "64"}
    env = kit_env(kit_dialect, NEURON_COMPETITION_R1_STEP_LOG=str(step_log), **({} if ranks == 1 else fallbacks))
    proc = launch(run_dir, ranks, flags if ranks == 1 else [], env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    summary = summary_of(proc.stdout)
    assert list(summary) == SUMMARY_FIELDS + EVAL_FIELDS  # every field, in order, the block last
    assert summary["num_steps"] == "7" and summary["target_steps"] == "7" and summary["world_size"] == str(ranks)
    assert summary["seq_len"] == "32" and summary["causality_passed"] == "True"
    assert summary["checkpoint_path"] == "out/final.pt" and summary["over_budget"] == "False"
    assert summary["budget_seconds"] == "1800.0" and summary["max_train_seconds"] == "1800.0"
    progress = [m for m in map(PROGRESS.fullmatch, proc.stdout.splitlines()) if m]
    assert [int(m[1]) for m in progress] == [0, 1, 2, 3, 4]  # rank 0 alone prints, at steps < 5 and every 10th
    # The kit's clock: record_step_boundary after every step (the stand-in logs rank 0's)
    assert [int(line.split()[0]) for line in step_log.read_text().splitlines()] == list(range(7))

    result = json.loads((run_dir / "out" / "result.json").read_text())
    assert result["kit_dialect"] == "kit" and result["config"]["vocab_size"] == 8192  # the kit's vocabulary
    assert result["config"]["excluded_steps"] == 5 and result["config"]["startup_allowance_s"] == 900
    assert result["config"]["depth"] == 1 and result["config"]["matrix_lr"] == 0.02  # the trial's constants
    recorded = result["kit_eval"]["val_bpb"]
    assert float(summary["public_val_bpb"]) == pytest.approx(recorded, abs=5e-7)

    # The organisers' way: the kit's scorer on the checkpoint in a fresh process, at the rows the run scored.
    scored = eval_public(run_dir, kit_dialect, "--seq-len", "64", "--eval-tokens", "4096", "--batch-size", "4")
    assert scored["val_bpb"] == pytest.approx(recorded, abs=1e-6)
    assert scored["num_tokens"] == result["kit_eval"]["num_tokens"] == 4096
    # At a longer context than it trained at (32), through the kit's own default line.
    longer = eval_public(run_dir, kit_dialect, "--seq-len", "128", "--eval-tokens", "4096")
    assert math.isfinite(longer["val_bpb"]) and longer["val_bpb"] != scored["val_bpb"]


@pytest.mark.slow
def test_the_export_is_submission_clean_by_default_and_stops_every_rank_on_a_bad_loss(study, kit_dialect, tmp_path):
    out = tmp_path / "sub"
    assert export(study, out) == 0
    text = (out / "train.py").read_bytes()
    # A kit whose public_val is not there: a default run must not need it.
    blind = tmp_path / "blind"
    shutil.copytree(kit_dialect, blind, ignore=shutil.ignore_patterns("public_val_*", "out"))
    assert not list(blind.glob("data/public_val_*"))
    run_dir = run_dir_beside(blind, tmp_path, text)
    proc = launch(run_dir, 1, ["--device-type", "cpu", "--num-steps", "3"], kit_env(blind))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = summary_of(proc.stdout)
    assert list(summary) == SUMMARY_FIELDS and proc.stdout.splitlines()[-1].startswith("num_params_M:")
    assert "kit_eval" not in json.loads((run_dir / "out" / "result.json").read_text())
    assert (run_dir / "out" / "final.pt").is_file()

    # Phase 2: the exported inference.py scores CORE on that checkpoint with the same bundled code.
    (run_dir / "inference.py").write_bytes((out / "inference.py").read_bytes())
    proc = subprocess.run([sys.executable, "-c", RUN, "inference.py", "--checkpoint", "out/final.pt", "--bundle",
                           "demo", "--max-examples", "2", "--cache-dir", str(tmp_path / "core"), "--num-threads", "1",
                           "--json"], cwd=run_dir, capture_output=True, text=True, timeout=240, env=isolated_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    core = json.loads(proc.stdout.strip().splitlines()[-1])
    assert math.isfinite(core["core"]) and core["examples"] > 0

    # --compile-only: one step, no checkpoint.
    proc = launch(run_dir_beside(kit_dialect, tmp_path, text, "warm"), 1, ["--device-type", "cpu", "--compile-only"],
                  kit_env(kit_dialect))
    assert proc.returncode == 0 and "compile-only: one step ran" in proc.stdout, proc.stderr[-3000:]
    assert not (tmp_path / "warm" / "out" / "final.pt").exists()

    # A bad loss (the bound lowered to 1, under any loss of a fresh model) stops both ranks, each saying why.
    lowered = text.replace(b"\nBAD_LOSS = 100.0\n", b"\nBAD_LOSS = 1.0\n")
    assert lowered != text
    proc = launch(run_dir_beside(kit_dialect, tmp_path, lowered, "bad"), 2, ["--device-type", "cpu"],
                  kit_env(kit_dialect))
    assert proc.returncode != 0
    assert proc.stderr.count("RuntimeError: bad loss detected: ") == 2, proc.stderr[-3000:]
    assert not (tmp_path / "bad" / "out" / "final.pt").exists()

    # A bad flag or fallback: one line, exit 2; so is the default device where there is none (no CPU default).
    proc = launch(run_dir, 1, [], kit_env(kit_dialect, NEURON_COMPETITION_R1_NUM_STEPS="many"))
    assert proc.returncode != 0 and "train.py: NEURON_COMPETITION_R1_NUM_STEPS='many' is not an integer" in proc.stderr
    proc = launch(run_dir, 1, [], kit_env(kit_dialect))
    assert proc.returncode != 0 and proc.stderr.count("train.py: device neuron: ") == 1
    assert 'File "train.py"' not in proc.stderr  # its one line, no traceback of the file (torchrun adds its own)


def test_provenance_warnings_and_the_launch_of_all_the_chips_ranks(study, tmp_path, capsys):
    out = tmp_path / "sub"
    assert export(study, out) == 0
    warned = capsys.readouterr().err
    assert "ran code at commit 000000000000" in warned  # the record says another commit trained it
    assert "trial 0 ran on 1 rank(s); the competition launches 4 at LNC 2" in warned
    text = (out / "train.py").read_bytes()
    prov = json.loads((out / "provenance.json").read_text())
    assert len(text) <= bundle.UPLOAD_LIMIT_BYTES and prov["train_py_bytes"] == len(text)
    assert prov["train_py_sha256"] == hashlib.sha256(text).hexdigest()
    assert (prov["study"], prov["trial"], prov["val_bpb"], prov["params"]) == ("exp", 0, 2.5, PARAMS)
    assert prov["code_version"] == code_version() and prov["code_matches_trial"] is False
    assert prov["bundle"]["encoding"] in bundle.ENCODINGS and "model.train" in prov["bundle"]["modules"]
    assert "kernels._fake_nki" not in prov["bundle"]["modules"]
    assert (prov["ranks"], prov["trained_ranks"], prov["lnc"]) == (4, 1, 2)
    assert os.access(out / "launch.sh", os.X_OK) and prov["launch"] in (out / "launch.sh").read_text()
    # The trial's keys are constants; the machine's and the kit's are not (the file sets them at start-up).
    assert prov["constants"]["DEPTH"] == 1 and prov["constants"]["MATRIX_LR"] == 0.02
    assert not {"DEVICE", "DATA", "VOCAB_SIZE", "CACHE_DIR", "BUDGET_S"} & set(prov["constants"])
    assert "\nDEPTH = 1\nMODEL_DIM = 32\n" in text.decode()
    # A trial that ran on 2 ranks exports with the chip's 4 (LNC 2), and says so.
    assert export(study, tmp_path / "two", "--trial", "2") == 0
    assert "trial 2 ran on 2 rank(s); the competition launches 4 at LNC 2" in capsys.readouterr().err


def test_two_studies_exports_differ_only_in_their_constants(study, tmp_path, tiny_config, capsys):
    import optuna

    from model.config import parse_config
    from sweep.spec import load

    other = {"depth": 2, "model_dim": 48, "matrix_lr": 0.03}
    spec = load(study)
    config = parse_config({**spec.space.trainer_config(other), "budget_s": spec.budget_s}).to_dict()
    record = {"status": "ok", "val_bpb": 2.1, "config": config, "device": "cpu"}
    s = optuna.create_study(study_name="other.study_2", storage=st.open_storage(os.environ["SWEEP_STORAGE"]))
    s.add_trial(optuna.trial.create_trial(params=other, distributions=spec.space.distributions(other), value=2.1,
                                          user_attrs={**record, "record_fields": sorted(record), "launch_ranks": 1,
                                                      "launch_lnc": 1}))
    other_spec = write_spec(tmp_path, "other.study_2", tiny_spec(tiny_config["cache_dir"]))
    assert export(study, tmp_path / "a") == 0 and export(other_spec, tmp_path / "b") == 0, capsys.readouterr().err
    a = (tmp_path / "a" / "train.py").read_text().splitlines()
    b = (tmp_path / "b" / "train.py").read_text().splitlines()
    assert len(a) == len(b)
    differing = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    constant = re.compile(r"[A-Z][A-Z0-9_]* = \S")
    assert differing and all(constant.match(x) and constant.match(y) for x, y in differing), differing[:3]
    names = {x.split(" = ")[0] for x, _ in differing}
    assert {"STUDY", "RECORDED_VAL_BPB", "DEPTH", "MODEL_DIM", "MATRIX_LR", "LAUNCH"} <= names
    assert "LAUNCH = 'NEURON_LOGICAL_NC_CONFIG=1 torchrun --standalone --nproc_per_node=8 train.py'" in b
    # The constants sit at the top, before the bundle; the file's own imports are torch's, the stdlib's, prepare.
    assert a.index("DEPTH = 1") < next(i for i, line in enumerate(a) if line.startswith("BUNDLED_MODULES"))
    tree = ast.parse("\n".join(a))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported - set(sys.stdlib_module_names) == {"prepare", "model"}  # model: bundled in the file


def test_load_for_eval_answers_both_loss_keywords_at_any_length(tmp_path):
    from model.config import GPTConfig
    from model.train import EvalGPT, load_for_eval, save_checkpoint

    model = EvalGPT(GPTConfig(vocab_size=64, depth=1, model_dim=32, head_dim=16, seq_len=16, kernels="torch"))
    save_checkpoint(model, tmp_path / "final.pt")
    loaded = load_for_eval(tmp_path / "final.pt", "cpu")
    assert not loaded.training
    x = torch.randint(0, 64, (2, 48))  # three times the trained context
    y = torch.randint(0, 64, (2, 48))
    with torch.no_grad():
        a = loaded(x, y, loss_reduction="none")
        b = loaded(x, y, reduction="none")
        mean = loaded(x, y)
    assert a.shape == b.shape == (2, 48) and torch.equal(a, b)
    assert mean.item() == pytest.approx(a.mean().item(), rel=1e-5)


@pytest.mark.parametrize(("args", "message"), [
    (["--trial", "7"], "--trial 7: study 'exp' has no trial 7"),
    (["--trial", "1"], "trial 1 of study 'exp' has no result record to export (state FAIL; crash: exit code 3)"),
    (["--trial", "3"], "trial 3: train.py would refuse its configuration at 4 ranks: batch_size must be positive"),
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
    assert "\nRECORDED_VAL_BPB = 2.7\n" in (out / "train.py").read_text()


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
