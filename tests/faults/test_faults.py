"""The fault suite: faults injected into real sweeps (real PostgreSQL, a real local Ray, the real trainer).

Every fault ends with the same checks (:func:`settle`): every trial finished before the fault is still
there with its state and value, no trial number was run twice (one trainer start per number) and
none is left RUNNING or WAITING, every retryable failure has its retry and every trial the
infrastructure lost (``infra``) its re-run, the study holds the requested number of counted trials,
no trainer process of the sweep is left, and every Ray CPU is free again. Each test adds a row (fault,
outcome, trials lost, trials re-run, time to recover) to the table the session prints at its end (and
writes to ``$FAULTS_REPORT`` when set).

The default run is short (2 trials of 3 s per sweep); ``FAULTS_FULL=1`` runs longer budgets and
more trials. ``make faults`` runs only this module (``-m faults``).

The studies live on a PostgreSQL server of the module's own (``private_pg``, tests.pg_cluster): the
faults stop and restart it, never the machine's server. Only processes this module started (by pid)
are signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import pytest

from sweep import store as st
from sweep.run.outcome import counts, needs_rerun, needs_retry
from tests import pg_cluster
from tests.ci import skip_unless_ci, under_ci
from tests.pg_cluster import PgCluster
from tests.ray_head import Head, free_cpus
from tests.sweep_fixtures import (
    ROOT,
    head_env,
    load_trials,
    processes_with,
    sweep_cmd,
    sweep_env,
    tiny_spec,
    wait_for,
    write_spec,
)

FULL = os.environ.get("FAULTS_FULL", "") not in ("", "0")
N_TRIALS = 4 if FULL else 2
BUDGET_S = 8 if FULL else 3
TRIAL = {"budget_s": BUDGET_S, "startup_allowance_s": 30, "eval_timeout_s": 20, "eval_fractions": [0.5],
         "heartbeat_s": 1, "stale_after_s": 8, "stop_grace_s": 3}
HEALTHY = {"depth": 1, "model_dim": 32, "matrix_lr": 0.02}
FAULTY_SEED = 7  # the trainer seed of the one faulted trial: TRNSWEEP_FAULT names it (model.faults)

pytestmark = [pytest.mark.faults, pytest.mark.slow,
              pytest.mark.skipif(pg_cluster.available() is not None and not under_ci(),
                              reason=str(pg_cluster.available()))]

ROWS: list[dict[str, Any]] = []


# -- the table -------------------------------------------------------------------------------------


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    head = ("fault", "outcome", "trials lost", "re-run", "time to recover")
    body = [(r["fault"], r["outcome"], str(r["lost"]), "-" if r.get("rerun") is None else str(r["rerun"]),
             "-" if r.get("recover_s") is None else f"{r['recover_s']:.1f} s") for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*b) for b in body)]


class _FaultTable:
    """A plugin registered by the module fixture: prints the table in pytest's terminal summary."""

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if ROWS:
            terminalreporter.section(f"fault suite ({'full' if FULL else 'short'})")
            for line in table_lines(ROWS):
                terminalreporter.write_line(line)


@pytest.fixture(scope="module", autouse=True)
def fault_table(request: pytest.FixtureRequest) -> Iterator[None]:
    name = "trnsweep-fault-table"
    if not request.config.pluginmanager.has_plugin(name):
        request.config.pluginmanager.register(_FaultTable(), name)
    yield
    report = os.environ.get("FAULTS_REPORT")
    if report and ROWS:
        Path(report).write_text("\n".join(table_lines(ROWS)) + "\n")


def record(fault: str, outcome: str, lost: int, recover_s: float | None, rerun: int | None = None) -> None:
    """One row; ``rerun``: how many trials the infrastructure lost and the sweep ran again (uncounted)."""
    ROWS.append({"fault": fault, "outcome": outcome, "lost": lost, "recover_s": recover_s, "rerun": rerun})


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture
def pg_url(private_pg: PgCluster) -> Iterator[str]:
    """A throwaway database on the module's own server, dropped over a fresh connection."""
    if not private_pg.running():  # a fault that failed half-way left it stopped
        private_pg.start()
    with private_pg.database() as url:
        yield url


@dataclass
class Sweep:
    name: str
    url: str
    art: Path
    spec: Path
    n_trials: int
    log: str = ""


@pytest.fixture
def make_sweep(tmp_path: Path, pg_url: str, data_cache: str, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Sweep]:
    """A spec and a store for one faulted sweep; this process's environment points at them."""

    def make(name: str, n_trials: int = N_TRIALS, concurrency: int = 2, trial: dict[str, Any] | None = None,
             fault: str = "", **sections: Any) -> Sweep:
        art = tmp_path / "art"
        art.mkdir(exist_ok=True)
        extra = dict(sections)
        if fault:  # the trainer's test-only fault at step 3, in every trainer's environment (the spec's trial
            # env: Ray's workers do not see this process's), fires in the trial enqueued with FAULTY_SEED only
            extra["params.seed"] = {"type": "categorical", "choices": [0, FAULTY_SEED]}
            extra["trial.env"] = {**extra.get("trial.env", {}), "TRNSWEEP_FAULT": f"{fault}@3:seed={FAULTY_SEED}"}
        spec = write_spec(tmp_path, name, tiny_spec(
            data_cache, study={"n_trials": n_trials, "concurrency": concurrency, "seed": 0},
            trial={**TRIAL, **(trial or {})}, **extra))
        monkeypatch.setenv(st.ENV_STORAGE, pg_url)
        monkeypatch.setenv("SWEEP_ARTIFACTS", str(art))
        monkeypatch.delenv(st.ENV_PROXY, raising=False)
        return Sweep(name, pg_url, art, spec, n_trials)

    return make


