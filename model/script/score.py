"""``python -m model.script.score --script train.py --kit prepare.py --checkpoint out/final.pt``: one score.

autoresearch's kit scores a checkpoint with its ``evaluate_bpb(model, tokenizer, batch_size)``, the model
built by the script's ``load_for_eval``. The script trainer runs this in a process of its own after the
script has exited (:func:`model.script.run.fallback_score`), so nothing of the script's code ever runs in
the process that reports the trial's result. Prints ``{"val_bpb": ...}``; exit 1 and the error otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from model.script.run import evaluate_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.script.score", description=__doc__.splitlines()[0])
    parser.add_argument("--script", type=Path, required=True)
    parser.add_argument("--kit", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    val = evaluate_checkpoint(args.script.resolve(), args.kit.resolve(), args.checkpoint.resolve(), args.batch_size,
                              args.device)
    print(json.dumps({"val_bpb": val}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
