"""The trial's attribute schema, and the one way an outcome is written, counted and retried.

Every key the run writes on a trial is named here: the system attributes that say who vouches for a
RUNNING trial (hidden in the dashboard; :mod:`sweep.run.liveness` reads and writes them) and the user
attributes that say what the trial was and how it ended. An outcome reaches the study through
:func:`write_outcome` whoever stores it: the supervisor its own (:mod:`sweep.run.remote`), the driver
one the supervisor could not store (:func:`tell_returned`) and the failures it finds itself
(:func:`fail_trial`). The val_bpb learning curve's key belongs to the objective
(:data:`sweep.objective.ATTR_CURVE`), which reads it back.

What counts towards ``n_trials``: every COMPLETE and PRUNED trial, and every FAIL that is final.
A FAIL is not final when it is a constraint rejection (never ran) or a retryable failure
(``crash``, ``lost``) of an original trial, because its retry stands in for it. So each proposed
point is run at most twice by its own fault. Ad-hoc trials (``sweep trial``) do not count.

A trial lost to the infrastructure (:data:`INFRA`: a Ray node, raylet or the GCS went away under it,
or the store could not be reached; the driver tells this from the trial's own failures in
:mod:`sweep.run.health`) is not a result at all: it never counts, and it is re-run with the same
parameters, as often as the infrastructure takes it, under a new number with ``rerun_of`` pointing
back. A re-run stands where its trial stood (a retry's re-run is still the retry). What bounds a
study whose trials keep being lost is the driver's circuit breaker, not the count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from sweep import store as st
from sweep.spec.objective import ATTR_CURVE_METRIC
from sweep.store.artifacts import ATTR_WORKDIR

# -- system attributes: liveness (see sweep.run.liveness) ---------------------------------------------
ATTR_HEARTBEAT = "sweep:heartbeat"  # unix time, refreshed while someone is responsible for the trial
ATTR_DRIVER = "sweep:driver"  # {"host", "pid", "pid_start", "run"} of the driver that asked it
ATTR_STARTED = "sweep:started"  # unix time the supervisor started (the task left Ray's queue)
ATTR_SUGGESTED = "sweep:suggested"  # unix time the driver had drawn every parameter (set with its claim)
ATTR_NODE = "sweep:node"  # the Ray node id the supervisor runs on (tells a node's death from the trial's)

# -- user attributes: how the trial ended -------------------------------------------------------------
ATTR_RECORD_FIELDS = "record_fields"  # the trainer's result record's keys; each is a user attribute too
ATTR_FAIL_KIND = "fail_kind"  # why a FAIL failed (or a PRUNED diverged): crash, lost, oom, deadline, ...
ATTR_FAIL_REASON = "fail_reason"  # one line, for a trial that did not complete
ATTR_SLOT_SECONDS = "slot_seconds"  # task start to just before the tell: what the trial cost its slot
ATTR_SUPERVISOR_SECONDS = "supervisor_seconds"  # where the supervisor's own time went, by phase
ATTR_LAUNCH_UNIX = "launch_unix"  # unix time the trainer was started
ATTR_FIRST_STEP_UNIX = "first_step_unix"  # unix time of the trainer's first step event
ATTR_ARTIFACTS = ATTR_WORKDIR  # "artifacts": the trial's working directory on its node (artifacts.py reads it)
ATTR_ARTIFACTS_ERROR = "artifacts_error"  # why the working files are not where the spec said (full disk)
ATTR_ARTIFACT_ERROR = "artifact_error"  # why the upload to the artifact store failed
ATTR_NOTE_ERROR = "note_error"  # why the trial's dashboard note could not be written (sweep.run.notes)

# -- user attributes: what the trial is --------------------------------------------------------------
ATTR_SPEC_HASH = "spec_hash"  # the spec file the trial ran under
ATTR_RETRY_OF = "retry_of"  # the number of the failed trial this one retries
ATTR_RERUN_OF = "rerun_of"  # the number of the trial lost to the infrastructure that this one runs again
ATTR_RANDOM_FEASIBLE = "random_feasible"  # enqueued after too many constraint rejections in a row
ATTR_ADHOC = "adhoc"  # a `sweep trial`: takes a slot, never counts
ATTR_ADHOC_BUDGET = "adhoc_budget_s"  # an ad-hoc trial's own budget (sweep trial --budget-s)
ATTR_ADHOC_SAMPLED = "adhoc_sampled"  # the parameters `sweep trial` drew because --params lacked them
ATTR_ADHOC_PRUNABLE = "adhoc_prunable"  # `sweep trial --prunable`: the study's pruner may stop it

# Written first, so the dashboard lists them first (a trial's attribute box shows about six lines, and
# the trial table's columns follow the order attributes were first written in the study).
HEADLINE_ATTRS = ("status", ATTR_FAIL_KIND, ATTR_FAIL_REASON, "val_bpb", "core", "tokens_per_second", "steps", "mfu",
                  "train_seconds", "git_commit", "git_dirty")

RETRYABLE = frozenset({"crash", "lost"})  # fail kinds retried once with the same parameters
CONSTRAINT = "constraint"  # the fail kind of a point the space's constraints rejected (never ran)
INFRA = "infra"  # the fail kind of a trial lost to the infrastructure: never counts, re-run with its parameters
# What a re-run carries over from the trial it runs again: what that trial stood for in the study.
RERUN_CARRIES = (ATTR_RETRY_OF, ATTR_RANDOM_FEASIBLE)


@dataclass
class Outcome:
    """How a trial ended, as returned to the driver. ``told``: the supervisor stored it itself."""

    number: int
    state: str  # "COMPLETE" | "PRUNED" | "FAIL"
    value: float | None = None  # single and composite objectives
    values: list[float] | None = None  # every objective value of a COMPLETE trial (one for single objectives)
    fail_kind: str | None = None
    reason: str | None = None
    slot_seconds: float = 0.0
    told: bool = False
    record: dict[str, Any] | None = None
    last_step: int | None = None
    curve_metric: str = "val_bpb"  # what its intermediate values are (sweep.run.supervisor.curve_metric)

    @property
    def retryable(self) -> bool:
        return self.state == "FAIL" and self.fail_kind in RETRYABLE

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- counting and retrying ----------------------------------------------------------------------------

def counts(t: Any) -> bool:
    """Whether a finished trial uses up one of the study's ``n_trials`` (see the module docstring)."""
    from optuna.trial import TrialState

    if t.user_attrs.get(ATTR_ADHOC):
        return False
    if t.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    if t.state == TrialState.FAIL:
        kind = t.user_attrs.get(ATTR_FAIL_KIND)
        if kind in (CONSTRAINT, INFRA):
            return False
        return not (kind in RETRYABLE and ATTR_RETRY_OF not in t.user_attrs)
    return False


