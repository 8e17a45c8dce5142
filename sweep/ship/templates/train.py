# The template of an exported train.py, filled by sweep/ship/export.py: "$CONSTANTS" (quotes included) is
# replaced by the trial's constants, one per line; the import hook and the bundled packages
# (sweep/ship/bundle.py) take the marked line's place. Nothing else is filled: two exports differ only in their
# constants. This note, up to the first blank line, is not copied; the directive below lets ruff read the
# template, whose constants (SEQ_LEN, SEED, ...) the fill defines.
# ruff: noqa: F821

#!/usr/bin/env python3
"""Competition train.py exported by trnsweep from one trial of a sweep (STUDY, TRIAL and the constants below).

Launch from the directory that holds the kit's prepare.py, with no arguments, as LAUNCH says (all of the
chip's ranks: NEURON_LOGICAL_NC_CONFIG=1 with 8, or 2 with 4), then score the checkpoint as the organisers do:
    python prepare.py eval-public --train-py train.py --checkpoint out/final.pt

It trains the configuration below (its hyperparameters are the module constants, the trial's values) with
trnsweep's own trainer, bundled further down with the model and kernels packages exactly as the sweep ran
them, on the kit's data and tokenizer (ensure_tokenizer, make_dataloader on each rank), under the kit's clock:
start-up is measured from process start to step TRAIN_STARTUP_STEPS_EXCLUDED and allowed up to
TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS; training stops before the charged time would pass --max-train-seconds
less a reserve for saving the checkpoint. After each step's synchronise it calls the kit's
record_step_boundary(step) (the official clock). Rank 0 prints the kit's progress line and, last, the summary
block after a `---` line; a NaN loss, or one over 100, stops every rank with `bad loss detected`.
out/final.pt comes from rank 0; load_for_eval(checkpoint_path, device) returns the model in eval mode, at any
context length, its per-token losses under `reduction="none"` or `loss_reduction="none"`.

Submission-clean by default: no validation data is read; --eval-public runs the kit's causality_check and
evaluate_bpb on public_val after training. Flags (each falls back to NEURON_COMPETITION_R1_<FLAG>):
--device-type, --num-steps, --max-train-seconds, --out-dir, --eval-public/--no-eval-public, --eval-tokens,
--eval-seq-len, --eval-batch-size, --compile/--no-compile, --compile-only, --seed. Imports: torch, the
standard library and prepare. Generated: re-export rather than edit.
"""

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

_PROCESS_START = time.perf_counter()  # the kit's clock measures start-up from here

# ---- the trial: sweep export writes this block ----------------------------------------------------------
"$CONSTANTS"

# The launch line carries only NEURON_LOGICAL_NC_CONFIG; the rest of the trial's launch environment is set
# here, before torch loads, unless the caller set it.
for _key, _value in LAUNCH_ENV.items():
    os.environ.setdefault(_key, _value)

# ==== the import hook and the bundled packages go here (sweep/ship/bundle.py) ====

# ---- the submission ---------------------------------------------------------------------------------------

from model.train import load_for_eval  # noqa: E402,F401  (the scorer's entry point)

ENV_PREFIX = "NEURON_COMPETITION_R1_"
CHECKPOINT_RESERVE_SECONDS = 15.0  # kept back from --max-train-seconds for saving (at most a tenth of it)
BAD_LOSS = 100.0
EMA_BETA = 0.9
CONFIG = {name.lower(): globals()[name] for name in HYPERPARAMETERS}


class UsageError(Exception):
    """Bad flags or environment: one line, exit 2."""


def _env(flag, default):
    """NEURON_COMPETITION_R1_<FLAG>, else default."""
    return os.environ.get(ENV_PREFIX + flag.upper().replace("-", "_"), default)


def _flag_bool(flag, default):
    value = _env(flag, None)
    if value is None:
        return default
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise UsageError(f"{ENV_PREFIX}{flag.upper().replace('-', '_')}={value!r} is not a boolean")


def _flag_number(flag, kind, default):
    value = _env(flag, None)
    if value is None:
        return default
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise UsageError(f"{ENV_PREFIX}{flag.upper().replace('-', '_')}={value!r} is not {what}") from None


