"""What several commands share: open a stored study, say a failure in one line, read what a study holds.

``sweep status``, ``best``, ``trial``, ``replay``, ``promote`` and ``export`` all load a study by its spec,
print the same one-line errors and read trials back as the same dicts (the status and best shapes of
docs/design.md), so those live here once rather than in the command line; so does the printing of
``sweep status`` and ``sweep best``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from sweep import store as st
from sweep.neuron import environment
from sweep.printable import printable
from sweep.spec import STUDIES_DIR, StudySpec
from sweep.spec import objective as obj
from sweep.store import artifacts

STATES = ("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING")


class UsageError(Exception):
    """Bad input found after parsing (unknown study, bad --params); exit 2."""


def parse_seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def fail(message: str, url: str | None) -> None:
    """Print ``sweep: MESSAGE`` on one line with any password in ``url`` scrubbed out."""
    line = " ".join(printable(st.scrub(message, url)).split())
    print(f"sweep: {line}", file=sys.stderr, flush=True)


def load_study(spec: StudySpec, url: str) -> Any:
    """The stored study named by ``spec``; a missing one is a UsageError (exit 2)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = st.open_storage(url)
    try:
        return st.retry(lambda: optuna.load_study(study_name=spec.name, storage=storage), url=url)
    except KeyError:
        raise UsageError(f"no study {spec.name!r} in {st.redact(url)}") from None


def finite(v: Any) -> Any:
    """A number for JSON: NaN and infinities become None."""
    return v if v is None or math.isfinite(v) else None


def finite_values(t: Any) -> list[Any] | None:
    """A trial's values, each through :func:`finite` (None for a single-objective trial without values)."""
    return None if t.values is None else [finite(v) for v in t.values]


def status_dict(study: Any) -> dict[str, Any]:
    """docs/design.md's status shape; a multi-objective study adds ``metrics``, ``directions`` and each trial's
    ``values`` (its ``value`` is null: there is no single one)."""
    trials = study.get_trials(deepcopy=False)
    counts = dict.fromkeys(STATES, 0)
    for t in trials:
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    if len(study.directions) == 1:
        return {"study": study.study_name, "counts": counts,
                "trials": [{"number": t.number, "state": t.state.name, "value": finite(t.value), "params": t.params}
                           for t in trials]}
    return {"study": study.study_name, "counts": counts, "metrics": study.metric_names,
            "directions": [d.name.lower() for d in study.directions],
            "trials": [{"number": t.number, "state": t.state.name, "value": None, "values": finite_values(t),
                        "params": t.params} for t in trials]}


def record_of(t: Any) -> dict[str, Any]:
    """The trainer's result record, rebuilt from the trial's user attributes."""
    fields = t.user_attrs.get("record_fields") or []
    return {k: t.user_attrs[k] for k in fields if k in t.user_attrs}


def best_dict(study: Any, direction: str, objective: obj.Objective | None = None) -> dict[str, Any] | None:
    """docs/design.md's best shape; for a composite objective ``val_bpb`` is the record's and ``value`` the score."""
    t = best_trial(study.get_trials(deepcopy=False), direction)
    if t is None:
        return None
    if objective is None or objective.kind == "single":
        return {"number": t.number, "params": t.params, "val_bpb": t.value, "record": record_of(t)}
    record = record_of(t)
    return {"number": t.number, "params": t.params, "val_bpb": record.get("val_bpb"), "value": t.value,
            "record": record}


def front_dict(study: Any, objective: obj.Objective) -> dict[str, Any]:
    """A pareto study's front: each member's number, params, values (in ``metrics`` order) and record."""
    members = obj.front(study.get_trials(deepcopy=False), objective.directions)
    return {"study": study.study_name, "metrics": list(objective.metrics), "directions": list(objective.directions),
            "front": [{"number": t.number, "params": t.params, "values": list(t.values), "record": record_of(t)}
                      for t in members]}


def trial_result(t: Any, objective: obj.Objective | None = None) -> dict[str, Any]:
    """What ``sweep trial`` prints last: the trial's number, state, val_bpb, params and result record (and,
    where the objective is not val_bpb alone, ``values``: what Optuna was told)."""
    record = record_of(t)
    if objective is None or objective.kind == "single":
        d = {"number": t.number, "state": t.state.name, "val_bpb": finite(t.value), "params": t.params,
             "record": record}
    else:
        d = {"number": t.number, "state": t.state.name, "val_bpb": finite(record.get("val_bpb")),
             "values": finite_values(t), "params": t.params, "record": record}
    if t.user_attrs.get("fail_reason"):
        d["fail_reason"] = t.user_attrs["fail_reason"]
    d.update(environment_of(t))
    return d