def needs_retry(t: Any) -> bool:
    """A FAIL whose retry has not been enqueued yet must get one (checked against existing retries)."""
    from optuna.trial import TrialState

    return (t.state == TrialState.FAIL and t.user_attrs.get(ATTR_FAIL_KIND) in RETRYABLE
            and ATTR_RETRY_OF not in t.user_attrs and not t.user_attrs.get(ATTR_ADHOC))


def retries_due(trials: list[Any], only: set[int] | None = None) -> list[Any]:
    """The failures among ``trials`` (or among the numbers ``only``) that need a retry nobody enqueued yet."""
    retried = {t.user_attrs.get(ATTR_RETRY_OF) for t in trials}
    return [t for t in trials if (only is None or t.number in only) and needs_retry(t) and t.number not in retried]


def enqueue_retry(study: Any, t: Any, url: str) -> None:
    """Enqueue the retry of the failed trial ``t``: its parameters again, pointing back at it."""
    st.retry(lambda: study.enqueue_trial(dict(t.params), user_attrs={ATTR_RETRY_OF: t.number}), url=url)


def lost_to_infra(t: Any) -> bool:
    """Whether ``t`` is a FAIL the infrastructure caused (never counted, re-run)."""
    from optuna.trial import TrialState

    return t.state == TrialState.FAIL and t.user_attrs.get(ATTR_FAIL_KIND) == INFRA


def rerun_params(t: Any) -> dict[str, Any] | None:
    """The complete parameters a trial lost to the infrastructure runs again with, or None.

    An enqueued point (a retry, a warm or hand-picked one) is whole in its ``fixed_params`` from the
    start; a sampled one only once the driver drew every parameter (:data:`ATTR_SUGGESTED`). A trial
    whose driver died before that never ran and has no point to run again: drawing what it lacks
    would run a point nobody proposed, so the study asks a fresh one instead.
    """
    fixed = t.system_attrs.get("fixed_params")
    if fixed:
        return dict(fixed)
    return dict(t.params) if ATTR_SUGGESTED in t.system_attrs else None


def needs_rerun(t: Any) -> bool:
    """A trial lost to the infrastructure whose point is known must run again (ad-hoc ones are not)."""
    return lost_to_infra(t) and not t.user_attrs.get(ATTR_ADHOC) and rerun_params(t) is not None


def reruns_due(trials: list[Any], only: set[int] | None = None) -> list[Any]:
    """The trials lost to the infrastructure (among the numbers ``only``) that nobody re-ran yet."""
    rerun = {t.user_attrs.get(ATTR_RERUN_OF) for t in trials}
    return [t for t in trials if (only is None or t.number in only) and needs_rerun(t) and t.number not in rerun]


def enqueue_rerun(study: Any, t: Any, url: str) -> None:
    """Enqueue the trial lost to the infrastructure ``t`` again: the same point, standing where it stood."""
    params = rerun_params(t)
    if params is None:
        raise ValueError(f"trial {t.number} has no complete parameters to run again")
    attrs = {k: t.user_attrs[k] for k in RERUN_CARRIES if k in t.user_attrs}
    st.retry(lambda: study.enqueue_trial(params, user_attrs={**attrs, ATTR_RERUN_OF: t.number}), url=url)


# -- writing ------------------------------------------------------------------------------------------

