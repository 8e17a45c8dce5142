"""The budgeted trainer, run as users and the sweep run it: the real CLI on the real demo text."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from model import device as devices
from model import train as trainer
from model.config import parse_config, resolve_batch
from model.train import ChargedClock, load_for_eval
from tests.conftest import ROOT, parse_events, subprocess_env, trainer_command

RECORD_FIELDS = {
    "status", "val_bpb", "val_loss", "val_tokens", "val_bytes", "val_rows", "val_population_rows", "val_seq_len",
    "val_bpb_stderr", "train_seconds", "startup_seconds",
    "eval_seconds", "eval_tokens", "eval_tokens_per_second", "steps", "tokens", "tokens_per_second", "params",
    "device", "world_size",
    "peak_memory_bytes", "config",
}


def test_clock_charges_startup_past_the_allowance_and_skips_excluded_steps():
    clock = ChargedClock(budget_s=10.0, allowance_s=5.0, excluded_steps=2)
    clock.start(4.0)
    assert clock.charged_s == 0.0
    clock.add_step(0.5)  # excluded, start-up now 4.5
    clock.add_step(1.0)  # excluded, start-up now 5.5: 0.5 s past the allowance is charged
    assert clock.startup_s == pytest.approx(5.5) and clock.charged_s == pytest.approx(0.5)
    for _ in range(9):
        clock.add_step(1.0)
    assert clock.charged_s == pytest.approx(9.5)
    assert clock.should_stop()  # another 1 s step would reach 10.5
    clock.charged_s = 8.9
    assert not clock.should_stop()


def test_clock_with_max_steps_keys_progress_to_steps():
    clock = ChargedClock(budget_s=100.0, allowance_s=0.0, excluded_steps=0, max_steps=4)
    clock.start(0.0)
    for _ in range(2):
        clock.add_step(0.1)
    assert clock.progress == pytest.approx(0.5)
    clock.add_step(0.1)
    clock.add_step(0.1)
    assert clock.should_stop()


def _charge(step_times: list[float], budget: float) -> tuple[ChargedClock, list[float]]:
    """The trainer's loop on given step times (its clock faked): ask should_stop before each step, then charge it."""
    clock = ChargedClock(budget_s=budget, allowance_s=900.0, excluded_steps=0)
    clock.start(0.0)
    taken = []
    for seconds in step_times:
        if clock.should_stop():
            break
        clock.add_step(seconds)
        taken.append(seconds)
    return clock, taken


def test_clock_stops_before_a_step_would_cross_the_budget_judged_by_the_last_step():
    clock, taken = _charge([1.0] * 20, budget=10.0)
    assert taken == [1.0] * 10 and clock.charged_s == 10.0  # the tenth step ends on the budget, an eleventh crosses
    clock, taken = _charge([1.0] * 9 + [0.5] * 10, budget=10.0)
    assert len(taken) == 11 and clock.charged_s == 10.0  # 9 + 0.5 + 0.5: another 0.5 would cross
    # A descheduled last step: the decision before it saw 9 s charged and a 1 s step, so it ran; it took 3 s. The
    # budget is overrun by that step's excess over the one before (2 s), which is why no real-time run is held to
    # a bound of the budget plus a few milliseconds.
    clock, taken = _charge([1.0] * 9 + [3.0, 1.0], budget=10.0)
    assert taken == [1.0] * 9 + [3.0] and clock.charged_s == 12.0


