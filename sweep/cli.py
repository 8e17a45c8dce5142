"""``python -m sweep run|status|best|trial``: the sweep's command line.

Exit codes follow DESIGN.md: 0 success, 2 bad input (one line naming the cause), 1 anything else.
Every command reads the study from ``SWEEP_STORAGE`` (else the spec's storage, else the embedded
journal under ``runs/``), so one study can be inspected from anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, TextIO

from sweep import storage as st
from sweep.spec import SpecError, StudySpec, load

STATES = ("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING")


class UsageError(Exception):
    """Bad input found after parsing (unknown study, bad --params); exit 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other bad input
        print(f"sweep: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m sweep", description="Sweep GPT hyperparameters with Optuna on Ray.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="create or resume a study and run it to n_trials")
    r.add_argument("study", help="NAME (sweep/studies/NAME.toml) or a path to a .toml spec")
    s = sub.add_parser("status", help="trial counts by state and every trial")
    s.add_argument("study")
    s.add_argument("--json", action="store_true")
    b = sub.add_parser("best", help="the best complete trial and its result record")
    b.add_argument("study")
    b.add_argument("--json", action="store_true")
    t = sub.add_parser("trial", help="run one ad-hoc trial with given parameters, recorded in the study")
    t.add_argument("--study", required=True)
    t.add_argument("--params", required=True, help="JSON object of searched parameters")
    return p


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    url: str | None = None
    try:
        spec = load(args.study)
        url = st.resolve_url(spec.storage)
        if args.command == "run":
            from sweep.driver import Driver

            return Driver(spec, out=out).run()
        if args.command == "trial":
            from sweep.driver import Driver

            try:
                params = json.loads(args.params)
            except ValueError as e:
                raise UsageError(f"--params: not JSON: {e}") from None
            if not isinstance(params, dict):
                raise UsageError("--params: must be a JSON object")
            return Driver(spec, out=out).run_adhoc(params)
        study = _load_study(spec, url)
        if args.command == "status":
            return _status(study, spec, args.json, out)
        return _best(study, spec, args.json, out)
    except (SpecError, UsageError, st.StorageError) as e:
        _fail(str(e), url)
        return 2
    except Exception as e:
        from sweep.driver import SweepAborted
        from sweep.space import SpaceError

        if isinstance(e, SweepAborted):
            _fail(str(e), url)
            return 2
        if isinstance(e, SpaceError):
            _fail(f"--params: {e}", url)
            return 2
        _fail(f"{type(e).__name__}: {e}", url)
        return 1


def _fail(message: str, url: str | None) -> None:
    line = " ".join(st.scrub(message, url).split())
    print(f"sweep: {line}", file=sys.stderr, flush=True)


def _load_study(spec: StudySpec, url: str) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = st.open_storage(url)
    try:
        return st.retry(lambda: optuna.load_study(study_name=spec.name, storage=storage), url=url)
    except KeyError:
        raise UsageError(f"no study {spec.name!r} in {st.redact(url)}") from None


def _value(v: Any) -> Any:
    return v if v is None or math.isfinite(v) else None


def status_dict(study: Any) -> dict[str, Any]:
    trials = study.get_trials(deepcopy=False)
    counts = dict.fromkeys(STATES, 0)
    for t in trials:
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    return {"study": study.study_name, "counts": counts,
            "trials": [{"number": t.number, "state": t.state.name, "value": _value(t.value), "params": t.params}
                       for t in trials]}


def record_of(t: Any) -> dict[str, Any]:
    """The trainer's result record, rebuilt from the trial's user attributes."""
    fields = t.user_attrs.get("record_fields") or []
    return {k: t.user_attrs[k] for k in fields if k in t.user_attrs}


def best_dict(study: Any, direction: str) -> dict[str, Any] | None:
    from sweep.driver import _best

    t = _best(study.get_trials(deepcopy=False), direction)
    if t is None:
        return None
    return {"number": t.number, "params": t.params, "val_bpb": t.value, "record": record_of(t)}


def _status(study: Any, spec: StudySpec, as_json: bool, out: TextIO) -> int:
    d = status_dict(study)
    if as_json:
        print(json.dumps(d), file=out)
        return 0
    print(f"study {d['study']}: " + ", ".join(f"{k} {v}" for k, v in d["counts"].items() if v), file=out)
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    for row in d["trials"]:
        t = by_number[row["number"]]
        value = f"{row['value']:.4f}" if row["value"] is not None else "-"
        extra = t.user_attrs.get("fail_reason", "")
        if "retry_of" in t.user_attrs:
            extra = f"retry of {t.user_attrs['retry_of']}" + (f"; {extra}" if extra else "")
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row["params"].items())
        print(f"{row['number']:>5} {row['state']:<9} {value:>8}  {params}" + (f"  [{extra}]" if extra else ""),
              file=out)
    return 0


def _best(study: Any, spec: StudySpec, as_json: bool, out: TextIO) -> int:
    d = best_dict(study, spec.direction)
    if d is None:
        print(f"sweep: study {spec.name!r} has no complete trial yet", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(d), file=out)
    else:
        print(f"best: trial {d['number']} val_bpb={d['val_bpb']:.4f}", file=out)
        for k, v in d["params"].items():
            print(f"  {k} = {v}", file=out)
    return 0
