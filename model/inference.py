"""Score CORE on a checkpoint, as the competition's inference.py does: `load_for_eval` plus the evaluation.

    python -m model.inference --checkpoint out/final.pt --bundle DIR_OR_demo [--max-seconds N]
        [--max-examples N] [--device auto|cpu|cuda|neuron] [--batch-size N] [--buckets N] [--tokenizer PATH]
        [--cache-dir DIR] [--num-threads N] [--json]
    torchrun --nproc_per_node=K -m model.inference ...   (examples split over ranks, counts summed)

The tokenizer is the one the trainer saved next to the checkpoint (tokenizer.json) unless --tokenizer names
another file or folder. Rows are padded to the shortest of --buckets lengths up to the model's seq_len that
holds them (1: all to seq_len; the scores do not depend on it); with the trainer's batch_size (the default
here matches the trainer's default) the figures are the ones the trainer recorded.
Prints the result (with --json one JSON object: core, core_tasks, core_seconds, core_complete, examples,
accuracy, core_shapes: the [rows, length] batch shapes run, core_padding: the share of padded positions).
Exit codes: 0 scored (complete or not), 2 bad input (missing or unreadable checkpoint, broken bundle) with
one line naming the cause, 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

import torch

from model import device as devices
from model.config import RunConfig
from model.data import DataError, Tokenizer
from model.democore import resolve_bundle
from model.evaluate import CoreResult, evaluate_core, load_bundle
from model.train import load_for_eval


class InputError(ValueError):
    """Bad input to the command; the message is one line."""


def _load_model(checkpoint: Path, device: torch.device) -> torch.nn.Module:

    if not checkpoint.is_file():
        raise InputError(f"{checkpoint}: no such checkpoint")
    try:
        return load_for_eval(checkpoint, device)
    except (pickle.UnpicklingError, RuntimeError, KeyError, TypeError, ValueError, EOFError, OSError) as e:
        raise InputError(f"{checkpoint}: not a loadable checkpoint ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def score(args: argparse.Namespace) -> tuple[CoreResult, bool]:
    """Load the checkpoint, the tokenizer and the bundle, then run the evaluation on this rank's share.

    Returns the result (every rank's, summed) and whether this process is the one to print it.
    """
    try:
        rt = devices.setup(args.device)
    except (RuntimeError, ValueError) as e:
        raise InputError(f"device {args.device}: {_first_line(e)}") from None
    try:
        model = _load_model(args.checkpoint, rt.device)
        tokenizer = Tokenizer.load(args.tokenizer or args.checkpoint.parent)
        tasks = load_bundle(resolve_bundle(args.bundle, args.cache_dir))
        seq_len = model.config.seq_len
        result = evaluate_core(model, tokenizer, tasks, seq_len=seq_len, batch_size=args.batch_size,
                               buckets=args.buckets, device=rt.device, autocast=rt.autocast(),
                               max_seconds=args.max_seconds, max_examples=args.max_examples, rank=rt.rank,
                               world_size=rt.world_size)
        return result, rt.is_master
    finally:
        devices.teardown()


def _positive(kind: type, minimum: float):
    def parse(text: str):
        value = kind(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.inference", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="a final.pt written by model.train")
    parser.add_argument("--bundle", required=True, help='an eval bundle directory, or "demo"')
    parser.add_argument("--max-seconds", type=_positive(float, 1e-9), default=RunConfig.core_max_seconds,
                        help="the evaluation's time limit (loading not included); past it: core_complete false")
    parser.add_argument("--max-examples", type=_positive(int, 0), default=0, help="per task; 0: all")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda", "neuron"), default="auto")
    parser.add_argument("--batch-size", type=_positive(int, 1), default=RunConfig.batch_size)
    parser.add_argument("--buckets", type=_positive(int, 1), default=RunConfig.core_buckets,
                        help="row lengths seq_len, /2, /4, ... (>= 64); 1: every row padded to seq_len")
    parser.add_argument("--tokenizer", default=None, help="default: tokenizer.json beside the checkpoint")
    parser.add_argument("--cache-dir", default=RunConfig.cache_dir, help='where "demo" is built')
    parser.add_argument("--num-threads", type=_positive(int, 0), default=0, help="torch CPU threads; 0: default")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        result, is_master = score(args)
    except (InputError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not is_master:
        return 0
    out = {"core": result.core, "core_tasks": result.tasks, "core_seconds": result.seconds,
           "core_complete": result.complete, "examples": result.examples, "accuracy": result.accuracy,
           "core_shapes": result.shapes, "core_padding": result.padding}
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        for label, centered in result.tasks.items():
            print(f"{label:32s} accuracy {result.accuracy[label]:.4f}  centered {centered:+.4f}")
        state = "complete" if result.complete else "INCOMPLETE (time limit)"
        print(f"CORE {result.core if result.core is None else f'{result.core:.4f}'} over {result.examples}"
              f" examples in {result.seconds:.1f}s, {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
