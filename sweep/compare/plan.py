"""What a comparison is: its sides, its linked study's spec and record (nothing runs here).

Each side is a script (a path; the spec's script trainer runs it with the spec's fixed values), a trial of a
study (``STUDY#N``: its parameters, and its script for a study of a script) or a set of parameters of the spec
(``{"depth": 12}`` or ``@FILE``). Trials of the comparison are trials of one Optuna study, ``NAME`` (by default
``SPEC-compare-HASH``, the hash of what is compared and how, so the same command resumes it), whose
parameters are ``side``, ``pair`` and ``seed``; the spec's :attr:`~sweep.spec.studyspec.StudySpec.sides`
tell the driver what each side runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sweep import store as st
from sweep.compare.decision import Rule
from sweep.spec import Component, StudySpec, load
from sweep.spec.script import SEED_KEY, detect_dialect
from sweep.spec.space import Param, SearchSpace, SpaceError
from sweep.spec.studyspec import PAIR, SIDE, Side

ATTR_COMPARE = "compare"  # study user attribute: what is compared and how
BASE = "base"
STAGES = ("screen", "confirm")  # the screen, then (--confirm) the confirmation of an adopted candidate


def side_of(label: str, stage: str) -> str:
    """The side a label runs as in a stage: ``cand`` at the screen, ``cand@confirm`` at the confirmation."""
    return label if stage == "screen" else f"{label}@{stage}"


class CompareError(ValueError):
    """Bad input for compare; exit 2 with this one line."""


# -- sides ------------------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _seeded_space(spec: StudySpec, params: Mapping[str, Any], max_seed: int) -> SearchSpace:
    """The space a side's trainer config comes from: the spec's, ``seed`` searched; a script side (no
    parameters) keeps only the spec's fixed values, so the script's own literals stand."""
    fixed = {k: v for k, v in spec.space.fixed.items() if k != SEED_KEY}
    seed = Param(SEED_KEY, "int", low=0, high=max(1, max_seed))
    if not params:
        return SearchSpace.build([seed], fixed=fixed)
    kept = [p for p in spec.space.params if p.name != SEED_KEY]
    return SearchSpace.build(kept + [seed], spec.space.derived, spec.space.constraints, fixed)


def read_side(text: str, spec: StudySpec, label: str, max_seed: int) -> tuple[Side, dict[str, Any]]:
    """One side from the command line, and how the comparison records it (what it is, its content hash)."""
    path = Path(text)
    if text.endswith(".py"):
        if spec.script is None:
            raise CompareError(f"{label} {text}: a script side needs --spec naming a study of a script "
                               "(its kit and trial settings); the spec given trains our own model")
        if not path.is_file():
            raise CompareError(f"{label} {text}: no such script")
        sha = _sha256(path)
        try:
            dialect = detect_dialect(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise CompareError(f"{label} {text}: cannot read it: {e}") from None
        if dialect != spec.script.dialect:
            raise CompareError(f"{label} {text}: written in the {dialect} dialect, the spec's script in the "
                               f"{spec.script.dialect} dialect: compare scripts of one dialect")
        script = dataclasses.replace(spec.script, script=path.resolve(), sha256=sha)
        side = Side(label, script, {}, _seeded_space(spec, {}, max_seed))
        return side, {"kind": "script", "text": text, "path": str(path.resolve()), "sha256": sha}
    if "#" in text and not text.lstrip().startswith(("{", "@")):
        name, _, number = text.rpartition("#")
        try:
            n = int(number)
        except ValueError:
            raise CompareError(f"{label} {text}: STUDY#N takes a trial number, got {number!r}") from None
        other = load(name)
        from sweep.study import load_study

        trials = {t.number: t for t in load_study(other, st.resolve_url(other.storage)).get_trials(deepcopy=False)}
        if n not in trials:
            raise CompareError(f"{label} {text}: study {other.name!r} has no trial {n}")
        params = {k: v for k, v in trials[n].params.items() if k != SEED_KEY}
        script = spec.script
        recorded = trials[n].user_attrs.get("script_path")
        if script is not None and recorded and Path(recorded).is_file():
            script = dataclasses.replace(script, script=Path(recorded), sha256=_sha256(Path(recorded)))
        side = Side(label, script, params, _seeded_space(spec, params, max_seed))
        _check_params(side, label, text)
        return side, {"kind": "trial", "text": text, "study": other.name, "trial": n, "params": params}
    raw = text
    if text.startswith("@"):
        try:
            raw = Path(text[1:]).read_text(encoding="utf-8")
        except OSError as e:
            raise CompareError(f"{label} {text}: cannot read it: {e}") from None
    try:
        params = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CompareError(f"{label} {text}: neither a .py script, STUDY#N nor a JSON object: {e}") from None
    if not isinstance(params, dict):
        raise CompareError(f"{label} {text}: parameters are a JSON object, got {type(params).__name__}")
    side = Side(label, spec.script, params, _seeded_space(spec, params, max_seed))
    _check_params(side, label, text)
    return side, {"kind": "params", "text": text, "params": params}


def _check_params(side: Side, label: str, text: str) -> None:
    try:
        side.space.validate({**side.params, SEED_KEY: 0})
    except SpaceError as e:
        raise CompareError(f"{label} {text}: {e}") from None


# -- the comparison's spec --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
    """A comparison: its linked spec, its sides' labels, its rule and its seeds."""

    spec: StudySpec
    labels: tuple[str, ...]  # "base", then each candidate's label
    record: dict[str, Any]  # what the study records under ATTR_COMPARE (and what a resume must match)
    rule: Rule
    first_seed: int
    max_pairs: int
    confirm: bool = False

    @property
    def candidates(self) -> tuple[str, ...]:
        return self.labels[1:]

    def eval_tokens(self, stage: str) -> int | None:
        """The kit's evaluation size at ``stage`` (None outside the kit's dialect: a kit constant sets it)."""
        side = self.spec.sides.get(side_of(BASE, stage))
        script = side.script if side is not None else None
        return script.eval_tokens if script is not None and script.dialect == "kit" else None


