"""A tiny, safe expression language for derived parameters, conditions and constraints.

Spec files are data, so their expressions are parsed with :mod:`ast` and walked by hand over a
whitelist of nodes: arithmetic, comparisons, boolean logic, ``a if c else b`` and a few pure
functions. Nothing is ever passed to :func:`eval`, attribute access and subscripts do not parse,
and exponents are bounded so a spec cannot hang the loader.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from model import counts
from model.config import GPTConfig


class ExprError(ValueError):
    """An expression that does not parse, uses something outside the whitelist, or fails to evaluate."""


def gpt_params(depth: Any, model_dim: Any, vocab_size: Any, mlp_ratio: Any = GPTConfig.mlp_ratio,
               head_dim: Any = 0, n_kv_head: Any = GPTConfig.n_kv_head, value_embeds: Any = False,
               residual_scalars: Any = False, ve_gate_channels: Any = GPTConfig.ve_gate_channels, smear: Any = False,
               backout: Any = False) -> Any:
    """The exact parameter count of the trainer's GPT of this shape (model.counts), without torch.

    Positional only in expressions; omitted shape arguments take the trainer's defaults (model.config.GPTConfig),
    the recipe's extras are off unless given (value_embeds, residual_scalars, smear, backout: the plain GPT's
    count; the trainer's defaults turn the first two on, docs/recipe.md), the gate width at its default.
    head_dim 0 (the default) stands for any head size that divides model_dim: with a K/V head per query
    head (n_kv_head 0) and no value embeddings the count does not depend on it; n_kv_head > 0 and
    value_embeds need it. With mlp_ratio 4 and the defaults this is 12·depth·d² + 2·vocab·d (59.6M for the
    competition baseline at depth 10, width 640). Derived values are evaluated before constraints, so a
    shape the trainer would refuse (model_dim not a multiple of head_dim, say) still gets the same
    arithmetic's number, never an error, for a constraint to reject; non-finite arguments give nan.
    """
    if not head_dim and (n_kv_head or value_embeds):
        raise ValueError("gpt_params: n_kv_head and value_embeds need head_dim (the fifth argument)")
    shape = (depth, model_dim, vocab_size, mlp_ratio, head_dim, n_kv_head)
    if any(isinstance(v, float) and not math.isfinite(v) for v in shape):
        return math.nan
    if not head_dim:  # one head of the full width: the same count as any head_dim that divides it
        head_dim = model_dim if model_dim > 0 else GPTConfig.head_dim
    cfg = GPTConfig(vocab_size=vocab_size, depth=depth, model_dim=model_dim, head_dim=head_dim, n_kv_head=n_kv_head,
                    mlp_ratio=mlp_ratio, value_embeds=bool(value_embeds), residual_scalars=bool(residual_scalars),
                    ve_gate_channels=ve_gate_channels, smear=bool(smear), backout=bool(backout),
                    check=False)
    return counts.num_params(cfg)


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "min": min,
    "max": max,
    "abs": abs,
    "round": round,
    "int": int,
    "float": float,
    "floor": math.floor,
    "ceil": math.ceil,
    "sqrt": math.sqrt,
    "log": math.log,
    "log2": math.log2,
    "gpt_params": gpt_params,
}

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_COMPARE: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_MAX_EXPONENT = 64
_MAX_SOURCE = 1000
_MAX_INT_BITS = 4096  # a power's result; ((9**64)**64)**64 has a million digits
_MAX_SEQUENCE = 10_000  # a repeated string or tuple ("x" * 10**18 would exhaust memory)


@dataclass(frozen=True)
class Expr:
    """A parsed expression; ``names`` are the variables it reads (functions excluded)."""

    source: str
    names: frozenset[str] = field(compare=False)
    _tree: ast.Expression = field(compare=False, repr=False)

    def __call__(self, env: Mapping[str, Any]) -> Any:
        try:
            return _eval(self._tree.body, env)
        except ExprError:
            raise
        except (ArithmeticError, TypeError, ValueError, RecursionError, MemoryError) as e:
            raise ExprError(f"{self.source!r}: {type(e).__name__}: {e}") from None


def parse(source: str) -> Expr:
    """Parse ``source`` into an :class:`Expr`, rejecting anything outside the whitelist."""
    if not isinstance(source, str) or not source.strip():
        raise ExprError("expression must be a non-empty string")
    if len(source) > _MAX_SOURCE:
        raise ExprError(f"expression longer than {_MAX_SOURCE} characters")
    try:
        tree = ast.parse(source.strip(), mode="eval")
        names: set[str] = set()
        _check(tree.body, source, names)
    except SyntaxError as e:
        raise ExprError(f"{source!r}: syntax error: {e.msg}") from None
    except (RecursionError, MemoryError):
        raise ExprError(f"{source!r}: nested too deeply") from None
    return Expr(source.strip(), frozenset(names), tree)


def _check(node: ast.AST, source: str, names: set[str]) -> None:
    """Validate the tree once at parse time so evaluation can trust its shape."""
    if isinstance(node, ast.Constant):
        if not isinstance(node.value, (int, float, str, bool)) and node.value is not None:
            raise ExprError(f"{source!r}: constant {node.value!r} not allowed")
    elif isinstance(node, ast.Name):
        if node.id in FUNCTIONS:
            raise ExprError(f"{source!r}: function {node.id!r} used as a value")
        names.add(node.id)
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        _check(node.left, source, names)
        _check(node.right, source, names)
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        _check(node.operand, source, names)
    elif isinstance(node, ast.BoolOp):
        for v in node.values:
            _check(v, source, names)
    elif isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        _check(node.left, source, names)
        for c in node.comparators:
            _check(c, source, names)
    elif isinstance(node, ast.IfExp):
        for part in (node.test, node.body, node.orelse):
            _check(part, source, names)
    elif isinstance(node, (ast.Tuple, ast.List)):
        for e in node.elts:
            _check(e, source, names)
    elif isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            func = ast.unparse(node.func)
            raise ExprError(f"{source!r}: unknown function {func!r} (allowed: {', '.join(sorted(FUNCTIONS))})")
        if node.keywords:
            raise ExprError(f"{source!r}: keyword arguments not allowed")
        for a in node.args:
            _check(a, source, names)
    else:
        raise ExprError(f"{source!r}: {type(node).__name__} not allowed in expressions")


def _check_size(op: ast.operator, left: Any, right: Any) -> None:
    """Refuse results that would take the loader's memory or time: huge powers, huge repetitions."""
    if isinstance(op, ast.Pow) and type(left) is int and type(right) is int and right > 0:
        if left.bit_length() * right > _MAX_INT_BITS:
            raise ExprError(f"a power larger than 2**{_MAX_INT_BITS}")
    elif isinstance(op, ast.Mult):
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, tuple)) and isinstance(n, int) and len(seq) * n > _MAX_SEQUENCE:
                raise ExprError(f"a repetition longer than {_MAX_SEQUENCE}")


def _eval(node: ast.AST, env: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ExprError(f"name {node.id!r} is not defined here")
        return env[node.id]
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, env), _eval(node.right, env)
        if isinstance(node.op, ast.Pow) and isinstance(right, (int, float)) and abs(right) > _MAX_EXPONENT:
            raise ExprError(f"exponent {right} larger than {_MAX_EXPONENT}")
        _check_size(node.op, left, right)
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_eval(node.operand, env))
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            result: Any = True
            for v in node.values:
                result = _eval(v, env)
                if not result:
                    return result
            return result
        result = False
        for v in node.values:
            result = _eval(v, env)
            if result:
                return result
        return result
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env)
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = _eval(comp, env)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return _eval(node.body, env) if _eval(node.test, env) else _eval(node.orelse, env)
    if isinstance(node, (ast.Tuple, ast.List)):
        return tuple(_eval(e, env) for e in node.elts)
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name)
        return FUNCTIONS[node.func.id](*(_eval(a, env) for a in node.args))
    raise ExprError(f"{type(node).__name__} not allowed")  # unreachable after _check
