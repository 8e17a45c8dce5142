"""``python -m model.script.run --config C --budget-s N --json --out-dir D``: a team's script as a trainer.

The supervisor runs this in place of ``model.train`` for a study of a script; it speaks the same JSON lines
(``start``, ``step``, ``eval``, then the ``result`` record last), each signed with the trial's key when the
supervisor passes one (``--key-fd``), so nothing above it learns a second protocol and nothing the script
prints passes for it. It knows nothing of sweeps: the config names the script, the kit's prepare.py, the
dialect and the knobs to set. In ``OUT/script/`` it writes the script with its constants rewritten (only
their literals change, :mod:`model.script.source`) beside a copy of the kit (byte for byte in the kit's
dialect; in autoresearch's, with the trial's budget in its budget constant) and the kit folder's other
entries linked, then launches the script: ``torchrun --standalone --nproc_per_node=R train.py`` in the kit's
dialect (one rank included), ``python train.py`` or torchrun in autoresearch's, with the knobs' flags and
environment and the budget and seed through their knobs. It reads the script's stdout and stderr as they
come (:mod:`model.script.output`): progress lines become ``step`` events and, at each of ``eval_fractions``
of the budget, an ``eval`` event with a validation figure or a smoothed training loss (``metric`` says
which); a non-finite loss, a FAIL line or ``bad loss detected`` stops the script as ``diverged``; a script
past its budget and grace is stopped as over budget. After every rank has exited the objective is scored
apart from the script (:mod:`model.script.score`: the kit's eval-public, or its evaluate_bpb in a process of
its own), the script's own figure kept as ``claimed_val_bpb``, unless the study trusts it. SIGTERM stops
the script and ends with status ``stopped``; a script that fails ends ``failed`` with its last error line.
Bad config: exit 2, one line.

Long file: one class, a script run's whole life (launch, read both streams, watch the clock, classify),
which reads best in one place.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from model.script import source
from model.script.output import Patterns, Reader
from model.script.score import (
    MARKER_MANIFEST,
    ScoreError,
    eval_public,
    fallback_score,
    kit_manifest,
    kit_tampered,
    last_error,
    sha256,
)
from model.script.signing import sign

BUDGET_CONSTANTS = ("TRAIN_TIME_BUDGET_SECONDS", "TIME_BUDGET")  # the kit's, then autoresearch's name
CONFIG_KEYS = {"script", "kit", "constants", "kit_constants", "kit_budget_constants", "kit_setup", "output",
               "eval_fractions", "startup_allowance_s", "eval_batch_size", "eval_device", "script_sha256",
               "dialect", "flags", "env", "budget_knob", "seed_knob", "seed", "eval_args", "eval_tokens",
               "eval_seq_len", "kit_setup_args", "progress_silence_s", "over_budget_grace_s", "claim_tolerance",
               "promote_eval_tokens", "trust_script",
               "eval_timeout_s"}
# The summary block's fields each dialect's scripts print, the only ones copied into the record (the whole
# block stays under "summary"): nothing a script prints may set a field the service acts on (status, seed,
# adhoc, core). In the kit's dialect even its val_bpb figure is only a claim (claimed_val_bpb).
SUMMARY_KEYS = {
    "kit": frozenset({"checkpoint_path", "training_seconds", "budget_seconds", "target_steps", "max_train_seconds",
                      "startup_allowance_est", "charged_seconds_est", "over_budget", "total_seconds", "compiled",
                      "num_steps", "total_tokens_M", "world_size", "lnc", "seq_len", "num_params_M",
                      "causality_passed", "causality_max_abs", "eval_seconds", "eval_timeout", "eval_over_timeout"}),
}
SUMMARY_KEYS["autoresearch"] = SUMMARY_KEYS["kit"] | {"val_bpb", "peak_vram_mb", "mfu_percent", "depth"}
KIT_BUDGET_KNOB = {"kind": "flag", "name": "--max-train-seconds"}  # the kit baseline's own budget flag
LNC_VAR = "NEURON_LOGICAL_NC_CONFIG"
SMOOTHING = 0.9  # of the training loss the pruner reads where the script prints no validation figure
OUT_CAP = 32 << 20  # bytes of the script's stdout kept in script.out
STEP_EVENTS_S = 0.5  # at most two step events a second


class BadConfig(ValueError):
    """Exit 2 with this line."""


def read_config(raw: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(raw) - CONFIG_KEYS)
    if unknown:
        raise BadConfig(f"unknown config key {unknown[0]!r} (a script trial takes {', '.join(sorted(CONFIG_KEYS))})")
    for key in ("script",) + (("kit",) if raw.get("kit") else ()):
        if not isinstance(raw.get(key), str) or not Path(raw[key]).is_file():
            raise BadConfig(f"{key}: no such file {raw.get(key)!r}")
    for key in ("constants", "kit_constants", "output"):
        if not isinstance(raw.get(key, {}), dict):
            raise BadConfig(f"{key}: must be a table")
    try:
        Patterns.build(raw.get("output"), raw.get("dialect", "autoresearch"))
    except ValueError as e:
        raise BadConfig(str(e)) from None
    for key in ("budget_knob", "seed_knob"):
        knob = raw.get(key)
        if knob is not None and (not isinstance(knob, dict) or knob.get("kind") not in ("constant", "flag", "env")
                                 or not isinstance(knob.get("name"), str)):
            raise BadConfig(f"{key}: must be {{'kind': 'constant' | 'flag' | 'env', 'name': ...}}, got {knob!r}")
    if raw.get("seed") is not None and not raw.get("seed_knob"):
        raise BadConfig("seed: the script has no seed knob to take it (set [trial] seed_knob in the spec)")
    return raw


def knob_text(value: Any) -> str:
    """A value as a command line or environment takes it: integral budgets as integers."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def launch_values(cfg: dict[str, Any], budget_s: float) -> tuple[dict[str, Any], list[str], dict[str, str]]:
    """The trial's constants, extra command-line arguments and environment: the knobs' values with the
    budget and the seed put through their own knobs (the kit's budget flag by default in its dialect)."""
    constants = dict(cfg.get("constants", {}))
    argv = [str(a) for a in cfg.get("flags", [])]
    env = {str(k): str(v) for k, v in cfg.get("env", {}).items()}
    knobs = [(cfg.get("budget_knob") or (KIT_BUDGET_KNOB if cfg.get("dialect") == "kit" else None), budget_s)]
    if cfg.get("seed") is not None:
        knobs.append((cfg.get("seed_knob"), cfg["seed"]))
    for knob, value in knobs:
        if knob is None:
            continue
        if knob["kind"] == "constant":
            constants[knob["name"]] = int(value) if isinstance(value, float) and value.is_integer() else value
        elif knob["kind"] == "flag":
            argv += [knob["name"], knob_text(value)]
        else:
            env[knob["name"]] = knob_text(value)
    return constants, argv, env