def candidate_labels(n: int) -> tuple[str, ...]:
    return ("cand",) if n == 1 else tuple(f"cand{i + 1}" for i in range(n))


def plan(spec: StudySpec, base: str, cands: Sequence[str], rule: Rule, *, budget_s: float | None = None,
         eval_tokens: int | None = None, first_seed: int = 0, name: str | None = None, confirm: bool = False) -> Plan:
    """The comparison of ``cands`` with ``base`` under ``spec``: its linked spec and record; nothing runs."""
    if not cands:
        raise CompareError("name at least one candidate after the base")
    script = spec.script
    if eval_tokens is not None or confirm:
        if script is None or script.dialect != "kit":
            raise CompareError("--eval-tokens and --confirm set the kit's eval-public evaluation: they need a "
                               "study of a kit-dialect script")
        if eval_tokens is not None:
            script = dataclasses.replace(script, eval_tokens=eval_tokens)
    run = dataclasses.replace(spec, script=script, budget_s=float(budget_s or spec.budget_s))
    max_seed = first_seed + 2 * rule.max_pairs * (2 if confirm else 1)
    labels = (BASE, *candidate_labels(len(cands)))
    sides: dict[str, Side] = {}
    described: dict[str, Any] = {}
    for label, text in zip(labels, (base, *cands), strict=True):
        sides[label], described[label] = read_side(text, run, label, max_seed)
    if confirm:
        for label in labels:
            s = sides[label]
            if s.script is not None:
                confirmed = dataclasses.replace(s.script, eval_tokens=s.script.promote_eval_tokens)
                sides[side_of(label, "confirm")] = dataclasses.replace(s, script=confirmed)
    how = {"spec": spec.name, "spec_path": str(Path(spec.path).resolve()), "budget_s": run.budget_s,
           "eval_tokens": script.eval_tokens if script is not None and script.dialect == "kit" else None,
           "first_seed": first_seed,
           "alpha": rule.alpha, "min_effect": rule.min_effect, "noise_sd": rule.noise_sd,
           "max_pairs": rule.max_pairs, "tolerance": rule.tolerance, "futile_first": rule.futile_first,
           "noise_slack": rule.noise_slack, "confirm": confirm}
    key = json.dumps({"sides": [{k: v for k, v in d.items() if k != "text"} for d in described.values()], **how},
                     sort_keys=True, default=str)
    name = name or f"{spec.name}-compare-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
    max_pair = 2 * rule.max_pairs * (2 if confirm else 1)
    space = SearchSpace.build([Param(SIDE, "categorical", choices=tuple(sides)),
                               Param(PAIR, "int", low=0, high=max_pair),
                               Param(SEED_KEY, "int", low=0, high=max(1, max_seed))])
    linked = dataclasses.replace(run, name=name, space=space, sides=sides, n_trials=1, eval_fractions=(),
                                 pruner=Component("none"), sampler=Component("random", {"seed": 0}),
                                 concurrency=None, max_concurrency=None)
    record = {"sides": described, "labels": list(labels), **how}
    return Plan(linked, labels, record, rule, first_seed, rule.max_pairs, confirm)
