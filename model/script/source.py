"""A competition script's knobs (module-level constants, argparse flags, environment variables), read and
rewritten from its source, never executed.

Torch-free (the sweep's spec validation and export use it, rank 1 of docs/design.md). A constant is a
top-level ``NAME = literal`` (or ``NAME: type = literal``): a number (a leading sign allowed), a string,
a boolean or None. A name that the module's top level assigns more than once, or assigns something
else, cannot be set from outside and is refused with the line it is on. Rewriting replaces the literals'
own bytes and nothing else, so the rest of the file stays byte-identical.

A flag is what an ``add_argument("--x", ...)`` call declares, or a call ``helper("--x", ...)`` of a function
whose body calls ``add_argument`` with one of its parameters (a team's flag-building helper). Its default is
baked by rewriting the literal it falls back to, seen through the wrappers teams put around it
(``int(...)``, ``os.environ.get(VAR, fallback)``, ``os.environ.get(VAR, "1") != "0"``), or the module
constant it names.

Long file: the script's three kinds of knob are read and rewritten by one set of byte-offset helpers, and a
spec check and an export each use all of them together.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Constant", "Flag", "ScriptError", "check", "check_flag", "constants", "flags", "kind_of", "names_env",
           "prepare_imports", "rewrite", "rewrite_flag_defaults"]


class ScriptError(ValueError):
    """A constant that cannot be set; ``line`` (1-based, 0 when the name is absent) and ``name`` say where."""

    def __init__(self, name: str, line: int, message: str) -> None:
        super().__init__(message)
        self.name, self.line, self.message = name, line, message


@dataclass(frozen=True)
class Constant:
    """One assignment of a name at the module's top level; ``value`` is set only for a literal."""

    name: str
    line: int
    start: int  # byte offsets of the literal in the UTF-8 source; -1 when the value is no literal
    end: int
    value: Any = None
    literal: bool = False


def kind_of(value: Any) -> str:
    """The literal kinds a constant can have: bool, int, float, str, none (bool before int: True is an int)."""
    for kind, t in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if isinstance(value, t):
            return kind
    return "none" if value is None else type(value).__name__


def _literal(node: ast.expr) -> tuple[bool, Any]:
    if isinstance(node, ast.Constant) and kind_of(node.value) in ("bool", "int", "float", "str", "none"):
        return True, node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant) and kind_of(node.operand.value) in ("int", "float")):
        v = node.operand.value
        return True, -v if isinstance(node.op, ast.USub) else v
    return False, None


def _line_offsets(data: bytes) -> list[int]:
    """Byte offset of the start of each line (1-based lines: offsets[line - 1])."""
    offsets, pos = [0], 0
    for line in data.splitlines(keepends=True):
        pos += len(line)
        offsets.append(pos)
    return offsets