def prepare_workdir(cfg: dict[str, Any], budget_s: float, work: Path,
                    constants: dict[str, Any] | None = None) -> tuple[Path, Path | None]:
    """OUT/script/: the rewritten script, the kit's copy, the kit folder's other entries linked beside.

    In the kit's dialect the kit's prepare.py is copied byte for byte (the kit is never modified: the
    budget reaches the script through its own knob); in autoresearch's the copy's budget constant is the
    trial's budget, as that kit has no other way in."""
    script = Path(cfg["script"]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    try:
        text = source.rewrite(script.read_text(encoding="utf-8"),
                              cfg.get("constants", {}) if constants is None else constants)
    except (source.ScriptError, ValueError, SyntaxError) as e:
        line = f":{e.line}" if isinstance(e, source.ScriptError) and e.line else ""
        raise BadConfig(f"{script}{line}: {e}") from None
    target = work / script.name
    target.write_text(text, encoding="utf-8")
    if not cfg.get("kit"):
        return target, None
    kit = Path(cfg["kit"]).resolve()
    kit_text = kit.read_text(encoding="utf-8")
    found = source.constants(kit_text)
    values = dict(cfg.get("kit_constants", {}))
    budget_constants = () if cfg.get("dialect") == "kit" or cfg.get("budget_knob") else \
        cfg.get("kit_budget_constants", BUDGET_CONSTANTS)
    for name in budget_constants:
        if name in found:
            literal = found[name][0].value
            values[name] = int(budget_s) if isinstance(literal, int) and budget_s == int(budget_s) else float(budget_s)
    try:
        if values:
            (work / kit.name).write_text(source.rewrite(kit_text, values), encoding="utf-8")
        else:
            shutil.copyfile(kit, work / kit.name)
    except (source.ScriptError, ValueError) as e:
        line = f":{e.line}" if isinstance(e, source.ScriptError) and e.line else ""
        raise BadConfig(f"{kit}{line}: {e}") from None
    for entry in kit.parent.iterdir():
        if entry.name in (kit.name, script.name, "out", "__pycache__") or entry.name.startswith("."):
            continue
        with contextlib.suppress(FileExistsError):
            (work / entry.name).symlink_to(entry)
    return target, work / kit.name


def kit_setup(kit: Path, args: list[str] | None = None) -> str | None:
    """The kit's own ``python prepare.py ARGS`` in its folder (``setup`` in the kit's dialect), once per
    version of it and its arguments (what a team runs once per machine); concurrent trials wait on one
    lock. Returns why it failed, or None."""
    args = [str(a) for a in (args or [])]
    marker = kit.parent / ".kit-ready"
    digest = hashlib.sha256((sha256(kit) + "\0" + "\0".join(args)).encode()).hexdigest() if args else sha256(kit)
    if _kit_ready(marker, digest):  # no lock to take: a trial of a user who may not write the kit folder gets here
        return None
    with open(kit.parent / ".kit-ready.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _kit_ready(marker, digest):
            return None
        proc = subprocess.run([sys.executable, kit.name, *args], cwd=kit.parent, stdout=sys.stderr,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, errors="replace")
        sys.stderr.write(proc.stderr)
        if proc.returncode:
            return f"kit setup ({kit} exited {proc.returncode}): {last_error(proc.stderr)}"
        (kit.parent / MARKER_MANIFEST).write_text(json.dumps(kit_manifest(kit.parent), sort_keys=True))
        marker.write_text(digest + "\n")
    return None


def _kit_ready(marker: Path, digest: str) -> bool:
    try:
        return marker.read_text().strip() == digest
    except OSError:
        return False


def launch_command(script: Path, ranks: int, rank_module: str | None, torchrun: bool = False) -> list[str]:
    """``python train.py``, or torchrun for several ranks; in the kit's dialect torchrun always, one rank
    included (a kit script may need its process group)."""
    if ranks <= 1 and not torchrun:
        return [sys.executable, script.name]
    entry = ["-m", rank_module, script.name] if rank_module else [script.name]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), *entry]


