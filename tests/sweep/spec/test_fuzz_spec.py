"""Fuzzed bad input: random and malformed study specs and trial parameters thrown at the loaders.

Every case either loads or raises the project's error with a one-line message (``SpecError`` for
specs, ``SpaceError``/``UsageError`` for ``--params``), which the CLI prints as one line and exit 2;
never another exception (a traceback), never a hang, and never a write to the store. Inputs are
derived from a valid spec by mutation (so validation is reached at every depth) and generated from
scratch (TOML text, JSON text, nested structures).

``FUZZ_EXAMPLES`` scales the number of examples (default 60 per property; CI keeps it short).
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import tempfile
import tomllib
from collections.abc import Iterator
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from sweep import cli
from sweep import store as st
from sweep.run import adhoc
from sweep.spec import SpecError, expr, load, parse
from sweep.spec.space import SpaceError
from sweep.study import UsageError
from tests.sweep_fixtures import environ, spec_toml, tiny_spec

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                       HealthCheck.data_too_large])

# A valid spec exercising every table: conditions, derived values, constraints, sampler and pruner.
BASE: dict[str, Any] = {
    **tiny_spec(),
    "trial": {"budget_s": 8, "startup_allowance_s": 20, "eval_timeout_s": 20, "eval_fractions": [0.25, 0.5],
              "heartbeat_s": 1, "stale_after_s": 8, "stop_grace_s": 5},
    "sampler": {"name": "tpe", "n_startup_trials": 2},
    "pruner": {"name": "median", "n_startup_trials": 2},
    "params.mlp_ratio": {"type": "categorical", "choices": [2, 4], "when": "depth > 1"},
    "derived": {"_params": "gpt_params(depth, model_dim, vocab_size)", "unembedding_lr": "matrix_lr / 10"},
    "constraints": {"small": "_params <= 1e7"},
}


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """{"params.depth": {...}} -> {"params": {"depth": {...}}}: the structure TOML decodes to."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if isinstance(value, dict):
            node.setdefault(leaf, {}).update(value)
        else:
            node[leaf] = value
    return out


BASE_TREE = nested(BASE)
BASE_TEXT = spec_toml(BASE)

# -- strategies ------------------------------------------------------------------------------------

scalars = hs.one_of(
    hs.none(), hs.booleans(), hs.integers(min_value=-(2**70), max_value=2**70),
    hs.floats(allow_nan=True, allow_infinity=True), hs.text(max_size=30),
    hs.sampled_from(["", "auto", "tpe", "gp", "cmaes", "random", "median", "hyperband", "none", "int", "float",
                     "categorical", "minimize", "maximize", "depth > 1", "1/0", "x ** 99", "__import__('os')",
                     "(lambda: 1)()", "depth.__class__", "model_dim % head_dim == 0", "-" * 600 + "1",
                     '"x" * 10**18', "((9**64)**64)**64", "demo", "../../etc/passwd", "/dev/zero"]),
)
values = hs.recursive(scalars, lambda inner: hs.one_of(
    hs.lists(inner, max_size=4), hs.dictionaries(hs.text(max_size=12), inner, max_size=4)), max_leaves=12)
KEYS = ["study", "trial", "sampler", "pruner", "fixed", "params", "derived", "constraints", "name", "type", "low",
        "high", "step", "log", "choices", "when", "n_trials", "budget_s", "eval_fractions", "resources", "env",
        "extends", "storage_proxy", "SWEEP_TRIAL_MEMORY_MB", "seed", "concurrency", "depth", "n_startup_trials"]


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _paths(v, (*prefix, i))


PATHS = [p for p in _paths(BASE_TREE) if p]


@hs.composite
def mutated_trees(draw: Any) -> dict[str, Any]:
    """The base spec with one to three random edits: replace, delete or add, anywhere in the tree."""
    tree = copy.deepcopy(BASE_TREE)
    for _ in range(draw(hs.integers(1, 3))):
        path = draw(hs.sampled_from(PATHS))
        parent = tree
        try:
            for k in path[:-1]:
                parent = parent[k]
        except (KeyError, IndexError, TypeError):
            continue
        leaf = path[-1]
        action = draw(hs.sampled_from(["replace", "delete", "add"]))
        with_value = draw(values)
        if isinstance(parent, dict):
            if action == "delete":
                parent.pop(leaf, None)
            elif action == "add" and isinstance(parent.get(leaf), dict):
                parent[leaf][draw(hs.sampled_from(KEYS) | hs.text(max_size=8))] = with_value
            else:
                parent[leaf] = with_value
        elif isinstance(parent, list) and isinstance(leaf, int) and leaf < len(parent):
            if action == "delete":
                del parent[leaf]
            else:
                parent[leaf] = with_value
    return tree


