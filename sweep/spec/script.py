"""A study of a team's own script: ``[trial] script = "train.py"`` (and ``kit = "prepare.py"``).

Each key a trial sets (searched, fixed or derived; the launch keys ``lnc``, ``ranks`` and
``neuron_cc_flags`` apart) reaches the script through a knob: a module-level constant (the upper-cased
key by default, or ``[params.NAME] constant = "..."``), an argparse flag (``flag = "--matrix-lr"``) or an
environment variable (``env = "NEURON_COMPETITION_R1_SEQ_LEN"``); a fixed or derived key names its knob in
``[trial.knobs]``. Before anything runs, the script is read (its AST, never executed;
:mod:`model.script.source`): a constant must be assigned once at its top level, a literal of a kind that
takes the key's values; a flag must be declared, of a type that takes them; an environment variable the
script never names is a warning. Otherwise one line names the spec's line, the script and its line.

The dialect (``[trial] dialect``, detected from what the script imports from prepare when absent) says how
the trainer, :mod:`model.script.run`, speaks to the script: the competition kit's (the budget through the
script's own ``--max-train-seconds``, the score from ``prepare.py eval-public``) or upstream autoresearch's
(the budget written into a copy of the kit). The trainer gets the config built here.

Long file: the keys of a script study, their defaults per dialect and their checks against the script are
one table of rules; split, each half would need the other's.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import string
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from model.script import source
from sweep.neuron import LAUNCH_KEYS
from sweep.spec.files import SpecError, SpecReader
from sweep.spec.space import SearchSpace, SpaceError

TRAINER = "model.script.run"
KEYS = {"script", "kit", "kit_setup", "kit_constants", "output", "eval_batch_size", "eval_device", "dialect",
        "budget_knob", "seed_knob", "eval_args", "eval_tokens", "promote_eval_tokens", "eval_seq_len",
        "kit_setup_args", "progress_silence_s", "over_budget_grace_s", "claim_tolerance", "knobs", "pass_env", "run_as"}
OUTPUT_PATTERNS = ("progress", "loss", "step", "val", "fail", "remaining_time", "remaining_steps", "charged")
SEED_KEY = "seed"  # promote's replicates vary this key (sweep.ship.replicates.SEED)
DIALECTS = ("kit", "autoresearch")
KNOB_KINDS = ("constant", "flag", "env")
EVAL_PLACEHOLDERS = ("eval_tokens", "seq_len", "batch_size")  # what the trainer fills in eval_args
# What a script imports from prepare says its dialect: the kit's own helpers first (a kit script may import
# a Tokenizer too), then autoresearch's names, then the kit's budget constant (a script may read it alone).
KIT_NAMES = ("ensure_tokenizer", "record_step_boundary")
AUTORESEARCH_NAMES = ("Tokenizer", "TIME_BUDGET")
KIT_BUDGET_NAME = "TRAIN_TIME_BUDGET_SECONDS"
KIT_DEFAULTS: dict[str, Any] = {"budget_knob": "--max-train-seconds", "kit_setup_args": ["setup"],
                                "eval_args": ["--seq-len", "{seq_len}", "--eval-tokens", "{eval_tokens}"]}
_KIND_SAMPLES = 50
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_USER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?|[0-9]+")  # a user name (useradd's rule) or a uid


def detect_dialect(text: str) -> str:
    """"kit" or "autoresearch" from the names the script imports from prepare (see KIT_NAMES above);
    autoresearch when it imports none of them."""
    names = source.prepare_imports(text)
    if names & set(KIT_NAMES):
        return "kit"
    if names & set(AUTORESEARCH_NAMES):
        return "autoresearch"
    return "kit" if KIT_BUDGET_NAME in names else "autoresearch"


@dataclass(frozen=True)
class Knob:
    """How a value reaches the script: a module ``constant``, an argparse ``flag`` or an ``env`` variable."""

    kind: str
    name: str

    def describe(self) -> str:
        return {"constant": "constant", "flag": "flag", "env": "environment variable"}[self.kind] + f" {self.name}"


@dataclass(frozen=True)
class ScriptSpec:
    """Where the script and kit are, which knob each key sets, and how the trainer runs and reads the script."""

    script: Path
    kit: Path | None
    sha256: str
    knobs: Mapping[str, Knob]  # trial key -> its knob, where the spec names one
    kit_setup: bool = False
    kit_constants: Mapping[str, Any] = field(default_factory=dict)
    output: Mapping[str, str] = field(default_factory=dict)
    eval_batch_size: int = 8
    eval_device: str = "cpu"
    dialect: str = "autoresearch"
    budget_knob: Knob | None = None
    seed_knob: Knob | None = None
    eval_args: tuple[str, ...] = ()
    eval_tokens: int = 2097152
    promote_eval_tokens: int = 20971520
    eval_seq_len: int = 1024
    kit_setup_args: tuple[str, ...] = ()
    progress_silence_s: float = 300.0
    over_budget_grace_s: float = 60.0
    claim_tolerance: float = 1e-4
    pass_env: tuple[str, ...] = ()  # variables of the worker's environment the script may see beyond the allow-list
    run_as: str = ""  # the user the script trainer runs as ("": the node's SWEEP_TRIAL_USER; sweep.run.trialuser)
    flag_info: Mapping[str, source.Flag] = field(default_factory=dict)  # each flag knob's declaration
    knob_types: Mapping[str, str | None] = field(default_factory=dict)  # budget/seed knob name -> literal/type kind
    warnings: tuple[str, ...] = ()
    trust_script: bool = False  # [objective] trust_script: the script's printed figure is the objective

    def knob(self, key: str) -> Knob:
        """The knob ``key`` sets: the spec's, else the constant named by the upper-cased key."""
        return self.knobs.get(key, Knob("constant", key.upper()))

    def constant(self, key: str) -> str:
        return self.knob(key).name

    def takes_seed(self, key: str) -> bool:
        """Whether ``key`` is the replicates' ``seed``, which the trainer sets through the seed knob."""
        return key == SEED_KEY and self.seed_knob is not None and SEED_KEY not in self.knobs

    def _split(self, flat: Mapping[str, Any]) -> tuple[dict[str, Any], list[str], dict[str, str]]:
        """A trial's values by knob kind: constants, the flags' argv (in the values' order), the environment."""
        constants: dict[str, Any] = {}
        argv: list[str] = []
        env: dict[str, str] = {}
        for k, v in flat.items():
            if k in LAUNCH_KEYS or self.takes_seed(k):
                continue
            knob = self.knob(k)
            if knob.kind == "constant":
                constants[knob.name] = v
            elif knob.kind == "flag":
                argv += flag_argv(self.flag_info.get(knob.name), knob.name, v)
            else:
                env[knob.name] = env_text(v)
        return constants, argv, env

    def _knob_dict(self, knob: Knob | None) -> dict[str, Any] | None:
        if knob is None:
            return None
        return {"kind": knob.kind, "name": knob.name, "type": self.knob_types.get(knob.name)}

    def trainer_config(self, flat: Mapping[str, Any]) -> dict[str, Any]:
        """What model.script.run gets for one trial's resolved values; launch keys stay at the top."""
        out: dict[str, Any] = {k: v for k, v in flat.items() if k in LAUNCH_KEYS}
        constants, argv, env = self._split(flat)
        out.update(script=str(self.script), constants=constants, flags=argv, env=env, dialect=self.dialect,
                   script_sha256=self.sha256, kit_setup=self.kit_setup, kit_setup_args=list(self.kit_setup_args),
                   output=dict(self.output), eval_batch_size=self.eval_batch_size, eval_device=self.eval_device,
                   budget_knob=self._knob_dict(self.budget_knob), seed_knob=self._knob_dict(self.seed_knob),
                   eval_args=list(self.eval_args), eval_tokens=self.eval_tokens,
                   promote_eval_tokens=self.promote_eval_tokens, eval_seq_len=self.eval_seq_len,
                   progress_silence_s=self.progress_silence_s, over_budget_grace_s=self.over_budget_grace_s,
                   claim_tolerance=self.claim_tolerance, trust_script=self.trust_script)
        if self.kit is not None:
            out.update(kit=str(self.kit), kit_constants=dict(self.kit_constants))
        if any(self.takes_seed(k) for k in flat):
            out["seed"] = flat[SEED_KEY]
        return out

    def rewritten(self, flat: Mapping[str, Any]) -> str:
        """The script's text with a trial's values baked in: its constants' literals and its flags' defaults
        (what export writes; environment knobs cannot be baked: :meth:`launch_env`)."""
        constants, _, _ = self._split(flat)
        text = source.rewrite(self.script.read_text(encoding="utf-8"), constants)
        flag_values = {self.knob(k).name: v for k, v in flat.items()
                       if k not in LAUNCH_KEYS and self.knob(k).kind == "flag"}
        return source.rewrite_flag_defaults(text, flag_values) if flag_values else text

    def launch_env(self, flat: Mapping[str, Any]) -> dict[str, str]:
        """The environment knobs' values, which export writes on the launch line rather than into the script."""
        return self._split(flat)[2]


