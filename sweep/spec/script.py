"""A study of a team's own script: ``[trial] script = "train.py"`` (and ``kit = "prepare.py"``).

Each key a trial sets (searched, fixed or derived; the launch keys ``lnc``, ``ranks`` and
``neuron_cc_flags`` apart) names a module-level constant of the script: the upper-cased key, or what
``[params.NAME] constant = "..."`` says. Before anything runs, the script is read (its AST, never
executed; :mod:`model.script.source`) and every such constant must be assigned once at its top level, a
literal of a kind that takes the key's values; otherwise one line names the spec, the script, the line
and the constant. The trainer of such a study is :mod:`model.script.run`, which gets the config built
here: the script, the kit, the constants with their values and how to read the script's output.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.script import source
from sweep.neuron import LAUNCH_KEYS
from sweep.spec.files import SpecError, SpecReader
from sweep.spec.space import SearchSpace, SpaceError

TRAINER = "model.script.run"
KEYS = {"script", "kit", "kit_setup", "kit_constants", "output", "eval_batch_size", "eval_device"}
OUTPUT_PATTERNS = ("progress", "loss", "step", "val", "fail")  # model.script.output's patterns
_KIND_SAMPLES = 50


@dataclass(frozen=True)
class ScriptSpec:
    """Where the script and kit are, which constant each key sets, and how the trainer reads the script."""

    script: Path
    kit: Path | None
    sha256: str
    constants: Mapping[str, str]  # trial key -> the script's constant
    kit_setup: bool = False
    kit_constants: Mapping[str, Any] = field(default_factory=dict)
    output: Mapping[str, str] = field(default_factory=dict)
    eval_batch_size: int = 8
    eval_device: str = "cpu"

    def constant(self, key: str) -> str:
        return self.constants.get(key, key.upper())

    def trainer_config(self, flat: Mapping[str, Any]) -> dict[str, Any]:
        """What model.script.run gets for one trial's resolved values; launch keys stay at the top."""
        out: dict[str, Any] = {k: v for k, v in flat.items() if k in LAUNCH_KEYS}
        out.update(script=str(self.script), constants={self.constant(k): v for k, v in flat.items()
                                                       if k not in LAUNCH_KEYS},
                   script_sha256=self.sha256, kit_setup=self.kit_setup, output=dict(self.output),
                   eval_batch_size=self.eval_batch_size, eval_device=self.eval_device)
        if self.kit is not None:
            out.update(kit=str(self.kit), kit_constants=dict(self.kit_constants))
        return out

    def rewritten(self, flat: Mapping[str, Any]) -> str:
        """The script's text with a trial's values in its constants (what the trial ran, what export writes)."""
        values = self.trainer_config(flat)["constants"]
        return source.rewrite(self.script.read_text(encoding="utf-8"), values)


def read(r: SpecReader, trial: Mapping[str, Any], params_t: Mapping[str, Any], space: SearchSpace,
         spec_text: str) -> ScriptSpec | None:
    """``[trial] script`` and its keys, checked against the script's constants; None for a study of our trainer."""
    if "script" not in trial:
        for k in sorted(KEYS & set(trial)):
            raise r.error(f"trial.{k}", "only for a study of a script (trial.script)")
        for name, raw in params_t.items():
            if isinstance(raw, Mapping) and "constant" in raw:
                raise r.error(f"params.{name}.constant", "only for a study of a script (trial.script)")
        return None
    if "trainer" in trial:
        raise r.error("trial.trainer", f"a study of a script runs {TRAINER}; remove trial.trainer")
    base = r.path.parent
    script = _file(r, trial, "trial.script", base)
    kit = _file(r, trial, "trial.kit", base) if "kit" in trial else None
    kit_setup = trial.get("kit_setup", False)
    if not isinstance(kit_setup, bool) or (kit_setup and kit is None):
        raise r.error("trial.kit_setup", "must be true or false, and true only with trial.kit")
    output = r.table(trial.get("output", {}), "trial.output", set(OUTPUT_PATTERNS))
    for k, v in output.items():
        try:
            if not isinstance(v, str) or (v and k != "fail" and re.compile(v).groups < 1):
                raise r.error(f"trial.output.{k}", "must be a regular expression with a group around the figure")
        except re.error as e:
            raise r.error(f"trial.output.{k}", f"not a regular expression: {e}") from None
    kit_constants = r.table(trial.get("kit_constants", {}), "trial.kit_constants", None)
    constants = {}
    for name, raw in params_t.items():
        if isinstance(raw, Mapping) and "constant" in raw:
            c = raw["constant"]
            if not isinstance(c, str) or not c.isidentifier():
                raise r.error(f"params.{name}.constant", f"must name a constant of the script, got {c!r}")
            constants[name] = c
    spec = ScriptSpec(script=script, kit=kit, sha256=hashlib.sha256(script.read_bytes()).hexdigest(),
                      constants=constants, kit_setup=kit_setup, kit_constants=kit_constants, output=output,
                      eval_batch_size=r.integer(trial, "trial.eval_batch_size", low=1, default=8),
                      eval_device=r.string(trial, "trial.eval_device", default="cpu"))
    _check_constants(r, spec, space, spec_text)
    if kit is not None and kit_constants:
        _check_file(r, kit, {k: {source.kind_of(v)} for k, v in kit_constants.items()}, "trial.kit_constants",
                    {}, spec_text)
    return spec