@hs.composite
def mutated_texts(draw: Any) -> str:
    """The base spec's TOML text with characters deleted, duplicated or inserted."""
    text = BASE_TEXT
    for _ in range(draw(hs.integers(1, 4))):
        i = draw(hs.integers(0, len(text)))
        op = draw(hs.sampled_from(["delete", "insert", "dup"]))
        if op == "delete":
            text = text[:i] + text[i + draw(hs.integers(1, 20)):]
        elif op == "insert":
            text = text[:i] + draw(hs.text(max_size=10) | hs.sampled_from(["[", "]", "=", '"', "\n", "[[x]]", "\\u"]))\
                + text[i:]
        else:
            text = text[:i] + text[max(0, i - 30):i] + text[i:]
    return text


# -- checks ----------------------------------------------------------------------------------------


def assert_one_line(e: BaseException) -> None:
    msg = str(e)
    assert msg.strip(), f"{type(e).__name__} without a message"
    assert "\n" not in msg and "\r" not in msg, f"{type(e).__name__} message spans lines: {msg!r}"
    assert "Traceback" not in msg


def load_or_error(path: Path) -> Any:
    try:
        return load(path)
    except SpecError as e:
        assert_one_line(e)
        return None


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="fuzz-spec-") as d:
        yield Path(d)


# -- properties ------------------------------------------------------------------------------------


def test_the_base_spec_loads(workdir):
    (workdir / "base.toml").write_text(BASE_TEXT)
    assert load(workdir / "base.toml").space.params


@FUZZ
@given(tree=mutated_trees())
def test_mutated_spec_structures_load_or_fail_in_one_line(tree):
    try:
        spec = parse(tree, Path("fuzz.toml"))
    except SpecError as e:
        assert_one_line(e)
        return
    # A spec that loads must be usable: its sampler asks and its space suggests (or rejects a point).
    import optuna

    from sweep.spec import build_pruner, build_sampler
    from sweep.spec.space import ConstraintViolation

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = optuna.create_study(sampler=build_sampler(spec.sampler), pruner=build_pruner(spec.pruner))
    for _ in range(2):
        trial = study.ask()
        try:
            point = spec.space.suggest(trial)
        except ConstraintViolation:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        assert spec.space.trainer_config(point)
        study.tell(trial, 1.0)


@FUZZ
@given(text=mutated_texts())
def test_mutated_spec_files_load_or_fail_in_one_line(workdir, text):
    path = workdir / "mutated.toml"
    path.write_bytes(text.encode("utf-8", "replace"))
    load_or_error(path)


@FUZZ
@given(data=hs.binary(max_size=300) | hs.text(max_size=300).map(lambda t: t.encode("utf-8", "replace")))
def test_random_bytes_as_a_spec_file_fail_in_one_line(workdir, data):
    path = workdir / "random.toml"
    path.write_bytes(data)
    load_or_error(path)


@FUZZ
@given(tree=hs.dictionaries(hs.sampled_from(KEYS) | hs.text(max_size=8), values, max_size=6))
def test_random_structures_fail_in_one_line(tree):
    try:
        parse(tree, Path("random.toml"))
    except SpecError as e:
        assert_one_line(e)


@FUZZ
@given(source=hs.text(max_size=200) | hs.sampled_from(
    ["-" * 999 + "1", "not " * 240 + "x", '"x" * 10**18', "(1,) * 10**9", "((9**64)**64)**64", "2 ** -99",
     "depth ** 0.5 ** 64", "log(0)", "sqrt(-1)", "min()", "int('9' * 999)", "1 if depth else", "a.b", "a[0]",
     "__import__('os').system('true')", "(lambda: 0)()", "[x for x in (1,)]", "f'{depth}'", "depth < 'a'"]))
def test_expressions_parse_and_evaluate_or_fail_in_one_line(source):
    try:
        e = expr.parse(source)
    except expr.ExprError as err:
        assert_one_line(err)
        return
    try:
        e({"depth": 3, "model_dim": 64, "vocab_size": 512, "x": 1.5, "a": 2})
    except expr.ExprError as err:
        assert_one_line(err)


# -- trial parameters (`sweep trial --params`) ------------------------------------------------------


@pytest.fixture(scope="module")
def base_spec(workdir) -> Any:
    path = workdir / "params.toml"
    path.write_text(BASE_TEXT)
    return load(path)