def constants(text: str) -> dict[str, list[Constant]]:
    """Every name the module's top level binds, with each binding (a SyntaxError propagates)."""
    data = text.encode("utf-8")
    offsets = _line_offsets(data)
    out: dict[str, list[Constant]] = {}
    for node in ast.parse(data).body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        names = [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        simple = len(targets) == 1 and isinstance(targets[0], ast.Name) and value is not None
        for n in names:
            const = Constant(n.id, node.lineno, -1, -1)
            if simple:
                ok, v = _literal(value)
                if ok:
                    start = offsets[value.lineno - 1] + value.col_offset
                    end = offsets[value.end_lineno - 1] + value.end_col_offset  # type: ignore[operator]
                    const = Constant(n.id, node.lineno, start, end, v, True)
            out.setdefault(n.id, []).append(const)
    return out


def _fits(kind: str, literal_kind: str) -> bool:
    """A value of ``kind`` may replace a literal of ``literal_kind``: a float literal takes an integer (written
    as a float); an integer literal never takes a float (the script would get 2.5 where it indexes or sizes)."""
    return kind == literal_kind or (kind == "int" and literal_kind == "float")


def check(found: Mapping[str, list[Constant]], name: str, kinds: set[str]) -> Constant:
    """The one literal binding ``name`` whose kind takes every kind in ``kinds``; else ScriptError."""
    bindings = found.get(name, [])
    if not bindings:
        raise ScriptError(name, 0, f"no module-level constant {name}")
    if len(bindings) > 1:
        lines = ", ".join(str(b.line) for b in bindings)
        raise ScriptError(name, bindings[1].line, f"{name} is assigned {len(bindings)} times at module level "
                                                  f"(lines {lines}); a searched constant is assigned once")
    b = bindings[0]
    if not b.literal:
        raise ScriptError(name, b.line, f"{name} is not a literal (a number, string or boolean)")
    have = kind_of(b.value)
    wrong = sorted(k for k in kinds if not _fits(k, have))
    if wrong:
        int_only = have == "int" and wrong == ["float"]
        hint = " (an integer constant takes an int range or int choices)" if int_only else ""
        raise ScriptError(name, b.line, f"{name} = {b.value!r} is a {have} literal; the spec sets it to a "
                                        f"{' or '.join(wrong)}{hint}")
    return b


def _source(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} has no literal")
    if kind_of(value) not in ("bool", "int", "float", "str", "none"):
        raise ValueError(f"{value!r} ({type(value).__name__}) has no literal")
    return repr(value)


def _source_for(value: Any, literal: Any) -> str:
    """The source of ``value`` where a literal like ``literal`` stood: an integer in a float's place is
    written as a float, so the script's constant keeps its type."""
    if kind_of(literal) == "float" and kind_of(value) == "int":
        return _source(float(value))
    return _source(value)


def _splice(data: bytes, edits: list[tuple[int, int, str]]) -> str:
    """``data`` with each (start, end) byte span replaced by its text; the spans must not overlap."""
    out, pos = [], 0
    for start, end, src in sorted(edits):
        if start < pos:
            raise ValueError("two rewrites of the same literal")
        out += [data[pos:start], src.encode("utf-8")]
        pos = end
    out.append(data[pos:])
    return b"".join(out).decode("utf-8")


def rewrite(text: str, values: Mapping[str, Any]) -> str:
    """``text`` with each named constant's literal replaced by the value's; every other byte unchanged."""
    found = constants(text)
    edits = []
    for name, v in values.items():
        c = check(found, name, {kind_of(v)})
        edits.append((c.start, c.end, _source_for(v, c.value)))
    return _splice(text.encode("utf-8"), edits)


# -- argparse flags ----------------------------------------------------------------------------------------

_TYPES = {"int": "int", "float": "float", "str": "str", "bool": "bool"}
_ENV_GETTERS = ("get", "getenv")  # os.environ.get(VAR, fallback), os.getenv(VAR, fallback)


@dataclass(frozen=True)
class Flag:
    """One ``--x`` flag the script declares.

    ``kind`` is int/float/str/bool, or None for an untyped flag (argparse gives it the text). ``action`` is
    "store_true", "store_false", "boolean_optional" (``argparse.BooleanOptionalAction``) or None; ``boolean``
    is True only for the last, the one flag that takes both ``--x`` and ``--no-x``. The default: ``start`` and
    ``end`` are the byte span of the literal a bake rewrites (-1 when there is none) with its ``value``;
    ``constant`` names the module constant it falls back to instead; ``negated`` is set for a default
    written ``<text> != "0"`` (or ``== "1"``): (operator, compared text), the literal being that text's
    fallback. ``env`` is the variable its default reads, when the call names it literally.
    """

    name: str
    line: int
    kind: str | None = None
    action: str | None = None
    boolean: bool = False
    start: int = -1
    end: int = -1
    value: Any = None
    constant: str | None = None
    negated: tuple[str, str] | None = None
    env: str | None = None
    helper: str | None = None  # the function that builds the flag, when it is not add_argument itself


def _call_name(node: ast.expr) -> str | None:
    """``f`` for ``f(...)`` and ``a.b.f(...)``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _flag_names(args: list[ast.expr]) -> list[str]:
    """The ``--`` names among the call's leading string-literal arguments."""
    names = []
    for a in args:
        if not (isinstance(a, ast.Constant) and isinstance(a.value, str)):
            break
        if a.value.startswith("--"):
            names.append(a.value)
    return names


def _action(node: ast.expr | None) -> str | None:
    if node is None:
        return None
    if isinstance(node, ast.Constant) and node.value in ("store_true", "store_false"):
        return node.value
    if _call_name(node) == "BooleanOptionalAction":
        return "boolean_optional"
    return "other"


def _type_name(node: ast.expr | None) -> str | None:
    return _TYPES.get(node.id) if isinstance(node, ast.Name) else None


def _is_env_get(node: ast.expr) -> bool:
    """``os.environ.get(...)``, ``environ.get(...)`` or ``os.getenv(...)``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    f = node.func
    if f.attr == "getenv":
        return True
    return f.attr == "get" and _call_name(f.value) == "environ"


class _Default:
    """What a flag's default expression bakes to, found by unwrapping casts, env look-ups and ``!= "0"``."""

    def __init__(self, node: ast.expr | None, offsets: list[int], casts: set[str],
                 fallbacks: Mapping[str, int] | None = None) -> None:
        self.span, self.value, self.constant, self.negated, self.env = (-1, -1), None, None, None, None
        self.param: str | None = None  # a helper's parameter the default comes from
        while node is not None:
            ok, v = _literal(node)
            if ok:
                end = offsets[node.end_lineno - 1] + node.end_col_offset  # type: ignore[operator]
                self.span, self.value = (offsets[node.lineno - 1] + node.col_offset, end), v
                return
            if isinstance(node, ast.Name):
                self.constant = node.id
                return
            if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.NotEq, ast.Eq)):
                right = node.comparators[0]
                if self.negated is None and isinstance(right, ast.Constant) and isinstance(right.value, str):
                    self.negated = ("!=" if isinstance(node.ops[0], ast.NotEq) else "==", right.value)
                    node = node.left
                    continue
                return
            if isinstance(node, ast.Call) and _is_env_get(node) and len(node.args) == 2:
                var = node.args[0]
                if isinstance(var, ast.Constant) and isinstance(var.value, str):
                    self.env = var.value
                node = node.args[1]
                continue
            if isinstance(node, ast.Call) and _call_name(node.func) in casts and len(node.args) == 1:
                node = node.args[0]
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (fallbacks or {}):
                at = (fallbacks or {})[node.func.id]  # a function of the script's taking a fallback, as an
                arg = node.args[at] if at < len(node.args) else _keyword(node, "default")  # env reader's
                if arg is not None:
                    node = arg
                    continue
            return


