"""Whole sweeps: real local Ray, real PostgreSQL, the real trainer with tiny models and short budgets."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
from pathlib import Path

import optuna
import pytest

from sweep import cli
from sweep import store as st
from sweep.run.driver import Driver
from sweep.run.outcome import counts
from sweep.spec import load
from tests.sweep_fixtures import (
    ROOT,
    load_trials,
    local_ray,
    pg_available,
    pg_database,
    processes_with,
    sweep_cmd,
    sweep_env,
    tiny_spec,
    wait_for,
    write_spec,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not pg_available(), reason="PostgreSQL is not running")]


@pytest.fixture(scope="module")
def ray_local():
    with local_ray("sweep-tests"):
        yield


@pytest.fixture
def pg_url():
    with pg_database() as url:
        yield url


@pytest.fixture
def env_for(monkeypatch, tmp_path):
    """Point SWEEP_STORAGE and SWEEP_ARTIFACTS of this process at the test's store."""

    def apply(url: str) -> Path:
        art = tmp_path / "art"
        monkeypatch.setenv(st.ENV_STORAGE, url)
        monkeypatch.setenv("SWEEP_ARTIFACTS", str(art))
        return art

    return apply


def test_study_completes_on_postgres_with_two_concurrent_trials(ray_local, pg_url, env_for, tmp_path,
                                                                data_cache, capsys):
    art = env_for(pg_url)
    path = write_spec(tmp_path, "e2e", tiny_spec(data_cache))
    out = io.StringIO()
    assert Driver(load(path), out=out).run() == 0
    text = out.getvalue()
    assert "progress: done 4/4" in text and "best: trial" in text

    trials = load_trials(pg_url, "e2e")
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    assert all(sorted(t.intermediate_values) == [2, 4] for t in trials)  # eval at 2 s, final at 4 s
    spans = sorted((t.datetime_start, t.datetime_complete) for t in trials)
    assert any(a[1] > b[0] for a, b in zip(spans, spans[1:], strict=False)), "no two trials overlapped"
    for t in trials:
        assert (art / "e2e" / str(t.number) / "trainer.log").exists()

    assert cli.main(["status", str(path), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert set(status) == {"study", "counts", "trials"} and status["study"] == "e2e"
    assert status["counts"] == {"COMPLETE": 4, "PRUNED": 0, "FAIL": 0, "RUNNING": 0, "WAITING": 0}
    assert [set(row) for row in status["trials"]] == [{"number", "state", "value", "params"}] * 4
    assert cli.main(["best", str(path), "--json"]) == 0
    best = json.loads(capsys.readouterr().out)
    assert set(best) == {"number", "params", "val_bpb", "record"}
    assert best["val_bpb"] == min(t.value for t in trials) == best["record"]["val_bpb"]
    assert best["record"]["status"] == "ok" and "train_seconds" in best["record"]
    assert cli.main(["status", str(path)]) == 0
    assert "COMPLETE 4" in capsys.readouterr().out


def test_ad_hoc_trial_is_recorded_but_not_counted(ray_local, env_for, tmp_path, data_cache, capsys):
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    env_for(url)
    path = write_spec(tmp_path, "adhoc", tiny_spec(data_cache))
    bad = '{"depth": 1, "model_dim": 48, "matrix_lr": 0.5}'  # off the range (missing ones would be sampled)
    assert cli.main(["trial", "--study", str(path), "--params", bad, "--now"]) == 2
    assert "matrix_lr" in capsys.readouterr().err
    params = {"depth": 1, "model_dim": 48, "matrix_lr": 0.02}
    assert cli.main(["trial", "--study", str(path), "--params", json.dumps(params), "--now"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["state"] == "COMPLETE"
    (t,) = load_trials(url, "adhoc")
    assert t.params == params and t.user_attrs["adhoc"] is True and not counts(t)


def test_pruner_stops_a_bad_config_early(ray_local, env_for, tmp_path, data_cache):
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    env_for(url)
    lr = {"type": "float", "low": 1e-6, "high": 1.0, "log": True}
    spec = load(write_spec(tmp_path, "prune", tiny_spec(
        data_cache,
        study={"n_trials": 3, "concurrency": 1},
        trial={"budget_s": 6, "startup_allowance_s": 20, "eval_timeout_s": 20, "eval_fractions": [0.25, 0.5, 0.75],
               "heartbeat_s": 1, "stale_after_s": 8, "stop_grace_s": 5},
        pruner={"name": "median", "n_startup_trials": 2},
        **{"params.matrix_lr": lr, "params.embedding_lr": lr, "params.unembedding_lr": lr},
    )))
    study = optuna.create_study(study_name="prune", storage=st.open_storage(url))
    good = {"depth": 1, "model_dim": 32, "matrix_lr": 0.04, "embedding_lr": 0.6, "unembedding_lr": 0.004}
    study.enqueue_trial(good)
    study.enqueue_trial({**good, "depth": 2})
    study.enqueue_trial({**good, "matrix_lr": 1e-6, "embedding_lr": 1e-6, "unembedding_lr": 1e-6})
    assert Driver(spec, out=io.StringIO()).run() == 0

    trials = load_trials(url, "prune")
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "PRUNED"]
    bad = trials[2]
    assert list(bad.intermediate_values) == [2]  # pruned at the first eval point (0.25 of 6 s)
    assert bad.value > max(t.intermediate_values[2] for t in trials[:2])
    assert bad.user_attrs["status"] == "stopped" and bad.user_attrs["train_seconds"] < 3
    assert "pruned at 2 s" in bad.user_attrs["fail_reason"]


def _start_driver(spec: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(sweep_cmd("run", str(spec)), env=env, cwd=ROOT, stdout=open(log, "w"),  # noqa: SIM115
                            stderr=subprocess.STDOUT, start_new_session=True)


def _trainer_pid(marker: str) -> int | None:
    for pid in processes_with(marker):
        try:
            if "model.train" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                return pid
        except OSError:
            pass
    return None


def test_sigkilled_trainer_fails_once_and_is_retried(tmp_path, data_cache):
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    art = tmp_path / "art"
    spec = write_spec(tmp_path, "kill", tiny_spec(data_cache, study={"n_trials": 1, "concurrency": 1},
                                                  trial={"budget_s": 8, "eval_timeout_s": 20, "eval_fractions": [0.5],
                                                         "heartbeat_s": 1, "stale_after_s": 8}))
    proc = _start_driver(spec, sweep_env(url, art), tmp_path / "driver.log")
    try:
        events = art / "kill" / "0" / "events.jsonl"
        wait_for(lambda: events.exists() and '"step"' in events.read_text(), 90, what="trial 0's first step")
        pid = _trainer_pid(str(art / "kill" / "0"))
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=120) == 0, (tmp_path / "driver.log").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = (tmp_path / "driver.log").read_text()
    trials = load_trials(url, "kill")
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"], log
    failed, retry = trials
    assert failed.user_attrs["fail_kind"] == "crash" and "SIGKILL" in failed.user_attrs["fail_reason"]
    assert retry.user_attrs["retry_of"] == 0 and retry.params == failed.params
    assert sum(counts(t) for t in trials) == 1
    assert "trial 0 FAIL (crash)" in log and "retry of trial 0" in log


def test_killed_driver_resumes_without_losing_or_repeating_trials(tmp_path, pg_url, data_cache):
    art = tmp_path / "art"
    spec = write_spec(tmp_path, "resume", tiny_spec(
        data_cache, study={"n_trials": 4, "concurrency": 2, "seed": 3},
        trial={"budget_s": 8, "startup_allowance_s": 20, "eval_timeout_s": 20, "eval_fractions": [0.5],
               "heartbeat_s": 1, "stale_after_s": 8}))
    env = sweep_env(pg_url, art)

    def states():
        return [(t.number, t.state.name) for t in load_trials(pg_url, "resume", missing_ok=True)]

    first = _start_driver(spec, env, tmp_path / "first.log")
    try:
        # Kill it while one trial is finished and another is training, still before its mid-run eval: at
        # least half its budget is left, so it cannot finish between this check and the kill.
        def early_in_training(n: int) -> bool:
            events = art / "resume" / str(n) / "events.jsonl"
            text = events.read_text() if events.exists() else ""
            return '"step"' in text and '"eval"' not in text

        def ready():
            s = states()
            running = [n for n, state in s if state == "RUNNING"]
            return any(state == "COMPLETE" for _, state in s) and any(early_in_training(n) for n in running)
        wait_for(ready, 240, interval=0.3, what="one complete and one training trial")
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver, its local Ray; workers follow the raylet
        first.wait()
    before = {t.number: t.value for t in load_trials(pg_url, "resume") if t.state.name == "COMPLETE"}
    running_before = [n for n, s in states() if s == "RUNNING"]
    assert before and running_before
    wait_for(lambda: not _trainer_pid(str(art)), 20, what="the dead driver's trainers to be reaped")

    second = subprocess.run(sweep_cmd("run", str(spec)), env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=240)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "lost" in second.stdout

    trials = load_trials(pg_url, "resume")
    numbers = [t.number for t in trials]
    assert numbers == list(range(len(trials)))
    assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")]
    assert sum(counts(t) for t in trials) == 4
    by_number = {t.number: t for t in trials}
    for n, value in before.items():  # nothing finished was lost or rerun
        assert by_number[n].state.name == "COMPLETE" and by_number[n].value == value
    # Killed with their driver (its local Ray took their tasks): lost to the infrastructure, re-run, uncounted.
    lost = [t for t in trials if t.user_attrs.get("fail_kind") == "infra"]
    assert {t.number for t in lost} >= set(running_before)
    for t in lost:
        reruns = [r for r in trials if r.user_attrs.get("rerun_of") == t.number]
        assert len(reruns) == 1 and reruns[0].params == t.params
    originals = [t for t in trials if "retry_of" not in t.user_attrs and "rerun_of" not in t.user_attrs]
    keys = [json.dumps(t.params, sort_keys=True) for t in originals]
    assert len(keys) == len(set(keys)), "a point was run twice outside a retry"
    assert not _trainer_pid(str(art))