def outcome_attrs(out: Outcome, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """An outcome's user attributes in the order they are written: the headline ones that are set
    (:data:`HEADLINE_ATTRS`), then the rest of the result record, its field list, ``extra`` (the
    supervisor's bookkeeping), the fail kind and, unless it completed, the reason."""
    attrs: dict[str, Any] = dict(out.record or {})
    attrs[ATTR_RECORD_FIELDS] = sorted(out.record or {})
    attrs.update(extra or {})
    if out.curve_metric != "val_bpb":
        attrs[ATTR_CURVE_METRIC] = out.curve_metric
    if out.fail_kind:
        attrs[ATTR_FAIL_KIND] = out.fail_kind
    if out.reason and out.state != "COMPLETE":
        attrs[ATTR_FAIL_REASON] = out.reason
    return {**{k: attrs[k] for k in HEADLINE_ATTRS if attrs.get(k) is not None}, **attrs}


def write_attrs(storage: Any, trial_id: int, attrs: dict[str, Any], url: str) -> None:
    """Set user attributes one by one, each its own retry unit, in ``attrs``' order."""
    for k, v in attrs.items():
        st.retry(lambda k=k, v=v: storage.set_trial_user_attr(trial_id, k, v), url=url)


def write_outcome(study: Any, trial_id: int, number: int, state: str, values: list[float] | None,
                  attrs: dict[str, Any], url: str, last: Callable[[], dict[str, Any]] | None = None) -> bool:
    """Store an outcome unless the trial is finished already: ``attrs``, then what ``last`` does and
    returns (the supervisor's curve, final report, uploads and slot time), then ``tell``.

    True when this call finished the trial in ``state``; False when someone else finished it first
    (another driver declared it lost, or the supervisor beat the driver to it).

    Optuna gives a PRUNED trial its last intermediate value as its value. Where those are not val_bpb
    (``attrs`` name their metric, :data:`ATTR_CURVE_METRIC`: a script's training loss), the trial is stored
    without a value, so no training loss stands in a val_bpb column; its last one is in its reason.
    """
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.trial import TrialState

    storage = st.study_storage(study)
    told = TrialState[state]
    bare = told == TrialState.PRUNED and attrs.get(ATTR_CURVE_METRIC, "val_bpb") != "val_bpb"
    try:
        if st.retry(lambda: storage.get_trial(trial_id), url=url).state.is_finished():
            return False
        write_attrs(storage, trial_id, attrs, url)
        if last is not None:
            write_attrs(storage, trial_id, last(), url)
        tell = (lambda: _prune_bare(study, trial_id)) if bare else (
            lambda: study.tell(number, values, state=told, skip_if_finished=True))
        frozen = st.retry(tell, url=url)
        return frozen.state == told
    except UpdateFinishedTrialError:
        return False
    except RuntimeError as e:
        if "finished" in str(e).lower():
            return False
        raise


def _prune_bare(study: Any, trial_id: int) -> Any:
    """``study.tell(PRUNED)`` without the value Optuna would take from the last report: the sampler hears of it
    as from tell, then the state is stored with no value. A finished trial is left as it is (as with
    ``skip_if_finished``)."""
    from optuna.trial import TrialState

    storage = st.study_storage(study)
    frozen = storage.get_trial(trial_id)
    if frozen.state.is_finished():
        return frozen
    study.sampler.after_trial(study, frozen, TrialState.PRUNED, None)
    storage.set_trial_state_values(trial_id, TrialState.PRUNED, None)
    return storage.get_trial(trial_id)


def fail_attrs(kind: str, reason: str) -> dict[str, Any]:
    """The user attributes of a failure the driver finds (lost, deadline, constraint, ...)."""
    return {ATTR_FAIL_KIND: kind, ATTR_FAIL_REASON: reason}


def fail_trial(study: Any, trial_id: int, number: int, kind: str, reason: str, url: str) -> bool:
    """Tell FAIL with kind and reason unless the trial already finished; True if this call did."""
    return write_outcome(study, trial_id, number, "FAIL", None, fail_attrs(kind, reason), url)


def fail_infra(study: Any, trial_id: int, number: int, reason: str, url: str) -> bool:
    """Record that the infrastructure lost the trial (kind :data:`INFRA`); True if this call finished it.
    The caller enqueues its re-run (:func:`reruns_due`, :func:`enqueue_rerun`)."""
    return fail_trial(study, trial_id, number, INFRA, reason, url)


def tell_returned(study: Any, trial_id: int, result: dict[str, Any], url: str) -> bool:
    """Store an outcome the supervisor returned but could not store itself (a database outage).

    ``result`` is :meth:`Outcome.as_dict` as Ray carried it back; the slot time is the supervisor's,
    written last as it would have.
    """
    out = Outcome(number=result["number"], state=result["state"], fail_kind=result.get("fail_kind"),
                  reason=result.get("reason"), record=result.get("record"),
                  curve_metric=result.get("curve_metric") or "val_bpb")
    attrs = outcome_attrs(out)
    attrs[ATTR_SLOT_SECONDS] = result.get("slot_seconds")
    values = None
    if out.state == "COMPLETE":  # a supervisor of older code returns "value" only
        values = result.get("values") or [result["value"]]
    return write_outcome(study, trial_id, out.number, out.state, values, attrs, url)
