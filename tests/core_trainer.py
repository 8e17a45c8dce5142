"""A trainer for sweep tests that reports CORE, standing in for ``model.train`` until its CORE evaluation lands.

The real trainer trains and evaluates (same CLI, events and record, under torchrun too); this wrapper
takes the CORE contract's config keys (``core_bundle``, ``core_max_seconds``, ``core_max_examples``, and
``total_batch_tokens``, turned into the ``grad_accum`` it implies) out of the config the real trainer would
refuse, and adds the contract's record fields to its result line:
``core``, ``core_tasks``, ``core_seconds``, ``core_complete``. Its ``core`` is not an evaluation but a
fixed function of the trained model: it grows with depth x width and with lower val_bpb, so a tiny
budget gives a real trade-off (a bigger model trains fewer steps: worse val_bpb, better "core") and
tests can check a Pareto front against the stored values. ``core_bundle = ""`` leaves CORE off and
``core_max_examples = 0`` evaluates nothing: both report ``core`` null, as a trainer would.

Run as ``python -m tests.core_trainer --config FILE --budget-s N --json [--out-dir D]`` (a spec's
``trial.trainer = "tests.core_trainer"``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

CORE_KEYS = ("core_bundle", "core_max_seconds", "core_max_examples")


def stand_in_core(record: dict[str, Any]) -> float:
    """The wrapper's CORE: capacity and val_bpb, squashed into [0, 1)."""
    cfg = record.get("config") or {}
    capacity = float(cfg.get("depth", 1)) * float(cfg.get("model_dim", 32)) / 256.0
    return round(capacity / (1.0 + capacity) * 0.5 + max(0.0, 3.0 - float(record["val_bpb"])) * 0.1, 6)


def core_fields(record: dict[str, Any], core_cfg: dict[str, Any]) -> dict[str, Any]:
    on = bool(core_cfg.get("core_bundle")) and core_cfg.get("core_max_examples", 1) != 0
    if record.get("status") != "ok" or not on or not isinstance(record.get("val_bpb"), (int, float)):
        return {"core": None, "core_tasks": {}, "core_seconds": 0.0, "core_complete": False}
    core = stand_in_core(record)
    return {"core": core, "core_tasks": {"stand_in": core}, "core_seconds": 0.0, "core_complete": True}


class _Lines(io.TextIOBase):
    """Passes the trainer's stdout through line by line, adding the CORE fields to the result line."""

    def __init__(self, out: Any, core_cfg: dict[str, Any]) -> None:
        self.out, self.core_cfg, self.buf = out, core_cfg, ""

    def write(self, text: str) -> int:
        self.buf += text
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.out.write(self._rewrite(line) + "\n")
            self.out.flush()
        return len(text)

    def _rewrite(self, line: str) -> str:
        try:
            ev = json.loads(line)
        except ValueError:
            return line
        if isinstance(ev, dict) and ev.get("event") == "result":
            ev.update(core_fields(ev, self.core_cfg))
            ev["config"] = {**(ev.get("config") or {}), **self.core_cfg}
            return json.dumps(ev)
        return line

    def flush(self) -> None:
        self.out.flush()


def main(argv: list[str]) -> int:
    from model import train

    i = argv.index("--config") + 1
    config = json.loads(Path(argv[i]).read_text())
    core_cfg = {k: config.pop(k) for k in CORE_KEYS if k in config}
    if "total_batch_tokens" in config:
        total = config.pop("total_batch_tokens")
        core_cfg["total_batch_tokens"] = total
        per_step = config["batch_size"] * config["seq_len"] * int(os.environ.get("WORLD_SIZE", "1"))
        config["grad_accum"] = max(1, total // per_step)
    stripped = Path(argv[i]).with_name(f"config.trainer.{os.environ.get('RANK', '0')}.json")
    stripped.write_text(json.dumps(config))
    argv = [*argv[:i], str(stripped), *argv[i + 1:]]
    lines = _Lines(sys.stdout, core_cfg)
    with contextlib.redirect_stdout(lines):
        code = train.main(argv)
    if lines.buf:
        sys.stdout.write(lines.buf)
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
