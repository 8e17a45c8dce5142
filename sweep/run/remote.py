"""What runs inside a trial's Ray task: open the trial, run a :class:`Supervisor`, store the outcome.

The supervisor records the outcome itself (result record as user attributes, then ``tell``, through
:func:`sweep.run.outcome.write_outcome`), so a finished trial is stored even if the driver dies at that
moment. When the study cannot be reached at the end, the outcome still goes back to the driver through
Ray, and the driver stores it. The trial's files go to the artifact store on the way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from sweep import store as st
from sweep.neuron import environment
from sweep.run import liveness, notes
from sweep.run.outcome import (
    ATTR_ARTIFACT_ERROR,
    ATTR_ARTIFACTS,
    ATTR_ARTIFACTS_ERROR,
    ATTR_FIRST_STEP_UNIX,
    ATTR_LAUNCH_UNIX,
    ATTR_NOTE_ERROR,
    ATTR_SLOT_SECONDS,
    ATTR_SUPERVISOR_SECONDS,
    Outcome,
    outcome_attrs,
    write_outcome,
)
from sweep.run.supervisor import Reporter, Supervisor, TrialTask, as_float
from sweep.spec import Component, build_pruner
from sweep.spec import objective as obj
from sweep.store import artifacts
from sweep.store.artifacts import code_version

log = logging.getLogger("sweep.run.remote")


def run_trial_task(task: TrialTask) -> dict[str, Any]:
    """The Ray task body (the driver wraps it in ``ray.remote``): :func:`run_trial`, as plain values."""
    return run_trial(task).as_dict()


def run_trial(task: TrialTask) -> Outcome:
    """Supervise one trial end to end and record its outcome in the study. Never raises for trainer
    trouble; raises only if the study itself cannot be reached."""
    t0 = time.monotonic()
    # Under the competition profile the trainer runs with the image venv's python (sweep.neuron.environment);
    # a node without that venv is refused before the trial is marked started.
    python = environment.trainer_python(task.env)
    if python is not None:  # competition: the image venv's versions, recorded, and the study's first node's
        found = environment.read_versions(python)
        refusal, _ = environment.admit(task.storage_url, task.study, found, role="worker")
        if refusal:
            raise environment.ProfileError(refusal)
        task = replace(task, attrs={**task.attrs, environment.ATTR_VERSIONS: found})
    study, trial = open_trial(task)
    sup = Supervisor(task, reporter=OptunaReporter(study, trial, task), python=python)
    sup.marks["opened"] = time.monotonic() - t0
    # The commit of the code this trial runs, asked of git beside the launch, off the critical path.
    version: dict[str, Any] = {}
    probe = threading.Thread(target=lambda: version.update(code_version()), daemon=True)
    probe.start()
    try:
        outcome = sup.run()
    finally:
        sup.close()
    probe.join(timeout=10)
    try:
        outcome.told = store(study, trial, task, outcome, sup, t0, version)
    except Exception as e:  # the driver stores the outcome instead (it gets it from Ray)
        log.warning("trial %d: could not store the outcome: %s", task.number, st.scrub(str(e), task.storage_url))
        outcome.told = False
        outcome.slot_seconds = outcome.slot_seconds or time.monotonic() - t0
    return outcome


def open_trial(task: TrialTask) -> tuple[Any, Any]:
    """The study and trial of ``task``, marked started (the supervisor's heartbeat vouches for it now)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = st.open_storage(task.storage_url, role="worker")
    pruner = build_pruner(Component(task.pruner[0], task.pruner[1]))
    study = st.retry(lambda: optuna.load_study(study_name=task.study, storage=storage,
                                               sampler=optuna.samplers.RandomSampler(), pruner=pruner),
                     what="load study", url=task.storage_url)
    trial = st.retry(lambda: optuna.trial.Trial(study, task.trial_id), what="load trial", url=task.storage_url)
    liveness.mark_started(st.study_storage(study), task.trial_id, task.storage_url, ray_node_id())
    return study, trial


def ray_node_id() -> str | None:
    """The id of the Ray node this task runs on; None outside a Ray worker."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        return None


class OptunaReporter(Reporter):
    """The supervisor's reports, curve and heartbeat, written to the trial in the study."""

    def __init__(self, study: Any, trial: Any, task: TrialTask) -> None:
        self.study, self.trial, self.task = study, trial, task

    def report(self, value: float, step: int) -> bool:
        def call() -> bool:
            if step not in st.reported_steps(self.trial):
                self.trial.report(value, step)
            return bool(self.trial.should_prune())

        return st.retry(call, what=f"report trial {self.task.number}", url=self.task.storage_url, attempts=4)

    def keep(self, curve: list[list[float]]) -> None:
        metric, storage = self.task.curve_metric, st.study_storage(self.study)
        if metric != "val_bpb" and len(curve) == 1:  # named before its first point: the curve is read by it
            st.retry(lambda: storage.set_trial_user_attr(self.task.trial_id, obj.ATTR_CURVE_METRIC, metric),
                     what=f"curve of trial {self.task.number}", url=self.task.storage_url, attempts=4)
        st.retry(lambda: storage.set_trial_user_attr(self.task.trial_id, obj.curve_attr(metric), curve),
                 what=f"curve of trial {self.task.number}", url=self.task.storage_url, attempts=4)

    def heartbeat(self) -> bool:
        storage = st.study_storage(self.study)
        return liveness.keep_alive(storage, self.task.trial_id, self.task.number, self.task.storage_url)


def store(study: Any, trial: Any, task: TrialTask, out: Outcome, sup: Supervisor, t0: float,
          version: dict[str, Any] | None = None) -> bool:
    """Store the record, the artifacts and the outcome; False when someone else finished the trial first.

    ``slot_seconds`` (task start to just before ``tell``) is measured after every other write, so it
    covers all the supervisor's own work, uploads included.
    """
    extra: dict[str, Any] = {ATTR_ARTIFACTS: str(sup.artifact_dir)}
    if sup.artifacts_error:
        extra[ATTR_ARTIFACTS_ERROR] = sup.artifacts_error
    extra[ATTR_SUPERVISOR_SECONDS] = phases(sup.marks, t0)
    extra.update(task.attrs)
    extra.update(sup.launch_attrs)
    extra.update(version or {})
    if sup.launch_unix is not None:
        extra[ATTR_LAUNCH_UNIX] = sup.launch_unix
    if sup.first_step_unix is not None:
        extra[ATTR_FIRST_STEP_UNIX] = sup.first_step_unix
    attrs = outcome_attrs(out, extra)
    values = out.values if out.state == "COMPLETE" else None
    with contextlib.suppress(OSError):
        (sup.artifact_dir / "outcome.json").write_text(json.dumps({**out.as_dict(), "attrs": attrs}, default=str))

    def last() -> dict[str, Any]:
        """The curve's final point, the final report, the uploads; then the slot time, measured last.

        The final val_bpb closes a curve of val_bpb only: a script's curve of its own figure (a training loss)
        stays in that unit, and its reports end with it (the pruner compares like with like)."""
        rec = out.record or {}
        final = as_float(rec.get("val_bpb")) if rec.get("status") == "ok" and task.curve_metric == "val_bpb" else None
        if final is not None and task.objective.kind != "single":
            curve = [*sup.curve, [task.final_step, final]]
            st.retry(lambda: st.study_storage(study).set_trial_user_attr(task.trial_id, obj.ATTR_CURVE, curve),
                     url=task.storage_url)
        reported = task.objective.intermediate(final) if final is not None and out.state == "COMPLETE" else None
        if reported is not None and task.final_step not in st.reported_steps(trial):
            st.retry(lambda: trial.report(reported, task.final_step), url=task.storage_url)
        upload_artifacts(study, trial, task, out, sup.artifact_dir)
        failed = notes.guarded(f"trial {task.number}: note", lambda: notes.write_trial_note(
            trial, notes.trial_note(task.number, out.state, values, attrs, task.params, task.objective.names),
            task.storage_url), task.storage_url)
        out.slot_seconds = time.monotonic() - t0
        return {ATTR_SLOT_SECONDS: round(out.slot_seconds, 3), **({ATTR_NOTE_ERROR: failed} if failed else {})}

    told = write_outcome(study, task.trial_id, task.number, out.state, values, attrs, task.storage_url, last=last)
    if not told and not out.slot_seconds:  # finished by someone else before this supervisor could tell
        out.slot_seconds = time.monotonic() - t0
    return told


def upload_artifacts(study: Any, trial: Any, task: TrialTask, out: Outcome, work: Path) -> None:
    """Upload the trial's files to the artifact store (see :mod:`sweep.artifacts`); never fails the trial."""
    if not task.artifact_store:
        return
    try:
        result = work / "result.json"
        body = out.record if out.record is not None else {k: v for k, v in out.as_dict().items() if k != "record"}
        result.write_text(json.dumps(body, indent=1, default=str) + "\n")
        files = [work / "config.json", work / "trainer.log", work / "events.jsonl", result]
        # A script's trial: the script as it ran (its constants rewritten) and the kit's copy (model.script.run).
        files += sorted(p for p in (work / "script").glob("*.py") if p.is_file() and not p.is_symlink())
        if out.state == "COMPLETE" and keeps_checkpoint(study, task.objective, out):
            files.append(work / "final.pt")
        store = artifacts.open_store(task.artifact_store)
        for f in files:  # one retry unit per file, so a retried write cannot upload a file twice
            st.retry(lambda f=f: artifacts.upload_files(store, trial, [f]), what=f"upload {f.name}",
                     url=task.storage_url)
    except Exception as e:  # a full bucket or missing credentials must not lose the trial's outcome
        reason = st.scrub(f"{type(e).__name__}: {e}", task.storage_url)[:500]
        log.warning("trial %d: artifact upload failed: %s", task.number, reason)
        with contextlib.suppress(Exception):
            st.study_storage(study).set_trial_user_attr(task.trial_id, ATTR_ARTIFACT_ERROR, reason)


def keeps_checkpoint(study: Any, objective: obj.Objective, out: Outcome) -> bool:
    """Whether the trial's weights are worth uploading: a new best, or on the Pareto front."""
    if out.values is None:
        return False
    if not objective.multi:
        return artifacts.beats_best(study, out.values[0])
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return not any(obj.dominates(t.values, out.values, objective.directions) for t in done)


def phases(marks: dict[str, float], t0: float) -> dict[str, float]:
    """Where the supervisor's own time went: study open, launch, reaper start, exit after the result."""
    m = {k: v for k, v in marks.items() if k != "opened"}
    out = {"open": round(marks.get("opened", 0.0), 3)}
    if "launched" in m and "opened" in marks:
        out["launch"] = round(m["launched"] - t0 - marks["opened"], 3)
    if "reaper" in m and "launched" in m:
        out["reaper"] = round(m["reaper"] - m["launched"], 3)
    if "result" in m and "reaped" in m:
        out["exit_after_result"] = round(m["reaped"] - m["result"], 3)
    if "reaped" in m:
        out["record"] = round(time.monotonic() - m["reaped"], 3)
    return out
