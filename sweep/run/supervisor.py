"""The trial supervisor: runs inside a Ray task, owns one trainer process group from start to end.

It starts the trainer (``python -m model.train``, or torchrun for several ranks) in a new session,
streams its JSON-lines events, reports each intermediate value to Optuna on the charged-second
axis and asks the pruner, stops the trainer when pruned (SIGTERM, then SIGKILL after a grace
period), kills the whole group at the hard deadline, and always reaps the group before returning.
A detached reaper (:mod:`sweep.run.reaper`) kills the group if this process dies first.

It turns the trainer's events and exit into an :class:`~sweep.run.outcome.Outcome` and writes nothing
to the study but through its :class:`Reporter`: :mod:`sweep.run.remote` opens the trial, runs it and
stores what it returns. Outcomes:

- trainer ``ok`` -> COMPLETE with the objective's value(s) from the record (:mod:`sweep.spec.objective`:
  val_bpb, a Pareto pair such as val_bpb and core, or a composite score); a record lacking a metric the
  objective needs -> FAIL ``metric``, naming it (the record is kept);
- pruned by the pruner -> PRUNED (the trainer's ``stopped`` record is kept);
- ``diverged`` -> PRUNED with ``fail_kind = "diverged"``: a diverging config is a bad point the
  sampler should learn from (TPE ranks pruned trials below complete ones), not a broken run;
- ``failed`` (the trainer caught an error, e.g. out of memory) -> FAIL, kind ``oom`` or ``failed``;
- ``rejected`` (a run the competition's scorer would not take: over budget, causality failed) -> FAIL,
  kind ``rejected``: recorded with its figures, never the study's best, never promoted or exported;
- no result line: exit 2 -> FAIL ``config`` (the driver aborts the sweep: every trial would fail
  alike); killed at the deadline -> FAIL ``deadline``; any other exit or signal -> FAIL ``crash``,
  which the driver retries once with the same parameters.

A study's intermediate values are one metric, so the pruner compares like with like
(:func:`curve_metric`): val_bpb for our trainer; for a team's script, the validation figure its spec's
``output.val`` pattern finds (``val``, in the script's own unit), else its smoothed training loss
(``train_loss_smoothed``). An eval event names its metric (``"metric"``, val_bpb when absent); one of
another metric (a script's smoothed loss before its first validation line) stays in events.jsonl and is not
reported. The metric's name goes with the trial (``curve_metric``), its pruned reason and its curve.

Long file: one class, the trainer group's whole life, which reads best in one place.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

from model.script.signing import signed
from sweep import store as st
from sweep.neuron import LaunchError, TrialLaunch
from sweep.neuron.overlay import seed_mode
from sweep.run.outcome import Outcome
from sweep.run.reaper import TOKEN_VAR, kill_trial, tagged_pids
from sweep.run.trialuser import TrialUser, TrialUserError, wanted
from sweep.spec import objective as obj
from sweep.spec.limits import is_oom, preexec

log = logging.getLogger("sweep.run.supervisor")

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT_TRAINER = "model.script.run"  # sweep.spec.script.TRAINER: a team's script, read through its output
TRAINER_LOG_CAP = 32 << 20  # bytes of the trainer's stderr kept in trainer.log (model.script.run's OUT_CAP)
LOG_CUT_LINE = b"\n[trnsweep: the trainer's stderr is cut here, at its cap]\n"
TAIL_BYTES = 8192  # of the trainer's stderr kept in memory for a one-line failure reason


def curve_metric(trainer: str, config: dict[str, Any]) -> str:
    """What a trial's intermediate values are (the module docstring): val_bpb for our trainer; for a script,
    ``val`` where its config's output patterns find a validation figure, else ``train_loss_smoothed``."""
    if trainer != SCRIPT_TRAINER:
        return "val_bpb"
    output = config.get("output")
    return "val" if isinstance(output, dict) and output.get("val") else "train_loss_smoothed"