def flag_argv(flag: source.Flag | None, name: str, value: Any) -> list[str]:
    """The command-line words that give flag ``name`` the value: ``--x V``; a boolean ``--x``/``--no-x``; a
    store_true flag ``--x`` or nothing (store_false the reverse)."""
    action = flag.action if flag is not None else None
    if action == "boolean_optional":
        return [name] if value else [f"--no-{name[2:]}"]
    if action == "store_true":
        return [name] if value else []
    if action == "store_false":
        return [] if value else [name]
    return [name, repr(value) if isinstance(value, float) else str(value)]


def env_text(value: Any) -> str:
    """An environment variable's text for a value; a boolean is 1 or 0 (the kit's fallbacks test ``!= "0"``)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def _knob(r: SpecReader, raw: Any, key: str, table_only: bool = False) -> Knob:
    """A knob from ``{constant = ..}``, ``{flag = ..}`` or ``{env = ..}``, or from a string ("--x": a flag,
    else a constant)."""
    if isinstance(raw, str) and not table_only:
        return _knob_of(r, "flag" if raw.startswith("-") else "constant", raw, key)
    if not isinstance(raw, Mapping):
        raise r.error(key, "must be a table { constant = .. }, { flag = .. } or { env = .. }"
                      + ("" if table_only else ", or a string"))
    t = r.table(raw, key, set(KNOB_KINDS))
    if len(t) != 1:
        raise r.error(key, "names exactly one of constant, flag or env")
    (kind, name), = t.items()
    return _knob_of(r, kind, name, f"{key}.{kind}")


def _knob_of(r: SpecReader, kind: str, name: Any, key: str) -> Knob:
    if kind == "constant" and not (isinstance(name, str) and name.isidentifier()):
        raise r.error(key, f"must name a constant of the script, got {name!r}")
    if kind == "flag" and not (isinstance(name, str) and name.startswith("--") and len(name) > 2
                               and not any(c.isspace() or c == "=" for c in name)):
        raise r.error(key, f'must name a flag of the script, as "--matrix-lr", got {name!r}')
    if kind == "env" and not (isinstance(name, str) and _ENV_NAME.fullmatch(name)):
        raise r.error(key, f"must name an environment variable, got {name!r}")
    return Knob(kind, name)


def _strings(r: SpecReader, trial: Mapping[str, Any], key: str, default: list[str]) -> tuple[str, ...]:
    v = trial.get(key.rsplit(".", 1)[-1], default)
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise r.error(key, f"must be a list of strings, got {v!r}")
    return tuple(v)


def _eval_args(r: SpecReader, trial: Mapping[str, Any], default: list[str]) -> tuple[str, ...]:
    args = _strings(r, trial, "trial.eval_args", default)
    for a in args:
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(a) if f is not None]
        except ValueError as e:
            raise r.error("trial.eval_args", f"{a!r}: {e}") from None
        for f in fields:
            if f not in EVAL_PLACEHOLDERS:
                raise r.error("trial.eval_args", f"{a!r}: unknown placeholder {{{f}}} (the trainer fills "
                                                 f"{', '.join('{' + p + '}' for p in EVAL_PLACEHOLDERS)})")
    return args


def _param_knobs(r: SpecReader, params_t: Mapping[str, Any]) -> dict[str, Knob]:
    knobs = {}
    for name, raw in params_t.items():
        if not isinstance(raw, Mapping):
            continue
        given = [k for k in KNOB_KINDS if k in raw]
        if len(given) > 1:
            raise r.error(f"params.{name}", f"names one knob, got {' and '.join(given)}")
        if given:
            knobs[name] = _knob_of(r, given[0], raw[given[0]], f"params.{name}.{given[0]}")
    return knobs


def read(r: SpecReader, trial: Mapping[str, Any], params_t: Mapping[str, Any], space: SearchSpace,
         spec_text: str) -> ScriptSpec | None:
    """``[trial] script`` and its keys, checked against the script; None for a study of our trainer."""
    if "script" not in trial:
        for k in sorted(KEYS & set(trial)):
            raise r.error(f"trial.{k}", "only for a study of a script (trial.script)")
        for name, raw in params_t.items():
            for kind in KNOB_KINDS:
                if isinstance(raw, Mapping) and kind in raw:
                    raise r.error(f"params.{name}.{kind}", "only for a study of a script (trial.script)")
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
    text = _script_text(r, script)
    dialect = r.choice(trial, "trial.dialect", DIALECTS) if "dialect" in trial else detect_dialect(text)
    kit_default = KIT_DEFAULTS if dialect == "kit" else {}
    if dialect == "kit" and kit_constants:
        raise r.error("trial.kit_constants", "the kit's dialect leaves prepare.py as it is; set the script's own "
                                             "knobs instead (or dialect = \"autoresearch\")")
    knobs = _param_knobs(r, params_t)
    trial_knobs = r.table(trial.get("knobs", {}), "trial.knobs", None)
    params = {p.name for p in space.params}
    for key, raw in trial_knobs.items():
        if key in params:
            raise r.error(f"trial.knobs.{key}", f"{key} is searched: name its knob in [params.{key}]")
        knobs[key] = _knob(r, raw, f"trial.knobs.{key}", table_only=True)
    budget_raw = trial.get("budget_knob", kit_default.get("budget_knob"))
    seed_raw = trial.get("seed_knob")
    spec = ScriptSpec(
        script=script, kit=kit, sha256=hashlib.sha256(script.read_bytes()).hexdigest(), knobs=knobs,
        kit_setup=kit_setup, kit_constants=kit_constants, output=output,
        eval_batch_size=r.integer(trial, "trial.eval_batch_size", low=1, default=8),
        eval_device=r.string(trial, "trial.eval_device", default="cpu"), dialect=dialect,
        budget_knob=None if budget_raw is None else _knob(r, budget_raw, "trial.budget_knob"),
        seed_knob=None if seed_raw is None else _knob(r, seed_raw, "trial.seed_knob"),
        eval_args=_eval_args(r, trial, kit_default.get("eval_args", [])),
        eval_tokens=r.integer(trial, "trial.eval_tokens", low=1, default=2097152),
        promote_eval_tokens=r.integer(trial, "trial.promote_eval_tokens", low=1, default=20971520),
        eval_seq_len=r.integer(trial, "trial.eval_seq_len", low=1, default=1024),
        kit_setup_args=_strings(r, trial, "trial.kit_setup_args", kit_default.get("kit_setup_args", [])),
        progress_silence_s=r.number(trial, "trial.progress_silence_s", low=0, strict=True, default=300.0),
        over_budget_grace_s=r.number(trial, "trial.over_budget_grace_s", low=0, default=60.0),
        claim_tolerance=r.number(trial, "trial.claim_tolerance", low=0, default=1e-4),
        pass_env=_names(r, trial, "trial.pass_env"),
        run_as=_run_as(r, trial),
    )
    spec = _check_knobs(r, spec, space, spec_text, text, set(trial_knobs), _budget_kinds(trial))
    if kit is not None and kit_constants:
        _check_file(r, kit, {k: {source.kind_of(v)} for k, v in kit_constants.items()}, "trial.kit_constants",
                    {}, spec_text)
    return spec


def _budget_kinds(trial: Mapping[str, Any]) -> set[str]:
    """The kinds of value the budget knob gets: a whole number of seconds is an int (``--max-train-seconds``
    is ``type=int`` in the kit's baseline)."""
    b = trial.get("budget_s")
    return {"int"} if isinstance(b, (int, float)) and math.isfinite(b) and float(b).is_integer() else {"float"}


def _names(r: SpecReader, trial: Mapping[str, Any], key: str) -> tuple[str, ...]:
    """A list of environment variable names (``[trial] pass_env``)."""
    raw = trial.get(key.split(".")[-1], [])
    if not isinstance(raw, list) or not all(isinstance(n, str) and n.isidentifier() for n in raw):
        raise r.error(key, f"must list environment variable names, got {raw!r}")
    return tuple(raw)


def _run_as(r: SpecReader, trial: Mapping[str, Any]) -> str:
    """``[trial] run_as``: a user name or uid, never root; whether it exists is the node's to say (the trial
    fails as ``config`` naming it)."""
    name = r.string(trial, "trial.run_as", default="")
    if name and (not _USER_NAME.fullmatch(name) or name in ("root", "0")):
        raise r.error("trial.run_as", f"a user name or uid other than root, got {name!r}")
    return name


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
    """The spec's line that defines ``key``, for the error; 0 if not found. ``params.NAME`` is its table's
    header; ``trial.X`` (``trial.knobs.X``) the line ``X = ...`` in that table; a fixed or derived key the
    first line ``NAME = ...``."""
    section, _, name = key.rpartition(".")
    current = ""
    first = 0
    for i, line in enumerate(spec_text.splitlines(), 1):
        s = line.strip()
        if s.startswith("["):
            current = s.strip("[] ")
            if current == key:
                return i
            continue
        if s.startswith((f"{name} =", f"{name}=")):
            if current == section:
                return i
            first = first or (i if not section else 0)
    return first


def _fail(r: SpecReader, spec_text: str, where: str, message: str) -> SpecError:
    """The one line for a knob the script cannot take: the spec's file and line, the key, the message."""
    line = _spec_line(spec_text, where)
    return SpecError(f"{r.path}:{line}: {where}: {message}") if line else r.error(where, message)


def _script_text(r: SpecReader, path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
        source.constants(text)
    except SyntaxError as e:
        raise r.error("trial.script", f"{path}:{e.lineno}: not Python: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise r.error("trial.script", f"{path}: {e}") from None
    return text


def _check_knob(r: SpecReader, spec: ScriptSpec, text: str, found: Mapping[str, list[source.Constant]],
                declared: Mapping[str, source.Flag], knob: Knob, kinds: set[str], where: str, spec_text: str,
                warnings: list[str]) -> source.Constant | source.Flag | None:
    """Check one knob against the script (raising the spec's one line); a warning for an unnamed variable."""
    path = spec.script
    try:
        if knob.kind == "constant":
            return source.check(found, knob.name, kinds)
        if knob.kind == "flag":
            return source.check_flag(declared, knob.name, kinds)
    except source.ScriptError as e:
        if e.line:
            raise _fail(r, spec_text, where, f"{path}:{e.line}: {e.message}") from None
        if knob.kind == "constant":
            literal = sorted(n for n, b in found.items() if len(b) == 1 and b[0].literal and n.isupper())
            message = f"{path} has no module-level constant {knob.name} (its constants: {', '.join(literal) or 'none'})"
        else:
            message = f"{path}: {e.message}"
        raise _fail(r, spec_text, where, message) from None
    if not source.names_env(text, knob.name):
        line = _spec_line(spec_text, where)
        warnings.append(f"{r.path}:{line}: {where}: warning: {path} never names the environment variable "
                        f"{knob.name}; the script may ignore it")
    return None


def _unbakeable(text: str, flag: source.Flag, kinds: set[str]) -> str | None:
    """Why export could not bake a value of each kind into the flag's default; None if it could."""
    sample = {"bool": True, "int": 1, "float": 1.5, "str": "x"}
    for kind in sorted(kinds):
        try:
            source.rewrite_flag_defaults(text, {flag.name: sample.get(kind, "x")})
        except source.ScriptError as e:
            return e.message
        except ValueError as e:
            return str(e)
    return None


def _check_knobs(r: SpecReader, spec: ScriptSpec, space: SearchSpace, spec_text: str, text: str,
                 trial_knobs: set[str], budget_kinds: set[str]) -> ScriptSpec:
    """Every knob checked against the script's text; the spec with the flags' declarations, the budget and seed
    knobs' types and the warnings (printed here, once per load)."""
    params = {p.name for p in space.params}
    found, declared = source.constants(text), source.flags(text)
    warnings: list[str] = []
    flag_info: dict[str, source.Flag] = {}
    all_kinds = key_kinds(space)
    for key in sorted(trial_knobs - set(all_kinds)):
        others = ", ".join(sorted(set(all_kinds) - params)) or "none"
        raise _fail(r, spec_text, f"trial.knobs.{key}",
                    f"{key} is not a key the trial sets (its fixed and derived keys: {others})")
    for key, kinds in all_kinds.items():
        if spec.takes_seed(key):
            continue
        where = f"params.{key}" if key in params else (f"trial.knobs.{key}" if key in trial_knobs else key)
        got = _check_knob(r, spec, text, found, declared, spec.knob(key), kinds, where, spec_text, warnings)
        if isinstance(got, source.Flag):
            flag_info[got.name] = got
            why = _unbakeable(text, got, kinds)
            if why:
                warnings.append(f"{r.path}:{_spec_line(spec_text, where)}: {where}: warning: {why}: export will "
                                "refuse a trial that sets it")
    knob_types: dict[str, str | None] = {}
    for knob, kinds, where in ((spec.budget_knob, budget_kinds, "trial.budget_knob"),
                               (spec.seed_knob, {"int"}, "trial.seed_knob")):
        if knob is None:
            continue
        got = _check_knob(r, spec, text, found, declared, knob, kinds, where, spec_text, warnings)
        if isinstance(got, source.Flag):
            flag_info[got.name] = got
            knob_types[knob.name] = got.kind
        elif isinstance(got, source.Constant):
            knob_types[knob.name] = source.kind_of(got.value)
    for w in warnings:
        print(w, file=sys.stderr)
    return replace(spec, flag_info=flag_info, knob_types=knob_types, warnings=tuple(warnings))


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
                raise _fail(r, spec_text, where, f"{path}:{e.line}: {e.message}") from None
            literal = sorted(n for n, b in found.items() if len(b) == 1 and b[0].literal and n.isupper())
            message = f"{path} has no module-level constant {name} (its constants: {', '.join(literal) or 'none'})"
            raise _fail(r, spec_text, where, message) from None
