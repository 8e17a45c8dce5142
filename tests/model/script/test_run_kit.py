"""The script trainer's kit dialect, piece by piece (model.script.run, model.script.output): its progress line,
the knobs that carry the budget and the seed, the scorer's arguments and JSON, and the watch on a script
that runs past its budget or falls silent. Real subprocesses; no kit is needed for these."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from model.script import run, score
from model.script.output import Patterns, Reader

KIT_LINE = (b"step 00010 | loss 6.1234 | lrm 1.000 | dt 0.50s | tok/s 262,144 | remaining_steps 989 "
            b"| remaining_time 1790s | epoch 1\n")


def test_the_kit_progress_line_gives_step_loss_and_what_is_left():
    r = Reader(Patterns.build(None, "kit"))
    (line, f), = r.feed(KIT_LINE)
    assert (f.step, f.loss, f.remaining_steps, f.remaining_time, f.progress) == (10, 6.1234, 989, 1790.0, None)
    # autoresearch's patterns find neither the loss nor a fraction on the kit's line
    (_, g), = Reader().feed(KIT_LINE)
    assert g.loss is None and g.progress is None
    with pytest.raises(ValueError, match="dialect 'nope': unknown"):
        Patterns.build(None, "nope")


@pytest.mark.parametrize(("budget", "step", "time_left", "steps_left", "fraction"), [
    (1800, 10, 1790.0, None, 10 / 1800),           # time only
    (1800, 500, 1700.0, 500, 0.5),                  # steps capped: the further of the two
    (100, 10, 100.0, 0, 1.0),                       # no steps left
    (100, 10, 250.0, None, 0.0),                    # more time left than the budget: clipped
])
def test_the_fraction_done_is_the_further_of_time_and_steps(budget, step, time_left, steps_left, fraction):
    r = run.ScriptRun({"script": "x", "dialect": "kit"}, budget, Path("."), 1, None, False)
    figures = Reader(Patterns.build(None, "kit")).progress(
        f"step {step:05d} | loss 5.0 | remaining_time {time_left:.0f}s"
        + (f" | remaining_steps {steps_left}" if steps_left is not None else ""))
    assert r._fraction(figures) == pytest.approx(fraction)


def test_a_charged_field_counts_where_a_script_prints_one():
    r = run.ScriptRun({"script": "x", "dialect": "kit"}, 100, Path("."), 1, None, False)
    line = "step 00040 | loss 5.0 | remaining_time 90s | epoch 1 | charged 30s | next_level 3"
    figures = Reader(Patterns.build(None, "kit")).progress(line)
    assert figures.charged == 30.0 and r._fraction(figures) == pytest.approx(0.3)


def test_the_budget_and_seed_reach_the_script_through_their_knobs():
    kit = {"dialect": "kit", "constants": {"DEPTH": 2}, "flags": ["--matrix-lr", "0.02"], "env": {"X": 1}}
    constants, argv, env = run.launch_values(kit, 30.0)
    assert (constants, argv, env) == ({"DEPTH": 2}, ["--matrix-lr", "0.02", "--max-train-seconds", "30"],
                                      {"X": "1"})
    as_env = {**kit, "budget_knob": {"kind": "env", "name": "NEURON_COMPETITION_R1_MAX_TRAIN_SECONDS"},
              "seed_knob": {"kind": "flag", "name": "--seed"}, "seed": 7}
    constants, argv, env = run.launch_values(as_env, 12.5)
    assert argv == ["--matrix-lr", "0.02", "--seed", "7"]
    assert env == {"X": "1", "NEURON_COMPETITION_R1_MAX_TRAIN_SECONDS": "12.5"}
    as_const = {"dialect": "autoresearch", "seed_knob": {"kind": "constant", "name": "SEED"}, "seed": 3}
    assert run.launch_values(as_const, 300.0) == ({"SEED": 3}, [], {})  # autoresearch: its kit copy's constant


def test_a_seed_without_a_seed_knob_and_a_malformed_knob_are_refused():
    with pytest.raises(run.BadConfig, match="seed_knob"):
        run.read_config({"script": __file__, "seed": 1})
    with pytest.raises(run.BadConfig, match="budget_knob: must be"):
        run.read_config({"script": __file__, "budget_knob": {"kind": "argv", "name": "--x"}})


def test_the_scorers_arguments_and_its_json():
    cfg = {"eval_seq_len": 512, "eval_batch_size": 4}
    assert score.eval_args(cfg, 2097152) == ["--seq-len", "512", "--eval-tokens", "2097152"]
    assert score.eval_args({"eval_args": ["--max-tokens={eval_tokens}", "--device", "{device}"]}, 10) == [
        "--max-tokens=10", "--device", "cpu"]
    printed = "loading...\n" + json.dumps({"val_bpb": 1.25, "num_tokens": 10}, indent=2, sort_keys=True) + "\n"
    assert score.read_json_object(printed) == {"num_tokens": 10, "val_bpb": 1.25}
    with pytest.raises(score.ScoreError, match="no JSON object"):
        score.read_json_object("Traceback\nValueError: nope\n")


def test_the_evaluation_timeout_is_the_specs_then_the_kits_then_1200(tmp_path):
    kit = tmp_path / "prepare.py"
    kit.write_text("EVAL_TIMEOUT_SECONDS = 77\n")
    assert score.eval_timeout(kit, {}) == 77.0
    assert score.eval_timeout(kit, {"eval_timeout_s": 5}) == 5.0
    kit.write_text("x = 1\n")
    assert score.eval_timeout(kit, {}) == 1200.0


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(body))
    return path


def _run(tmp_path: Path, cfg: dict, budget: float) -> dict:
    r = run.ScriptRun(cfg, budget, tmp_path / "out", 1, None, False)
    (tmp_path / "out").mkdir(exist_ok=True)
    return r.run()


def test_a_script_past_its_budget_and_grace_is_stopped_and_rejected_over_budget(tmp_path):
    script = _script(tmp_path, """
        import time
        print("step 00000 | loss 9.0 | remaining_time 1s", flush=True)
        time.sleep(120)
    """)
    rec = _run(tmp_path, {"script": str(script), "startup_allowance_s": 0, "over_budget_grace_s": 1,
                          "progress_silence_s": 60}, budget=1)
    assert rec["status"] == "rejected" and rec["over_budget"] is True and "over budget" in rec["reason"]
    assert rec["wall_seconds"] < 60  # stopped, not left to sleep its two minutes
    assert b"step 00000" in (tmp_path / "out" / "script.out").read_bytes()


def test_a_script_silent_past_progress_silence_s_gets_a_note(tmp_path):
    script = _script(tmp_path, """
        import time
        time.sleep(1.5)
        print("---")
        print("val_bpb: 1.5")
    """)
    rec = _run(tmp_path, {"script": str(script), "progress_silence_s": 0.5, "trust_script": True}, budget=30)
    assert rec["status"] == "ok" and rec["val_bpb"] == 1.5 and rec["trust_script"] is True
    assert rec["progress_silence"].startswith("no progress line for")


def test_bad_loss_detected_on_stderr_is_diverged_in_the_kit_dialect(tmp_path):
    script = _script(tmp_path, """
        import sys
        print("step 00001 | loss 9.0 | remaining_time 29s", flush=True)
        raise RuntimeError("bad loss detected: nan")
    """)
    rec = _run(tmp_path, {"script": str(script), "dialect": "kit"}, budget=30)
    assert rec["status"] == "diverged", rec
    assert "bad loss detected" in rec["reason"]
    # one rank, launched through torchrun all the same; the budget on the kit's own flag
    assert "torch.distributed.run --standalone --nproc_per_node 1 train.py --max-train-seconds 30" in rec["command"]


def test_only_the_dialects_summary_fields_reach_the_record(tmp_path):
    script = _script(tmp_path, """
        print("---")
        print("val_bpb: 1.5")
        print("num_steps: 12")
        print("adhoc: true")
        print("core: 0.9")
        print("status: ok")
    """)
    rec = _run(tmp_path, {"script": str(script), "trust_script": True}, budget=30)
    assert rec["val_bpb"] == 1.5 and rec["num_steps"] == 12 and rec["summary"]["adhoc"] is True
    assert "adhoc" not in rec and "core" not in rec
    # untrusted (the default), the summary's figure is only a claim, and with no kit nothing scores it
    rec = _run(tmp_path, {"script": str(script)}, budget=30)
    assert rec["status"] == "failed" and rec["val_bpb"] is None and rec["claimed_val_bpb"] == 1.5
    assert "trust_script" in rec["reason"]


def test_the_fallback_scorer_keeps_dataclasses_try_blocks_and_passes_a_device(tmp_path):
    script = _script(tmp_path, """
        from __future__ import annotations
        from dataclasses import dataclass
        try:
            import torch
        except ImportError:
            torch = None

        @dataclass
        class Config:
            width: int = 3

        def load_for_eval(checkpoint_path, device):
            assert isinstance(device, torch.device), type(device)
            return Config()

        raise SystemExit("training at module level is not run")
    """)
    module = score.definitions(script)
    assert module.load_for_eval("x", __import__("torch").device("cpu")).width == 3


def test_the_scripts_stderr_is_capped_in_the_trainers_log_and_still_read(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(run, "OUT_CAP", 1000)
    script = _script(tmp_path, """
        import sys
        sys.stderr.write("x" * 5000 + "\\n")
        sys.stderr.flush()
        raise RuntimeError("bad loss detected: nan")
    """)
    rec = _run(tmp_path, {"script": str(script), "dialect": "kit"}, budget=30)
    err = capfd.readouterr().err
    assert rec["status"] == "diverged"  # read past the cap
    assert err.count("x") == 1000 and "cut here, at its cap" in err and "bad loss" not in err