@dataclass(frozen=True)
class TrialTask:
    """Everything a supervisor needs; plain values so Ray can ship it anywhere."""

    study: str
    storage_url: str
    number: int
    trial_id: int
    params: dict[str, Any]
    config: dict[str, Any]
    budget_s: float
    deadline_s: float
    eval_fractions: tuple[float, ...]
    ranks: int = 1
    trainer: str = "model.train"
    launches_ranks: bool = False  # the trainer starts its own torchrun (a script's, model.script.run): one process here
    stop_grace_s: float = 30.0
    heartbeat_s: float = 10.0
    env: dict[str, str] = field(default_factory=dict)
    pruner: tuple[str, dict[str, Any]] = ("none", {})
    artifact_dir: str = ""
    artifact_store: str = ""  # SWEEP_ARTIFACTS as resolved by the driver; "" uploads nothing
    attrs: dict[str, Any] = field(default_factory=dict)  # user attributes stored with the outcome
    compile_cache: str = ""  # the spec's trial.compile_cache (see sweep.neuron)
    objective: obj.Objective = field(default_factory=obj.Objective)  # what is told to Optuna
    pass_env: tuple[str, ...] = ()  # [trial] pass_env: variables a script trial may see beyond the allow-list
    run_as: str = ""  # [trial] run_as, a script trial's user; "" takes the node's (sweep.run.trialuser)

    def eval_step(self, progress: float) -> int:
        """The nominal eval point nearest to ``progress``, in whole charged seconds.

        Pruners compare trials at identical steps, so the step must not depend on how far the
        last training step overshot the eval point.
        """
        f = min(self.eval_fractions, key=lambda x: abs(x - progress))
        return round(f * self.budget_s)

    @property
    def final_step(self) -> int:
        return round(self.budget_s)

    @property
    def curve_metric(self) -> str:
        """The metric of this trial's intermediate values (:func:`curve_metric`)."""
        return curve_metric(self.trainer, self.config)


def trainer_command(task: TrialTask, config_path: Path, out_dir: Path, python: str | None = None,
                    rank_module: str | None = None) -> list[str]:
    """The trainer's command line; torchrun when the spec asks for several ranks.

    ``rank_module`` (the Neuron launch plan's, :mod:`sweep.neuron.rank`) runs first in each rank, so
    every rank holds its own NeuronCore before the trainer imports torch.
    """
    python = python or sys.executable
    args = ["--config", str(config_path), "--budget-s", f"{task.budget_s:g}", "--json", "--out-dir", str(out_dir)]
    if task.launches_ranks:
        first = ["--rank-module", rank_module] if rank_module and task.ranks > 1 else []
        return [python, "-m", task.trainer, *args, "--ranks", str(task.ranks), *first]
    if task.ranks > 1:
        entry = [rank_module, task.trainer] if rank_module else [task.trainer]
        return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(task.ranks),
                "-m", *entry, *args]
    return [python, "-m", task.trainer, *args]


# What a team's script sees of the worker's environment (:func:`script_env`): the system's, the toolchains'
# and the spec's own trial.env and pass_env; never the storage URL, PG*, cloud keys, the Ray address or token.
SCRIPT_ENV_NAMES = frozenset({"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR",
                              "TMP", "TEMP", "HOSTNAME", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "PYTHONHASHSEED"})
SCRIPT_ENV_PREFIXES = ("LC_", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "NEURON_", "NKI_", "XLA_", "TORCH", "CUDA_",
                       "NCCL_", "FI_", "MALLOC_")
SECRET_NAME = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|CREDENTIAL|PRIVATE|(^|_)KEY$|SESSION|AUTH", re.IGNORECASE)


def script_env(environ: dict[str, str], passed: tuple[str, ...] = ()) -> dict[str, str]:
    """The allow-listed part of ``environ`` for a trial of a team's script, plus the names ``passed``."""
    keep = {k: v for k, v in environ.items() if (k in SCRIPT_ENV_NAMES or k.startswith(SCRIPT_ENV_PREFIXES))
            and not SECRET_NAME.search(k)}
    return {**keep, **{k: environ[k] for k in passed if k in environ}}