class ScriptRun:
    """One script run: launch, read, classify. Emits the trainer's events through ``emit``."""

    def __init__(self, cfg: dict[str, Any], budget_s: float, out_dir: Path, ranks: int, rank_module: str | None,
                 as_json: bool) -> None:
        self.cfg, self.budget_s, self.out_dir = cfg, budget_s, out_dir
        self.ranks, self.rank_module, self.as_json = ranks, rank_module, as_json
        self.key: bytes | None = None  # the supervisor's per-trial key: every event line is signed with it
        self.kit_digest: str | None = None  # the trial's copy of the kit, as made
        self.kit_manifest: dict[str, str] | None = None  # the kit folder's files, as the trial found them
        self.dialect = cfg.get("dialect", "autoresearch")
        patterns = Patterns.build(cfg.get("output"), self.dialect)
        self.reader = Reader(patterns)
        self.err_reader = Reader(patterns)  # stderr: a kit script raises its `bad loss detected` there
        self.fractions = sorted(float(f) for f in cfg.get("eval_fractions", []))
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.diverged: str | None = None
        self.smooth, self.smooth_n, self.val = 0.0, 0, None
        self.err_tail = b""
        self.steps_seen = 0
        self.last_progress = time.monotonic()
        self.silences: list[str] = []
        self.over_budget: str | None = None

    def emit(self, event: dict[str, Any]) -> None:
        if self.as_json:
            print(event_line(event, self.key), flush=True)

    def _on_sigterm(self, *_: Any) -> None:
        self.stopping = True
        self._stop_child()

    def _stop_child(self) -> None:
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.child.send_signal(signal.SIGTERM)

    def _tee_stderr(self, stream: Any) -> None:
        """The script's stderr into ours (the trial's trainer.log), capped at OUT_CAP like its stdout; all of it
        is still read for its last error and a `bad loss detected`."""
        passed = 0
        for chunk in iter(lambda: stream.read1(65536), b""):
            if passed < OUT_CAP:
                with contextlib.suppress(OSError):
                    sys.stderr.buffer.write(chunk[:OUT_CAP - passed])
                    if passed + len(chunk) >= OUT_CAP:
                        sys.stderr.buffer.write(b"\n[trnsweep: the script's stderr is cut here, at its cap]\n")
                    sys.stderr.buffer.flush()
                passed += len(chunk)
            self.err_tail = (self.err_tail + chunk)[-8192:]
            self.err_reader.feed(chunk)
            self._err_failed()

    def _err_failed(self) -> None:
        """A fail line on stderr (a kit script's `bad loss detected`) makes the run diverged."""
        if self.err_reader.failed_line and not self.diverged:
            self.diverged = f"the script printed {self.err_reader.failed_line!r}"

    def _watch(self, started: float) -> None:
        """Stop a script past its budget, start-up allowance and grace (over budget), and note a script
        that prints no progress line for ``progress_silence_s``."""
        limit = self.budget_s + float(self.cfg.get("startup_allowance_s", 900)) + \
            float(self.cfg.get("over_budget_grace_s", 60))
        silence = float(self.cfg.get("progress_silence_s", 300))
        noted = 0.0
        while self.child is not None and self.child.poll() is None:
            now = time.monotonic()
            quiet = now - self.last_progress
            if quiet >= silence and self.last_progress > noted:
                noted = self.last_progress
                self.silences.append(f"no progress line for {quiet:.0f} s after {self.last_progress - started:.0f} s")
            if now - started > limit and self.over_budget is None:
                self.over_budget = (f"over budget: still running {now - started:.0f} s after launch (budget "
                                    f"{self.budget_s:g} s + start-up allowance + grace = {limit:g} s); stopped")
                self._stop_child()
            time.sleep(0.2)

    def _line(self, figures: Any) -> None:
        if figures is None or self.diverged:
            return
        if figures.val is not None and math.isfinite(figures.val):
            self.val = figures.val
        if figures.loss is not None:
            if not math.isfinite(figures.loss):
                self.diverged = f"non-finite training loss ({figures.loss}) at step {figures.step}"
                self._stop_child()
                return
            self.smooth = SMOOTHING * self.smooth + (1 - SMOOTHING) * figures.loss
            self.smooth_n += 1
        if figures.progress is None:
            figures.progress = self._fraction(figures)
        if figures.progress is None:
            return
        self.last_progress = time.monotonic()
        self.steps_seen += 1
        now = time.monotonic()
        if self.steps_seen == 1 or now - self._last_step_event >= STEP_EVENTS_S:
            self._last_step_event = now
            self.emit({"event": "step", "step": figures.step, "progress": round(figures.progress, 6),
                       "loss": figures.loss, "charged_s": round(figures.progress * self.budget_s, 3)})
        while self.fractions and figures.progress >= self.fractions[0] - 1e-9:
            f = self.fractions.pop(0)
            if self.val is not None:
                value, metric = self.val, "val"
            elif self.smooth_n:
                value, metric = self.smooth / (1 - SMOOTHING ** self.smooth_n), "train_loss_smoothed"
            else:
                value, metric = None, ""
            if value is not None:
                self.emit({"event": "eval", "val_bpb": value, "metric": metric, "progress": f,
                           "charged_s": f * self.budget_s})

    def _fraction(self, figures: Any) -> float | None:
        """The fraction done from what the kit's line says: the charged seconds where it prints them, what is
        left of the time against the trial's budget, of the steps against those done (where the script caps
        steps); the furthest of them."""
        found = []
        if figures.charged is not None and self.budget_s > 0:
            found.append(figures.charged / self.budget_s)
        if figures.remaining_time is not None and self.budget_s > 0:
            found.append(1.0 - figures.remaining_time / self.budget_s)
        step, left = figures.step, figures.remaining_steps
        if left is not None and step is not None and step + left > 0:
            found.append(step / (step + left))
        return min(1.0, max(0.0, max(found))) if found else None

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        record: dict[str, Any] = {"script": cfg["script"], "script_sha256": sha256(Path(cfg["script"])),
                                  "constants": cfg.get("constants", {}), "budget_s": self.budget_s,
                                  "world_size": self.ranks, "config": cfg, "dialect": self.dialect}
        expected = cfg.get("script_sha256")
        if expected and expected != record["script_sha256"]:
            return {**record, "status": "failed", "val_bpb": None,
                    "reason": f"{cfg['script']} changed since the study was set up (sha256 "
                              f"{record['script_sha256'][:12]}, the study's {expected[:12]})"}
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.emit({"event": "start", "script": cfg["script"], "script_sha256": record["script_sha256"],
                   "budget_s": self.budget_s, "ranks": self.ranks})
        if cfg.get("kit") and cfg.get("kit_setup"):  # first: the kit folder's entries are linked once they exist
            why = kit_setup(Path(cfg["kit"]).resolve(), cfg.get("kit_setup_args"))
            if why:
                return {**record, "status": "failed", "val_bpb": None, "reason": why}
        constants, argv, knob_env = launch_values(cfg, self.budget_s)
        script, kit = prepare_workdir(cfg, self.budget_s, self.out_dir / "script", constants)
        if kit is not None:
            self.kit_digest = sha256(kit)
            self.kit_manifest = kit_manifest(Path(cfg["kit"]).resolve().parent)
            why = kit_tampered(Path(cfg["kit"]).resolve().parent, self.kit_manifest)
            if why:
                return {**record, "status": "failed", "val_bpb": None, "reason": why}
        self._last_step_event = 0.0
        started = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **knob_env}
        if cfg.get("lnc") is not None:
            env[LNC_VAR] = str(cfg["lnc"])
        command = launch_command(script, self.ranks, self.rank_module, torchrun=self.dialect == "kit") + argv
        record["command"] = " ".join(["python", *command[1:]])
        self.child = subprocess.Popen(command, cwd=script.parent, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, env=env)
        tee = threading.Thread(target=self._tee_stderr, args=(self.child.stderr,), daemon=True)
        tee.start()
        threading.Thread(target=self._watch, args=(started,), daemon=True).start()
        kept = 0
        # Unbuffered: a trial killed at its deadline keeps every line read before it.
        with open(self.out_dir / "script.out", "wb", buffering=0) as raw:
            assert self.child.stdout is not None
            fd = self.child.stdout.fileno()
            while chunk := os.read(fd, 65536):
                if kept < OUT_CAP:
                    raw.write(chunk[:OUT_CAP - kept])
                    kept += len(chunk)
                for _, figures in self.reader.feed(chunk):
                    self._line(figures)
            for _, figures in self.reader.finish():
                self._line(figures)
        code = self.child.wait()
        tee.join(timeout=5)
        self.err_reader.finish()
        self._err_failed()
        summary = dict(self.reader.summary)
        record.update({k: v for k, v in summary.items() if k in SUMMARY_KEYS[self.dialect] and k not in record})
        record.update(summary_fields(summary), wall_seconds=time.monotonic() - started, exit_code=code,
                      summary=summary)
        if self.silences:
            record["progress_silence"] = "; ".join(self.silences)
        return self._classify(record, code, script, kit)

    def _classify(self, record: dict[str, Any], code: int, script: Path, kit: Path | None) -> dict[str, Any]:
        err = last_error(self.err_tail.decode("utf-8", "replace"))
        if self.stopping:
            return {**record, "status": "stopped", "val_bpb": None, "reason": "stopped by SIGTERM"}
        if self.over_budget:
            return {**record, "status": "rejected", "val_bpb": None, "over_budget": True, "reason": self.over_budget}
        if self.diverged or self.reader.failed_line:
            return {**record, "status": "diverged", "val_bpb": None,
                    "reason": self.diverged or f"the script printed {self.reader.failed_line!r}"}
        if code != 0:
            return {**record, "status": "failed", "val_bpb": None,
                    "reason": err or f"the script exited with code {code}"}
        if self.dialect == "kit":
            return self._score_kit(record, script, kit)
        why = self._kit_changed(script, kit)
        if why:
            return {**record, "status": "failed", "val_bpb": None, "reason": why}
        if self.dialect == "kit":
            return self._score_kit(record, script, kit)
        claimed = record.pop("val_bpb", None)  # the summary's figure: the script's claim
        if isinstance(claimed, (int, float)) and not isinstance(claimed, bool):
            if not math.isfinite(claimed):
                return {**record, "status": "diverged", "val_bpb": None,
                        "reason": f"val_bpb {claimed} in the summary"}
            record["claimed_val_bpb"] = float(claimed)
        if self.cfg.get("trust_script"):  # the study opted in: the script's own figure, said on the trial
            if "claimed_val_bpb" not in record:
                return {**record, "status": "failed", "val_bpb": None, "trust_script": True,
                        "reason": "no val_bpb in the summary block, which the study trusts (trust_script)"}
            return {**record, "status": "ok", "val_bpb": record["claimed_val_bpb"], "val_bpb_source": "summary",
                    "trust_script": True}
        checkpoint = script.parent / "out" / "final.pt"
        if kit is None or not checkpoint.is_file():
            return {**record, "status": "failed", "val_bpb": None,
                    "reason": "no out/final.pt and kit to score (a study may take the script's own val_bpb: "
                              "[objective] trust_script = true)"}
        try:
            scored, seconds = fallback_score(script, kit, checkpoint, self.cfg)
        except ScoreError as e:
            return {**record, "status": "failed", "val_bpb": None, "reason": f"evaluating out/final.pt: {e}"}
        val = scored.get("val_bpb")
        if not isinstance(val, (int, float)) or isinstance(val, bool) or not math.isfinite(val):
            return {**record, "status": "diverged", "val_bpb": None, "reason": f"the kit's evaluate_bpb gave {val!r}"}
        record.update(val_bpb=float(val), val_bpb_source="kit", eval_seconds=round(seconds, 3))
        self._compare_claim(record)
        return {**record, "status": "ok"}

    def _compare_claim(self, record: dict[str, Any]) -> None:
        """Flag a script's claimed figure that differs from the score by more than the spec's tolerance."""
        if "claimed_val_bpb" in record:
            tolerance = float(self.cfg.get("claim_tolerance", 1e-4))
            record["claim_differs"] = abs(record["claimed_val_bpb"] - record["val_bpb"]) > tolerance

    def _kit_changed(self, script: Path, kit: Path | None) -> str | None:
        """Why the kit the scorer is about to read is not the kit the trial started with (its copy of
        prepare.py, or a file of the kit's folder the trial could reach through its links); None if intact."""
        if kit is None:
            return None
        if self.kit_digest is not None and sha256(kit) != self.kit_digest:
            return f"the trial changed its copy of the kit's {kit.name} (sha256 differs): not scored"
        if self.kit_manifest is not None:
            now = kit_manifest(Path(self.cfg["kit"]).resolve().parent)
            changed = sorted(k for k in set(now) | set(self.kit_manifest) if now.get(k) != self.kit_manifest.get(k))
            if changed:
                return f"the kit's folder changed during the trial ({', '.join(changed[:3])}): not scored"
        return None

    def _score_kit(self, record: dict[str, Any], script: Path, kit: Path | None) -> dict[str, Any]:
        """The kit's own scorer on out/final.pt, as teams run it, in a fresh process after every rank has
        exited; what the script printed is only its claim. A run the scorer would reject (over budget,
        causality failed) is ``rejected``: recorded with its score, never the study's best."""
        summary = record.get("summary", {})
        claimed = summary.get("public_val_bpb")
        if isinstance(claimed, (int, float)) and not isinstance(claimed, bool):
            record["claimed_val_bpb"] = float(claimed)
        checkpoint = script.parent / "out" / "final.pt"
        if kit is None or not checkpoint.is_file():
            return {**record, "status": "failed", "val_bpb": None,
                    "reason": "no out/final.pt (or no kit) for the kit's eval-public to score"}
        tokens = int(self.cfg.get("eval_tokens", 2097152))
        try:
            scored, seconds = eval_public(kit, script, checkpoint, self.cfg, tokens)
        except ScoreError as e:
            return {**record, "status": "failed", "val_bpb": None, "reason": f"eval-public: {e}"}
        val = scored.get("val_bpb")
        record.update(val_bpb_source="eval-public", eval_tokens=tokens, eval_wall_seconds=round(seconds, 3),
                      eval_public={k: v for k, v in scored.items() if isinstance(v, (int, float, bool, str))})
        if not isinstance(val, (int, float)) or isinstance(val, bool) or not math.isfinite(val):
            return {**record, "status": "diverged", "val_bpb": None, "reason": f"eval-public gave val_bpb {val!r}"}
        record["val_bpb"] = float(val)
        self._compare_claim(record)
        why = [k for k, bad in (("over_budget", summary.get("over_budget") is True),
                                ("causality_passed", summary.get("causality_passed") is False),
                                ("eval_over_timeout", scored.get("eval_over_timeout") is True)) if bad]
        if why:
            return {**record, "status": "rejected",
                    "reason": "the scorer would reject it: " + ", ".join(f"{k} {summary.get(k, scored.get(k))}"
                                                                          for k in why)}
        return {**record, "status": "ok"}


