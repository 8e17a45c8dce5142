"""A study of a team's script: knobs of three kinds, the dialect, and each spec error as one line with the spec's
line and the script's (sweep.spec.script). The scripts here are small kit-style texts of our own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from model.script import source
from sweep.spec import SpecError, load
from sweep.spec.script import Knob, detect_dialect
from tests.sweep_fixtures import ROOT, run_sweep, sweep_env

KIT_TRAIN = '''"""A kit-style train.py of our own."""
import argparse
import os

from prepare import TRAIN_TIME_BUDGET_SECONDS, ensure_tokenizer, record_step_boundary

DEPTH = 4
MATRIX_LR = 0.02
SEQ_LEN = 256


def main():
    p = argparse.ArgumentParser(description="a baseline")
    p.add_argument("--max-train-seconds", type=int,
                   default=int(os.environ.get("NEURON_COMPETITION_R1_MAX_TRAIN_SECONDS", TRAIN_TIME_BUDGET_SECONDS)))
    p.add_argument("--matrix-lr", type=float, default=MATRIX_LR)
    p.add_argument("--width", type=int, default=int(os.environ.get("NEURON_COMPETITION_R1_WIDTH", "512")))
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--nki", action="store_true", default=False)
    p.add_argument("--fused", action="store_true")
    return p.parse_args(), ensure_tokenizer, record_step_boundary
'''

SPEC = '''[study]
n_trials = 2

[trial]
script = "train.py"
budget_s = 30
eval_timeout_s = 60
{trial}
[params.matrix_lr]
type = "float"
low = 0.01
high = 0.04
flag = "--matrix-lr"

[params.compile]
type = "categorical"
choices = [true, false]
flag = "--compile"

[params.depth]
type = "int"
low = 2
high = 6
{params}
[fixed]
seq_len = 512
{fixed}'''


def write(tmp_path: Path, trial: str = "", params: str = "", fixed: str = "", script: str = KIT_TRAIN) -> Path:
    (tmp_path / "train.py").write_text(script)
    spec = tmp_path / "s.toml"
    spec.write_text(SPEC.format(trial=trial, params=params, fixed=fixed))
    return spec


def spec_line(path: Path, text: str) -> int:
    return path.read_text().splitlines().index(text) + 1


def test_a_kit_script_gets_its_flags_constants_and_environment_in_the_trainer_config(tmp_path):
    knobs = '[trial.knobs]\nseq_len = { env = "NEURON_COMPETITION_R1_SEQ_LEN" }\n'
    path = write(tmp_path, trial='seed_knob = "--seed"\n' + knobs,
                 params='[params.width]\ntype = "int"\nlow = 256\nhigh = 768\nstep = 256\nflag = "--width"\n'
                        '[params.nki]\ntype = "categorical"\nchoices = [true, false]\nflag = "--nki"\n')
    spec = load(path).script
    assert spec.dialect == "kit" and spec.knob("depth") == Knob("constant", "DEPTH")
    assert spec.knob("seq_len") == Knob("env", "NEURON_COMPETITION_R1_SEQ_LEN")
    flat = {"seq_len": 512, "matrix_lr": 0.03, "compile": False, "depth": 3, "width": 768, "nki": True}
    config = spec.trainer_config(flat)
    assert config["constants"] == {"DEPTH": 3}
    assert config["flags"] == ["--matrix-lr", "0.03", "--no-compile", "--width", "768", "--nki"]
    assert spec.trainer_config({**flat, "compile": True, "nki": False})["flags"] == [
        "--matrix-lr", "0.03", "--compile", "--width", "768"]  # store_true off: nothing on the command line
    assert config["env"] == {"NEURON_COMPETITION_R1_SEQ_LEN": "512"} == spec.launch_env(flat)
    assert config["budget_knob"] == {"kind": "flag", "name": "--max-train-seconds", "type": "int"}
    assert config["seed_knob"] == {"kind": "flag", "name": "--seed", "type": "int"}
    assert config["dialect"] == "kit" and config["kit_setup_args"] == ["setup"]
    assert config["eval_args"] == ["--seq-len", "{seq_len}", "--eval-tokens", "{eval_tokens}"]
    assert (config["eval_tokens"], config["promote_eval_tokens"], config["eval_seq_len"]) == (2097152, 20971520, 1024)
    assert (config["progress_silence_s"], config["over_budget_grace_s"], config["claim_tolerance"]) == (300, 60, 1e-4)
    # Export bakes constants and flag defaults; the environment knob is left to the launch line.
    baked = spec.rewritten(flat)
    assert baked == (KIT_TRAIN.replace("DEPTH = 4", "DEPTH = 3").replace("MATRIX_LR = 0.02", "MATRIX_LR = 0.03")
                     .replace('"NEURON_COMPETITION_R1_WIDTH", "512"', "\"NEURON_COMPETITION_R1_WIDTH\", '768'")
                     .replace('"--nki", action="store_true", default=False',
                              '"--nki", action="store_true", default=True'))
    assert len(spec.warnings) == 1 and "NEURON_COMPETITION_R1_SEQ_LEN" in spec.warnings[0]  # not named: below


def test_the_dialect_is_detected_from_what_the_script_imports_from_prepare(tmp_path):
    assert detect_dialect(KIT_TRAIN) == "kit"
    assert detect_dialect("from prepare import Tokenizer, TIME_BUDGET\n") == "autoresearch"
    # A kit script may import the kit's Tokenizer too; the kit's own helpers decide.
    assert detect_dialect("from prepare import Tokenizer, ensure_tokenizer\n") == "kit"
    assert detect_dialect("import prepare\nprepare.record_step_boundary(1)\n") == "kit"
    assert detect_dialect("from prepare import TRAIN_TIME_BUDGET_SECONDS\n") == "kit"
    assert detect_dialect("import torch\n") == "autoresearch"
    # Our worked example of autoresearch's dialect imports the kit's budget constant beside a Tokenizer.
    demo = ROOT / "sweep" / "studies" / "script-demo" / "train.py"
    assert detect_dialect(demo.read_text()) == "autoresearch" and load("script-demo").script.dialect == "autoresearch"
    # Stated, it wins over the detection.
    assert load(write(tmp_path, trial='dialect = "autoresearch"\n')).script.dialect == "autoresearch"


def test_script_demo_keeps_its_autoresearch_config():
    spec = load("script-demo").script
    config = spec.trainer_config({"learning_rate": 0.01, "model_dim": 64, "depth": 2, "warmdown_ratio": 0.5,
                                  "num_threads": 1})
    assert config["constants"] == {"LEARNING_RATE": 0.01, "MODEL_DIM": 64, "DEPTH": 2, "WARMDOWN_RATIO": 0.5,
                                   "NUM_THREADS": 1}
    assert (config["flags"], config["env"], config["budget_knob"], config["eval_args"]) == ([], {}, None, [])
    assert config["kit_setup_args"] == [] and config["kit_constants"] == {"EVAL_TOKENS": 16384}


def error(path: Path) -> str:
    with pytest.raises(SpecError) as e:
        load(path)
    text = str(e.value)
    assert "\n" not in text
    return text


def test_a_float_range_for_an_integer_constant_is_refused_with_the_specs_line(tmp_path):
    path = write(tmp_path, params='[params.seq]\ntype = "float"\nlow = 1.0\nhigh = 3.0\nconstant = "SEQ_LEN"\n')
    text = error(path)
    assert text.startswith(f"{path}:{spec_line(path, '[params.seq]')}: params.seq: {tmp_path / 'train.py'}:9: "
                           "SEQ_LEN = 256 is a int literal; the spec sets it to a float"), text


def test_a_fixed_key_the_script_lacks_names_the_specs_line_of_that_key(tmp_path):
    path = write(tmp_path, fixed="warmup_ratio = 0.5\n")
    text = error(path)
    assert text.startswith(f"{path}:{spec_line(path, 'warmup_ratio = 0.5')}: warmup_ratio: {tmp_path / 'train.py'} "
                           "has no module-level constant WARMUP_RATIO (its constants: DEPTH, MATRIX_LR, SEQ_LEN)"), text


@pytest.mark.parametrize(("params", "at", "words"), [
    ('[params.layers]\ntype = "int"\nlow = 1\nhigh = 2\nflag = "--layers"\n', "[params.layers]",
     r"params\.layers: .*train\.py: no flag --layers is declared by an add_argument call \(its flags: --compile, "),
    ('[params.width]\ntype = "float"\nlow = 1.0\nhigh = 2.0\nflag = "--width"\n', "[params.width]",
     r"params\.width: .*train\.py:17: --width is type=int; the spec gives it float values"),
    ('[params.width]\ntype = "categorical"\nchoices = [true]\nflag = "--width"\n', "[params.width]",
     r"--width is not a boolean flag \(type=int\); the spec gives it bool values"),
    ('[params.seq]\ntype = "int"\nlow = 1\nhigh = 2\nflag = "--seq-len"\nconstant = "SEQ_LEN"\n', None,
     r"params\.seq: names one knob, got constant and flag"),
    ('[params.seq]\ntype = "int"\nlow = 1\nhigh = 2\nflag = "seq-len"\n', None,
     r"params\.seq\.flag: must name a flag of the script"),
])
def test_a_flag_the_script_cannot_take_exits_with_one_line(tmp_path, params, at, words):
    path = write(tmp_path, params=params)
    text = error(path)
    assert re.search(words, text), text
    if at:
        assert text.startswith(f"{path}:{spec_line(path, at)}: "), text


@pytest.mark.parametrize(("trial", "at", "words"), [
    ('budget_knob = "--budget"\n', "budget_knob = \"--budget\"", r"trial\.budget_knob: .*no flag --budget"),
    ('seed_knob = "SEED"\n', "seed_knob = \"SEED\"", r"trial\.seed_knob: .*has no module-level constant SEED"),
    ('seed_knob = { flag = "--compile" }\n', None,
     r"--compile is a boolean flag \(--x/--no-x\); the spec gives it int"),
    ('budget_knob = { flag = "--x", env = "Y" }\n', None, r"trial\.budget_knob: names exactly one of constant, flag"),
    ('eval_args = ["--ctx", "{context}"]\n', None, r"trial\.eval_args: '\{context\}': unknown placeholder \{context\}"),
    ('kit_constants = { EVAL_TOKENS = 1 }\n', None, r"trial\.kit_constants: the kit's dialect leaves prepare\.py"),
    ('dialect = "nanogpt"\n', None, r"trial\.dialect: must be one of kit, autoresearch"),
    ('pass_env = "HF_TOKEN"\n', None, r"trial\.pass_env: must list environment variable names"),
    ('run_as = "root"\n', None, r"trial\.run_as: a user name or uid other than root, got 'root'"),
    ('run_as = "a b"\n', None, r"trial\.run_as: a user name or uid other than root, got 'a b'"),
    ('[trial.knobs]\ndepth = { flag = "--depth" }\n', None, r"trial\.knobs\.depth: depth is searched"),
    ('[trial.knobs]\nseqlen = { flag = "--seq" }\n', 'seqlen = { flag = "--seq" }',
     r"trial\.knobs\.seqlen: seqlen is not a key the trial sets \(its fixed and derived keys: seq_len\)"),
    ('[trial.knobs]\nseq_len = { flag = "--seq" }\n', 'seq_len = { flag = "--seq" }',
     r"trial\.knobs\.seq_len: .*no flag --seq is declared"),
])
def test_a_trial_knob_or_key_the_script_cannot_take_exits_with_one_line(tmp_path, trial, at, words):
    path = write(tmp_path, trial=trial)
    text = error(path)
    assert re.search(words, text), text
    if at:
        assert text.startswith(f"{path}:{spec_line(path, at)}: "), text


def test_run_as_names_the_script_trials_user(tmp_path):
    assert load(write(tmp_path, trial='run_as = "trnsweep-trial"\n')).script.run_as == "trnsweep-trial"
    (tmp_path / "d").mkdir()
    assert load(write(tmp_path / "d")).script.run_as == ""  # the node's SWEEP_TRIAL_USER decides


def test_a_budget_of_a_fraction_of_a_second_is_refused_for_an_integer_budget_flag(tmp_path):
    path = write(tmp_path)
    path.write_text(path.read_text().replace("budget_s = 30", "budget_s = 30.5"))
    assert re.search(r"trial\.budget_knob: .*--max-train-seconds is type=int; the spec gives it float", error(path))


def test_an_environment_knob_the_script_never_names_is_a_warning(tmp_path, capsys):
    path = write(tmp_path, trial='[trial.knobs]\nseq_len = { env = "NEURON_COMPETITION_R1_SEQ_LEN" }\n',
                 params='[params.width]\ntype = "int"\nlow = 256\nhigh = 768\nenv = "NEURON_COMPETITION_R1_WIDTH"\n')
    spec = load(path).script
    line = spec_line(path, 'seq_len = { env = "NEURON_COMPETITION_R1_SEQ_LEN" }')
    assert spec.warnings == (f"{path}:{line}: trial.knobs.seq_len: warning: {tmp_path / 'train.py'} never names "
                             "the environment variable NEURON_COMPETITION_R1_SEQ_LEN; the script may ignore it",)
    assert capsys.readouterr().err.strip() == spec.warnings[0]  # WIDTH is named: no warning for it


def test_a_flag_knob_whose_default_cannot_be_baked_is_a_warning_and_export_refuses_it(tmp_path, capsys):
    path = write(tmp_path, params='[params.fused]\ntype = "categorical"\nchoices = [true, false]\nflag = "--fused"\n')
    spec = load(path).script
    assert spec.warnings == (f"{path}:{spec_line(path, '[params.fused]')}: params.fused: warning: the default of "
                             "--fused is neither a literal nor a module constant; it cannot be baked into the script: "
                             "export will refuse a trial that sets it",)
    assert spec.trainer_config({"fused": True})["flags"] == ["--fused"]  # a trial still runs with it
    with pytest.raises(source.ScriptError, match="the default of --fused is neither"):
        spec.rewritten({"fused": True})


def test_spec_errors_exit_2_with_one_line_before_anything_is_written(tmp_path):
    path = write(tmp_path, params='[params.seq]\ntype = "float"\nlow = 1.0\nhigh = 3.0\nconstant = "SEQ_LEN"\n')
    proc = run_sweep("run", str(path), env=sweep_env(f"journal:{tmp_path / 'j.log'}", tmp_path / "a"), timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{path}:{spec_line(path, '[params.seq]')}: params.seq: " in proc.stderr
    assert not (tmp_path / "j.log").exists()


def test_status_states_the_dialect_of_a_script_study(tmp_path):
    import io
    import json

    import optuna

    from sweep.study import print_status

    spec = load(write(tmp_path))
    study = optuna.create_study(study_name=spec.name)
    out = io.StringIO()
    assert print_status(study, spec, False, out) == 0
    assert out.getvalue().splitlines()[1] == f"  dialect: kit (script {tmp_path / 'train.py'})"
    out = io.StringIO()
    print_status(study, spec, True, out)
    assert json.loads(out.getvalue())["dialect"] == "kit"
    out = io.StringIO()
    print_status(study, load("script-demo"), True, out)
    assert json.loads(out.getvalue())["dialect"] == "autoresearch"