class Reporter:
    """What the supervisor tells the outside world while the trainer runs (Optuna in production)."""

    def report(self, value: float, step: int) -> bool:
        """Record an intermediate value; return True when the trial should be pruned."""
        return False

    def keep(self, curve: list[list[float]]) -> None:
        """Keep the learning curve (in the task's curve metric) where the objective's reports are not that curve."""

    def heartbeat(self) -> bool:
        """Refresh liveness; return False when the trial has been finished by someone else."""
        return True


class Supervisor:
    """Runs the trainer and turns its events and exit into an :class:`Outcome` (no storage writes
    except through the reporter, so it can be tested without Optuna)."""

    def __init__(self, task: TrialTask, reporter: Reporter | None = None, python: str | None = None) -> None:
        self.task = task
        self.reporter = reporter or Reporter()
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        self.record: dict[str, Any] | None = None
        self.first_step_unix: float | None = None
        self.launch_unix: float | None = None
        self.last_step: int | None = None
        self.last_value: float | None = None
        self.curve: list[list[float]] = []  # [charged second, value] of every eval (task.curve_metric), for curves
        self._pruned_at: float | None = None
        self._deadline_hit = False
        self._superseded = False
        self._reaper_w: int | None = None
        self._files: list[IO[Any]] = []
        self.log_cap = TRAINER_LOG_CAP  # trainer.log is cut here; the rest of stderr is still read (see _drain)
        self._err_tail = bytearray()  # the end of the trainer's stderr, whatever the cap kept
        self._drainer: threading.Thread | None = None
        self._stop = threading.Event()
        self._lost = threading.Event()
        self.token = uuid.uuid4().hex  # in every trainer process's environment, see sweep.run.reaper
        # A script trial's events are signed with a key only its trainer gets (over a pipe, not inherited by the
        # script): a line the script writes to its parent's stdout is not an event.
        self.key = secrets.token_bytes(32) if task.trainer == SCRIPT_TRAINER else None
        self.unsigned_lines = 0
        self.marks: dict[str, float] = {}  # monotonic times of the supervisor's phases, for overhead
        self.artifacts_error: str | None = None  # why the trial's files are not where the spec said
        self.artifact_dir = Path(task.artifact_dir) if task.artifact_dir else Path.cwd() / "runs" / "scratch"
        self.launch: TrialLaunch | None = None  # Neuron launch plan, cache and utilisation (sweep.neuron)
        self.launch_attrs: dict[str, Any] = {}
        self.user: TrialUser | None = None  # a script trial's own user (sweep.run.trialuser), if any
        self._handed_over = False  # the trial's folder belongs to the trial user until _take_back

    # -- lifecycle ------------------------------------------------------------------------------

    def run(self) -> Outcome:
        task = self.task
        self._usable_artifact_dir()
        try:
            self.user = self._trial_user()
        except TrialUserError as e:
            return Outcome(number=task.number, state="FAIL", fail_kind="config", reason=f"trial user: {e}",
                           curve_metric=task.curve_metric)
        other_user = self.user is not None and self.user.uid != os.geteuid()
        try:  # launch keys out of the config, cores mapped onto ranks, the compile cache pointed at
            # A script trial's compile cache is a private one over the shared cache (sweep.neuron.overlay).
            private = self.artifact_dir / "neuron-cache" if self.key is not None else None
            self.launch = TrialLaunch.prepare(task.config, task.ranks, task.env, task.compile_cache,
                                              pids=lambda: tagged_pids(self.token), workdir=self.artifact_dir,
                                              private_cache=private, seed=seed_mode(os.environ, other_user))
        except LaunchError as e:
            return Outcome(number=task.number, state="FAIL", fail_kind="config", reason=f"launch plan refused: {e}",
                           curve_metric=task.curve_metric)
        self.launch_attrs = self.launch.attrs
        if self.user is not None:
            self.launch_attrs["trial_user"] = self.user.name
        config_path = self.artifact_dir / "config.json"
        config_path.write_text(json.dumps(self.launch.config, indent=1, sort_keys=True) + "\n")
        trainer_log = open(self.artifact_dir / "trainer.log", "ab")  # noqa: SIM115 - closed in close()
        events = open(self.artifact_dir / "events.jsonl", "a")  # noqa: SIM115
        self._files += [trainer_log, events]
        base = dict(os.environ) if self.key is None else script_env(dict(os.environ), task.pass_env)
        env = {**base, **task.env, **self.launch.env, "PYTHONUNBUFFERED": "1", TOKEN_VAR: self.token}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        cmd = trainer_command(replace(task, ranks=self.launch.ranks), config_path, self.artifact_dir, self.python,
                              self.launch.rank_module)
        as_user: dict[str, Any] = {}
        if other_user and self.user is not None:
            why = self._kit_setup_first(cmd, env, trainer_log)
            if why:
                return Outcome(number=task.number, state="FAIL", fail_kind="failed", reason=why,
                               curve_metric=task.curve_metric)
            env.update(self.user.env(self.artifact_dir))
            self._handed_over = True
            self.user.hand_over(self.artifact_dir, keep=("config.json", "trainer.log", "events.jsonl"))
            as_user = self.user.popen_args()
        key_fds: tuple[int, ...] = ()
        if self.key is not None:
            read_fd, write_fd = os.pipe()
            os.write(write_fd, self.key.hex().encode())
            os.close(write_fd)
            key_fds = (read_fd,)
            cmd += ["--key-fd", str(read_fd)]
        self.launch_unix = time.time()
        launched = time.monotonic()
        deadline = launched + task.deadline_s
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                         cwd=REPO_ROOT, env=env, start_new_session=True, preexec_fn=preexec(env),
                                         pass_fds=key_fds, **as_user)
        finally:
            for fd in key_fds:
                os.close(fd)
        self.marks["launched"] = time.monotonic()
        self.launch.started()
        self._start_reaper(self.launch_unix + task.deadline_s + task.stop_grace_s + 30)
        self.marks["reaper"] = time.monotonic()
        lines: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=_pump, args=(self.proc.stdout, lines), daemon=True).start()
        self._drainer = threading.Thread(target=_drain, daemon=True,
                                         args=(self.proc.stderr, trainer_log, self.log_cap, self._err_tail))
        self._drainer.start()
        beat = threading.Thread(target=self._heartbeats, daemon=True)
        beat.start()

        kill_at: float | None = None  # SIGKILL time once a stop was requested
        killed_at: float | None = None  # when the group got SIGKILL; stdout should close soon after
        while True:
            now = time.monotonic()
            wait = deadline - now
            if kill_at is not None:
                wait = min(wait, kill_at - now)
            try:
                line = lines.get(timeout=max(0.0, min(wait, 1.0)))
            except queue.Empty:
                line = b""
            if line is None:
                break
            if killed_at is not None and time.monotonic() > killed_at + 10:
                break  # something outside the group holds stdout open; stop waiting for EOF
            if line:
                try:
                    events.write(line.decode("utf-8", "replace"))
                    events.flush()
                except OSError as e:  # a disk that fills up mid-trial costs the event log, not the trial
                    self.artifacts_error = self.artifacts_error or f"events.jsonl: {e.strerror or e}"
                if self._handle(line) and kill_at is None:
                    self._signal(signal.SIGTERM)
                    self._pruned_at = time.monotonic()
                    kill_at = self._pruned_at + task.stop_grace_s
            now = time.monotonic()
            if self._lost.is_set() and not self._superseded:
                self._superseded = True
                self._signal(signal.SIGKILL)
                killed_at = killed_at or now
            if now >= deadline and not self._deadline_hit:
                self._deadline_hit = True
                self._signal(signal.SIGKILL)
                killed_at = killed_at or now
            elif kill_at is not None and now >= kill_at:
                self._signal(signal.SIGKILL)
                kill_at = float("inf")
                killed_at = killed_at or now
        self.marks["eof"] = time.monotonic()
        returncode = self._wait_and_reap(max(5.0, deadline - time.monotonic()))
        self._drainer.join(timeout=10)  # the group is gone: its stderr closes, unless something outside holds it
        self.marks["reaped"] = time.monotonic()
        self._take_back()  # before anything of ours reads, publishes or writes there
        self.launch_attrs = self.launch.finished(self.record, self.launch_unix, self.first_step_unix)
        if self.unsigned_lines:  # a script wrote JSON lines where only its trainer may: said on the trial
            self.launch_attrs["unsigned_lines"] = self.unsigned_lines
        return self._outcome(returncode)

    def _trial_user(self) -> TrialUser | None:
        """The user a script trial runs as (:mod:`sweep.run.trialuser`), checked to reach what the trial needs;
        None for our own trainer (our code, run as the service) or where neither spec nor node names one."""
        name = wanted(self.task.run_as, os.environ)
        if not name or self.key is None:
            return None
        user = TrialUser.resolve(name)
        if user.uid == os.geteuid():
            return user
        python = self.python or sys.executable
        needs = [(python, os.X_OK), (REPO_ROOT, os.R_OK | os.X_OK), (self.artifact_dir.parent, os.X_OK)]
        if python == sys.executable:
            needs += [(sys.prefix, os.R_OK | os.X_OK), (sysconfig.get_path("stdlib"), os.R_OK | os.X_OK)]
        needs += [(self.task.config[k], os.R_OK) for k in ("script", "kit") if isinstance(self.task.config.get(k), str)]
        for path, want in needs:
            why = user.unreachable(path, want)
            if why:
                raise TrialUserError(f"{user.name} cannot reach what the trial needs: {why}")
        return user

    def _kit_setup_first(self, cmd: list[str], env: dict[str, str], log: IO[bytes]) -> str | None:
        """The kit's setup (``kit_setup``) as the service's user, before a trial of another user, who may not
        write the kit folder; the trainer then finds the kit ready. Why it failed, or None."""
        if not (self.task.config.get("kit") and self.task.config.get("kit_setup")):
            return None
        try:
            proc = subprocess.run([*cmd, "--setup-only"], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.PIPE,
                                  cwd=REPO_ROOT, env=env, timeout=self.task.deadline_s)
        except subprocess.TimeoutExpired:
            return f"kit setup (as the service's user) ran past the trial's deadline {self.task.deadline_s:g} s"
        with contextlib.suppress(OSError):
            log.write(proc.stderr[-self.log_cap:])
            log.flush()
        if proc.returncode:
            return (f"kit setup (as the service's user) failed: "
                    f"{_last_line(proc.stderr).removeprefix('error: ') or f'exit {proc.returncode}'}")
        return None

    def _take_back(self) -> None:
        """The trial's folder back from the trial user (:meth:`TrialUser.take_back`); a failure is said on the trial."""
        if not self._handed_over:
            return
        self._handed_over = False
        try:
            TrialUser.take_back(self.artifact_dir)
        except OSError as e:
            self.artifacts_error = self.artifacts_error or f"taking back {self.artifact_dir}: {e.strerror or e}"

    def _usable_artifact_dir(self) -> None:
        """Make the trial's working directory, or a scratch one where it cannot be written.

        A full artifacts disk must not fail every trial within seconds, using up the study's
        n_trials: the trainer then runs in a directory under the system's temporary directory and
        the trial records why (``artifacts_error``).
        """
        probe = self.artifact_dir / ".writable"
        try:
            self.artifact_dir.mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as f:  # a full disk refuses this; a nearly full one takes a trial's logs
                f.write(bytes(65536))
            probe.unlink()
        except OSError as e:
            with contextlib.suppress(OSError):
                probe.unlink()
            self.artifacts_error = f"{self.artifact_dir}: {e.strerror or e}"
            self.artifact_dir = Path(tempfile.mkdtemp(prefix=f"sweep-{self.task.study}-{self.task.number}-"))
            log.warning("trial %d: %s; working in %s instead", self.task.number, self.artifacts_error,
                        self.artifact_dir)

    def close(self) -> None:
        """Always runs: no process of the group survives, the reaper stands down, files close."""
        self._stop.set()
        if self.launch is not None:
            self.launch.close()
        if self.proc is not None:
            # A reaped leader's pid may already name another group: then only the token is safe.
            kill_trial(self.proc.pid if self.proc.returncode is None else None, self.token)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self._reaper_w is not None:
            with contextlib.suppress(OSError):
                os.write(self._reaper_w, b"done")
            with contextlib.suppress(OSError):
                os.close(self._reaper_w)
            self._reaper_w = None
        for f in self._files:
            with contextlib.suppress(OSError):
                f.close()
        self._files.clear()
        self._take_back()  # a trial that never got as far as its outcome (its folder is still the trial user's)

    # -- events ---------------------------------------------------------------------------------

    def _handle(self, raw: bytes) -> bool:
        """Handle one stdout line; True means the pruner asked to stop."""
        try:
            ev = json.loads(raw)
        except ValueError:
            return False
        if not isinstance(ev, dict):
            return False
        if self.key is not None and not signed(self.key, ev):
            self.unsigned_lines += 1  # not the trainer's: the script wrote it (see __init__)
            return False
        kind = ev.get("event")
        if kind == "step" and self.first_step_unix is None:
            self.first_step_unix = time.time()
        elif kind == "eval" and self._pruned_at is None:
            value = as_float(ev.get("val_bpb"))
            progress = as_float(ev.get("progress"))
            if progress is None:
                charged = as_float(ev.get("charged_s")) or 0.0
                progress = charged / self.task.budget_s
            metric = ev.get("metric") or "val_bpb"
            if value is None or metric != self.task.curve_metric:
                return False  # not the study's metric: the pruner compares like with like
            step = self.task.eval_step(progress)
            self.last_step, self.last_value = step, value
            self.curve.append([step, value])
            objective = self.task.objective
            try:
                if objective.kind != "single":
                    self.reporter.keep(self.curve)
                # A composite's reports are its normalised val_bpb term: a script's own figure has none.
                reported = (objective.intermediate(value) if metric == "val_bpb"
                            else value if objective.kind == "single" else None)
                # A pareto study cannot prune (Optuna raises on report): it keeps the curve only.
                return reported is not None and self.reporter.report(reported, step)
            except Exception as e:
                log.warning("trial %d: report failed: %s", self.task.number,
                            st.scrub(str(e), self.task.storage_url))
                if "finished" in str(e).lower():
                    self._lost.set()
        elif kind == "result":
            self.marks["result"] = time.monotonic()
            self.record = {k: v for k, v in ev.items() if k != "event"}
        return False

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.task.heartbeat_s):
            if not self.reporter.heartbeat():
                self._lost.set()
                return

    # -- processes ------------------------------------------------------------------------------

    def _signal(self, sig: int) -> None:
        """Signal the trainer's group and every process carrying the trial's token (torchrun ranks)."""
        if self.proc is not None:
            kill_trial(self.proc.pid, self.token, sig)

    def _start_reaper(self, deadline_unix: float) -> None:
        assert self.proc is not None
        r, w = os.pipe()
        try:
            subprocess.Popen([sys.executable, "-m", "sweep.run.reaper", str(r), str(self.proc.pid), self.token,
                              f"{deadline_unix:.3f}"],
                             pass_fds=(r,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True, cwd=REPO_ROOT,
                             env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}).wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("trial %d: no reaper (%s); an orphaned trainer is possible if this worker dies",
                        self.task.number, e)
            os.close(w)
            w = -1
        finally:
            os.close(r)
        self._reaper_w = w if w >= 0 else None

    def _wait_and_reap(self, timeout: float) -> int:
        """Wait for the group leader to exit, kill what is left of its group, then reap it.

        The leader is waited for without being reaped (WNOWAIT) so its pid, which is the group
        id, cannot be reused by an unrelated group before the group kill.
        """
        assert self.proc is not None
        pid = self.proc.pid
        end = time.monotonic() + timeout
        while True:
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
            except ChildProcessError:
                info = None
                break
            if info is not None:
                break
            if time.monotonic() >= end:
                self._deadline_hit = self._deadline_hit or self._pruned_at is None
                self._signal(signal.SIGKILL)
                end = float("inf")
            time.sleep(0.05)
        self._signal(signal.SIGKILL)
        return self.proc.wait()

    # -- classification -------------------------------------------------------------------------

    def _outcome(self, returncode: int) -> Outcome:
        task, rec = self.task, self.record
        out = Outcome(number=task.number, state="FAIL", record=rec, last_step=self.last_step,
                      curve_metric=task.curve_metric)
        status = (rec or {}).get("status")
        tail = _last_line(bytes(self._err_tail))
        if self._superseded:
            out.fail_kind, out.reason = "lost", "trial was finished elsewhere (declared lost); trainer killed"
        elif self._pruned_at is not None:
            out.state = "PRUNED"
            out.reason = f"pruned at {self.last_step} s ({task.curve_metric} {self.last_value:.4f})"
            if rec is None:
                out.reason += f"; trainer did not stop within {task.stop_grace_s:g} s and was killed"
        elif status == "ok" and self.key is not None and returncode != 0:
            out.fail_kind = "crash"
            out.reason = f"the script trainer exited with code {returncode} after its result (never COMPLETE)"
        elif status == "ok":
            try:
                out.values = task.objective.values(rec or {})
            except obj.MissingMetric as e:
                out.fail_kind, out.reason = "metric", str(e)
            else:
                out.state = "COMPLETE"
                out.value = None if task.objective.multi else out.values[0]
        elif status in ("diverged", "pruned"):
            out.state = "PRUNED"
            out.fail_kind = "diverged" if status == "diverged" else None
            out.reason = f"{status}: {rec.get('reason') or 'no reason given'}"
        elif status == "failed":
            reason = str(rec.get("reason") or tail or "no reason given")
            out.fail_kind = "oom" if is_oom(reason) else "failed"
            out.reason = f"trainer failed: {reason}"
        elif status == "rejected":
            out.fail_kind, out.reason = "rejected", str(rec.get("reason") or "the scorer would reject it")
        elif status == "stopped":
            out.fail_kind, out.reason = "lost", "trainer stopped by a signal the supervisor did not send"
        elif self._deadline_hit:
            out.fail_kind = "deadline"
            out.reason = (f"hard deadline {task.deadline_s:g} s (budget + start-up allowance + eval timeout) "
                          "exceeded; process group killed")
        elif returncode == 2:
            out.fail_kind, out.reason = "config", f"trainer rejected the config: {tail or 'exit 2'}"
        elif returncode < 0:
            name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
            out.fail_kind = "crash"
            out.reason = f"trainer killed by {name}" + (" (the kernel OOM killer sends SIGKILL too)"
                                                       if name == "SIGKILL" else "")
            if tail:
                out.reason += f"; last log line: {tail}"
        else:
            out.fail_kind = "crash"
            out.reason = f"trainer exited with code {returncode} without a result" + (f": {tail}" if tail else "")
        return out


def _pump(stream: IO[bytes] | None, q: queue.Queue[bytes | None]) -> None:
    assert stream is not None
    try:
        for line in iter(stream.readline, b""):
            q.put(line)
    finally:
        q.put(None)


def as_float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _drain(stream: IO[bytes] | None, log: IO[bytes], cap: int, tail: bytearray) -> None:
    """The trainer's stderr into trainer.log, cut at ``cap`` bytes with a line saying so, as the script trainer
    cuts a script's streams; all of it is still read, so the trainer never blocks on a full pipe, and its last
    bytes are kept in ``tail`` for the failure reason."""
    assert stream is not None
    written = 0
    for chunk in iter(lambda: stream.read1(65536), b""):
        if written < cap:
            with contextlib.suppress(OSError, ValueError):  # a full disk (or a closed log) costs the log only
                log.write(chunk[:cap - written])
                if written + len(chunk) > cap:
                    log.write(LOG_CUT_LINE)
                log.flush()
            written += len(chunk)
        tail += chunk
        del tail[:-TAIL_BYTES]


def _last_line(text: bytes, limit: int = 300) -> str:
    """The last non-empty line of the trainer's stderr, for one-line failure reasons."""
    lines = [ln.strip() for ln in text.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else ""