def event_line(event: dict[str, Any], key: bytes | None) -> str:
    """One JSON event line, signed with ``key`` where the supervisor gave one."""
    return json.dumps(event, default=str) if key is None else sign(key, event)


def read_key(fd: int | None) -> bytes | None:
    """The trial's key from the pipe the supervisor passed, which is then closed: the script never inherits it.
    The process also turns non-dumpable, so a script of the same user cannot read it (or open this process's
    stdout) through /proc."""
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as pipe:
        key = bytes.fromhex(pipe.read().decode())
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4, off
    return key


def summary_fields(summary: dict[str, Any]) -> dict[str, Any]:
    """The record's usual names for what the summary block says (train_seconds, steps, tokens, params)."""
    def num(key: str, scale: float = 1.0) -> float | None:
        v = summary.get(key)
        return v * scale if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    out = {"train_seconds": num("charged_seconds_est") or num("training_seconds"), "steps": num("num_steps"),
           "tokens": num("total_tokens_M", 1e6), "params": num("num_params_M", 1e6),
           "startup_seconds": num("startup_allowance_est")}
    if isinstance(summary.get("world_size"), int):
        out["world_size"] = summary["world_size"]
    return {k: (int(v) if k in ("steps", "tokens", "params") else v) for k, v in out.items() if v is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.script.run", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="inline JSON, or a .json file")
    parser.add_argument("--budget-s", type=float, required=True, help="the kit's budget for this run")
    parser.add_argument("--json", action="store_true", help="JSON lines on stdout")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/script"), help="the run's working files")
    parser.add_argument("--ranks", type=int, default=1, help="torchrun processes")
    parser.add_argument("--rank-module", default=None, help="a module each rank runs first (it then runs the script)")
    parser.add_argument("--key-fd", type=int, default=None, help="a pipe holding the key that signs each event line")
    parser.add_argument("--setup-only", action="store_true",
                        help="only the kit's setup (kit_setup), as a user who may write the kit folder; exit 1 with "
                             "the reason when it fails")
    args = parser.parse_args(argv)
    key = read_key(args.key_fd)
    try:
        text = args.config.strip()
        try:
            raw = json.loads(text if text.startswith("{") else Path(text).read_text())
        except (OSError, ValueError) as e:
            raise BadConfig(f"--config: {e}") from None
        if not isinstance(raw, dict):
            raise BadConfig("--config must be a JSON object")
        if args.setup_only:
            cfg = read_config(raw)
            why = kit_setup(Path(cfg["kit"]).resolve(), cfg.get("kit_setup_args")) \
                if cfg.get("kit") and cfg.get("kit_setup") else None
            if why:
                print(f"error: {why}", file=sys.stderr)
            return 1 if why else 0
        run = ScriptRun(read_config(raw), args.budget_s, args.out_dir, args.ranks, args.rank_module, args.json)
        run.key = key
        args.out_dir.mkdir(parents=True, exist_ok=True)
        record = run.run()
    except BadConfig as e:  # before the script ran: its config, files or constants
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the sweep needs a result line and a reason, whatever broke
        record = {"status": "failed", "val_bpb": None, "reason": f"{type(e).__name__}: {e}"[:300]}
    checkpoint = args.out_dir / "script" / "out" / "final.pt"
    if checkpoint.is_file():
        with contextlib.suppress(OSError):
            (args.out_dir / "final.pt").unlink(missing_ok=True)
            try:
                os.link(checkpoint, args.out_dir / "final.pt")
            except OSError:
                shutil.copyfile(checkpoint, args.out_dir / "final.pt")
    print(event_line({"event": "result", **record}, key), flush=True)
    return 0 if record["status"] in ("ok", "stopped", "diverged") else 1


if __name__ == "__main__":
    sys.exit(main())