def _fallback_functions(tree: ast.Module) -> dict[str, int]:
    """The script's functions with a parameter named ``default`` (as a helper reading a flag's environment
    variable, ``_env("--seed", int, 42)``): name -> that parameter's position."""
    out = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
            if "default" in params:
                out.setdefault(fn.name, params.index("default"))
    return out


def _helpers(tree: ast.Module) -> dict[str, tuple[list[str], ast.Call]]:
    """Functions (at any depth) whose body calls add_argument with one of their own parameters as the flag:
    name -> (parameter names, that add_argument call)."""
    out: dict[str, tuple[list[str], ast.Call]] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and _call_name(node.func) == "add_argument" and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in params):
                out.setdefault(fn.name, (params, node))
    return out


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _helper_flag(name: str, call: ast.Call, helper: str, params: list[str], inner: ast.Call,
                 offsets: list[int], fallbacks: Mapping[str, int]) -> Flag:
    """A flag built by ``helper``: its type and default are the call's arguments for the parameters that the
    helper passes on as ``type=`` and (inside ``default=``) as the default; failing that, the first argument
    after the flag that names a type is the type and the first other one the default."""
    bound: dict[str, ast.expr] = dict(zip(params, call.args, strict=False))
    bound.update({k.arg: k.value for k in call.keywords if k.arg})
    type_param = _keyword(inner, "type")
    type_key = type_param.id if isinstance(type_param, ast.Name) and type_param.id in params else None
    default_expr = _keyword(inner, "default")
    default_key = None
    if default_expr is not None:
        used = {n.id for n in ast.walk(default_expr) if isinstance(n, ast.Name)}
        default_key = next((p for p in params[1:] if p in used and p != type_key), None)
    rest = [a for a in call.args[1:]]
    type_node = bound.get(type_key) if type_key else next((a for a in rest if _type_name(a)), None)
    default_node = bound.get(default_key) if default_key else next((a for a in rest if a is not type_node), None)
    kind = _type_name(type_node)
    action = _action(_keyword(inner, "action"))
    d = _Default(default_node, offsets, {"int", "float", "str", "bool"}, fallbacks)
    return Flag(name, call.lineno, kind, action, action == "boolean_optional", *d.span, d.value, d.constant,
                d.negated, d.env, helper)


