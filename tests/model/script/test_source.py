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


def test_an_integer_may_replace_a_float_literal_but_a_float_never_an_integer_one():
    found = source.constants(SCRIPT)
    assert source.check(found, "LR", {"int"}).value == -0.5
    # A float range for an integer constant would crash every trial (the script indexes or sizes with it).
    with pytest.raises(source.ScriptError, match=r"WARMDOWN = 0 is a int literal; the spec sets it to a float "
                                                 r"\(an integer constant takes an int range or int choices\)"):
        source.check(found, "WARMDOWN", {"float"})
    # Written as a float, so the constant keeps its type.
    assert "LR: float = 2.0\n" in source.rewrite(SCRIPT, {"LR": 2})


def test_rewrite_changes_the_literals_and_nothing_else():
    out = source.rewrite(SCRIPT, {"DEPTH": 6, "LR": 0.25, "NAME": "x", "WARMDOWN": 3, "FLAG": False})
    assert out == (SCRIPT.replace("DEPTH = 4", "DEPTH = 6").replace("LR: float = -0.5", "LR: float = 0.25")
                   .replace('NAME = "ünïcode"; WARMDOWN = 0', "NAME = 'x'; WARMDOWN = 3")
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


# -- flags, the environment, the kit's names (a kit-style script of our own) --------------------------------

KIT_SCRIPT = '''"""A kit-style script."""
import argparse
import os

import prepare
from prepare import TRAIN_TIME_BUDGET_SECONDS, ensure_tokenizer

SEQ_LEN = 256
MAX_TRAIN_SECONDS = TRAIN_TIME_BUDGET_SECONDS


def build_parser():
    p = argparse.ArgumentParser(description="a baseline")
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("-m", "--matrix-lr", type=float, default=0.02, help="Muon's lr")
    p.add_argument("--max-train-seconds", type=int,
                   default=int(os.environ.get("NEURON_COMPETITION_R1_MAX_TRAIN_SECONDS", MAX_TRAIN_SECONDS)))
    p.add_argument("--seed", type=int, default=int(os.environ.get("NEURON_COMPETITION_R1_SEED", "42")))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction,
                   default=os.environ.get("NEURON_COMPETITION_R1_COMPILE", "1") != "0")
    p.add_argument("--nki", action="store_true")
    p.add_argument("--tag", default=f"run{SEQ_LEN}")
    p.add_argument("--bad-bool", type=bool, default=False)

    def knob(flag, default, cast, text):
        env = "NEURON_COMPETITION_R1_" + flag.lstrip("-").replace("-", "_").upper()
        p.add_argument(flag, type=cast, default=cast(os.environ.get(env, default)), help=text)

    knob("--seq-len", SEQ_LEN, int, "context")
    knob("--pack-factor", 4, int, "rows per micro-batch")
    return p


def main():
    args = build_parser().parse_args()
    tok = prepare.make_dataloader
    return args, tok, ensure_tokenizer
'''


def _line(needle: str) -> int:
    """The 1-based line of KIT_SCRIPT where ``needle`` first appears."""
    return KIT_SCRIPT[:KIT_SCRIPT.index(needle)].count("\n") + 1


def test_flags_are_found_in_add_argument_calls_and_in_a_helper_that_builds_them():
    found = source.flags(KIT_SCRIPT)
    assert set(found) == {"--depth", "--matrix-lr", "--max-train-seconds", "--seed", "--compile", "--nki", "--tag",
                          "--bad-bool", "--seq-len", "--pack-factor"}
    depth, lr, seq = found["--depth"], found["--matrix-lr"], found["--seq-len"]
    literal = KIT_SCRIPT.encode()[depth.start:depth.end]
    assert (depth.line, depth.kind, depth.value, literal) == (_line('"--depth"'), "int", 4, b"4")
    assert (lr.kind, lr.value) == ("float", 0.02)
    # The helper passes its parameters on by name: (flag, default, cast, text), not (flag, type, default).
    assert (seq.helper, seq.kind, seq.constant, seq.line) == ("knob", "int", "SEQ_LEN", _line('knob("--seq-len"'))
    assert (found["--pack-factor"].kind, found["--pack-factor"].value) == ("int", 4)
    budget = found["--max-train-seconds"]
    assert (budget.constant, budget.env) == ("MAX_TRAIN_SECONDS", "NEURON_COMPETITION_R1_MAX_TRAIN_SECONDS")
    assert (found["--seed"].kind, found["--seed"].value) == ("int", "42")  # the text the script casts
    compile_ = found["--compile"]
    assert (compile_.kind, compile_.boolean, compile_.negated, compile_.value) == ("bool", True, ("!=", "0"), "1")
    assert (found["--nki"].kind, found["--nki"].boolean, found["--nki"].action) == ("bool", False, "store_true")
    assert found["--tag"].start == -1 and found["--tag"].constant is None  # an f-string: nothing to bake


@pytest.mark.parametrize(("name", "kinds", "at", "words"), [
    ("--layers", {"int"}, None, "no flag --layers is declared by an add_argument call (its flags: --bad-bool, "
                             "--compile, --depth, --matrix-lr"),
    ("--depth", {"float"}, '"--depth"', "--depth is type=int; the spec gives it float values"),
    ("--depth", {"bool"}, '"--depth"', "--depth is not a boolean flag (type=int); the spec gives it bool values"),
    ("--compile", {"int"}, '"--compile"', "--compile is a boolean flag (--x/--no-x); the spec gives it int values"),
    ("--seq-len", {"float", "int"}, 'knob("--seq-len"', "--seq-len is type=int; the spec gives it float values"),
    ("--bad-bool", {"bool"}, '"--bad-bool"', "type=bool, which turns any text but '' into True"),
])
def test_a_flag_that_cannot_take_the_values_says_its_line_and_why(name, kinds, at, words):
    with pytest.raises(source.ScriptError) as e:
        source.check_flag(source.flags(KIT_SCRIPT), name, kinds)
    assert (e.value.name, e.value.line) == (name, _line(at) if at else 0) and words in str(e.value), str(e.value)


def test_flags_take_the_values_their_type_does():
    found = source.flags(KIT_SCRIPT)
    assert source.check_flag(found, "--matrix-lr", {"int", "float"}).name == "--matrix-lr"
    assert source.check_flag(found, "--compile", {"bool"}).boolean
    assert source.check_flag(found, "--tag", {"str", "int"}).kind is None


def test_baking_flag_defaults_diff_holds_only_the_swept_literals():
    values = {"--depth": 6, "--matrix-lr": 0.035, "--seq-len": 512, "--pack-factor": 8, "--seed": 7,
              "--compile": False, "--nki": True}
    base = KIT_SCRIPT.replace('p.add_argument("--nki", action="store_true")',
                              'p.add_argument("--nki", action="store_true", default=False)')
    out = source.rewrite_flag_defaults(base, values)
    expected = (base.replace("SEQ_LEN = 256", "SEQ_LEN = 512")
                .replace('"--depth", type=int, default=4', '"--depth", type=int, default=6')
                .replace("default=0.02", "default=0.035")
                .replace('"NEURON_COMPETITION_R1_SEED", "42"', "\"NEURON_COMPETITION_R1_SEED\", '7'")
                .replace('"NEURON_COMPETITION_R1_COMPILE", "1"', "\"NEURON_COMPETITION_R1_COMPILE\", '0'")
                .replace('action="store_true", default=False', 'action="store_true", default=True')
                .replace('knob("--pack-factor", 4,', 'knob("--pack-factor", 8,'))
    assert out == expected  # byte for byte: every other byte of the script is as it was
    found = source.flags(out)
    assert found["--depth"].value == 6 and found["--matrix-lr"].value == 0.035 and found["--nki"].value is True
    assert source.constants(out)["SEQ_LEN"][0].value == 512 and found["--pack-factor"].value == 8
    # The fallback the script compares with "0" now says off; set back on, it says "1" again.
    assert found["--compile"].value == "0"
    assert source.flags(source.rewrite_flag_defaults(out, {"--compile": True}))["--compile"].value == "1"


@pytest.mark.parametrize(("values", "words"), [
    ({"--tag": "x"}, "the default of --tag is neither a literal nor a module constant; it cannot be baked"),
    ({"--max-train-seconds": 1700}, "MAX_TRAIN_SECONDS is not a literal"),
    ({"--depth": 2.5}, "--depth is type=int; the spec gives it float values"),
    ({"--nki": True}, "the default of --nki is neither a literal nor a module constant"),
])
def test_a_flag_default_that_cannot_be_baked_is_refused(values, words):
    with pytest.raises(source.ScriptError, match=words.replace("(", r"\(").replace(")", r"\)")):
        source.rewrite_flag_defaults(KIT_SCRIPT, values)


def test_an_environment_variable_is_named_literally_or_by_a_helper_that_builds_it():
    assert source.names_env(KIT_SCRIPT, "NEURON_COMPETITION_R1_SEED")  # literally
    assert source.names_env(KIT_SCRIPT, "NEURON_COMPETITION_R1_PACK_FACTOR")  # prefix + a helper's flag
    assert source.names_env(KIT_SCRIPT, "NEURON_COMPETITION_R1_DEPTH")  # prefix + any declared flag
    assert not source.names_env(KIT_SCRIPT, "NEURON_COMPETITION_R1_WIDTH")  # no --width flag
    assert not source.names_env(KIT_SCRIPT, "FF_DEPTH")
    assert not source.names_env(KIT_SCRIPT.replace('"NEURON_COMPETITION_R1_" + flag', "flag"),
                                "NEURON_COMPETITION_R1_PACK_FACTOR")


def test_the_names_taken_from_prepare_are_imported_ones_and_attribute_uses():
    assert source.prepare_imports(KIT_SCRIPT) == {"TRAIN_TIME_BUDGET_SECONDS", "ensure_tokenizer", "make_dataloader"}
    assert source.prepare_imports("import prepare as kit\nx = kit.TIME_BUDGET\nfrom other import Tokenizer\n") == {
        "TIME_BUDGET"}
    assert source.prepare_imports("from .prepare import Tokenizer\n") == set()  # a package's own module


ENV_READER_SCRIPT = '''import argparse
import os

PREFIX = "TEAM_"
P = argparse.ArgumentParser()


def from_env(flag, cast, default):
    raw = os.environ.get(PREFIX + flag.lstrip("-").upper().replace("-", "_"))
    return default if raw is None else cast(raw)


def hp(flag, cast, default):
    P.add_argument(flag, type=cast, default=from_env(flag, cast, default))


P.add_argument("--steps", type=int, default=from_env("--steps", int, 100))
hp("--seed", int, 42)
'''


def test_a_default_read_through_the_scripts_own_environment_function_is_baked_at_its_fallback():
    found = source.flags(ENV_READER_SCRIPT)
    assert (found["--steps"].value, found["--seed"].value) == (100, 42)
    out = source.rewrite_flag_defaults(ENV_READER_SCRIPT, {"--steps": 250, "--seed": 3})
    assert out == ENV_READER_SCRIPT.replace('int, 100)', 'int, 250)').replace('hp("--seed", int, 42)',
                                                                             'hp("--seed", int, 3)')
    # The prefix is a module constant here: TEAM_<FLAG> is named for each declared flag.
    assert source.names_env(ENV_READER_SCRIPT, "TEAM_STEPS") and not source.names_env(ENV_READER_SCRIPT, "TEAM_LR")