def environment_of(t: Any) -> dict[str, Any]:
    """The environment profile (and image venv, and its versions) recorded with a trial."""
    keys = (environment.ATTR_PROFILE, environment.ATTR_VENV, environment.ATTR_VERSIONS)
    return {k: t.user_attrs[k] for k in keys if k in t.user_attrs}


def best_trial(trials: list[Any], direction: str) -> Any:
    """The best complete trial with a finite value in ``direction`` ("minimize" or "maximize"), or None."""
    done = [t for t in trials if t.state.name == "COMPLETE" and t.value is not None and math.isfinite(t.value)]
    if not done:
        return None
    pick: Callable[..., Any] = min if direction == "minimize" else max
    return pick(done, key=lambda t: t.value)


def fmt_params(params: dict[str, Any]) -> str:
    """Parameters on one line: ``name=value`` with floats to 4 significant digits."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


# The result record's headline figures, in the order people read them (docs/design.md, "The result record").
HEADLINE = ("val_bpb", "val_loss", "core", "steps", "train_seconds", "tokens_per_second", "mfu", "params", "device")


def headline(record: dict[str, Any], attrs: dict[str, Any] | None = None, skip: tuple[str, ...] = ()) -> str:
    """A result record's headline figures on one line (``status`` first unless ok; ``git_commit`` last, from
    the trial's user attributes ``attrs``); fields the record lacks, and those in ``skip``, are left out."""
    parts = [] if record.get("status") in (None, "ok") else [f"status={record['status']}"]
    for k in HEADLINE:
        v = record.get(k)
        if k in skip:
            continue
        if v is None or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)) and not math.isfinite(v):
            shown = str(v)
        elif k in ("val_bpb", "val_loss", "core"):
            shown = f"{v:.4f}"
        elif k == "train_seconds":
            shown = f"{v:.1f}"
        elif k == "tokens_per_second":
            shown = f"{v:.0f}"
        elif k == "mfu":
            shown = f"{100 * v:.2f}%"
        elif k == "params" and isinstance(v, (int, float)):
            shown = f"{v / 1e6:.2f}M"
        else:
            shown = str(v)
        parts.append(f"{k}={shown}")
    commit = (attrs or {}).get("git_commit")
    if commit:
        parts.append(f"git_commit={commit[:12]}{'-dirty' if (attrs or {}).get('git_dirty') else ''}")
    return " ".join(parts) or "no result record"


def study_arg(spec: StudySpec) -> str:
    """How a person names the study on a command line: ``NAME`` for ``sweep/studies/NAME.toml``, else its path."""
    path = Path(spec.path)
    if path.resolve().parent == STUDIES_DIR.resolve() and path.stem == spec.name:
        return spec.name
    return artifacts.shown_path(path)


def storage_shown(url: str) -> str:
    """Where the study is kept, as a person would look for it: a journal file (relative to here when under
    it), else the storage URL without its password."""
    journal = st.journal_path(url)
    return artifacts.shown_path(Path(journal)) if journal is not None else st.redact(url)


def python_cmd() -> str:
    """``.venv/bin/python`` (this interpreter, when it lies under the current directory), else ``python``."""
    try:  # not resolved: a virtual environment's python is a link to the system's
        return str(Path(sys.executable).absolute().relative_to(Path.cwd().resolve()))
    except ValueError:
        return "python"


def file_lines(t: Any, spec: StudySpec, indent: str = "  ") -> list[str]:
    """Where a trial's checkpoint and result record are (``checkpoint: PATH``, ``result: PATH``)."""
    found = artifacts.trial_files(t, artifacts.artifacts_url(spec.artifacts), spec.name)
    lines = [f"{indent}checkpoint: {found.get('checkpoint', 'none kept')}"]
    if "record" in found:
        lines.append(f"{indent}result:     {found['record']}")
    if "dir" in found:
        lines.append(f"{indent}files:      {found['dir']} (config.json, trainer.log, events.jsonl, ...)")
        if spec.script is not None:  # a study of a script: the script as this trial ran it
            constants = t.user_attrs.get("constants") or {}
            set_to = " ".join([f"{k}={v!r}" for k, v in sorted(constants.items())]
                              + [str(a) for a in (t.user_attrs.get("config") or {}).get("flags", [])])
            lines.append(f"{indent}script:     {Path(found['dir']) / 'script' / spec.script.script.name}"
                         + (f" ({set_to})" if set_to else ""))
    if t.user_attrs.get("val_bpb_source") == "eval-public":  # the kit's own scorer gave the value
        scored = t.user_attrs.get("eval_public") or {}
        claim = t.user_attrs.get("claimed_val_bpb")
        lines.append(f"{indent}scored:     the kit's eval-public, val_bpb {scored.get('val_bpb', '?')} on "
                     f"{scored.get('num_tokens', t.user_attrs.get('eval_tokens', '?')):,} tokens"
                     + (f" (the script claimed {claim})" if claim is not None else ""))
    return lines