def flags(text: str) -> dict[str, Flag]:
    """Every ``--x`` flag the module declares (the first declaration of each), by name; a SyntaxError
    propagates."""
    data = text.encode("utf-8")
    offsets = _line_offsets(data)
    tree = ast.parse(data)
    helpers, fallbacks = _helpers(tree), _fallback_functions(tree)
    found: dict[str, Flag] = {}
    calls = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
    for call in calls:
        fname = _call_name(call.func)
        names = _flag_names(call.args)
        if not names:
            continue
        if fname == "add_argument":
            action = _action(_keyword(call, "action"))
            kind = "bool" if action in ("store_true", "store_false", "boolean_optional") else _type_name(
                _keyword(call, "type"))
            type_node = _keyword(call, "type")
            casts = {"int", "float", "str", "bool"} | ({type_node.id} if isinstance(type_node, ast.Name) else set())
            d = _Default(_keyword(call, "default"), offsets, casts, fallbacks)
            for n in names:
                found.setdefault(n, Flag(n, call.lineno, kind, action, action == "boolean_optional", *d.span, d.value,
                                         d.constant, d.negated, d.env))
        elif isinstance(call.func, ast.Name) and fname in helpers:
            params, inner = helpers[fname]
            found.setdefault(names[0], _helper_flag(names[0], call, fname, params, inner, offsets, fallbacks))
    return found


def _flag_takes(flag: Flag, kind: str) -> bool:
    if flag.kind == "bool":
        return kind == "bool"
    if kind == "bool" or kind == "none":
        return False
    if flag.kind == "int":
        return kind == "int"
    if flag.kind == "float":
        return kind in ("int", "float")
    return True  # str or untyped: argparse hands the script the text


def check_flag(found: Mapping[str, Flag], name: str, kinds: set[str]) -> Flag:
    """The flag ``name`` if it takes values of every kind in ``kinds``; else ScriptError saying why."""
    flag = found.get(name)
    if flag is None:
        raise ScriptError(name, 0, f"no flag {name} is declared by an add_argument call (its flags: "
                                   f"{', '.join(sorted(found)) or 'none'})")
    if flag.action == "other":
        raise ScriptError(name, flag.line, f"{name} has an argparse action trnsweep cannot set a value with")
    if flag.kind == "bool" and flag.action is None:
        raise ScriptError(name, flag.line, f"{name} has type=bool, which turns any text but '' into True: give it "
                                           "action=argparse.BooleanOptionalAction to sweep it")
    wrong = sorted(k for k in kinds if not _flag_takes(flag, k))
    if wrong:
        if flag.kind == "bool":
            what = f"{name} is a boolean flag ({'--x/--no-x' if flag.boolean else flag.action})"
        elif "bool" in wrong:
            what = f"{name} is not a boolean flag (type={flag.kind or 'str'})"
        else:
            what = f"{name} is type={flag.kind}"
        raise ScriptError(name, flag.line, f"{what}; the spec gives it {' and '.join(wrong)} values")
    return flag


def _negated_text(flag: Flag, value: bool) -> str:
    """The fallback text that makes ``fallback <op> compared`` equal ``value``; the current one if it does."""
    op, compared = flag.negated  # type: ignore[misc]
    current = flag.value if isinstance(flag.value, str) else None
    if (op == "!=") != value:  # the fallback must equal the compared text
        return compared
    if current is not None and current != compared:
        return current
    return "0" if compared != "0" else "1"


