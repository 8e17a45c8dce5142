"""The sweep driver: ``python -m sweep run NAME``.

It creates or resumes the Optuna study, keeps one trial in flight per free slot as a Ray task
(``max_retries=0``, the slot's resources, one supervisor and one trainer group per task), notices
dead trials, prints what happens, and stops when the study holds ``n_trials`` finished trials.

What counts towards ``n_trials``, and which failures are retried, is :mod:`sweep.run.outcome`'s;
when a RUNNING trial is lost is :mod:`sweep.run.liveness`'s. Lost trials are told FAIL with the
reason and retried once under a new number with ``retry_of`` pointing back.

Long file: one class, the sweep loop and the state it keeps between polls, which reads best whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import sys
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, TextIO

from sweep import store as st
from sweep.printable import printable
from sweep.run import health, liveness, notes, printing
from sweep.run.autoscale import Capacity
from sweep.run.outcome import (
    ATTR_ADHOC,
    ATTR_ADHOC_BUDGET,
    ATTR_ADHOC_PRUNABLE,
    ATTR_NODE,
    ATTR_RANDOM_FEASIBLE,
    ATTR_SPEC_HASH,
    CONSTRAINT,
    INFRA,
    RETRYABLE,
    counts,
    enqueue_rerun,
    enqueue_retry,
    fail_infra,
    fail_trial,
    reruns_due,
    retries_due,
    tell_returned,
)
from sweep.run.remote import run_trial_task
from sweep.run.supervisor import TrialTask
from sweep.run.warm import WarmPicker
from sweep.spec import StudySpec, build_pruner, build_sampler, spec_hash
from sweep.spec import objective as obj
from sweep.spec.space import ConstraintViolation
from sweep.store import artifacts as art
from sweep.study import python_cmd, study_arg

MAX_CONSTRAINT_REJECTS = 100
PROGRESS_EVERY_S = 30.0
PROBE_EVERY_S = 5.0  # how often the driver asks the GCS whether its Ray is there (the pids: every poll)
EXIT_STOPPED = 3  # stopped before the study was done (its Ray went away, the circuit breaker): resume later
# How long the driver waits for a store that is away (each storage call, from its first failure) before it
# gives up and exits: a PostgreSQL restart or failover takes seconds to a minute, its trials keep training.
STORE_WAIT_S = 300.0


class SweepAborted(Exception):
    """The sweep cannot go on (e.g. the trainer rejects the spec's config); exit 2, one line."""


class SweepStopped(Exception):
    """The driver stops launching before the study is done: its Ray went away (``infra``: trials in flight are
    lost to it) or the circuit breaker tripped. Exit :data:`EXIT_STOPPED`, one line naming the cause and the
    command that resumes."""

    def __init__(self, cause: str, infra: bool = True) -> None:
        super().__init__(cause)
        self.cause, self.infra = cause, infra


@dataclass
class InFlight:
    """A trial the driver submitted and waits for."""

    number: int
    trial_id: int
    params: dict[str, Any]
    submitted: float
    started: float | None = None
    reported: set[int] = field(default_factory=set)
    cancelled: str | None = None  # why the driver cancelled it, if it did
    deadline_s: float | None = None  # the trainer's hard limit when not the spec's (ad-hoc --budget-s)


class Driver:
    """One sweep run over a study; :meth:`run` returns the process exit code."""

    def __init__(self, spec: StudySpec, out: TextIO | None = None, poll_s: float = 1.0, next_steps: bool = True,
                 own_only: bool = False) -> None:
        self.spec = spec
        self.out = out or sys.stdout
        self.poll_s = poll_s
        self.next_steps = next_steps  # end the run with the commands to run next (a promotion prints its report)
        # `sweep trial --now`: speak of and watch only the trials it submits (no study progress, no reaping)
        self.own_only = own_only
        self.url = st.resolve_url(spec.storage)
        self.spec_hash = spec_hash(spec.path)
        self.run_id = uuid.uuid4().hex[:8]
        self.identity = {**liveness.host_identity(), "run": self.run_id}
        self.inflight: dict[Any, InFlight] = {}
        self._asked: set[int] = set()  # ids of every trial this run asked, claimed or not (see _settled)
        self.t0 = time.monotonic()
        self._started_ray = False
        self.watch: health.RayWatch | None = None  # is the Ray we launch into still there (sweep.run.health)
        self.breaker = health.CircuitBreaker(spec.max_failures_in_a_row)
        self._last_probe = 0.0
        self._infra_loss = False  # a trial was lost to the infrastructure: check that nodes can hold trials
        self._waiting_since: float | None = None  # on a cluster: since when no node can run a trial
        self._last_words = ""  # the line a stopped run ends with
        self._store_since: float | None = None  # since when the store cannot be reached
        self._last_scan = 0.0
        # When the store last came back from an outage this process waited out (unix time).
        self._store_back = (st.last_outage() or (0.0, 0.0))[1]
        self._last_progress = 0.0
        self._rejects = 0
        self._rng = random.Random()
        self._stop: str | None = None
        self.study: Any = None
        self._remote: Any = None
        self._warm = WarmPicker(spec)  # enqueued trials whose graphs are compiled go first
        self._proxy: st.StorageProxy | None = None
        self.worker_url = self.url  # what trials use: the store itself, or the driver's gRPC proxy
        self.capacity: Capacity | None = None  # slots and the autoscaler request (sweep.run.autoscale)

    # -- printing -------------------------------------------------------------------------------

    def say(self, msg: str) -> None:
        print(printable(st.scrub(msg, self.url)), file=self.out, flush=True)

    # -- setup ----------------------------------------------------------------------------------

    def open_study(self) -> Any:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        storage = st.open_storage(self.url, role="driver")
        spec = self.spec
        study = st.retry(lambda: optuna.create_study(study_name=spec.name, storage=storage,
                                                     directions=spec.directions, load_if_exists=True,
                                                     sampler=optuna.samplers.RandomSampler(),
                                                     pruner=build_pruner(spec.pruner)),
                         what="open study", url=self.url)
        stored = [d.name.lower() for d in study.directions]
        if stored != spec.directions:
            word = "direction" if len(stored) == len(spec.directions) == 1 else "directions"
            raise SweepAborted(f"study {spec.name!r} exists with {word} {', '.join(stored)}, "
                               f"spec says {', '.join(spec.directions)}")
        names = spec.objective.names
        if study.metric_names not in (None, names):
            raise SweepAborted(f"study {spec.name!r} exists with objective {', '.join(study.metric_names)}, "
                               f"spec says {', '.join(names)}")
        existing = len(study.get_trials(deepcopy=False))
        # Re-seed on resume, or a seeded sampler would propose its first points all over again.
        sampler_spec = spec.sampler
        if "seed" in sampler_spec.options and existing:
            sampler_spec = type(sampler_spec)(sampler_spec.name,
                                              {**sampler_spec.options, "seed": sampler_spec.options["seed"] + existing})
        study.sampler = build_sampler(sampler_spec)
        self._rng = random.Random((spec.seed or 0) + existing)
        with contextlib.suppress(Exception):
            for k, v in {"spec": str(spec.path), "budget_s": spec.budget_s, "n_trials": spec.n_trials,
                         "direction": ", ".join(spec.directions), "spec_hash": self.spec_hash,
                         "objective": spec.objective.describe()}.items():
                if study.user_attrs.get(k) != v:
                    study.set_user_attr(k, v)
            if study.metric_names != names:  # the dashboard's names for the objectives
                study.set_metric_names(names)
        self.study = study
        return study

    def connect_ray(self) -> None:
        import ray

        if ray.is_initialized():  # someone else's Ray (a test's, `sweep trial --now`'s driver): watched via its GCS
            self.watch = self.watch or health.RayWatch(local=False)
            return
        address = os.environ.get("RAY_ADDRESS")
        kwargs: dict[str, Any] = {"namespace": "trnsweep", "log_to_driver": False, "logging_level": logging.WARNING}
        if address:
            ray.init(address=address, **kwargs)
        else:
            kwargs |= {"include_dashboard": False, "num_cpus": os.cpu_count() or 1,
                       "object_store_memory": 200 * 1024**2}
            # address="local": always a Ray of its own, even where /tmp/ray/ray_current_cluster still names
            # a cluster that is gone (a head killed without its clean-up), which ray.init() would try to join.
            with quiet_local_token_notice():
                ray.init(address="local", **kwargs)
            self._started_ray = True
        self.watch = health.RayWatch(local=self._started_ray)
        missing = [r for r in self.spec.resources.as_dict() if ray.cluster_resources().get(r, 0) <= 0]
        if missing and self._started_ray:
            raise SweepAborted(f"{self.spec.path}: trial.resources: this machine's Ray has no {', '.join(missing)}")
        if missing:
            self.say(f"warning: the cluster has no {', '.join(missing)} yet; trials wait until it does")

    def slots(self) -> int:
        return self._capacity().slots()

    def _capacity(self) -> Capacity:
        if self.capacity is None:  # joined a cluster: it may autoscale; a local Ray this driver started cannot
            joined = bool(os.environ.get("RAY_ADDRESS")) and not self._started_ray
            self.capacity = Capacity(self.spec, cluster=joined, say=self.say)
        return self.capacity

    # -- main loop ------------------------------------------------------------------------------

    def run(self) -> int:
        spec = self.spec
        self.say(f"study {spec.name}: storage {st.redact(self.url)}, {spec.n_trials} trials, "
                 f"budget {spec.budget_s:g} s, deadline {spec.deadline_s:g} s per trial")
        self.open_study()
        self.connect_ray()
        self.start_proxy()
        self.say(f"ray: {self._ray_summary()}; {self.slots()} trial slot(s)")
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        patience = contextlib.ExitStack()
        patience.enter_context(st.patience(STORE_WAIT_S))  # a store away for a while is waited out, not fatal
        try:
            self.reconcile()
            while self.step():
                pass
            self.progress(force=time.monotonic() - self._last_progress > 1.0)
            self.print_best()
            return 0
        except SweepStopped as e:
            return self.stopped(e)
        except KeyboardInterrupt:
            self.abandon(f"driver interrupted ({self._stop or 'SIGINT'})")
            self.say("interrupted: running trials failed as lost; `sweep run` again resumes with their retries")
            return 1
        except SweepAborted:
            self.abandon("sweep aborted")
            raise
        finally:
            patience.close()
            for s, h in old.items():
                signal.signal(s, h)
            self.shutdown()
            if self._last_words:
                self.say(self._last_words)

    def step(self) -> bool:
        """One turn of the loop (:meth:`turn`); False once the study is done. A store that cannot be reached
        (after :func:`sweep.store.retry`'s own tries) is waited for."""
        if self._stop:
            raise KeyboardInterrupt(self._stop)
        try:
            if not self.turn():
                return False
        except Exception as e:
            if not st.is_transient(e):
                raise
            self._store_away(e)
            return True
        if self._store_since is not None:
            self.say(f"store: reachable again after {time.monotonic() - self._store_since:.0f} s")
            self._store_since = None
        return True

    def turn(self) -> bool:
        """Launch into the free slots, wait a poll for results; False once the study is done."""
        spec = self.spec
        launch = self.check_ray()
        trials = self._settled(self.scan())
        done = sum(counts(t) for t in trials)
        # Ad-hoc trials (`sweep trial`) take slots but never count, and run even when the count is reached.
        running = sum(1 for t in trials if t.state.name == "RUNNING" and not t.user_attrs.get(ATTR_ADHOC))
        adhoc = sum(1 for t in trials if t.state.name == "WAITING" and t.user_attrs.get(ATTR_ADHOC))
        want = max(spec.n_trials - done - running, adhoc)
        self._capacity().demand(len(self.inflight) + max(want, 0))
        while want > 0 and len(self.inflight) < self.slots() and launch and not self._stop:
            if self.launch_next():
                want -= 1
            launch = self.check_ray(probe=False)
        if self.breaker.tripped and not self.inflight and want > 0:
            raise SweepStopped(self._breaker_cause(), infra=False)
        # A trial its dead driver left RUNNING, or one no driver claimed, ends here: stored by its
        # supervisor, or lost (liveness.orphaned) and re-run or asked anew.
        if not self.inflight and want <= 0 and (self.own_only or not any(
                liveness.orphan_of_dead_driver(t, self.run_id) or liveness.unclaimed(t) for t in trials)):
            return False
        self.wait_some()
        return True

    def _store_away(self, e: BaseException) -> None:
        """The store stayed unreachable through a call's retries: trials keep running (their supervisors
        retry too), nothing is launched; past ``infra_wait_s`` the run stops (exit 3)."""
        now = time.monotonic()
        why = st.scrub(st.first_line(e), self.url)
        if self._store_since is None:
            self._store_since = now
            self.say(f"store: unreachable ({why}); launching nothing, waiting up to {self.spec.infra_wait_s:g} s "
                     "([study] infra_wait_s)")
        elif now - self._store_since > self.spec.infra_wait_s:
            raise SweepStopped(f"the store stayed unreachable for {self.spec.infra_wait_s:g} s "
                               f"([study] infra_wait_s): {why}") from e
        time.sleep(self.poll_s)

    # -- the infrastructure ---------------------------------------------------------------------

    def check_ray(self, probe: bool = True) -> bool:
        """Whether to launch now. Raises :class:`SweepStopped` when the local Ray is gone, or a cluster has
        had no node able to run a trial for ``infra_wait_s``; False while waiting for one or the breaker
        has tripped. The local Ray's processes are checked every call, the GCS every ``PROBE_EVERY_S``."""
        if self.watch is None:
            return not self.breaker.tripped
        gone = self.watch.process_gone()
        if gone:
            raise SweepStopped(gone)
        now = time.monotonic()
        if probe and now - self._last_probe >= PROBE_EVERY_S:
            self._last_probe = now
            problem = self.watch.problem()
            if problem is None and self._infra_loss and self.watch.fits(self.spec.resources.as_dict()) is False:
                problem = "no live Ray node can hold a trial"
            self._waiting(problem, now)
        return self._waiting_since is None and not self.breaker.tripped

    def _waiting(self, problem: str | None, now: float) -> None:
        """Start, go on with or end the wait for nodes; a local Ray is not waited for."""
        if problem is None:
            if self._waiting_since is not None:
                self.say(f"ray: nodes are back after {now - self._waiting_since:.0f} s; launching again")
            self._waiting_since, self._infra_loss = None, False
            return
        if self.watch is not None and self.watch.local:
            raise SweepStopped(problem)
        if self._waiting_since is None:
            self._waiting_since = now
            self.say(f"ray: {problem}; launching nothing, waiting up to {self.spec.infra_wait_s:g} s for nodes "
                     "([study] infra_wait_s)")
        elif now - self._waiting_since > self.spec.infra_wait_s:
            raise SweepStopped(f"{problem} for {self.spec.infra_wait_s:g} s ([study] infra_wait_s)")

    def _breaker_cause(self) -> str:
        b = self.breaker
        last = f" (last: {b.last_reason[:160]})" if b.last_reason else ""
        return (f"circuit breaker: {b.streak} trials in a row ended FAIL ({b.kind}){last}, at most "
                f"{b.threshold} allowed ([study] max_failures_in_a_row)")

    def stopped(self, e: SweepStopped) -> int:
        """Stop before the study is done: trials in flight lost to the infrastructure (re-run by the resume,
        never counted), one line with the cause and the command that resumes; exit :data:`EXIT_STOPPED`."""
        lost = len(self.inflight)
        if lost:
            self.abandon(f"lost to the infrastructure: {e.cause}", kind=INFRA, cancel=False)
        with contextlib.suppress(Exception):
            self._enqueue_retries()
        running = f"{lost} running trial(s) lost to it, re-run then, not counted; " if lost else ""
        what = "fix the cause, then resume" if not e.infra else "resume once Ray is back"
        # Said after Ray is shut down (run's finally), so that it is the run's last line.
        self._last_words = f"sweep stopped: {e.cause}; {running}{what}: {python_cmd()} -m sweep run " \
                           f"{study_arg(self.spec)}"
        return EXIT_STOPPED

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stop = signal.Signals(signum).name

    def start_proxy(self) -> None:
        """Put Optuna's gRPC proxy between the workers and a database when asked (spec or environment)."""
        if self._proxy is not None or not st.proxy_wanted(self.spec.storage_proxy):
            return
        if not st.is_database(self.url) or st.is_proxy(self.url):
            self.say(f"storage proxy: not used for {st.redact(self.url)} (it fronts a database only)")
            return
        self._proxy = st.StorageProxy(self.url)
        self.worker_url = self._proxy.url
        self.say(f"storage proxy: workers use {st.redact(self.worker_url)}")

    def shutdown(self) -> None:
        if self.capacity is not None:
            self.capacity.release()
        if self._proxy is not None:
            self._proxy.close()
            self._proxy = None
            self.worker_url = self.url
        if self._started_ray:
            import ray

            # What the local Ray started; a Ray whose GCS died leaves its agents (and workers) behind on shutdown.
            tree = self.watch.tree() if self.watch is not None else {}
            with contextlib.suppress(Exception):
                ray.shutdown()
            health.end_leftovers(tree)
            self._started_ray = False

    def _ray_summary(self) -> str:
        import ray

        res = ray.cluster_resources()
        keys = [k for k in ("CPU", "GPU", "neuron_cores") if k in res]
        return ", ".join(f"{k}={res[k]:g}" for k in keys) or "no resources"

    # -- asking and launching -------------------------------------------------------------------

    def launch_next(self) -> bool:
        """Ask one trial and submit it; False when it was rejected by a constraint."""
        trial = st.retry(lambda: self._warm.claim(self.study) or self.study.ask(), what="ask", url=self.url)
        return self.launch(trial)

    def launch(self, trial: Any, placement: dict[str, Any] | None = None) -> bool:
        """Claim an asked trial, draw its parameters and submit it (``placement``: Ray options, see :meth:`submit`);
        False when it was rejected by a constraint."""
        study, spec = self.study, self.spec
        self._asked.add(st.trial_id(trial))  # before the claim: an outage may cut the launch from here on
        self._seed_sampler(trial.number)
        st.retry(lambda: liveness.claim(st.study_storage(study), st.trial_id(trial), self.identity),
                 what="claim", url=self.url)
        try:
            params = spec.space.suggest(trial)
        except ConstraintViolation as cv:
            fail_trial(study, st.trial_id(trial), trial.number, CONSTRAINT, str(cv), self.url)
            self._rejects += 1
            if self._rejects >= MAX_CONSTRAINT_REJECTS:
                point = spec.space.sample_feasible(self._rng)
                if point is not None:
                    self.say(f"{self._rejects} constraint rejections in a row; enqueueing a random feasible point")
                    study.enqueue_trial(point, user_attrs={ATTR_RANDOM_FEASIBLE: True})
                self._rejects = 0
            return False
        self._rejects = 0
        # Only now, every parameter drawn, may the trial be run again with them (outcome.rerun_params).
        st.retry(lambda: liveness.mark_suggested(st.study_storage(study), st.trial_id(trial)),
                 what="mark suggested", url=self.url)
        self.submit(trial.number, st.trial_id(trial), params, trial.user_attrs, placement)
        return True

    def _seed_sampler(self, number: int) -> None:
        """Seed a seeded sampler afresh for each trial from the study's seed and the trial's number.

        Numbers are unique in a study, so two drivers running the same seeded spec at once (or a
        resumed one) never draw the same stream and never propose the same points, and one driver
        alone stays reproducible. Relative samplers (GP, CMA-ES, multivariate TPE) draw inside
        ``ask``, before the number is known: for them this separates only the later draws.
        """
        sampler = self.spec.sampler
        if "seed" in sampler.options:
            seeded = type(sampler)(sampler.name, {**sampler.options, "seed": sampler.options["seed"] + number})
            self.study.sampler = build_sampler(seeded)

    @property
    def _curve_label(self) -> str:
        """What the intermediate values are: val_bpb for our trainer, a script's own figure otherwise."""
        script = self.spec.script
        if script is None:
            return "val_bpb"
        return "val" if script.output.get("val") else "train_loss_smoothed"

    def _script_attrs(self, params: dict[str, Any]) -> dict[str, str]:
        """A study of a script records the script it ran with every trial (sweep.spec.script)."""
        script = self.spec.script_for(params)
        return {} if script is None else {"script_sha256": script.sha256, "script_path": str(script.script)}

    def submit(self, number: int, trial_id: int, params: dict[str, Any], user_attrs: dict[str, Any],
               placement: dict[str, Any] | None = None) -> Any:
        """Start the trial's Ray task; ``placement`` adds Ray options (a comparison pins a pair to one node).
        Returns the task's reference."""
        import ray

        spec = self.spec
        script = spec.script_for(params)
        config = {**spec.trainer_config(params), "startup_allowance_s": spec.startup_allowance_s,
                  "eval_fractions": list(spec.eval_fractions)}
        # An ad-hoc trial runs to its end unless asked (--prunable); one with its own budget always does, since
        # the pruner's rungs belong to the spec's budget.
        budget_s = float(user_attrs.get(ATTR_ADHOC_BUDGET, spec.budget_s))
        prunable = budget_s == spec.budget_s and (not user_attrs.get(ATTR_ADHOC) or user_attrs.get(ATTR_ADHOC_PRUNABLE))
        pruner = (spec.pruner.name, dict(spec.pruner.options)) if prunable else ("none", {})
        store = art.artifacts_url(spec.artifacts)
        task = TrialTask(
            study=spec.name, storage_url=self.worker_url, number=number, trial_id=trial_id, params=params,
            config=config, budget_s=budget_s, deadline_s=spec.deadline_s - spec.budget_s + budget_s,
            eval_fractions=spec.eval_fractions, ranks=spec.ranks, trainer=spec.trainer,
            launches_ranks=spec.script is not None,
            stop_grace_s=spec.stop_grace_s, heartbeat_s=spec.heartbeat_s,
            env={**spec.env, **spec.environment.trial_env()}, pruner=pruner,
            artifact_dir=str(art.scratch_root(store) / spec.name / str(number)), artifact_store=store,
            attrs={ATTR_SPEC_HASH: self.spec_hash, **self._script_attrs(params), **spec.environment.attrs()},
            compile_cache=spec.compile_cache,
            objective=spec.objective, pass_env=script.pass_env if script is not None else (),
            run_as=script.run_as if script is not None else "",
        )
        if self._remote is None:
            self._remote = ray.remote(run_trial_task)
        ref = self._remote.options(max_retries=0, name=f"{spec.name}-trial-{number}",
                                   **{**spec.resources.ray_options(), **(placement or {})}).remote(task)
        self.inflight[ref] = InFlight(number, trial_id, params, time.monotonic(), deadline_s=task.deadline_s)
        self.say(printing.started_line(number, params, user_attrs))
        return ref

    # -- waiting and results --------------------------------------------------------------------

    def wait_some(self) -> None:
        import ray

        refs = list(self.inflight)
        if not refs:
            time.sleep(self.poll_s)
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.poll_s)
        for ref in ready:
            slot = self.inflight.pop(ref)
            try:
                self.finish(slot, ref)
            except Exception as e:
                if st.is_transient(e):  # the store is away: finished again (its result is Ray's) once it is back
                    self.inflight[ref] = slot
                raise
        if ready:
            self.progress(force=True)
        else:
            self.progress()

    def finish(self, slot: InFlight, ref: Any) -> None:
        import ray

        try:
            result = ray.get(ref)
        except ray.exceptions.RayError as e:
            # The supervisor never returned: cancelled by us (deadline, lost heartbeat), killed by
            # Ray's memory monitor, or its worker or node died.
            if slot.cancelled and slot.cancelled.startswith("hard deadline"):
                kind, reason = "deadline", slot.cancelled
            elif slot.cancelled:
                kind, reason = "lost", slot.cancelled
            else:
                verdict = health.classify(e, self._node_dead(slot, e))
                if verdict.infra:
                    self.lost_to_infra(slot.number, slot.trial_id, verdict.reason)
                    return
                kind, reason = verdict.kind, verdict.reason
            if self.fail(slot.number, slot.trial_id, kind, reason):
                self._note_end(slot.number, "FAIL", kind, reason)
            self._retry_if_needed(slot.number)
            return
        self._print_reports(slot)
        if not result["told"]:
            self._tell_from_outcome(slot, result)
        self.say(printing.outcome_line(slot.number, result, self.spec.objective))
        self._note_end(slot.number, result["state"], result["fail_kind"], result["reason"])
        if result["state"] == "COMPLETE":
            self.summarise(slot.number, slot.trial_id)
        if result["fail_kind"] == "config":
            raise SweepAborted(f"trial {slot.number}: {result['reason']}")
        if result["state"] == "FAIL" and result["fail_kind"] in RETRYABLE:
            self._retry_if_needed(slot.number)

    def summarise(self, number: int, trial_id: int) -> None:
        """Rewrite the study's summary in the dashboard (:mod:`sweep.run.notes`) if the trial belongs in it.
        The driver writes it, one writer per study: supervisors ending together would race, and a worker's
        view of other trials lags (:mod:`sweep.store.caches`). A failure costs the summary only."""
        def write() -> None:
            current = st.retry(lambda: st.study_storage(self.study).get_trial(trial_id), url=self.url)
            if notes.in_summary(self.study, current):
                notes.write_study_summary(self.study, current, self.url)

        notes.guarded(f"trial {number}: study summary", write, self.url)

    def _tell_from_outcome(self, slot: InFlight, result: dict[str, Any]) -> None:
        """The supervisor could not store its outcome (database outage); store it from here."""
        tell_returned(self.study, slot.trial_id, result, self.url)

    def fail(self, number: int, trial_id: int, kind: str, reason: str) -> bool:
        """Tell FAIL with kind and reason unless the trial already finished; True if this call did."""
        if not fail_trial(self.study, trial_id, number, kind, reason, self.url):
            return False
        self.say(f"trial {number} FAIL ({kind}): {reason}")
        return True

    def lost_to_infra(self, number: int, trial_id: int, reason: str) -> bool:
        """The infrastructure lost the trial: FAIL ``infra`` (never counted) and its re-run enqueued with the
        same parameters. True if this call finished the trial (False: it had finished already)."""
        if not fail_infra(self.study, trial_id, number, reason, self.url):
            return False
        self.say(f"trial {number} lost to the infrastructure (not counted): {reason}")
        self._infra_loss = True
        self._last_probe = 0.0  # look at the infrastructure before launching again
        self._enqueue_retries(only={number})
        self._note_end(number, "FAIL", INFRA, reason)
        return True

    def _note_end(self, number: int, state: str, kind: str | None, reason: str | None) -> None:
        """Feed the circuit breaker one finished trial; say so once when it trips."""
        was = self.breaker.tripped
        if self.breaker.record(state, kind, reason) and not was:
            self.say(f"trial {number}: {self._breaker_cause()}; launching no more trials, "
                     f"{len(self.inflight)} still running")

    def _node_dead(self, slot: InFlight, e: BaseException) -> bool | None:
        """For a crashed worker only (the one ambiguous error): whether the trial's node is dead."""
        if self.watch is None or not health.worker_crashed(e):
            return None
        with contextlib.suppress(Exception):
            t = st.study_storage(self.study).get_trial(slot.trial_id)
            return self.watch.node_dead(t.system_attrs.get(ATTR_NODE))
        return None

    def _retry_if_needed(self, number: int) -> None:
        self._enqueue_retries(only={number})

    def _enqueue_retries(self, only: set[int] | None = None) -> None:
        """Enqueue the missing retries and re-runs, judged on a fresh read so none is enqueued twice."""
        trials = st.retry(lambda: self.study.get_trials(deepcopy=False), what="read trials", url=self.url)
        for t in retries_due(trials, only):
            enqueue_retry(self.study, t, self.url)
            self.say(f"trial {t.number}: retry enqueued with the same parameters")
        for t in reruns_due(trials, only):
            enqueue_rerun(self.study, t, self.url)
            self.say(f"trial {t.number}: re-run enqueued with the same parameters")

    # -- liveness -------------------------------------------------------------------------------

    def reconcile(self) -> None:
        """On start: fail RUNNING trials whose owner is gone, and enqueue retries that are missing."""
        trials = self.study.get_trials(deepcopy=False)
        line = printing.opening_line(self.spec.name, trials)
        if line:
            self.say(line)
        self.scan(force=True)
        self._enqueue_retries()

    def scan(self, force: bool = False) -> list[Any]:
        """All trials; every heartbeat interval also checks liveness and prints new reports."""
        trials = st.retry(lambda: self.study.get_trials(deepcopy=False), what="read trials", url=self.url)
        now = time.monotonic()
        if not force and now - self._last_scan < min(self.spec.heartbeat_s / 2, 5.0):
            return trials
        self._last_scan = now
        mine = {s.trial_id: (ref, s) for ref, s in self.inflight.items()}
        wall = time.time()
        outage = st.last_outage()
        if outage and outage[1] > self._store_back:
            self._store_back = outage[1]
            self.say(f"storage: reachable again after {outage[1] - outage[0]:.0f} s away; "
                     "heartbeats are judged from its return")
        changed = False
        for t in trials:
            if t.state.name != "RUNNING":
                continue
            if st.trial_id(t) in mine:
                ref, slot = mine[st.trial_id(t)]
                changed |= self._check_own(t, ref, slot, wall)
            elif not self.own_only:
                changed |= self._check_foreign(t, wall)
        if changed:
            self._enqueue_retries()
            trials = st.retry(lambda: self.study.get_trials(deepcopy=False), what="read trials", url=self.url)
        return trials

    def _settled(self, trials: list[Any]) -> list[Any]:
        """``trials`` with this run's RUNNING trials that are not in flight read again from the store itself.

        Such a trial is either one this run just finished, seen through a cache a moment old (the proxy
        serves one read to every caller within its ttl), or one whose launch a store outage cut between
        ``ask`` and submit (its claim too, when the outage came first: this run remembers what it asked).
        Counted as running, the first would end the study one trial short, with that trial shown RUNNING;
        the second is lost to the infrastructure (re-run only if its parameters were complete,
        :func:`sweep.run.liveness.mark_suggested`)."""
        flying = {s.trial_id for s in self.inflight.values()}
        stray = [t for t in trials if t.state.name == "RUNNING" and st.trial_id(t) not in flying
                 and (liveness.asked_by(t, self.run_id) or st.trial_id(t) in self._asked)]
        if not stray:
            return trials
        storage = st.study_storage(self.study)

        def read(trial_id: int) -> Any:
            return st.retry(lambda: storage.get_trial(trial_id), what="read trial", url=self.url)

        fresh = {st.trial_id(t): read(st.trial_id(t)) for t in stray}
        for trial_id, t in fresh.items():
            if t.state.name == "RUNNING":
                self.lost_to_infra(t.number, trial_id, "its launch was cut off before it was submitted")
                fresh[trial_id] = read(trial_id)
        return [fresh.get(st.trial_id(t), t) for t in trials]

    def _check_own(self, t: Any, ref: Any, slot: InFlight, wall: float) -> bool:
        import ray

        if liveness.started_at(t) is None:  # still queued in Ray: the driver vouches for it
            with contextlib.suppress(Exception):
                liveness.beat(st.study_storage(self.study), st.trial_id(t), wall)
            return False
        slot.started = liveness.started_at(t)
        self._print_reports(slot, t)
        spec = self.spec
        why = liveness.overdue(t, wall, slot.deadline_s or spec.deadline_s, spec.stop_grace_s, spec.stale_after_s,
                               self._store_back)
        if why and slot.cancelled is None:
            slot.cancelled = f"{why}; Ray task cancelled"
            ray.cancel(ref, force=True)
        return False

    def _check_foreign(self, t: Any, wall: float) -> bool:
        lost = liveness.orphaned(t, wall, self.spec.stale_after_s, self.run_id, self._store_back)
        return lost is not None and self.fail(t.number, st.trial_id(t), *lost)

    def abandon(self, why: str, kind: str = "lost", cancel: bool = True) -> None:
        """Cancel every trial in flight and fail it as ``kind`` (lost: a later run retries them; infra: it
        re-runs them, uncounted). ``cancel=False`` when Ray is gone and cannot be asked."""
        import ray

        for ref, slot in list(self.inflight.items()):
            if cancel:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            with contextlib.suppress(Exception):
                self.fail(slot.number, slot.trial_id, kind, why)
        self.inflight.clear()

    # -- reporting ------------------------------------------------------------------------------

    def _print_reports(self, slot: InFlight, t: Any | None = None) -> None:
        if t is None:
            t = st.study_storage(self.study).get_trial(slot.trial_id)
        for step, value in obj.curve_points(t, self.spec.objective):
            if step not in slot.reported and step != round(self.spec.budget_s):
                slot.reported.add(step)
                self.say(printing.report_line(slot.number, step, value, self._curve_label))

    def progress(self, force: bool = False) -> None:
        if self.own_only:
            return
        now = time.monotonic()
        if not force and now - self._last_progress < PROGRESS_EVERY_S:
            return
        self._last_progress = now
        trials = self._settled(self.study.get_trials(deepcopy=False))
        self.say(printing.progress_line(trials, self.spec, len(self.inflight), now - self.t0))

    def print_best(self) -> None:
        trials = self._settled(self.study.get_trials(deepcopy=False))
        for line in printing.summary_lines(trials, self.spec, self.url, next_steps=self.next_steps):
            self.say(line)


# Ray's notice on every local ray.init() when RAY_AUTH_MODE is unset: token authentication was switched on for
# the cluster it starts. A local Ray lives and dies with the command, so the notice is noise there; joining a
# cluster (RAY_ADDRESS) goes through Ray's own path and keeps every warning.
TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"
TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"


class _DropTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TOKEN_NOTICE)


@contextlib.contextmanager
def quiet_local_token_notice() -> Any:
    """Drop Ray's token-authentication notice while a local Ray starts (authentication itself stays on)."""
    logger, drop = logging.getLogger(TOKEN_LOGGER), _DropTokenNotice()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