# -- helpers ---------------------------------------------------------------------------------------


def trials_of(sw: Sweep) -> list[Any]:
    try:
        return st.retry(lambda: load_trials(sw.url, sw.name), what="read trials")
    except KeyError:
        return []


def snapshot(sw: Sweep) -> dict[int, tuple[str, float | None]]:
    """Finished trials as they are now: what must survive the fault unchanged."""
    return {t.number: (t.state.name, t.value) for t in trials_of(sw) if t.state.is_finished()}


def events_file(sw: Sweep, number: int) -> Path:
    return sw.art / sw.name / str(number) / "events.jsonl"


def stepping(sw: Sweep, number: int) -> bool:
    f = events_file(sw, number)
    return f.exists() and '"event": "step"' in f.read_text(errors="replace")


def trainer_pids(sw: Sweep, number: int | None = None) -> list[int]:
    """Live trainer processes of this sweep (of one trial number when given: those under this test's own
    artifacts directory, the only ones a test may signal; without a number, any that names the sweep,
    its scratch fallback included, for the checks that wait for them to be gone)."""
    marker = f"{sw.art / sw.name}/{number}/" if number is not None else sw.name
    pids = []
    for pid in processes_with(marker):
        with contextlib.suppress(OSError):
            if "model.train" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                pids.append(pid)
    return pids


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def starts(sw: Sweep, number: int) -> int:
    """How many times a trainer started under this trial number (its event log is appended to)."""
    f = events_file(sw, number)
    return f.read_text(errors="replace").count('"event": "start"') if f.exists() else 0


def outcome_text(trials: list[Any]) -> str:
    parts = []
    for t in trials:
        kind = t.user_attrs.get("fail_kind")
        s = f"{t.number} {t.state.name}" + (f" ({kind})" if kind else "")
        if "retry_of" in t.user_attrs:
            s += f" retry of {t.user_attrs['retry_of']}"
        if "rerun_of" in t.user_attrs:
            s += f" re-run of {t.user_attrs['rerun_of']}"
        parts.append(s)
    return "; ".join(parts)


def stamp(dt: Any) -> float | None:
    return dt.timestamp() if dt is not None else None


def run_driver(sw: Sweep, head: Head, inject: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run the sweep's driver in a process of its own, joined to the module's head, while ``inject`` runs here;
    the driver must exit 0."""
    log = sw.art.parent / f"{sw.name}.driver.log"
    proc = start_driver(sw, head, log, child=True)
    try:
        got = inject() if inject else {}
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:  # an inject that failed, or a driver that hangs: only this test's own driver
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        sw.log = log.read_text(errors="replace")
    assert rc == 0, sw.log
    return got


def start_driver(sw: Sweep, head: Head, log: Path, child: bool = False) -> subprocess.Popen[bytes]:
    """A driver in its own process, joined to the module's Ray head (as on a cluster); ``child``: polling every
    0.5 s (tests.driver_child) rather than the command's 1 s."""
    env = head_env(head, sw.url, sw.art)
    cmd = ([sys.executable, "-m", "tests.driver_child", str(sw.spec), "--poll-s", "0.5"] if child
           else sweep_cmd("run", str(sw.spec)))
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log, "wb"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, start_new_session=True)


def settle(sw: Sweep, before: dict[int, tuple[str, float | None]], head: Head | None = None,
           overshoot: int = 0) -> dict[str, Any]:
    """The checks every fault ends with; returns the trials and the number lost (asserted to be 0). With the
    module's ``head``, every CPU of it must be free again."""
    trials = trials_of(sw)
    by_number = {t.number: t for t in trials}
    assert [t.number for t in trials] == list(range(len(trials))), "trial numbers must be unique and contiguous"
    changed = [n for n, (state, value) in before.items()
               if n not in by_number or (by_number[n].state.name, by_number[n].value) != (state, value)]
    unfinished = [t.number for t in trials if t.state.name in ("RUNNING", "WAITING")]
    retried = {t.user_attrs.get("retry_of") for t in trials}
    unretried = [t.number for t in trials if needs_retry(t) and t.number not in retried]
    rerun = {t.user_attrs.get("rerun_of") for t in trials}  # a trial the infrastructure lost runs again
    unretried += [t.number for t in trials if needs_rerun(t) and t.number not in rerun]
    twice = [t.number for t in trials if starts(sw, t.number) > 1]
    no_value = [t.number for t in trials if t.state.name == "COMPLETE" and not isinstance(t.value, float)]
    lost = len(set(changed) | set(unfinished) | set(unretried) | set(twice) | set(no_value))
    detail = f"{outcome_text(trials)}\n{sw.log[-3000:]}"
    assert not changed, f"finished trials changed or vanished: {changed}\n{detail}"
    assert not unfinished, f"trials left unfinished: {unfinished}\n{detail}"
    assert not unretried, f"retryable failures without a retry: {unretried}\n{detail}"
    assert not twice, f"trial numbers whose trainer ran twice: {twice}\n{detail}"
    assert not no_value, f"COMPLETE trials without a value: {no_value}\n{detail}"
    for t in trials:  # a retry runs the same point; what its original never drew (its driver died mid-suggest) is new
        if "retry_of" in t.user_attrs:
            original = by_number[t.user_attrs["retry_of"]]
            assert all(t.params.get(k) == v for k, v in original.params.items()), detail
    done = sum(counts(t) for t in trials)
    assert sw.n_trials <= done <= sw.n_trials + overshoot, f"{done} counted trials, wanted {sw.n_trials}\n{detail}"
    wait_for(lambda: not trainer_pids(sw), 30, what="every trainer process of the sweep to be gone")
    if head is not None:
        cpus = free_cpus(head)
        assert cpus["free"] >= cpus["total"] > 0, f"Ray CPUs still held after the sweep: {cpus}\n{detail}"
    return {"trials": trials, "lost": lost, "done": done, "by_number": by_number}