def print_status(study: Any, spec: StudySpec, as_json: bool, out: TextIO) -> int:
    """``sweep status``: the counts by state, then one line per trial (or :func:`status_dict` as JSON)."""
    d = status_dict(study)
    if spec.script is not None:  # a study of a script: the dialect the trainer speaks to it (sweep.spec.script)
        d["dialect"] = spec.script.dialect
    if as_json:
        print(json.dumps(d), file=out)
        return 0
    counts = ", ".join(f"{k} {v}" for k, v in d["counts"].items() if v)
    print(f"study {d['study']}: {counts or 'no trials yet'}", file=out)
    if spec.script is not None:
        print(f"  dialect: {spec.script.dialect} (script {spec.script.script})", file=out)
    shown_env = f"environment: {environment.describe(spec.environment, study.user_attrs)}"
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    rows = []
    for row in d["trials"]:
        t = by_number[row["number"]]
        shown = row["values"] if "values" in row else [row["value"]]
        value = "/".join(f"{v:.4f}" if v is not None else "-" for v in shown or [None])
        extra = printable(str(t.user_attrs.get("fail_reason", "")))  # one row, whatever the reason holds
        if "retry_of" in t.user_attrs:
            extra = f"retry of {t.user_attrs['retry_of']}" + (f"; {extra}" if extra else "")
        params = fmt_params(row["params"]) + (f"  [{extra}]" if extra else "")
        rows.append((str(row["number"]), row["state"], value, params))
    if rows:
        head = ("trial", "state", "/".join(spec.objective.names), "parameters")
        width = max(len(head[2]), *(len(r[2]) for r in rows))
        for r in (head, *rows):
            print(f"{r[0]:>5} {r[1]:<9} {r[2]:>{width}}  {r[3]}", file=out)
    print(shown_env, file=out)
    return 0


def print_best(study: Any, spec: StudySpec, as_json: bool, out: TextIO) -> int:
    """``sweep best``: the best complete trial, its record's headline figures, where its checkpoint and record
    are, and its parameters (or :func:`best_dict` as JSON); 1 if none."""
    d = best_dict(study, spec.direction, spec.objective)
    if d is None:
        print(f"sweep: study {spec.name!r} has no complete trial yet", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(d), file=out)
        return 0
    t = next(t for t in study.get_trials(deepcopy=False) if t.number == d["number"])
    values = [d["value"]] if "value" in d else [d["val_bpb"]]
    print(f"best: trial {d['number']} {obj.fmt_values(spec.objective, values, d['record'])}", file=out)
    print(f"  record:     {headline(d['record'], t.user_attrs, skip=spec.objective.metrics)}", file=out)
    recorded = environment_of(t)
    print(f"  environment: {recorded.get(environment.ATTR_PROFILE, 'not recorded')}"
          + (f" (venv {recorded[environment.ATTR_VENV]})" if environment.ATTR_VENV in recorded else ""), file=out)
    for line in file_lines(t, spec):
        print(line, file=out)
    print("  parameters:", file=out)
    for k, v in d["params"].items():
        print(f"    {k} = {v}", file=out)
    return 0


def print_front(study: Any, spec: StudySpec, as_json: bool, out: TextIO) -> int:
    """``sweep best`` of a pareto study: its front (or :func:`front_dict` as JSON); 1 if empty."""
    d = front_dict(study, spec.objective)
    if not d["front"]:
        print(f"sweep: study {spec.name!r} has no complete trial yet", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(d), file=out)
        return 0
    print(f"pareto front of {spec.name} ({spec.objective.describe()}): {len(d['front'])} trial(s)", file=out)
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    for m in d["front"]:
        t = by_number[m["number"]]
        print(f"  trial {m['number']} {obj.fmt_values(spec.objective, m['values'], m['record'])}  "
              f"{fmt_params(m['params'])}", file=out)
        print(f"    record:     {headline(m['record'], t.user_attrs, skip=spec.objective.metrics)}", file=out)
        for line in file_lines(t, spec, indent="    "):
            print(line, file=out)
    return 0