def _file(r: SpecReader, trial: Mapping[str, Any], key: str, base: Path) -> Path:
    p = Path(r.string(trial, key)).expanduser()
    p = (base / p if not p.is_absolute() else p).resolve()
    if not p.is_file():
        raise r.error(key, f"no such file {p}")
    return p


def key_kinds(space: SearchSpace) -> dict[str, set[str]]:
    """Each trial key with the literal kinds its values take: from a parameter's type and choices, and from
    sampled points for fixed and derived values."""
    kinds: dict[str, set[str]] = {}
    for p in space.params:
        kinds[p.name] = ({source.kind_of(c) for c in p.choices} if p.kind == "categorical" else {p.kind})
    rng, searched = random.Random(0), set(kinds)
    for _ in range(_KIND_SAMPLES):
        try:
            config = space.trainer_config(space.sample(rng))
        except SpaceError:
            continue
        for k, v in config.items():
            if k not in searched:
                kinds.setdefault(k, set()).add(source.kind_of(v))
    return {k: v for k, v in kinds.items() if not k.startswith("_") and k not in LAUNCH_KEYS}


def _spec_line(spec_text: str, key: str) -> int:
    """The spec's line that defines ``key`` (``[params.NAME]`` or ``NAME =``), for the error; 0 if not found."""
    name = key.rsplit(".", 1)[-1]
    for i, line in enumerate(spec_text.splitlines(), 1):
        s = line.strip()
        if s.startswith((f"[params.{name}]", f"{name} =", f"{name}=")):
            return i
    return 0


def _check_constants(r: SpecReader, spec: ScriptSpec, space: SearchSpace, spec_text: str) -> None:
    params = {p.name for p in space.params}
    wanted = {spec.constant(k): kinds for k, kinds in key_kinds(space).items()}
    keys = {spec.constant(k): (f"params.{k}" if k in params else k) for k in key_kinds(space)}
    _check_file(r, spec.script, wanted, "", keys, spec_text)


def _check_file(r: SpecReader, path: Path, wanted: Mapping[str, set[str]], key: str, keys: Mapping[str, str],
                spec_text: str) -> None:
    try:
        found = source.constants(path.read_text(encoding="utf-8"))
    except SyntaxError as e:
        raise r.error(key or "trial.script", f"{path}:{e.lineno}: not Python: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise r.error(key or "trial.script", f"{path}: {e}") from None
    for name, kinds in wanted.items():
        try:
            source.check(found, name, kinds)
        except source.ScriptError as e:
            where = key or keys.get(name, name)
            if e.line:
                raise r.error(where, f"{path}:{e.line}: {e.message}") from None
            literal = sorted(n for n, b in found.items() if len(b) == 1 and b[0].literal and n.isupper())
            line = _spec_line(spec_text, where)
            message = f"{path} has no module-level constant {name} (its constants: {', '.join(literal) or 'none'})"
            raise SpecError(f"{r.path}:{line}: {where}: {message}" if line else str(r.error(where, message))) from None