def enqueue(sw: Sweep, *points: dict[str, Any]) -> None:
    study = optuna.create_study(study_name=sw.name, storage=st.open_storage(sw.url), load_if_exists=True)
    for p in points:
        study.enqueue_trial(p)


# -- the faults ------------------------------------------------------------------------------------


def test_sigkill_of_a_trainer(ray_cluster, make_sweep):
    sw = make_sweep("f_trainer_kill")

    def inject() -> dict[str, Any]:
        wait_for(lambda: stepping(sw, 0), 120, what="trial 0 training")
        before = snapshot(sw)
        (pid,) = wait_for(lambda: trainer_pids(sw, 0), 10, what="trial 0's trainer")
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        return {"t": t, "before": before}

    got = run_driver(sw, ray_cluster, inject)
    res = settle(sw, got["before"], ray_cluster)
    failed = res["by_number"][0]
    assert failed.state.name == "FAIL" and failed.user_attrs["fail_kind"] == "crash", outcome_text(res["trials"])
    assert "SIGKILL" in failed.user_attrs["fail_reason"]
    (retry,) = [t for t in res["trials"] if t.user_attrs.get("retry_of") == 0]
    assert retry.state.name == "COMPLETE"
    record("SIGKILL trainer", outcome_text(res["trials"]), res["lost"], stamp(retry.datetime_start) - got["t"])


def test_sigkill_of_a_ray_worker(ray_cluster, make_sweep):
    sw = make_sweep("f_worker_kill")

    def inject() -> dict[str, Any]:
        wait_for(lambda: stepping(sw, 0), 120, what="trial 0 training")
        before = snapshot(sw)
        (trainer,) = wait_for(lambda: trainer_pids(sw, 0), 10, what="trial 0's trainer")
        worker = parent_of(trainer)  # the supervisor: the Ray worker process running the trial's task
        assert "ray::" in Path(f"/proc/{worker}/cmdline").read_bytes().decode(errors="replace")
        t = time.time()
        os.kill(worker, signal.SIGKILL)
        # The reaper, not the dead supervisor, must take the trainer down.
        wait_for(lambda: not alive(trainer), 30, what="the orphaned trainer to be reaped")
        return {"t": t, "before": before, "reaped_s": time.time() - t}

    got = run_driver(sw, ray_cluster, inject)
    res = settle(sw, got["before"], ray_cluster)
    failed = res["by_number"][0]
    assert failed.state.name == "FAIL" and failed.user_attrs["fail_kind"] == "lost", outcome_text(res["trials"])
    (retry,) = [t for t in res["trials"] if t.user_attrs.get("retry_of") == 0]
    assert retry.state.name == "COMPLETE"
    record("SIGKILL Ray worker", outcome_text(res["trials"]) + f"; trainer reaped in {got['reaped_s']:.1f} s",
           res["lost"], stamp(retry.datetime_start) - got["t"])


def test_sigkill_of_the_driver_then_resume(ray_cluster, make_sweep, tmp_path):
    sw = make_sweep("f_driver_kill", n_trials=N_TRIALS + 1)
    first = start_driver(sw, ray_cluster, tmp_path / "first.log")
    try:
        def ready() -> bool:
            ts = trials_of(sw)
            running = [t.number for t in ts if t.state.name == "RUNNING"]
            return any(t.state.name == "COMPLETE" for t in ts) and any(stepping(sw, n) for n in running)

        wait_for(ready, 180, interval=0.3, what="one complete and one training trial")
        before = snapshot(sw)
        t_kill = time.time()
        os.kill(first.pid, signal.SIGKILL)  # the driver alone: Ray ends its job's tasks, reapers their trainers
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    running_before = [t.number for t in trials_of(sw) if t.state.name == "RUNNING"]
    wait_for(lambda: not trainer_pids(sw), 60, what="the dead driver's trainers to be reaped")
    second = start_driver(sw, ray_cluster, tmp_path / "second.log")
    assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()
    sw.log = (tmp_path / "first.log").read_text() + (tmp_path / "second.log").read_text()
    res = settle(sw, before, ray_cluster)
    lost = {t.number for t in res["trials"] if t.user_attrs.get("fail_kind") == "lost"}
    # Each trial running at the kill was failed as lost and retried (settle checks the retry), or its
    # supervisor outlived the driver for the moment it needed to finish and store its own result.
    assert all(res["by_number"][n].state.is_finished() for n in running_before), outcome_text(res["trials"])
    later = [stamp(t.datetime_start) for t in res["trials"] if t.number not in before and t.number not in lost
             and t.datetime_start is not None and stamp(t.datetime_start) > t_kill]
    record("SIGKILL driver, resume", outcome_text(res["trials"]), res["lost"], min(later) - t_kill if later else None)