def parse_args(argv, budget_seconds):
    p = argparse.ArgumentParser(description="Neuron Competition R1 submission (trnsweep export)")
    p.add_argument("--device-type", choices=("neuron", "cpu", "cuda"), default=_env("device_type", "neuron"))
    p.add_argument("--num-steps", type=int, default=_flag_number("num_steps", int, MAX_STEPS),
                   help="stop after this many steps too (0: the clock alone; default the trial's)")
    p.add_argument("--max-train-seconds", type=float,
                   default=_flag_number("max_train_seconds", float, float(MAX_TRAIN_SECONDS or budget_seconds)))
    p.add_argument("--out-dir", default=_env("out_dir", "out"))
    p.add_argument("--eval-public", action=argparse.BooleanOptionalAction, default=_flag_bool("eval_public", False))
    p.add_argument("--eval-tokens", type=int, default=_flag_number("eval_tokens", int, FINAL_EVAL_TOKENS),
                   help="tokens --eval-public scores (default the trial's, what its record scored)")
    p.add_argument("--eval-seq-len", type=int, default=_flag_number("eval_seq_len", int, EVAL_SEQ_LEN or SEQ_LEN))
    p.add_argument("--eval-batch-size", type=int, default=_flag_number("eval_batch_size", int, BATCH_SIZE),
                   help="rows per evaluation batch (with --eval-seq-len and --eval-tokens: which rows are scored)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=_flag_bool("compile", COMPILE))
    p.add_argument("--compile-only", action="store_true", default=_flag_bool("compile_only", False),
                   help="one step to warm the compile cache, then exit")
    p.add_argument("--seed", type=int, default=_flag_number("seed", int, SEED))
    args = p.parse_args(argv)
    sizes = (args.max_train_seconds, args.eval_tokens, args.eval_seq_len, args.eval_batch_size)
    if min(sizes) <= 0 or args.num_steps < 0:
        raise UsageError("--max-train-seconds, --eval-tokens, --eval-seq-len and --eval-batch-size must be positive, "
                         "--num-steps must not be negative")
    return args


def run_config(args, kit):
    """The trainer's configuration: the constants, the flags, and the kit's clock."""
    reserve = min(CHECKPOINT_RESERVE_SECONDS, args.max_train_seconds / 10)
    config = dict(CONFIG)
    config.update(
        device=args.device_type, data="kit:" + os.path.abspath(kit.__file__), tokenizer="", val_shard="",
        seed=args.seed, compile=args.compile, budget_s=args.max_train_seconds - reserve,
        startup_allowance_s=float(getattr(kit, "TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS", 900)),
        excluded_steps=int(getattr(kit, "TRAIN_STARTUP_STEPS_EXCLUDED", 5)),
        max_steps=1 if args.compile_only else args.num_steps,
        eval_fractions=[], eval_at_start=False, final_eval_tokens=args.eval_tokens, eval_seq_len=args.eval_seq_len,
        save_checkpoint=not args.compile_only, core_bundle="", max_loss=BAD_LOSS, log_every=1,
    )
    return config


class KitProgress:
    """The trainer's events as the kit's train.py prints them: rank 0's progress line at steps < 5 and every
    10th, with the debiased EMA of the loss; the trainer's own logs to stderr."""

    def __init__(self, enabled, tokens_per_step, num_steps, max_train_seconds):
        self.enabled = enabled
        self.json_mode = False
        self.tokens_per_step = tokens_per_step
        self.num_steps = num_steps
        self.max_train_seconds = max_train_seconds
        self.ema = 0.0
        self.seen = 0

    def emit(self, event, **fields):
        if event != "step":
            return
        step = fields["step"] - 1  # the step that just ended, counted from 0 (as record_step_boundary)
        loss = fields["train_loss"]
        if math.isfinite(loss):
            self.ema = EMA_BETA * self.ema + (1 - EMA_BETA) * loss
            self.seen += 1
        if not self.enabled or not (step < 5 or step % 10 == 0):
            return
        smooth = self.ema / (1 - EMA_BETA ** self.seen) if self.seen else loss
        dt = fields.get("step_seconds") or 0.0
        remaining_time = max(0.0, self.max_train_seconds - fields["charged_s"])
        if self.num_steps:
            remaining_steps = max(0, self.num_steps - step - 1)
        else:
            remaining_steps = int(remaining_time / dt) if dt > 0 else 0
        epoch = fields.get("epoch")
        print(f"step {step:05d} | loss {smooth:.4f} | lrm {fields.get('lrm', 1.0):.3f} | dt {dt:.2f}s | "
              f"tok/s {int(self.tokens_per_step / dt) if dt > 0 else 0:,} | remaining_steps {remaining_steps} | "
              f"remaining_time {remaining_time:.0f}s | epoch {epoch if epoch is not None else '?'}", flush=True)

    def log(self, message):
        if self.enabled:
            print(message, file=sys.stderr, flush=True)


def summary(result, args, kit, total_seconds):
    """The kit's summary block: every field, in its order, after a `---` line."""
    r = result
    budget = float(getattr(kit, "TRAIN_TIME_BUDGET_SECONDS", 1800))
    cap = float(getattr(kit, "TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS", 900))
    charged = r.get("train_seconds", 0.0) + r.get("checkpoint_seconds", 0.0)  # the clock after saving
    rows = [
        ("checkpoint_path", r.get("checkpoint", os.path.join(args.out_dir, "final.pt"))),
        ("training_seconds", f"{r.get('excluded_seconds', 0.0) + r.get('step_seconds_sum', 0.0):.1f}"),
        ("budget_seconds", f"{budget:.1f}"),
        ("target_steps", args.num_steps),
        ("max_train_seconds", f"{args.max_train_seconds:.1f}"),
        ("startup_allowance_est", f"{min(r.get('startup_seconds', 0.0), cap):.1f}"),
        ("charged_seconds_est", f"{charged:.1f}"),
        ("over_budget", charged > budget),
        ("total_seconds", f"{total_seconds:.1f}"),
        ("compiled", bool(args.compile)),
        ("num_steps", r.get("steps", 0)),
        ("total_tokens_M", f"{r.get('tokens', 0) / 1e6:.1f}"),
        ("world_size", r.get("world_size", 1)),
        ("lnc", os.environ.get("NEURON_LOGICAL_NC_CONFIG", "")),
        ("seq_len", SEQ_LEN),
        ("num_params_M", f"{r.get('params', 0) / 1e6:.2f}"),
    ]
    if args.eval_public:
        got, causality = r.get("kit_eval") or {}, r.get("causality") or {}
        rows += [
            ("causality_passed", causality.get("passed")),
            ("causality_max_abs", causality.get("max_abs_diff")),
            ("public_val_bpb", f"{got.get('val_bpb', r.get('val_bpb') or float('nan')):.6f}"),
            ("eval_seconds", f"{float(got.get('eval_seconds', 0.0)):.1f}"),
            ("eval_timeout", got.get("eval_timeout")),
            ("eval_over_timeout", got.get("eval_over_timeout")),
        ]
    return "---\n" + "\n".join(f"{k}: {v}" for k, v in rows)


def main(argv=None):
    try:
        import prepare  # the kit's, beside this file: its data, tokenizer, clock and scorer
    except ImportError as e:
        print(f"train.py: the kit's prepare.py cannot be imported (run from its directory): {e}", file=sys.stderr)
        return 2

    from model import device as devices
    from model import train as trainer
    from model.config import ConfigError, parse_config, resolve_batch
    from model.data import DataError

    trainer._PROCESS_START = _PROCESS_START  # start-up counts from this process's start
    try:
        args = parse_args(argv, getattr(prepare, "TRAIN_TIME_BUDGET_SECONDS", 1800))
        cfg = parse_config(run_config(args, prepare))
    except (UsageError, ConfigError) as e:
        print(f"train.py: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        rt = devices.setup(cfg.run.device)
    except (RuntimeError, ValueError) as e:
        print(f"train.py: device {cfg.run.device}: {str(e).splitlines()[0]} (--device-type cpu, or "
              f"{ENV_PREFIX}DEVICE_TYPE=cpu, trains on the CPU)", file=sys.stderr, flush=True)
        return 2
    try:
        resolve_batch(cfg, rt.world_size)
        tokens_per_step = cfg.run.batch_size * cfg.model.seq_len * cfg.run.grad_accum * rt.world_size
        events = KitProgress(rt.is_master, tokens_per_step, args.num_steps, args.max_train_seconds)
        result = trainer.train(cfg, rt, events, None if args.compile_only else Path(args.out_dir),
                               final_eval=args.eval_public and not args.compile_only,
                               eval_batch_size=args.eval_batch_size)
    except (ConfigError, DataError) as e:
        devices.teardown()
        print(f"train.py: {e}", file=sys.stderr, flush=True)
        return 2
    devices.teardown()
    if result["status"] == "diverged":  # every rank agreed on it: every rank stops here
        raise RuntimeError(f"bad loss detected: {result['train_loss']}")
    if result["status"] != "ok":
        raise RuntimeError(f"training {result['status']}: {result.get('reason', '')}")
    if args.compile_only:
        if rt.is_master:
            print("compile-only: one step ran; the compile cache is warm", flush=True)
        return 0
    if rt.is_master:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "result.json"), "w") as f:  # the trainer's full record, for reference
            f.write(json.dumps(result, default=str) + "\n")
        print(summary(result, args, prepare, time.perf_counter() - _PROCESS_START), flush=True)
    return 0


if __name__ == "__main__":
    exit_code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)  # as model.train does: everything is written; skip unloading torch