json_values = hs.recursive(
    hs.none() | hs.booleans() | hs.integers(-(2**64), 2**64) | hs.floats(allow_nan=False) | hs.text(max_size=10),
    lambda inner: hs.lists(inner, max_size=3) | hs.dictionaries(hs.text(max_size=8), inner, max_size=3),
    max_leaves=8)
param_dicts = hs.dictionaries(hs.sampled_from(["depth", "model_dim", "matrix_lr", "mlp_ratio", "unembedding_lr",
                                               "vocab_size", "_params", "seed"]) | hs.text(max_size=8),
                              json_values | hs.sampled_from([1, 2, 32, 48, 64, 0.02, 2.0, 4, math.inf, -0.0]),
                              max_size=5)
param_texts = (param_dicts.map(json.dumps) | hs.text(max_size=80)
               | hs.sampled_from(["", "{", "[]", "null", "1", '"x"', "NaN", '{"depth": NaN}', '{"depth": Infinity}',
                                  '{"depth": 1e999}', "{'depth': 1}", '{"__class__": 1}', "@/nonexistent/file",
                                  "@/dev/null", '{"depth": {"$ref": "x"}}', "cos\x00", '{"depth": 1}' * 2]))


@FUZZ
@given(text=param_texts)
def test_params_json_is_parsed_or_refused_in_one_line(base_spec, text):
    try:
        params = adhoc.read_params(text)
    except UsageError as e:
        assert_one_line(e)
        return
    try:
        point, _ = adhoc.adhoc_point(base_spec.space, params, attempts=50)
    except SpaceError as e:
        assert_one_line(e)
        return
    base_spec.space.validate(point)  # whatever passes is a valid point of the space


@settings(max_examples=max(5, EXAMPLES // 6), deadline=None, suppress_health_check=list(HealthCheck))
@given(text=param_texts, bad_spec=mutated_texts())
def test_cli_exits_2_with_one_line_and_writes_nothing(workdir, base_spec, text, bad_spec):
    """Through ``python -m sweep`` (in process): bad --params or a bad spec exit 2, one line, no store."""
    journal = workdir / "store" / "journal.log"
    with environ({st.ENV_STORAGE: f"journal:{journal}", "SWEEP_ARTIFACTS": str(workdir / "art")}):
        try:
            bad_params = False
            adhoc.adhoc_point(base_spec.space, adhoc.read_params(text), attempts=50)
        except (UsageError, SpaceError):
            bad_params = True
        cases = []
        if bad_params:  # a valid point would be enqueued: only bad ones go through the CLI here
            cases.append(["trial", "--study", str(workdir / "params.toml"), "--params", text, "--no-wait"])
        spec_path = workdir / "cli-bad.toml"
        spec_path.write_bytes(bad_spec.encode("utf-8", "replace"))
        try:
            load(spec_path)
        except SpecError:
            cases += [["run", str(spec_path)], ["status", str(spec_path)],
                      ["trial", "--study", str(spec_path), "--params", "{}", "--no-wait"]]
        for argv in cases:
            err = io.StringIO()
            with redirect_stderr(err):
                try:
                    rc = cli.main(argv, out=io.StringIO())
                except SystemExit as e:  # argparse's own refusals ("--params -x"): one line, exit 2 too
                    rc = e.code
            lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
            assert rc == 2, (argv, err.getvalue())
            assert len(lines) == 1 and lines[0].startswith("sweep: "), (argv, err.getvalue())
            assert not journal.exists(), f"{argv} wrote to the store"


def test_params_are_data_never_code(base_spec):
    """Parameter values are JSON values checked against the space: nothing is evaluated or unpickled."""
    import pickle

    payload = pickle.dumps({"depth": 1})
    for text in ['{"depth": "__import__(\'os\').system(\'touch /tmp/pwned\')"}', '{"depth": "1 + 1"}',
                 json.dumps({"depth": payload.decode("latin-1")}), '{"matrix_lr": "0.02"}']:
        with pytest.raises(SpaceError):
            adhoc.adhoc_point(base_spec.space, adhoc.read_params(text), attempts=5)
    assert not Path("/tmp/pwned").exists()
    # TOML cannot carry code either: a string where a number belongs is refused, not evaluated.
    tree = copy.deepcopy(BASE_TREE)
    tree["trial"]["budget_s"] = "__import__('os').getpid()"
    with pytest.raises(SpecError, match="budget_s"):
        parse(tree, Path("code.toml"))
    assert tomllib.loads(BASE_TEXT)  # the base text is plain TOML