# The store unreachable for this long mid-sweep: a minute in the full run, a few seconds in the short one.
OUTAGE_S = 60 if FULL else 5


def _store_fault(sw: Sweep, head: Head, fault: Callable[[], None]) -> dict[str, Any]:
    """Run the sweep while ``fault`` takes its store away and gives it back once both trials train; when
    it came back (``t1``) and when the sweep first wrote to it again."""

    def inject() -> dict[str, Any]:
        wait_for(lambda: stepping(sw, 0) and stepping(sw, 1), 120, what="both trials training")
        before = snapshot(sw)
        t0 = time.time()
        fault()
        t1 = time.time()

        def fresh_write() -> float | None:
            """When the sweep wrote to the store again: a heartbeat, a start or an end after the fault
            (or, if every trial ended before it, the first successful read)."""
            with contextlib.suppress(Exception):
                ts = load_trials(sw.url, sw.name)
                stamps = [t.system_attrs.get("sweep:heartbeat", 0) for t in ts]
                stamps += [stamp(t.datetime_complete) or 0 for t in ts] + [stamp(t.datetime_start) or 0 for t in ts]
                if max(stamps) > t1:
                    return min(x for x in stamps if x > t1)
                if all(t.state.is_finished() for t in ts):
                    return time.time()
            return None

        back = wait_for(fresh_write, 90, interval=0.2, what="a write to the store after the fault")
        return {"before": before, "t0": t0, "t1": t1, "back": back}

    got = run_driver(sw, head, inject)
    res = settle(sw, got["before"], head)
    reasons = {t.number: t.user_attrs.get("fail_reason") for t in res["trials"] if t.state.name != "COMPLETE"}
    assert not reasons, f"{outcome_text(res['trials'])}: {reasons}\n{sw.log[-3000:]}"
    # Nothing counted that did not run: every trial counted started its trainer exactly once and trained.
    assert all(starts(sw, t.number) == 1 and stepping(sw, t.number) for t in res["trials"]), \
        {t.number: starts(sw, t.number) for t in res["trials"]}
    return {**got, **res}


# The rows that only FAULTS_FULL=1 runs (make faults, and .ci/run after make test: `-m faults_full`).
FULL_ONLY = [pytest.mark.faults_full, pytest.mark.skipif(not FULL, reason="FAULTS_FULL=1 only (make faults; "
                                                                          ".ci/run runs it after make test)")]
BEHIND_PROXY = pytest.mark.parametrize("proxy", [False, pytest.param(True, marks=FULL_ONLY)], ids=["direct", "proxy"])


# One restart per short run; FAULTS_FULL=1 restarts behind the gRPC proxy too.
@BEHIND_PROXY
def test_postgres_restart_mid_sweep(ray_cluster, make_sweep, private_pg, monkeypatch, proxy):
    sw = make_sweep("f_pg_restart_proxy" if proxy else "f_pg_restart")
    if proxy:
        monkeypatch.setenv(st.ENV_PROXY, "1")
    got = _store_fault(sw, ray_cluster, private_pg.restart)  # the module's own server, never the machine's
    if proxy:
        assert "storage proxy: workers use grpc://" in sw.log, sw.log
    record("PostgreSQL restart" + (" behind the proxy" if proxy else ""),
           outcome_text(got["trials"]) + f"; restart took {got['t1'] - got['t0']:.1f} s", got["lost"],
           got["back"] - got["t0"])


# FAULTS_FULL=1 cuts the store off behind the gRPC proxy too (the workers reach it through the driver's proxy).
@BEHIND_PROXY
def test_store_unreachable_mid_sweep(ray_cluster, make_sweep, private_pg, monkeypatch, proxy):
    sw = make_sweep("f_store_away_proxy" if proxy else "f_store_away")
    if proxy:
        monkeypatch.setenv(st.ENV_PROXY, "1")

    def outage() -> None:
        private_pg.stop()  # every connection refused until it is back
        time.sleep(OUTAGE_S)
        private_pg.start()

    got = _store_fault(sw, ray_cluster, outage)
    assert "storage: reachable again after" in sw.log, sw.log  # the driver waited it out and said so
    if proxy:
        assert "storage proxy: workers use grpc://" in sw.log, sw.log
    # Time to recover: from the store's return to the sweep's first write to it.
    record(f"store unreachable {OUTAGE_S} s" + (" behind the proxy" if proxy else ""),
           outcome_text(got["trials"]) + f"; {got['done']} counted", got["lost"], got["back"] - got["t1"])


