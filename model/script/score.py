"""Scoring a script trial's checkpoint, apart from the script: the kit's own ``eval-public`` (its dialect) or
its ``evaluate_bpb`` (autoresearch's), each in a process of its own after every rank has exited, and the
checks that the kit the scorer reads is the kit the trial started with.

``python -m model.script.score --script train.py --kit prepare.py --checkpoint out/final.pt`` is
autoresearch's scoring: its ``evaluate_bpb(model, tokenizer, batch_size)`` on the model the script's
``load_for_eval`` builds. The script trainer runs it as a subprocess (:func:`fallback_score`), so nothing of
the script's code ever runs in the process that reports the trial's result. Prints ``{"val_bpb": ...}``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

from model.script import source

KIT_EVAL_ARGS = ["--seq-len", "{seq_len}", "--eval-tokens", "{eval_tokens}"]  # a guess: the kit's names are not public
KIT_EVAL_TIMEOUT_S = 1200.0  # the kit's EVAL_TIMEOUT_SECONDS when its prepare.py does not say


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def last_error(text: str) -> str:
    """The line that says what broke: the last ``SomethingError: ...`` line, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) or head.startswith("error"):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def definitions(script: Path) -> types.ModuleType:
    """The script's imports, functions, classes, ``try:`` blocks and call-free assignments, run as a module:
    its ``load_for_eval`` without its training (a script that trains at module level is common)."""
    tree = ast.parse(script.read_bytes())
    keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Try)
    body = [n for n in tree.body if isinstance(n, keep) or (isinstance(n, (ast.Assign, ast.AnnAssign))
                                                            and not any(isinstance(c, ast.Call) for c in ast.walk(n)))]
    module = types.ModuleType("trnsweep_script")
    module.__file__ = str(script)
    sys.modules[module.__name__] = module  # @dataclass looks its class's module up there
    sys.path.insert(0, str(script.parent))
    exec(compile(ast.Module(body=body, type_ignores=[]), str(script), "exec"), module.__dict__)  # noqa: S102
    return module


def evaluate_checkpoint(script: Path, kit: Path, checkpoint: Path, batch_size: int, device: str) -> float:
    """The kit's evaluate_bpb on the checkpoint, the model built by the script's load_for_eval."""
    import torch

    from model.data.kit import load_kit

    model = definitions(script).load_for_eval(str(checkpoint), torch.device(device))
    return float(load_kit(kit, device).evaluate_bpb(model, batch_size))


MANIFEST_HASH_BYTES = 256 << 20  # files hashed whole per check; beyond it, size and mtime stand for content
MARKER_MANIFEST = ".kit-manifest.json"  # beside .kit-ready: the kit folder as its setup left it


def kit_manifest(folder: Path) -> dict[str, str]:
    """The kit folder's files (not its prepare.py's trial copies, out/ or dotfiles), each by its sha256, or its
    size and mtime past MANIFEST_HASH_BYTES: what a trial must not change for the next one."""
    out, budget = {}, MANIFEST_HASH_BYTES
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if not path.is_file() or rel.parts[0] in ("out", "__pycache__") or any(p.startswith(".") for p in rel.parts):
            continue
        st = path.stat()
        if st.st_size <= budget:
            budget -= st.st_size
            out[str(rel)] = sha256(path)
        else:
            out[str(rel)] = f"{st.st_size}:{st.st_mtime_ns}"
    return out


def kit_tampered(folder: Path, now: dict[str, str]) -> str | None:
    """Why the kit folder differs from what its setup left (a previous trial wrote into it); None if it does
    not, or if no setup recorded it."""
    marker = folder / MARKER_MANIFEST
    try:
        then = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    changed = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k))
    if changed:
        return (f"the kit folder {folder} changed since its setup ({', '.join(changed[:3])}): a trial wrote into "
                f"it; run its setup again (delete {marker.name} and .kit-ready)")
    return None


