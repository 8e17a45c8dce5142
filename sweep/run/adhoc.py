"""``sweep trial``: one ad-hoc trial with hand-picked parameters, recorded in the study.

Everything is checked first, so nothing is written for bad input: ``--params`` (JSON or ``@FILE``) against
the space, the missing active parameters drawn until the constraints hold, ``--budget-s`` against the
spec's eval points, the storage against a Ray job's throwaway working directory. Then the trial is
enqueued WAITING for a running sweep's next free slot (and followed until it finishes, unless
``--no-wait``), or run at once on this Ray (``--now``). It is marked ``adhoc``: it takes a slot but never
counts towards ``n_trials`` and is never retried. A point a person asked for runs to its end: the study's
pruner judges it only with ``--prunable`` (and never one with its own budget, off the pruner's rungs).

Its output is its own: the lines of its trial (started, reports, outcome), then the result as JSON. The exit
code says whether it failed, not how it ranked: 0 for COMPLETE and PRUNED (the state is in the JSON), 1 for
FAIL.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from sweep import store as st
from sweep.run import liveness, printing
from sweep.run.driver import Driver
from sweep.run.outcome import ATTR_ADHOC, ATTR_ADHOC_BUDGET, ATTR_ADHOC_PRUNABLE, ATTR_ADHOC_SAMPLED
from sweep.spec import StudySpec
from sweep.spec import objective as obj
from sweep.spec.expr import ExprError
from sweep.spec.space import SearchSpace, SpaceError
from sweep.store import artifacts
from sweep.study import UsageError, trial_result

WAIT_POLL_S = 2.0
NO_SWEEP_HINT_AFTER_S = 10.0


def run_adhoc(spec: StudySpec, url: str, args: argparse.Namespace, out: TextIO) -> int:
    """Check everything first (nothing is written for bad input), then enqueue or run, then print the result."""
    params = read_params(args.params)
    attrs: dict[str, Any] = {}
    if args.budget_s is not None and args.budget_s != spec.budget_s:
        steps = [round(f * args.budget_s) for f in spec.eval_fractions]
        if len(set(steps)) != len(steps):
            raise UsageError(f"--budget-s {args.budget_s:g}: the spec's eval points collide on the charged-second "
                             f"axis ({steps}); use a longer budget")
        attrs[ATTR_ADHOC_BUDGET] = args.budget_s
    if getattr(args, "prunable", False):
        if ATTR_ADHOC_BUDGET in attrs:
            raise UsageError(f"--prunable: a trial with its own --budget-s {args.budget_s:g} is never pruned (the "
                             f"pruner's rungs are those of the spec's {spec.budget_s:g} s)")
        attrs[ATTR_ADHOC_PRUNABLE] = True
    point, sampled = adhoc_point(spec.space, params)
    if sampled:
        attrs[ATTR_ADHOC_SAMPLED] = sampled
    refuse_job_local_store(url, spec)
    driver = Driver(spec, out=out, own_only=True)
    if args.now:
        t = run_now(driver, point, attrs)
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
    return 1 if t.state.name == "FAIL" else 0


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


def refuse_job_local_store(url: str, spec: StudySpec) -> None:
    """Inside a ``ray job submit --working-dir`` job, relative paths land in a throwaway copy of the repo."""
    journal = st.journal_path(url)
    if journal is not None and "_ray_pkg_" in journal:
        raise UsageError(f"storage {url} lies in the Ray job's working directory and vanishes with the job; set "
                         "SWEEP_STORAGE to PostgreSQL (or a journal on a path every node shares)")
    where = artifacts.artifacts_url(spec.artifacts)
    if "_ray_pkg_" in where:
        print(f"sweep: warning: artifacts {where} lie in the Ray job's working directory and vanish with the job; "
              "set SWEEP_ARTIFACTS to s3://bucket/prefix or a shared path", file=sys.stderr)


def run_now(driver: Driver, params: dict[str, Any], user_attrs: dict[str, Any] | None = None) -> Any:
    """Run one trial with hand-picked parameters now on this Ray, recorded in the study (``--now``).

    Returns the finished FrozenTrial. ``user_attrs`` (e.g. ``adhoc_budget_s``) are stored on the
    trial before it starts and steer :meth:`Driver.submit`.
    """
    import optuna
    from optuna.trial import TrialState

    point = driver.spec.space.validate(params)
    attrs = {**(user_attrs or {}), ATTR_ADHOC: True}
    driver.open_study()
    driver.connect_ray()
    try:
        frozen = optuna.trial.create_trial(
            state=TrialState.RUNNING, params=point, distributions=driver.spec.space.distributions(point),
            user_attrs=attrs, system_attrs=liveness.claim_attrs(driver.identity))
        storage = st.study_storage(driver.study)
        trial_id = storage.create_new_trial(st.study_id(driver.study), template_trial=frozen)
        number = storage.get_trial(trial_id).number
        driver.submit(number, trial_id, point, attrs)
        while driver.inflight:
            driver.scan()
            driver.wait_some()
        return storage.get_trial(trial_id)
    finally:
        driver.shutdown()


def enqueue(driver: Driver, point: dict[str, Any], attrs: dict[str, Any]) -> tuple[int, int]:
    """Add the point as a WAITING ad-hoc trial (what ``study.enqueue_trial`` does, keeping the id)."""
    import optuna
    from optuna.trial import TrialState

    study = driver.open_study()
    frozen = optuna.trial.create_trial(state=TrialState.WAITING, system_attrs={"fixed_params": point},
                                       user_attrs={**attrs, ATTR_ADHOC: True})
    trial_id = st.study_storage(study).create_new_trial(st.study_id(study), template_trial=frozen)
    number = st.study_storage(study).get_trial(trial_id).number
    driver.say(f"trial {number} enqueued in study {driver.spec.name}: a running sweep runs it in its next free "
               "slot (`sweep trial --now` runs it at once)")
    return number, trial_id


def wait_for_trial(driver: Driver, number: int, trial_id: int, poll_s: float = WAIT_POLL_S) -> Any:
    """Follow an enqueued trial until it finishes; print its reports, and a hint if no sweep is running."""
    from optuna.trial import TrialState

    storage, spec = st.study_storage(driver.study), driver.spec
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
                driver.say(printing.report_line(number, step, value, driver._curve_label))
        if not started and not hinted and time.monotonic() - t0 > NO_SWEEP_HINT_AFTER_S:
            hinted = True
            now = time.time()
            live = [r for r in driver.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                    if liveness.vouched(r, now, spec.stale_after_s)]
            if not live:
                driver.say(f"no sweep seems to be running study {spec.name}: `python -m sweep run {spec.name}` "
                           f"will run trial {number}; Ctrl-C leaves it queued")
        time.sleep(poll_s)