def _trainer_fault(make_sweep: Callable[..., Sweep], head: Head, name: str, fault: str,
                   **kw: Any) -> tuple[Sweep, dict[str, Any]]:
    """A sweep whose trial 0 runs the trainer's ``fault`` at step 3 while trial 1 trains normally."""
    sw = make_sweep(name, fault=fault, **kw)
    enqueue(sw, {**HEALTHY, "seed": FAULTY_SEED}, {**HEALTHY, "seed": 0},
            *({**HEALTHY, "seed": 0, "depth": 2} for _ in range(sw.n_trials - 2)))
    run_driver(sw, head)
    res = settle(sw, {}, head)
    return sw, res


def _since_last_event(sw: Sweep, t: Any) -> float | None:
    """From the faulted trainer's last sign of life (its last event) to the trial's recorded end."""
    f = events_file(sw, t.number)
    if not f.exists() or t.datetime_complete is None:
        return None
    return stamp(t.datetime_complete) - f.stat().st_mtime


def test_hung_trainer(ray_cluster, make_sweep):
    # A short hard deadline (budget + 15 s start-up + 8 s eval): the hung trainer ignores SIGTERM.
    sw, res = _trainer_fault(make_sweep, ray_cluster, "f_hang", "hang",
                             trial={"startup_allowance_s": 15, "eval_timeout_s": 8})
    hung = res["by_number"][0]
    assert hung.state.name == "FAIL" and hung.user_attrs["fail_kind"] == "deadline", outcome_text(res["trials"])
    assert all(t.state.name == "COMPLETE" for t in res["trials"][1:]), outcome_text(res["trials"])
    assert not any("retry_of" in t.user_attrs for t in res["trials"])
    record("hung trainer", outcome_text(res["trials"]), res["lost"], _since_last_event(sw, hung))


def test_diverging_trainer(ray_cluster, make_sweep):
    sw, res = _trainer_fault(make_sweep, ray_cluster, "f_diverge", "diverge")
    bad = res["by_number"][0]
    assert bad.state.name == "PRUNED" and bad.user_attrs["fail_kind"] == "diverged", outcome_text(res["trials"])
    assert all(t.state.name == "COMPLETE" for t in res["trials"][1:]), outcome_text(res["trials"])
    record("diverging trainer", outcome_text(res["trials"]), res["lost"], _since_last_event(sw, bad))


def test_out_of_memory_trainer(ray_cluster, make_sweep):
    # Every trainer of the sweep gets a 3 GiB address space (RLIMIT_AS, sweep.spec.limits): the healthy one
    # trains within it, the faulty one allocates until the allocator refuses.
    sw, res = _trainer_fault(make_sweep, ray_cluster, "f_oom", "oom",
                             **{"trial.env": {"SWEEP_TRIAL_MEMORY_MB": "3072"}})
    bad = res["by_number"][0]
    assert bad.state.name == "FAIL" and bad.user_attrs["fail_kind"] == "oom", outcome_text(res["trials"])
    assert all(t.state.name == "COMPLETE" for t in res["trials"][1:]), outcome_text(res["trials"])
    record("out-of-memory trainer", outcome_text(res["trials"]), res["lost"], _since_last_event(sw, bad))


