"""The expression language and the search space: safe, conditional, constrained, validated."""

from __future__ import annotations

import random

import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from sweep.spec import expr
from sweep.spec.space import ConstraintViolation, Param, SearchSpace, SpaceError


def test_expressions_evaluate_arithmetic_and_logic():
    env = {"a": 6, "b": 4, "flag": True}
    cases = {
        "a + b * 2 - 1": 13, "a / b": 1.5, "a // b": 1, "a % b": 2, "2 ** 10": 1024, "-a": -6,
        "max(a, b) + min(a, b)": 10, "a > b and not flag": False, "a if flag else b": 6,
        "a in (1, 6)": True, "1 < b < a": True, "gpt_params(10, 640, 8192)": 12 * 10 * 640**2 + 2 * 8192 * 640,
        "ceil(a / b) + floor(a / b)": 3, "log2(b)": 2.0,
    }
    for source, want in cases.items():
        assert expr.parse(source)(env) == want, source
    assert expr.parse("a + b * c").names == {"a", "b", "c"}


@pytest.mark.parametrize("source", [
    "__import__('os')", "a.b", "a[0]", "open('x')", "lambda: 1", "[x for x in a]", "f'{a}'",
    "a := 1", "(1).__class__", "exec('1')", "max(a, key=b)", "",
])
def test_expressions_reject_everything_else(source):
    with pytest.raises(expr.ExprError):
        expr.parse(source)


def test_expressions_fail_cleanly_at_runtime():
    with pytest.raises(expr.ExprError, match="not defined"):
        expr.parse("a + 1")({})
    with pytest.raises(expr.ExprError, match="ZeroDivisionError"):
        expr.parse("a / 0")({"a": 1})
    with pytest.raises(expr.ExprError, match="exponent"):
        expr.parse("2 ** 10 ** 10")({})


def _space() -> SearchSpace:
    P = Param
    return SearchSpace.build(
        [
            P("depth", "int", low=1, high=4),
            P("model_dim", "int", low=32, high=128, step=32),
            P("lr", "float", low=1e-3, high=1e-1, log=True),
            P("_gqa", "categorical", choices=(False, True)),
            P("n_kv_head", "categorical", choices=(1, 2), when=expr.parse("_gqa")),
        ],
        derived=[("n_head", expr.parse("model_dim // head_dim")), ("_p", expr.parse("depth * model_dim ** 2"))],
        constraints=[("heads", expr.parse("n_head % n_kv_head == 0 if _gqa else True")),
                     ("cap", expr.parse("_p <= 3 * 96 ** 2"))],
        fixed={"head_dim": 32},
    )


def test_suggest_respects_conditions_and_constraints():
    space = _space()
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    ok = rejected = 0
    for _ in range(60):
        trial = study.ask()
        try:
            point = space.suggest(trial)
        except ConstraintViolation as cv:
            assert cv.name in ("heads", "cap")
            rejected += 1
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        ok += 1
        assert ("n_kv_head" in point) == point["_gqa"]
        assert point["depth"] * point["model_dim"] ** 2 <= 3 * 96**2
        config = space.trainer_config(point)
        assert config["n_head"] == point["model_dim"] // 32 and "_gqa" not in config and "_p" not in config
        study.tell(trial, 1.0)
    assert ok and rejected


def test_validate_ad_hoc_params():
    space = _space()
    good = {"depth": 2, "model_dim": 64.0, "lr": 0.01, "_gqa": True, "n_kv_head": 2}
    assert space.validate(good) == {**good, "model_dim": 64}
    bad = {
        "unknown": ({**good, "width": 3}, "width"),
        "missing": ({k: v for k, v in good.items() if k != "lr"}, "lr"),
        "off grid": ({**good, "model_dim": 48}, "model_dim"),
        "out of range": ({**good, "lr": 0.5}, "lr"),
        "not a choice": ({**good, "n_kv_head": 3}, "n_kv_head"),
        "inactive conditional": ({**good, "_gqa": False}, "n_kv_head"),
        "fixed": ({**good, "head_dim": 32}, "head_dim"),
        "constraint": ({**good, "depth": 4, "model_dim": 128}, "constraints.cap"),
    }
    for case, (params, key) in bad.items():
        with pytest.raises(SpaceError) as e:
            space.validate(params)
        assert e.value.key == key, case


def test_build_rejects_bad_references():
    with pytest.raises(SpaceError, match="unknown name"):
        SearchSpace.build([Param("a", "int", low=1, high=2)], derived=[("b", expr.parse("c + 1"))])
    with pytest.raises(SpaceError, match="cycle"):
        SearchSpace.build([Param("a", "int", low=1, high=2, when=expr.parse("b > 1")),
                           Param("b", "int", low=1, high=2, when=expr.parse("a > 1"))])
    with pytest.raises(SpaceError, match="already defined"):
        SearchSpace.build([Param("a", "int", low=1, high=2)], fixed={"a": 1})


@settings(max_examples=200, deadline=None)
@given(seed=hs.integers(0, 2**32 - 1))
def test_random_points_are_valid_points(seed):
    """Every sampled point lies on the grid and, when feasible, passes validation unchanged."""
    space = _space()
    point = space.sample(random.Random(seed))
    for p in space.params:
        if p.name in point:
            assert p.check(point[p.name]) is None
    if space.complete(point)[1] is None:
        assert space.validate(point) == point
    else:
        with pytest.raises(SpaceError):
            space.validate(point)


@settings(max_examples=100, deadline=None)
@given(low=hs.integers(-50, 50), span=hs.integers(0, 40), step=hs.integers(1, 7))
def test_int_grid_sampling(low, span, step):
    high = low + span - span % step
    p = Param("x", "int", low=low, high=high, step=step)
    rng = random.Random(low * 1000 + span)
    for _ in range(10):
        v = p.sample(rng)
        assert low <= v <= high and (v - low) % step == 0 and p.check(v) is None