def fallback_score(script: Path, kit: Path, checkpoint: Path, cfg: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """autoresearch's kit scoring out/final.pt (its evaluate_bpb through the script's load_for_eval) in a
    process of its own, never in this one: a script's code runs only where its output is not trusted."""
    command = [sys.executable, "-m", "model.script.score", "--script", script.name, "--kit", kit.name,
               "--checkpoint", str(checkpoint.relative_to(script.parent)),
               "--batch-size", str(int(cfg.get("eval_batch_size", 8))), "--device", str(cfg.get("eval_device", "cpu"))]
    t0 = time.monotonic()
    limit = float(cfg.get("eval_timeout_s") or KIT_EVAL_TIMEOUT_S)
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH", "")) if p)}
    try:
        proc = subprocess.run(command, cwd=script.parent, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        raise ScoreError(f"no score within {limit:g} s") from None
    out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    sys.stderr.write(err[-20000:])
    if proc.returncode:
        raise ScoreError(last_error(err) or f"the scorer exited {proc.returncode}")
    return read_json_object(out), time.monotonic() - t0


class ScoreError(RuntimeError):
    """The kit's scorer did not give a score: why, in one line."""


def eval_args(cfg: dict[str, Any], tokens: int) -> list[str]:
    """The spec's evaluation arguments with their placeholders filled (the kit's flag names are not public)."""
    values = {"eval_tokens": tokens, "seq_len": int(cfg.get("eval_seq_len", 1024)),
              "batch_size": int(cfg.get("eval_batch_size", 8)), "device": str(cfg.get("eval_device", "cpu"))}
    return [str(a).format(**values) for a in cfg.get("eval_args", KIT_EVAL_ARGS)]


def eval_timeout(kit: Path, cfg: dict[str, Any]) -> float:
    """The spec's eval_timeout_s, else the kit's own EVAL_TIMEOUT_SECONDS, else its documented 1200 s."""
    if cfg.get("eval_timeout_s"):
        return float(cfg["eval_timeout_s"])
    with contextlib.suppress(OSError, SyntaxError, ValueError):
        found = source.constants(kit.read_text(encoding="utf-8")).get("EVAL_TIMEOUT_SECONDS", [])
        if len(found) == 1 and isinstance(found[0].value, (int, float)) and not isinstance(found[0].value, bool):
            return float(found[0].value)
    return KIT_EVAL_TIMEOUT_S


def read_json_object(text: str) -> dict[str, Any]:
    """The last JSON object a command printed (the kit prints one, indented; other lines may precede it)."""
    with contextlib.suppress(ValueError):
        whole = json.loads(text)
        if isinstance(whole, dict):
            return whole
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].lstrip().startswith("{"):
            with contextlib.suppress(ValueError):
                obj = json.loads("\n".join(lines[i:]))
                if isinstance(obj, dict):
                    return obj
    raise ScoreError(f"printed no JSON object (last line: {lines[-1][:200] if lines else 'none'!r})")


def eval_public(kit: Path, script: Path, checkpoint: Path, cfg: dict[str, Any],
                tokens: int) -> tuple[dict[str, Any], float]:
    """``python prepare.py eval-public --train-py train.py --checkpoint out/final.pt ARGS`` in the trial's
    folder: the kit's JSON and its wall time. Its limit is the kit's evaluation timeout."""
    command = [sys.executable, kit.name, "eval-public", "--train-py", script.name,
               "--checkpoint", str(checkpoint.relative_to(script.parent)), *eval_args(cfg, tokens)]
    t0 = time.monotonic()
    limit = eval_timeout(kit, cfg)
    try:
        proc = subprocess.run(command, cwd=script.parent, stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=limit, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        raise ScoreError(f"no score within {limit:g} s (the kit's evaluation timeout)") from None
    seconds = time.monotonic() - t0
    out, err = proc.stdout.decode("utf-8", "replace"), proc.stderr.decode("utf-8", "replace")
    sys.stderr.write(err[-20000:])
    if proc.returncode:
        raise ScoreError(f"exited {proc.returncode}: {last_error(err) or last_error(out)}")
    return read_json_object(out), seconds


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