@contextlib.contextmanager
def full_disk(path: Path) -> Iterator[None]:
    """A 64 KiB tmpfs on ``path``, filled up; skips where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        skip_unless_ci(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        with contextlib.suppress(OSError), open(path / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_full_artifacts_disk(ray_cluster, make_sweep):
    sw = make_sweep("f_disk_full")
    with full_disk(sw.art):
        with pytest.raises(OSError):
            (sw.art / "probe").write_bytes(b"x" * 4096)
        t0 = time.time()
        run_driver(sw, ray_cluster)
        res = settle(sw, {}, ray_cluster)
    trials = res["trials"]
    assert all(t.state.name == "COMPLETE" for t in trials), outcome_text(trials)
    assert all(t.user_attrs.get("artifacts_error") for t in trials), [t.user_attrs for t in trials]
    first = min(stamp(t.datetime_complete) for t in trials)
    for t in trials:  # the scratch directories the supervisors fell back to
        scratch = Path(t.user_attrs.get("artifacts", ""))
        if scratch.name.startswith(f"sweep-{sw.name}-"):
            shutil.rmtree(scratch, ignore_errors=True)
    record("artifacts disk full", outcome_text(trials) + "; artifacts moved to a scratch dir, recorded",
           res["lost"], first - t0)


def test_two_drivers_on_one_study(ray_cluster, make_sweep, tmp_path):
    sw = make_sweep("f_two_drivers", n_trials=N_TRIALS + 1, concurrency=1)
    a = start_driver(sw, ray_cluster, tmp_path / "a.log")
    b = start_driver(sw, ray_cluster, tmp_path / "b.log")
    try:
        rc = (a.wait(timeout=300), b.wait(timeout=300))
    finally:
        for p in (a, b):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    sw.log = (tmp_path / "a.log").read_text() + (tmp_path / "b.log").read_text()
    assert rc == (0, 0), sw.log
    # Each driver counts the other's running trials, but both may ask in the same instant: at most
    # one trial per driver beyond n_trials.
    res = settle(sw, {}, ray_cluster, overshoot=1)
    originals = [json.dumps(t.params, sort_keys=True) for t in res["trials"] if "retry_of" not in t.user_attrs]
    assert len(originals) == len(set(originals)), "a point was proposed twice"
    record("two drivers on one study", outcome_text(res["trials"]) + f"; {res['done']} counted of {sw.n_trials}",
           res["lost"], None)


@pytest.mark.faults_full  # make test runs the short form, tests/sweep/run/test_autoscale.py
@pytest.mark.skipif(not FULL, reason="FAULTS_FULL=1 only (make faults; .ci/run runs it after make test)")
def test_worker_node_removed_from_an_autoscaling_cluster(make_sweep, tmp_path):
    """Ray's fake autoscaling cluster, from zero workers; the node under a training trial is taken away."""
    from sweep.run import liveness
    from sweep.run.outcome import ATTR_RERUN_OF, lost_to_infra
    from tests.autoscaling_cluster import autoscaling_cluster

    workers = 3
    sw = make_sweep("f_node_removed", n_trials=workers + 1, concurrency="auto")
    node = {"cpu1": {"resources": {"CPU": 1, "object_store_memory": 80 * 1024**2}, "max_workers": workers}}
    with autoscaling_cluster(node, max_workers=workers) as cluster:
        env = {**sweep_env(sw.url, sw.art), **cluster.env}
        with open(tmp_path / "driver.log", "wb") as log:
            driver = subprocess.Popen(sweep_cmd("run", str(sw.spec)), env=env, cwd=ROOT, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        try:
            def training() -> list[int]:
                return [n for n in range(workers) if stepping(sw, n) and trainer_pids(sw, n)]

            victim = wait_for(training, 240, interval=0.3, what="a trial training on a worker node")[0]
            before = snapshot(sw)
            (pid,) = trainer_pids(sw, victim)
            t_kill = time.time()
            cluster.remove_node_of(pid)
            rc = driver.wait(timeout=400)
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, signal.SIGKILL)
                driver.wait()
        sw.log = (tmp_path / "driver.log").read_text(errors="replace")
        assert rc == 0, sw.log
        request = cluster.standing_request()
    res = settle(sw, before)
    detail = outcome_text(res["trials"]) + "\n" + sw.log[-3000:]
    lost = [t.number for t in res["trials"] if lost_to_infra(t)]
    reruns = [t for t in res["trials"] if ATTR_RERUN_OF in t.user_attrs]
    assert lost == [victim] and [t.user_attrs[ATTR_RERUN_OF] for t in reruns] == [victim], detail
    assert reruns[0].state.name == "COMPLETE" and reruns[0].params == res["by_number"][victim].params, detail
    assert "autoscaler: asked for" in sw.log and "(nodes joined" in sw.log, sw.log
    assert request == [], f"the autoscaler request was left standing: {request}"
    record("worker node removed (autoscaling cluster)",
           outcome_text(res["trials"]) + "; the re-run not counted", res["lost"],
           liveness.started_at(reruns[0]) - t_kill, rerun=len(reruns))  # to the re-run's supervisor up on a node


# -- the store itself: what the faults above lean on ----------------------------------------------


