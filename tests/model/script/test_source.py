"""A script's constants read from its AST and rewritten literal by literal (model.script.source)."""

from __future__ import annotations

import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from model.script import source

SCRIPT = '''"""A script."""
import os

DEPTH = 4  # layers
LR: float = -0.5
NAME = "ünïcode"; WARMDOWN = 0
FLAG = True
TWICE = 1
TWICE = 2
COMPUTED = 2 * DEPTH
A = B = 3


def f():
    DEPTH = 99  # not module level
    return DEPTH
'''


def test_module_level_literals_are_found_with_their_lines():
    found = source.constants(SCRIPT)
    assert [(c.line, c.value, c.literal) for c in found["DEPTH"]] == [(4, 4, True)]
    assert found["LR"][0].value == -0.5 and found["NAME"][0].value == "ünïcode" and found["WARMDOWN"][0].line == 6
    assert [c.line for c in found["TWICE"]] == [8, 9]
    assert not found["COMPUTED"][0].literal and not found["A"][0].literal


@pytest.mark.parametrize(("name", "kinds", "line", "words"), [
    ("MISSING", {"int"}, 0, "no module-level constant MISSING"),
    ("TWICE", {"int"}, 9, "assigned 2 times at module level (lines 8, 9)"),
    ("COMPUTED", {"int"}, 10, "COMPUTED is not a literal"),
    ("DEPTH", {"str"}, 4, "DEPTH = 4 is a int literal; the spec sets it to a str"),
    ("FLAG", {"int"}, 7, "is a bool literal"),
])
def test_a_constant_that_cannot_be_set_says_its_line_and_name(name, kinds, line, words):
    with pytest.raises(source.ScriptError) as e:
        source.check(source.constants(SCRIPT), name, kinds)
    assert (e.value.name, e.value.line) == (name, line) and words in str(e.value)


def test_a_float_may_replace_an_integer_literal_but_not_the_reverse():
    found = source.constants(SCRIPT)
    assert source.check(found, "WARMDOWN", {"float"}).value == 0
    with pytest.raises(source.ScriptError):
        source.check(found, "LR", {"int"})


def test_rewrite_changes_the_literals_and_nothing_else():
    out = source.rewrite(SCRIPT, {"DEPTH": 6, "LR": 0.25, "NAME": "x", "WARMDOWN": 0.3, "FLAG": False})
    assert out == (SCRIPT.replace("DEPTH = 4", "DEPTH = 6").replace("LR: float = -0.5", "LR: float = 0.25")
                   .replace('NAME = "ünïcode"; WARMDOWN = 0', "NAME = 'x'; WARMDOWN = 0.3")
                   .replace("FLAG = True", "FLAG = False"))
    with pytest.raises(ValueError, match="no literal"):
        source.rewrite(SCRIPT, {"LR": float("nan")})


_names = hs.lists(hs.text(string.ascii_uppercase, min_size=1, max_size=6), min_size=1, max_size=5, unique=True)
_values = hs.one_of(hs.integers(-10**12, 10**12), hs.floats(allow_nan=False, allow_infinity=False),
                    hs.text(max_size=20), hs.booleans())


@settings(max_examples=150, deadline=None)
@given(names=_names, data=hs.data())
def test_rewrite_round_trips_any_literal_and_keeps_every_other_byte(names, data):
    old = {n: data.draw(_values) for n in names}
    new = {n: data.draw(hs.sampled_from([type(v)]).flatmap(lambda t: {int: hs.integers(-10**12, 10**12),
           float: hs.floats(allow_nan=False, allow_infinity=False), str: hs.text(max_size=20),
           bool: hs.booleans()}[t])) for n, v in old.items()}
    comment = data.draw(hs.text(alphabet=hs.characters(blacklist_categories=("Cs", "Cc")), max_size=20))
    text = "".join(f"{n} = {v!r}  # {comment}\n" for n, v in old.items()) + "def g():\n    return 1\n"
    out = source.rewrite(text, new)
    assert {n: source.constants(out)[n][0].value for n in names} == new
    expected = "".join(f"{n} = {v!r}  # {comment}\n" for n, v in new.items()) + "def g():\n    return 1\n"
    assert out == expected