@settings(max_examples=300, deadline=None)
@given(hs.lists(hs.floats(0.01, 2.0), min_size=1, max_size=60), hs.floats(0.5, 20.0))
def test_clock_never_stops_a_step_early_and_overruns_only_by_the_last_steps_excess(steps, budget):
    clock, taken = _charge(steps * (int(budget // sum(steps)) + 2), budget)  # repeated past the budget
    assert clock.should_stop()
    last, before = taken[-1], (taken[-2] if len(taken) > 1 else 0.0)
    assert budget - clock.charged_s < last + 1e-9  # one more step of the last one's length would have crossed
    assert clock.charged_s - budget <= max(0.0, last - before) + 1e-9  # the decision before it saw `before`


def test_tokens_per_second_is_the_charged_steps_tokens_over_their_seconds(tiny_config, monkeypatch):
    """Counted apart from the trainer: tokens as the loader hands them out, seconds as the clock is given them.
    No allowance, so start-up (the excluded steps included) is charged too: neither its seconds nor the
    excluded steps' tokens belong in the rate."""
    batches: list[int] = []
    steps: list[float] = []

    class CountingLoader(trainer.BatchLoader):
        def __next__(self):
            x, y = super().__next__()
            batches.append(x.numel())
            return x, y

    class TimedClock(ChargedClock):
        def add_step(self, seconds: float) -> None:
            steps.append(seconds)
            super().add_step(seconds)

    monkeypatch.setattr(trainer, "BatchLoader", CountingLoader)
    monkeypatch.setattr(trainer, "ChargedClock", TimedClock)
    cfg = parse_config({**tiny_config, "device": "cpu", "max_steps": 7, "excluded_steps": 3, "startup_allowance_s": 0.0,
                        "eval_fractions": [0.5], "save_checkpoint": False}, budget_s=1e6)
    rt = devices.setup("cpu")
    resolve_batch(cfg, rt.world_size)
    result = trainer.train(cfg, rt, trainer.Events(False, False), None)
    assert result["status"] == "ok" and result["steps"] == len(steps) == len(batches) == 7
    charged_tokens, charged_s = sum(batches[3:]), sum(steps[3:])
    assert result["tokens_per_second"] == pytest.approx(charged_tokens / charged_s, rel=1e-9)
    assert result["tokens"] == sum(batches)
    # The old figure, every token over every charged second, is far off here (start-up is charged).
    assert result["tokens"] / result["train_seconds"] < 0.9 * result["tokens_per_second"]
    # Evaluation's rate beside it: the intermediate and the final evaluations' rows at their lengths.
    intermediate_rows = tiny_config["eval_tokens"] // tiny_config["seq_len"]
    assert result["eval_tokens"] == (intermediate_rows + result["val_rows"]) * tiny_config["seq_len"]
    assert result["eval_tokens_per_second"] == pytest.approx(result["eval_tokens"] / result["eval_seconds"])


@pytest.mark.slow
def test_tiny_model_learns_and_reports_the_full_record(run_trainer, tiny_config, tmp_path):
    run = run_trainer({**tiny_config, "eval_at_start": True}, budget_s=8, out_dir=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    result = run.result
    assert set(result) >= RECORD_FIELDS
    assert result["status"] == "ok" and result["device"] == "cpu" and result["world_size"] == 1
    evals = run.of("eval")
    assert evals[0]["step"] == 0
    assert result["val_bpb"] < 0.8 * evals[0]["val_bpb"], (evals[0], result["val_bpb"])
    assert [e["charged_s"] for e in evals] == sorted(e["charged_s"] for e in evals)
    assert result["config"]["vocab_size"] == 512 and result["params"] > 0
    model = load_for_eval(tmp_path / "final.pt", "cpu")
    assert not model.training
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 512)


@pytest.mark.slow
def test_charged_clock_stops_within_one_step_and_excludes_eval(run_trainer, tiny_config):
    # Large evaluations at three points: if they were charged, the step times would not add up.
    config = {**tiny_config, "eval_tokens": 65536, "eval_fractions": [0.25, 0.5, 0.75]}
    run = run_trainer(config, budget_s=10)
    result = run.result
    budget, charged = 10.0, result["train_seconds"]
    assert charged <= budget + 1.0  # generous: the rule itself is tested on given step times above
    assert budget - charged <= 2 * result["step_seconds_max"]
    assert result["eval_seconds"] > 0 and len(run.of("eval")) == 3  # three intermediate evaluations ran
    # Charged time is exactly the charged steps' time: the evaluations' seconds are nowhere in it.
    assert charged == pytest.approx(result["step_seconds_sum"], abs=0.05)


@pytest.mark.slow
def test_startup_past_the_allowance_is_charged(run_trainer, tiny_config):
    result = run_trainer({**tiny_config, "startup_allowance_s": 0.0, "eval_fractions": [1.0]}, budget_s=8).result
    assert result["startup_seconds"] > 0
    assert result["train_seconds"] <= 8 + 1.0  # generous (the rule: test_clock_never_stops_a_step_early...)
    # With no allowance, all of start-up (the excluded steps included) is charged on top of the steps.
    charged_startup = result["train_seconds"] - result["step_seconds_sum"]
    assert charged_startup == pytest.approx(result["startup_seconds"], abs=0.05)


@pytest.mark.slow
def test_sigterm_mid_run_yields_a_stopped_result(tiny_config):
    proc = subprocess.Popen(trainer_command(tiny_config, budget_s=120), cwd=ROOT, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if '"event": "step"' in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)  # half its budget: a trainer that ignored SIGTERM runs past it
    result = parse_events("".join(lines) + out)[-1]
    assert proc.returncode == 0
    assert result["event"] == "result" and result["status"] == "stopped"
    assert result["train_seconds"] < 120  # stopped short of its budget, by its own clock


@pytest.mark.slow
def test_huge_learning_rate_diverges_fast(run_trainer, tiny_config):
    lrs = {"matrix_lr": 1e4, "embedding_lr": 1e4, "unembedding_lr": 1e4, "scalar_lr": 1e4, "log_every": 1}
    run = run_trainer({**tiny_config, **lrs}, budget_s=120)
    assert run.returncode == 0
    assert run.result["status"] == "diverged" and "training loss" in run.result["reason"]
    assert run.result["steps"] < 50 and run.result["train_seconds"] < 120  # ended at once, not at the budget


@pytest.mark.slow
def test_seeded_runs_repeat_exactly(run_trainer, tiny_config):
    config = {**tiny_config, "max_steps": 12, "seed": 7}
    first, second = (run_trainer(config, budget_s=100).result for _ in range(2))
    assert first["steps"] == second["steps"] == 12
    assert first["val_bpb"] == second["val_bpb"]


@pytest.mark.slow
def test_two_ranks_match_one_rank_at_the_same_global_batch(run_trainer, tiny_config):
    # Without value embeddings: theirs are reached through the zero-initialised output projections, so their
    # first gradients are tiny sums that a batch split rounds differently, and Adam and Muon scale any such
    # direction to a full step; 15 steps then differ by ~0.1 bpb even for one rank with grad_accum 2.
    config = {**tiny_config, "max_steps": 15, "value_embeds": False}
    one = run_trainer({**config, "batch_size": 8}, budget_s=100).result
    two = run_trainer({**config, "batch_size": 4}, budget_s=100, ranks=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.result["world_size"] == 2 and two.result["tokens"] == one["tokens"]
    assert two.result["val_bpb"] == pytest.approx(one["val_bpb"], abs=0.01)


@pytest.mark.slow
def test_two_ranks_on_the_charged_clock_agree_on_evals_and_the_stop(run_trainer, tiny_config):
    # Time-keyed progress: ranks must share one clock or they meet eval points at different steps.
    run = run_trainer({**tiny_config, "batch_size": 4, "eval_fractions": [0.25, 0.5, 0.75]}, budget_s=6,
                      ranks=2, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.result["status"] == "ok" and run.result["world_size"] == 2
    assert len(run.of("eval")) == 3
    assert run.result["train_seconds"] <= 6 + 1.0  # generous: the stop rule is tested on given step times


@pytest.mark.slow
def test_on_the_kit_the_final_val_bpb_is_the_kits_evaluate_bpb(run_trainer, tiny_config, standin_kit, tmp_path):
    # Trained at seq_len 64, scored at the stand-in kit's MAX_SEQ_LEN 2048 on the rows its evaluate_bpb scores.
    from tests.conftest import KIT_EVAL_ROWS
    from tests.kit_standin import import_prepare

    config = {**tiny_config, "data": f"kit:{standin_kit}", "max_steps": 12, "eval_fractions": [0.5]}
    run = run_trainer(config, budget_s=100, out_dir=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = run.result
    assert result["status"] == "ok" and result["config"]["seq_len"] == 64
    assert (result["val_seq_len"], result["val_rows"], result["val_population_rows"]) == (2048, KIT_EVAL_ROWS,
                                                                                         KIT_EVAL_ROWS)
    assert result["val_bpb_stderr"] == 0.0
    kit = import_prepare(standin_kit / "prepare.py")
    theirs = kit.evaluate_bpb(load_for_eval(tmp_path / "final.pt", "cpu"), kit.Tokenizer.from_directory(),
                              tiny_config["batch_size"])
    assert result["val_bpb"] == pytest.approx(theirs, rel=1e-6), (result["val_bpb"], theirs)
    print(f"trainer val_bpb {result['val_bpb']!r}, the stand-in kit's evaluate_bpb {theirs!r}")


@pytest.mark.slow
def test_a_sampled_final_evaluation_reports_its_standard_error(run_trainer, tiny_config):
    config = {**tiny_config, "max_steps": 6, "eval_fractions": [1.0], "eval_seq_len": 128, "final_eval_rows": 20}
    result = run_trainer(config, budget_s=100).result
    assert result["status"] == "ok" and result["val_seq_len"] == 128
    assert result["val_rows"] == 20 and result["val_population_rows"] == tiny_config["final_eval_tokens"] // 128
    assert 0 < result["val_bpb_stderr"] < 0.2 * result["val_bpb"]


@pytest.mark.parametrize("config, message", [
    ({"depht": 3}, "unknown config key 'depht'"),
    ({"model_dim": 100, "head_dim": 32}, "not divisible by head_dim"),
    ({"budget_s": -5}, "budget_s must be positive"),
])
def test_bad_config_exits_2_with_one_line(config, message):
    proc = subprocess.run(trainer_command(config, budget_s=config.get("budget_s", 5)), cwd=ROOT,
                          env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_config_file_and_inline_json_agree(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"depth": 3}))
    from model.config import load_config_arg

    assert parse_config(load_config_arg(str(path))).to_dict() == parse_config(load_config_arg('{"depth": 3}')).to_dict()


@pytest.mark.slow
def test_total_batch_tokens_sets_grad_accum_on_two_ranks(run_trainer, tiny_config):
    # 2 ranks x 4 sequences x 64 tokens = 512 tokens a micro-step, so 1024 tokens a step is grad_accum 2.
    config = {**tiny_config, "batch_size": 4, "total_batch_tokens": 1024, "max_steps": 6, "eval_fractions": [1.0]}
    run = run_trainer(config, budget_s=100, ranks=2, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = run.result
    assert result["world_size"] == 2 and result["config"]["grad_accum"] == 2
    assert result["steps"] == 6 and result["tokens"] == 6 * 1024
    assert run.of("start")[0]["config"]["grad_accum"] == 2
    assert result["core"] is None and result["core_tasks"] == {} and result["core_complete"] is False


@pytest.mark.parametrize("config, message", [
    ({"total_batch_tokens": 1000}, "total_batch_tokens 1000 is not a multiple of batch_size * seq_len"),
    ({"total_batch_tokens": 2048, "grad_accum": 3}, "grad_accum 3 contradicts total_batch_tokens 2048"),
    ({"core_bundle": "/nonexistent/bundle"}, "/nonexistent/bundle/core.yaml: cannot read the task list"),
])
def test_bad_batch_or_bundle_exits_2_with_one_line_before_training(tiny_config, config, message):
    proc = subprocess.run(trainer_command({**tiny_config, **config}, budget_s=5), cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert '"event": "step"' not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


@pytest.mark.parametrize("values, message", [
    ({"core_max_seconds": 0}, "core_max_seconds must be positive"),
    ({"core_max_examples": -1}, "core_max_examples must not be negative"),
    ({"total_batch_tokens": -8}, "total_batch_tokens must not be negative"),
    ({"core_bundle": 3}, "config key 'core_bundle' expects str"),
    ({"core_max_examples": 1.5}, "config key 'core_max_examples' expects int"),
])
def test_core_and_batch_keys_are_strict(values, message):
    from model.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_config(values)


def test_resolve_batch_derives_grad_accum_from_the_world_size():
    from model.config import resolve_batch

    cfg = parse_config({"batch_size": 4, "seq_len": 32, "total_batch_tokens": 1024})
    resolve_batch(cfg, world_size=4)
    assert cfg.run.grad_accum == 2
    unset = parse_config({"grad_accum": 3})
    resolve_batch(unset, world_size=8)
    assert unset.run.grad_accum == 3  # total_batch_tokens 0 leaves grad_accum alone


@pytest.mark.slow
def test_a_failing_core_costs_the_core_figure_not_the_val_bpb(run_trainer, tiny_config, monkeypatch):
    monkeypatch.setenv("TRNSWEEP_FAULT", "core_crash@0")  # the trainer's test-only fault hook (model.faults)
    config = {**tiny_config, "max_steps": 3, "eval_fractions": [1.0], "core_bundle": "demo"}
    run = run_trainer(config, budget_s=100)
    assert run.returncode == 0, run.stderr[-3000:]
    result = run.result
    assert result["status"] == "ok" and result["val_bpb"] > 0
    assert result["core"] is None and result["core_error"] == "RuntimeError: injected fault in CORE"


def test_a_fault_is_read_from_the_environment_for_one_seed_only():
    from model.config import ConfigError
    from model.faults import Fault, parse_fault

    assert parse_fault("", seed=0) is None
    assert parse_fault("hang@5", seed=0) == Fault("hang", 5)
    assert parse_fault("diverge@3:seed=7", seed=7) == Fault("diverge", 3)
    assert parse_fault("diverge@3:seed=7", seed=0) is None  # another trial's fault
    for bad in ("meteor@3", "hang", "hang@", "hang@-1", "hang@3:seed=", "hang@3:sede=1", "hang@3 extra"):
        with pytest.raises(ConfigError, match="TRNSWEEP_FAULT must be KIND@STEP"):
            parse_fault(bad, seed=0)


def test_a_malformed_fault_is_one_line_and_exit_2_before_training(tiny_config):
    env = subprocess_env(TRNSWEEP_FAULT="meteor@3")
    proc = subprocess.run(trainer_command(tiny_config, budget_s=5), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and not parse_events(proc.stdout)
    assert proc.stderr.strip().splitlines() == [
        "error: TRNSWEEP_FAULT must be KIND@STEP or KIND@STEP:seed=N with KIND one of hang, crash, oom, diverge,"
        " core_crash, got 'meteor@3'"]
