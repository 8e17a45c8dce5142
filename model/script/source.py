"""A competition script's module-level constants, read and rewritten from its source, never executed.

Torch-free (the sweep's spec validation and export use it, rank 1 of docs/design.md). A constant is a
top-level ``NAME = literal`` (or ``NAME: type = literal``): a number (a leading sign allowed), a string,
a boolean or None. A name that the module's top level assigns more than once, or assigns something
else, cannot be set from outside and is refused with the line it is on. Rewriting replaces the literals'
own bytes and nothing else, so the rest of the file stays byte-identical.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Constant", "ScriptError", "check", "constants", "kind_of", "rewrite"]


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
    """A value of ``kind`` may replace a literal of ``literal_kind`` (an integer literal takes a float)."""
    return kind == literal_kind or (kind == "float" and literal_kind == "int")


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
        raise ScriptError(name, b.line, f"{name} = {b.value!r} is a {have} literal; the spec sets it to a "
                                        f"{' or '.join(wrong)}")
    return b


def _source(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r} has no literal")
    if kind_of(value) not in ("bool", "int", "float", "str", "none"):
        raise ValueError(f"{value!r} ({type(value).__name__}) has no literal")
    return repr(value)


def rewrite(text: str, values: Mapping[str, Any]) -> str:
    """``text`` with each named constant's literal replaced by the value's; every other byte unchanged."""
    found = constants(text)
    data = text.encode("utf-8")
    edits = [(check(found, name, {kind_of(v)}), _source(v)) for name, v in values.items()]
    edits.sort(key=lambda e: e[0].start)
    out, pos = [], 0
    for const, src in edits:
        out += [data[pos:const.start], src.encode("utf-8")]
        pos = const.end
    out.append(data[pos:])
    return b"".join(out).decode("utf-8")