def test_sweep_indexes_are_created_once(pg_url):
    driver = st.open_storage(pg_url)  # the driver's role creates them
    try:
        assert st.ensure_indexes(driver, pg_url) == []  # already there: nothing to do, no error
        rows = driver.engine.connect().exec_driver_sql(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'trials'").fetchall()
        assert set(st.SWEEP_INDEXES) <= {r[0] for r in rows}
    finally:
        driver.engine.dispose()


def _first_open(url: str) -> str:
    try:
        st.open_storage(url).engine.dispose()
        return "ok"
    except Exception as e:  # reported to the parent, which asserts
        return f"{type(e).__name__}: {e}"


def test_drivers_opening_a_fresh_database_at_once_do_not_race(pg_url):
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(4) as pool:
        assert pool.map(_first_open, [pg_url] * 4) == ["ok"] * 4


def test_worker_cache_reads_new_trials_at_once_and_running_ones_within_its_refresh(pg_url, monkeypatch):
    from optuna.trial import TrialState

    study = optuna.create_study(study_name="cache", storage=st.open_storage(pg_url))
    worker = st.open_storage(pg_url, role="worker")
    assert worker is st.open_storage(pg_url, role="worker")  # one per process, shared by its trials
    sid = study._study_id
    running = study.ask()
    assert [t.state for t in worker.get_all_trials(sid)] == [TrialState.RUNNING]
    study.tell(running, 1.0)
    done = study.ask()
    study.tell(done, 2.0)  # created and finished since the worker's last read: read at once
    states = [t.state for t in worker.get_all_trials(sid)]
    assert states == [TrialState.RUNNING, TrialState.COMPLETE]  # the running one is re-read later
    worker._full_at[sid] -= st.WORKER_REFRESH_S + 1
    assert [t.state for t in worker.get_all_trials(sid)] == [TrialState.COMPLETE] * 2
    assert [t.value for t in worker.get_all_trials(sid, states=(TrialState.COMPLETE,))] == [1.0, 2.0]
    worker._backend.engine.dispose()


def command_line(pid: int) -> list[str]:
    """A process's arguments, one string each (/proc's cmdline separates them with NUL bytes)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def url_parts_in(args: list[str], url: str) -> list[str]:
    """The arguments that hold the database URL, or its address and user without the database name."""
    return [a for a in args if url in a or url.rsplit("/", 1)[0] in a]


def test_the_command_line_check_sees_a_url_that_is_there(pg_url):
    """What the proxy test's command-line check says of a process that does carry the URL."""
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--storage={pg_url}"])
    try:
        args = wait_for(lambda: (a := command_line(proc.pid))[1:2] == ["-c"] and a, 10, what="the child's exec")
        assert url_parts_in(args, pg_url) == [f"--storage={pg_url}"]
        assert url_parts_in(args, pg_url.rsplit("/", 1)[0] + "/other") == [f"--storage={pg_url}"]
        # The check it replaces joined the characters of the text with spaces, and so never saw it.
        assert pg_url.rsplit(":", 1)[0] not in " ".join(Path(f"/proc/{proc.pid}/cmdline").read_text())
    finally:
        proc.kill()
        proc.wait()


def test_grpc_proxy_serves_workers_and_its_outage_is_transient(pg_url, monkeypatch):
    # Every read full: the pruner sees trials told just now.
    monkeypatch.setattr("sweep.store.opening.WORKER_REFRESH_S", 0.0)
    study = optuna.create_study(study_name="proxied", storage=st.open_storage(pg_url),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=1))
    proxy = st.StorageProxy(pg_url)
    try:
        assert proxy.url.startswith("grpc://127.0.0.1:")
        args = command_line(proxy.proc.pid)
        assert "sweep.store" in args and "proxy" in args, args  # the proxy's own command line was read
        assert not url_parts_in(args, pg_url), args  # its URL came through the environment
        worker = st.open_storage(proxy.url, role="worker")
        remote = optuna.load_study(study_name="proxied", storage=worker,
                                   pruner=optuna.pruners.MedianPruner(n_startup_trials=1))
        for value in (1.0, 2.0, 3.0):
            trial = remote.ask()
            trial.suggest_float("x", 0, 1)
            time.sleep(st.PROXY_READ_TTL_S + 0.1)  # the proxy answers reads from a snapshot this old at most
            trial.report(value, 1)
            pruned = trial.should_prune()
            remote.tell(trial, value)
        assert pruned  # the third is worse than the median of the first two
        assert [t.value for t in study.get_trials()] == [1.0, 2.0, 3.0]
    finally:
        proxy.close()
    try:
        with pytest.raises(Exception) as info:
            remote.ask()
        assert st.is_transient(info.value), info.value  # retried like a database restart, not fatal
    finally:  # the client's channel, which would keep gRPC's threads running to the interpreter's exit
        worker.close()
        st.forget_shared()


# -- the infrastructure around the trials: Ray and the driver ------------------------------------------


def start_local_driver(sw: Sweep, log: Path) -> subprocess.Popen[bytes]:
    """A driver in its own process that starts its own local Ray (no RAY_ADDRESS), as `make sweep` does."""
    return subprocess.Popen(sweep_cmd("run", str(sw.spec)), env=sweep_env(sw.url, sw.art), cwd=ROOT,  # noqa: SIM115
                            stdout=open(log, "wb"), stderr=open(log.with_suffix(".err"), "wb"), start_new_session=True)


def _kill_local_ray_part(make_sweep: Callable[..., Sweep], tmp_path: Path, name: str, part: str) -> dict[str, Any]:
    """Kill one process (``raylet`` or ``gcs_server``) of the local Ray a driver started, while a trial trains;
    the driver must stop in one line and exit 3; the same command again must finish the study."""
    from sweep.run.health import child_processes, end_leftovers, process_tree, still_running

    sw = make_sweep(name)
    first = start_local_driver(sw, tmp_path / "first.log")
    started: dict[int, int | None] = {}
    try:
        wait_for(lambda: any(stepping(sw, t.number) for t in trials_of(sw) if t.state.name == "RUNNING"), 180,
                 interval=0.3, what="a trial training")
        before = snapshot(sw)
        started = process_tree([first.pid])  # the driver and all it started: its local Ray
        pid = child_processes(first.pid, {part})[part]  # a process of the Ray this test's driver started
        t_kill = time.time()
        os.kill(pid, signal.SIGKILL)
        rc = first.wait(timeout=120)
        stopped_s = time.time() - t_kill
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    log1 = (tmp_path / "first.log").read_text()
    last = log1.strip().splitlines()[-1]
    assert rc == 3, log1
    assert last.startswith("sweep stopped: the local Ray's ") and f"pid {pid}) is gone" in last, log1
    assert last.endswith(f"-m sweep run {sw.spec}"), last
    assert "Traceback" not in log1, log1
    try:
        wait_for(lambda: not trainer_pids(sw), 60, what="the stopped driver's trainers to be gone")
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not still_running(started), 30, what="the stopped driver's processes to be gone")
        left = {p: Path(f"/proc/{p}/cmdline").read_bytes()[:40] for p in still_running(started)}
        assert not left, f"processes of the stopped driver's Ray left behind: {left}"
    finally:
        end_leftovers(started, 0)
    mid = trials_of(sw)
    lost = [t for t in mid if t.user_attrs.get("fail_kind") == "infra"]
    assert not [t for t in mid if t.state.name == "RUNNING"], outcome_text(mid)
    # Nothing counted that did not run: every counted trial is one whose trainer returned its result.
    assert all(t.state.name == "COMPLETE" for t in mid if counts(t)), outcome_text(mid)
    assert not any(counts(t) for t in lost)

    t_resume = time.time()
    second = start_local_driver(sw, tmp_path / "second.log")
    try:
        rc2 = second.wait(timeout=300)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait()
    sw.log = log1 + (tmp_path / "second.log").read_text()
    assert rc2 == 0, sw.log
    res = settle(sw, before)  # exactly n_trials counted, each lost trial re-run with its parameters
    assert res["done"] == sw.n_trials
    reruns = [t for t in res["trials"] if "rerun_of" in t.user_attrs]
    assert {t.user_attrs["rerun_of"] for t in reruns} == {t.number for t in lost if t.params}
    back = [stamp(t.datetime_start) for t in res["trials"] if (stamp(t.datetime_start) or 0) > t_resume]
    return {"res": res, "lost": lost, "reruns": reruns, "stopped_s": stopped_s,
            "recover_s": min(back) - t_kill if back else None}


