"""The trainer's CORE fields and `python -m model.inference` on the checkpoint it wrote: the same figures."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from model.inference import main
from tests.conftest import ROOT, parse_events, subprocess_env, trainer_command
from tests.core_bundle import HAND_TASKS, LM, MC, SCHEMA, write_bundle

pytestmark = pytest.mark.slow  # every test here uses one real training run

MAX_EXAMPLES = 30
DEMO_LABELS = {"demo_last_word", "demo_next_sentence", "demo_next_sentence_2shot", "demo_which_context"}


@pytest.fixture(scope="module")
def trained(tiny_config, tmp_path_factory):
    """One short training with CORE on the demo bundle: (result record, output folder)."""
    out = tmp_path_factory.mktemp("trained")
    config = {**tiny_config, "core_bundle": "demo", "core_max_examples": MAX_EXAMPLES, "eval_fractions": [1.0]}
    proc = subprocess.run(trainer_command(config, budget_s=3, out_dir=out), cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return parse_events(proc.stdout)[-1], out


def _inference(args: list[str], ranks: int = 1) -> subprocess.CompletedProcess:
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                   f"--nproc_per_node={ranks}"]
    return subprocess.run([*launcher, "-m", "model.inference", *args], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=240)


def _demo_args(out, cache: str) -> list[str]:
    return ["--checkpoint", str(out / "final.pt"), "--bundle", "demo", "--cache-dir", cache, "--max-examples",
            str(MAX_EXAMPLES), "--batch-size", "8", "--num-threads", "1", "--json"]


def test_trainer_records_core_after_the_final_eval_uncharged(trained):
    record, _ = trained
    assert record["status"] == "ok"
    assert math.isfinite(record["core"]) and set(record["core_tasks"]) == DEMO_LABELS
    assert record["core"] == pytest.approx(sum(record["core_tasks"].values()) / 4)
    assert record["core_complete"] is True and record["core_examples"] == 4 * MAX_EXAMPLES
    assert record["core_seconds"] > 0 and record["train_seconds"] <= 3 + 1.0  # generous: a real clock
    # CORE is not charged: the charged seconds are the charged steps' own (start-up is within the allowance).
    assert record["train_seconds"] == pytest.approx(record["step_seconds_sum"], abs=1e-9)
    assert record["config"]["core_bundle"] == "demo" and record["config"]["core_max_examples"] == MAX_EXAMPLES


def test_inference_on_final_pt_gives_the_recorded_core(trained, data_cache):
    record, out = trained
    proc = _inference(_demo_args(out, data_cache))
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = json.loads(proc.stdout.strip().splitlines()[-1])
    assert scored["core"] == record["core"] and scored["core_tasks"] == record["core_tasks"]
    assert scored["examples"] == record["core_examples"] and scored["core_complete"] is True


def test_two_ranks_split_the_examples_and_sum_the_counts(trained, data_cache):
    record, out = trained
    proc = _inference(_demo_args(out, data_cache), ranks=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints
    scored = json.loads(lines[0])
    assert scored["examples"] == record["core_examples"] and scored["core_complete"] is True
    # Same examples, different batch companions: at most a float near-tie apart, one example per task.
    assert record["core_tasks"] and scored["core_tasks"].keys() == record["core_tasks"].keys()
    for label, centered in record["core_tasks"].items():
        assert scored["core_tasks"][label] == pytest.approx(centered, abs=1.5 / MAX_EXAMPLES)


def test_time_limit_through_the_cli_reports_incomplete(trained, data_cache, capsys):
    _, out = trained
    args = _demo_args(out, data_cache)
    args[args.index("--num-threads") + 1] = "0"
    assert main([*args, "--max-seconds", "0.000001"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["core_complete"] is False and scored["examples"] < 4 * MAX_EXAMPLES


def _one_line_error(capsys, argv: list[str], expected: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err


def test_bad_input_exits_2_with_one_line(trained, tmp_path, capsys):
    _, out = trained
    _one_line_error(capsys, ["--checkpoint", str(tmp_path / "none.pt"), "--bundle", "demo"], "no such checkpoint")
    junk = tmp_path / "junk.pt"
    junk.write_text("not a checkpoint")
    _one_line_error(capsys, ["--checkpoint", str(junk), "--bundle", "demo"], "not a loadable checkpoint")
    tasks = [dict(t) for t in HAND_TASKS]
    tasks[3]["icl_task_type"] = "generation"
    bad = write_bundle(tmp_path / "bad", tasks, {"mc.jsonl": MC, "sub/schema.jsonl": SCHEMA, "lm.jsonl": LM},
                       {"mc": 25, "mc_2shot": 25, "schema": 50, "lm": 0})
    _one_line_error(capsys, ["--checkpoint", str(out / "final.pt"), "--bundle", str(bad)],
                    "core.yaml task 4: lm: icl_task_type must be one of")
    (bad / "core.yaml").write_text("icl_tasks: [")
    _one_line_error(capsys, ["--checkpoint", str(out / "final.pt"), "--bundle", str(bad)], "not valid YAML")


def test_buckets_flag_reports_its_shapes_and_refuses_zero(trained, data_cache, capsys):
    record, out = trained
    assert main([*_demo_args(out, data_cache), "--buckets", "1"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["core"] == record["core"] and scored["core_tasks"] == record["core_tasks"]
    assert scored["core_shapes"] == [[8, 64]] and 0 <= scored["core_padding"] < 1  # the model's seq_len is 64
    with pytest.raises(SystemExit) as exit_:
        main([*_demo_args(out, data_cache), "--buckets", "0"])
    assert exit_.value.code == 2 and "--buckets: must be at least 1" in capsys.readouterr().err