def rewrite_flag_defaults(text: str, values: Mapping[str, Any]) -> str:
    """``text`` with each flag's default baked to its value (the literal it falls back to, or the module
    constant it names); every other byte unchanged. A flag whose default is neither raises ScriptError."""
    found = flags(text)
    consts = constants(text)
    edits: list[tuple[int, int, str]] = []
    baked_constants: dict[str, Any] = {}
    for name, v in values.items():
        flag = check_flag(found, name, {kind_of(v)})
        if flag.negated is not None and flag.start >= 0 and isinstance(flag.value, str) and isinstance(v, bool):
            edits.append((flag.start, flag.end, repr(_negated_text(flag, v))))
        elif flag.start >= 0 and flag.negated is None:
            if isinstance(flag.value, str) and not isinstance(v, str):
                src = repr(str(v).lower() if isinstance(v, bool) else str(v))  # a fallback the script casts
            elif not _fits(kind_of(v), kind_of(flag.value)):
                raise ScriptError(name, flag.line, f"{name} falls back to {flag.value!r}, a {kind_of(flag.value)} "
                                                   f"literal; it cannot be baked to {v!r}")
            else:
                src = _source_for(v, flag.value)
            edits.append((flag.start, flag.end, src))
        elif flag.constant is not None and flag.negated is None:
            if baked_constants.get(flag.constant, v) != v:
                raise ScriptError(name, flag.line, f"{name} and another flag both fall back to {flag.constant}, "
                                                   "with different values")
            c = check(consts, flag.constant, {kind_of(v)})
            baked_constants[flag.constant] = v
            edits.append((c.start, c.end, _source_for(v, c.value)))
        else:
            raise ScriptError(name, flag.line, f"the default of {name} is neither a literal nor a module constant; "
                                               "it cannot be baked into the script")
    return _splice(text.encode("utf-8"), list(dict.fromkeys(edits)))


# -- environment variables and the kit's names -------------------------------------------------------------

def _env_prefixes(tree: ast.Module, text: str) -> set[str]:
    """Strings ending in "_" that start a built name: ``"PREFIX_" + ...``, ``f"PREFIX_{...}"``, or a module
    constant ``PREFIX = "PREFIX_"`` so used."""
    named = {n: b[0].value for n, b in constants(text).items() if len(b) == 1 and isinstance(b[0].value, str)}
    out = set()
    for node in ast.walk(tree):
        head: ast.expr | None = None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            head = node.left
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
        if isinstance(head, ast.FormattedValue):
            head = head.value
        value = head.value if isinstance(head, ast.Constant) else named.get(head.id) if isinstance(
            head, ast.Name) else None
        if isinstance(value, str) and value.endswith("_"):
            out.add(value)
    return out


def names_env(text: str, var: str) -> bool:
    """Whether the script names the environment variable ``var``: the name appears in its text, or ``var`` is
    a built name PREFIX + FLAG, where ``"PREFIX_" + ...`` (or an f-string starting so, or a module constant
    holding "PREFIX_" so used) is in the script and
    FLAG is one of its flags upper-cased with "-" as "_" (a heuristic for a team's helper that derives each
    flag's variable, as the kit's baseline names them ``NEURON_COMPETITION_R1_<FLAG>``)."""
    if var in text:
        return True
    try:
        tree = ast.parse(text.encode("utf-8"))
    except SyntaxError:
        return False
    built = {f.lstrip("-").replace("-", "_").upper() for f in flags(text)}
    return any(var.startswith(p) and var[len(p):] in built for p in _env_prefixes(tree, text))


def prepare_imports(text: str) -> set[str]:
    """The names the script takes from a module named ``prepare``: ``from prepare import a, b`` and
    ``prepare.X`` (or ``alias.X``) after ``import prepare [as alias]``."""
    tree = ast.parse(text.encode("utf-8"))
    names, aliases = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "prepare" and not node.level:
            names.update(a.name for a in node.names if a.name != "*")
        elif isinstance(node, ast.Import):
            aliases.update(a.asname or a.name for a in node.names if a.name == "prepare")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            names.add(node.attr)
    return names
