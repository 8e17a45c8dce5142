"""``python -m sweep run|status|best|trial|dashboard|precompile|replay|promote|export``: the sweep's command line.

Exit codes follow DESIGN.md: 0 success, 2 bad input (one line naming the cause), 1 anything else.
Every command reads the study from ``SWEEP_STORAGE`` (else the spec's storage, else the embedded
journal under ``runs/``), so one study can be inspected from anywhere.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from sweep import artifacts, export, precompile, promote, replay
from sweep import objective as obj
from sweep import storage as st
from sweep.expr import ExprError
from sweep.space import SearchSpace, SpaceError
from sweep.spec import SpecError, StudySpec, load
from sweep.study import (
    UsageError,
    best_dict,
    fail,
    front_dict,
    load_study,
    parse_seconds,
    status_dict,
    trial_result,
)


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
    b = sub.add_parser("best", help="the best complete trial and its result record (a pareto study: its front)")
    b.add_argument("study")
    b.add_argument("--json", action="store_true")
    t = sub.add_parser("trial", help="one ad-hoc trial with given parameters, recorded in the study; "
                       "enqueued for a running sweep unless --now")
    t.add_argument("--study", required=True)
    t.add_argument("--params", required=True, metavar="JSON_OR_@FILE",
                   help="JSON object of searched parameters, or @FILE holding one; missing ones are sampled")
    t.add_argument("--budget-s", type=parse_seconds, default=None, metavar="N",
                   help="charged training seconds (default: the spec's budget); such a trial is never pruned")
    mode = t.add_mutually_exclusive_group()
    mode.add_argument("--now", action="store_true",
                      help="run it at once on this Ray (RAY_ADDRESS, else a local one) instead of enqueueing it")
    mode.add_argument("--no-wait", action="store_true", help="enqueue it and return without waiting for its result")
    d = sub.add_parser("dashboard", help="optuna-dashboard on the study's storage, with its trial artifacts")
    d.add_argument("study", nargs="?", help="NAME or spec path (its storage and artifacts); default: "
                   "SWEEP_STORAGE and SWEEP_ARTIFACTS, else runs/")
    d.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: no authentication)")
    d.add_argument("--port", type=int, default=8080)
    precompile.add_parser(sub)
    replay.add_parser(sub)
    promote.add_parser(sub)
    export.add_parser(sub)
    return p


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    url: str | None = None
    try:
        if args.command == "dashboard":
            dspec = load(args.study) if args.study else None
            url = st.resolve_url(dspec.storage if dspec else None)
            return _dashboard(dspec, url, args.host, args.port, out)
        spec = promote.load_spec(args.study, args.command)  # a linked study (NAME-promote-B) too
        url = st.resolve_url(spec.storage)
        if args.command == "run":
            from sweep.run.driver import Driver

            return Driver(spec, out=out).run()
        if args.command == "trial":
            return _trial(spec, url, args, out)
        if args.command == "precompile":
            return precompile.main(spec, url, args, out)
        if args.command == "replay":
            return replay.main(spec, url, args, out)
        if args.command == "promote":
            return promote.main(spec, url, args, out)
        if args.command == "export":
            return export.main(spec, url, args, out)
        study = load_study(spec, url)
        if args.command == "status":
            return _status(study, spec, args.json, out)
        if spec.objective.multi:
            return _front(study, spec, args.json, out)
        return _best(study, spec, args.json, out)
    except (SpecError, UsageError, st.StorageError) as e:
        fail(str(e), url)
        return 2
    except Exception as e:
        from sweep.run.driver import SweepAborted

        if isinstance(e, SweepAborted):
            fail(str(e), url)
            return 2
        if isinstance(e, SpaceError):
            fail(f"--params: {e}", url)
            return 2
        fail(f"{type(e).__name__}: {e}", url)
        return 1


# -- sweep trial --------------------------------------------------------------------------------------

WAIT_POLL_S = 2.0
NO_SWEEP_HINT_AFTER_S = 10.0


def _trial(spec: StudySpec, url: str, args: argparse.Namespace, out: TextIO) -> int:
    """Check everything first (nothing is written for bad input), then enqueue or run, then print the result."""
    from sweep.run.driver import ATTR_ADHOC_BUDGET, Driver

    params = read_params(args.params)
    attrs: dict[str, Any] = {}
    if args.budget_s is not None and args.budget_s != spec.budget_s:
        steps = [round(f * args.budget_s) for f in spec.eval_fractions]
        if len(set(steps)) != len(steps):
            raise UsageError(f"--budget-s {args.budget_s:g}: the spec's eval points collide on the charged-second "
                             f"axis ({steps}); use a longer budget")
        attrs[ATTR_ADHOC_BUDGET] = args.budget_s
    point, sampled = adhoc_point(spec.space, params)
    if sampled:
        attrs["adhoc_sampled"] = sampled
    _refuse_job_local_store(url, spec)
    driver = Driver(spec, out=out)
    if args.now:
        t = driver.run_adhoc(point, attrs)
    else:
        number, trial_id = enqueue(driver, point, attrs)
        if args.no_wait:
            print(json.dumps({"number": number, "state": "WAITING", "params": point}), file=out, flush=True)
            return 0
        try:
            t = wait_for_trial(driver, number, trial_id)
        except KeyboardInterrupt:
            driver.say(f"interrupted: trial {number} stays in study {spec.name}; a sweep of it will run it")
            return 1
    print(json.dumps(trial_result(t, spec.objective)), file=out, flush=True)
    return 0 if t.state.name == "COMPLETE" else 1


def read_params(text: str) -> dict[str, Any]:
    """``--params``: a JSON object, or ``@FILE`` holding one."""
    source = "--params"
    if text.startswith("@"):
        source = f"--params {text}"
        try:
            text = Path(text[1:]).expanduser().read_text()
        except OSError as e:
            raise UsageError(f"{source}: cannot read: {e.strerror}") from None
    try:
        params = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{source}: not JSON: {e}") from None
    if not isinstance(params, dict):
        raise UsageError(f"{source}: must be a JSON object of parameter names to values")
    return params


def adhoc_point(space: SearchSpace, given: dict[str, Any], rng: random.Random | None = None,
                attempts: int = 1000) -> tuple[dict[str, Any], list[str]]:
    """The point an ad-hoc trial runs: ``given`` checked against the space, the active parameters it
    lacks drawn at random until the constraints hold (so an infeasible point never reaches a slot).

    Raises SpaceError naming the first offending parameter (unknown, fixed, wrong type, off its
    range or grid, inactive) or the violated constraint. Returns the point and the sampled names.
    """
    by_name = {p.name: p for p in space.params}
    for k, v in given.items():
        p = by_name.get(k)
        if p is None:
            where = "fixed" if k in space.fixed else "derived" if k in dict(space.derived) else None
            raise SpaceError(k, f"is {where}, not a searched parameter" if where else "unknown parameter")
        why = p.check(v)
        if why:
            raise SpaceError(k, why)
    rng = rng or random.Random()
    error: SpaceError | None = None
    for _ in range(attempts):
        env: dict[str, Any] = dict(space.fixed)
        point: dict[str, Any] = {}
        sampled: list[str] = []
        for p in space.params:
            try:
                active = p.when is None or p.when(env)
            except ExprError as e:
                raise SpaceError(f"params.{p.name}.when", str(e)) from None
            if not active:
                continue
            if p.name in given:
                value = given[p.name]
            else:
                value = p.sample(rng)
                sampled.append(p.name)
            point[p.name] = env[p.name] = value
        point.update({k: v for k, v in given.items() if k not in point})  # inactive ones: validate names them
        try:
            return space.validate(point), sampled
        except SpaceError as e:
            if not sampled:
                raise
            error = e
    assert error is not None
    raise SpaceError(error.key, f"{error.message} with the given values, in all {attempts} draws of "
                     f"{', '.join(sampled)}")


def _refuse_job_local_store(url: str, spec: StudySpec) -> None:
    """Inside a ``ray job submit --working-dir`` job, relative paths land in a throwaway copy of the repo."""
    journal = st.journal_path(url)
    if journal is not None and "_ray_pkg_" in journal:
        raise UsageError(f"storage {url} lies in the Ray job's working directory and vanishes with the job; set "
                         "SWEEP_STORAGE to PostgreSQL (or a journal on a path every node shares)")
    where = artifacts.artifacts_url(spec.artifacts)
    if "_ray_pkg_" in where:
        print(f"sweep: warning: artifacts {where} lie in the Ray job's working directory and vanish with the job; "
              "set SWEEP_ARTIFACTS to s3://bucket/prefix or a shared path", file=sys.stderr)


def enqueue(driver: Any, point: dict[str, Any], attrs: dict[str, Any]) -> tuple[int, int]:
    """Add the point as a WAITING ad-hoc trial (what ``study.enqueue_trial`` does, keeping the id)."""
    import optuna
    from optuna.trial import TrialState

    study = driver.open_study()
    frozen = optuna.trial.create_trial(state=TrialState.WAITING, system_attrs={"fixed_params": point},
                                       user_attrs={**attrs, "adhoc": True})
    trial_id = study._storage.create_new_trial(study._study_id, template_trial=frozen)
    number = study._storage.get_trial(trial_id).number
    driver.say(f"trial {number} enqueued in study {driver.spec.name}: a running sweep runs it in its next free "
               "slot (`sweep trial --now` runs it at once)")
    return number, trial_id


def wait_for_trial(driver: Any, number: int, trial_id: int, poll_s: float = WAIT_POLL_S) -> Any:
    """Follow an enqueued trial until it finishes; print its reports, and a hint if no sweep is running."""
    from optuna.trial import TrialState

    from sweep.run.supervisor import ATTR_HEARTBEAT

    storage, spec = driver.study._storage, driver.spec
    t0, hinted, started, seen = time.monotonic(), False, False, set()
    while True:
        t = st.retry(lambda: storage.get_trial(trial_id), what="read trial", url=driver.url)
        if t.state.is_finished():
            return t
        if t.state == TrialState.RUNNING and not started:
            started = True
            driver.say(f"trial {number} is running")
        for step, value in obj.curve_points(t, spec.objective):
            if step not in seen:
                seen.add(step)
                driver.say(f"trial {number}: t={step}s val_bpb={value:.4f}")
        if not started and not hinted and time.monotonic() - t0 > NO_SWEEP_HINT_AFTER_S:
            hinted = True
            now = time.time()
            live = [r for r in driver.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                    if now - r.system_attrs.get(ATTR_HEARTBEAT, 0) < spec.stale_after_s]
            if not live:
                driver.say(f"no sweep seems to be running study {spec.name}: `python -m sweep run {spec.name}` "
                           f"will run trial {number}; Ctrl-C leaves it queued")
        time.sleep(poll_s)


# -- sweep dashboard ----------------------------------------------------------------------------------

def _dashboard(spec: StudySpec | None, url: str, host: str, port: int, out: TextIO) -> int:
    from sweep import dashboard

    where = artifacts.artifacts_url(spec.artifacts if spec else None)
    try:
        return dashboard.serve(url, where, host, port, study=spec.name if spec else None, out=out)
    except dashboard.ListenError as e:
        raise UsageError(f"--host {host} --port {port}: cannot listen: {e}") from None


def _status(study: Any, spec: StudySpec, as_json: bool, out: TextIO) -> int:
    d = status_dict(study)
    if as_json:
        print(json.dumps(d), file=out)
        return 0
    print(f"study {d['study']}: " + ", ".join(f"{k} {v}" for k, v in d["counts"].items() if v), file=out)
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    for row in d["trials"]:
        t = by_number[row["number"]]
        shown = row["values"] if "values" in row else [row["value"]]
        value = "/".join(f"{v:.4f}" if v is not None else "-" for v in shown or [None])
        extra = t.user_attrs.get("fail_reason", "")
        if "retry_of" in t.user_attrs:
            extra = f"retry of {t.user_attrs['retry_of']}" + (f"; {extra}" if extra else "")
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row["params"].items())
        print(f"{row['number']:>5} {row['state']:<9} {value:>8}  {params}" + (f"  [{extra}]" if extra else ""),
              file=out)
    return 0


def _best(study: Any, spec: StudySpec, as_json: bool, out: TextIO) -> int:
    d = best_dict(study, spec.direction, spec.objective)
    if d is None:
        print(f"sweep: study {spec.name!r} has no complete trial yet", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(d), file=out)
    else:
        values = [d["value"]] if "value" in d else [d["val_bpb"]]
        print(f"best: trial {d['number']} {obj.fmt_values(spec.objective, values, d['record'])}", file=out)
        for k, v in d["params"].items():
            print(f"  {k} = {v}", file=out)
    return 0


def _front(study: Any, spec: StudySpec, as_json: bool, out: TextIO) -> int:
    d = front_dict(study, spec.objective)
    if not d["front"]:
        print(f"sweep: study {spec.name!r} has no complete trial yet", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(d), file=out)
        return 0
    print(f"pareto front of {spec.name} ({spec.objective.describe()}): {len(d['front'])} trial(s)", file=out)
    for m in d["front"]:
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m["params"].items())
        print(f"  trial {m['number']} {obj.fmt_values(spec.objective, m['values'], m['record'])}  {params}", file=out)
    return 0