def test_raylet_killed_mid_sweep_local(make_sweep, tmp_path):
    got = _kill_local_ray_part(make_sweep, tmp_path, "f_raylet_kill", "raylet")
    res = got["res"]
    record("raylet killed mid-sweep (local)", outcome_text(res["trials"]) + f"; driver stopped "
           f"{got['stopped_s']:.1f} s after the kill (exit 3), resumed by the same command", res["lost"],
           got["recover_s"], len(got["reruns"]))


@pytest.mark.faults_full  # in make test, the raylet row covers its stop and resume in short
@pytest.mark.skipif(not FULL, reason="FAULTS_FULL=1 only (make faults; .ci/run runs it after make test)")
def test_gcs_killed_mid_sweep_local(make_sweep, tmp_path):
    # Ray ends a driver whose GCS has been away 60 s; the driver must have stopped cleanly well before.
    got = _kill_local_ray_part(make_sweep, tmp_path, "f_gcs_kill", "gcs_server")
    res = got["res"]
    assert got["stopped_s"] < 30, got
    record("GCS killed (local)", outcome_text(res["trials"]) + f"; driver stopped {got['stopped_s']:.1f} s after "
           "the kill (exit 3), resumed by the same command", res["lost"], got["recover_s"], len(got["reruns"]))


# The driver, SIGKILLed by itself right after drawing the first parameter of trial KILL_AT: between `ask` and
# the last suggestion, the moment a real kill lands in once in a while.
KILL_MID_SUGGEST = """
import os, signal, sys
from sweep.spec import space

draw = space.Param.suggest

def suggest(self, trial):
    value = draw(self, trial)
    if trial.number == int(os.environ["KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return value

space.Param.suggest = suggest
from sweep.cli import main
sys.exit(main(["run", sys.argv[1]]))
"""


def test_driver_killed_between_ask_and_suggest(ray_cluster, make_sweep, tmp_path):
    sw = make_sweep("f_mid_suggest")
    enqueue(sw, HEALTHY)  # trial 0: a whole point from the start; trial 1 is sampled, killed mid-draw
    env = head_env(ray_cluster, sw.url, sw.art, KILL_AT="1")
    with open(tmp_path / "first.log", "wb") as log:
        first = subprocess.run([sys.executable, "-c", KILL_MID_SUGGEST, str(sw.spec)], env=env, cwd=ROOT,
                               stdout=log, stderr=subprocess.STDOUT, timeout=180)
    t_kill = time.time()
    assert first.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()
    mid = {t.number: t for t in trials_of(sw)}
    assert mid[1].state.name == "RUNNING" and len(mid[1].params) == 1, outcome_text(list(mid.values()))
    second = start_driver(sw, ray_cluster, tmp_path / "second.log")
    try:
        assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait()
    sw.log = (tmp_path / "first.log").read_text() + (tmp_path / "second.log").read_text()
    res = settle(sw, {}, ray_cluster)
    by = res["by_number"]
    half = by[1]  # never ran: failed without counting, and never run with what it lacked drawn anew
    assert half.state.name == "FAIL" and half.user_attrs["fail_kind"] == "infra" and not counts(half), sw.log
    assert not [t for t in res["trials"] if t.user_attrs.get("rerun_of") == 1 or t.user_attrs.get("retry_of") == 1]
    reruns = [t for t in res["trials"] if "rerun_of" in t.user_attrs]
    for t in reruns:  # the whole point of what the kill took (trial 0, if its task was under way)
        assert t.params == by[t.user_attrs["rerun_of"]].params == HEALTHY, outcome_text(res["trials"])
    assert res["done"] == sw.n_trials and all(t.state.name == "COMPLETE" for t in res["trials"] if counts(t))
    back = [stamp(t.datetime_start) for t in res["trials"] if t.number not in mid]
    record("driver killed between ask and suggest", outcome_text(res["trials"]), res["lost"],
           min(back) - t_kill if back else None, len(reruns))
