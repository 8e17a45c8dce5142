"""Whole sweeps: a real Ray head, real PostgreSQL, the real trainer with tiny models and short budgets.

Each driver runs in a process of its own (``python -m sweep run``), joined to the module's head. The killed
trainer and the killed, resumed driver are the fault suite's rows (tests/faults/test_faults.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from sweep import cli
from sweep import store as st
from sweep.run.outcome import counts
from tests.sweep_fixtures import (
    head_env,
    load_trials,
    pg_available,
    pg_database,
    run_sweep,
    tiny_spec,
    write_spec,
)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not pg_available(), reason="PostgreSQL is not running")]


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


def test_study_completes_on_postgres_with_two_concurrent_trials(ray_cluster, pg_url, env_for, tmp_path,
                                                                data_cache, capsys):
    art = env_for(pg_url)
    path = write_spec(tmp_path, "e2e", tiny_spec(data_cache))
    run = run_sweep("run", str(path), env=head_env(ray_cluster, pg_url, art))
    text = run.stdout
    assert run.returncode == 0, text + run.stderr
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


def test_ad_hoc_trial_is_recorded_but_not_counted(ray_cluster, env_for, tmp_path, data_cache, capsys):
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    art = env_for(url)
    path = write_spec(tmp_path, "adhoc", tiny_spec(data_cache))
    bad = '{"depth": 1, "model_dim": 48, "matrix_lr": 0.5}'  # off the range (missing ones would be sampled)
    assert cli.main(["trial", "--study", str(path), "--params", bad, "--now"]) == 2  # refused before any Ray
    assert "matrix_lr" in capsys.readouterr().err
    params = {"depth": 1, "model_dim": 48, "matrix_lr": 0.02}
    run = run_sweep("trial", "--study", str(path), "--params", json.dumps(params), "--now",
                    env=head_env(ray_cluster, url, art))
    assert run.returncode == 0, run.stdout + run.stderr
    last = run.stdout.strip().splitlines()[-1]
    assert json.loads(last)["state"] == "COMPLETE"
    (t,) = load_trials(url, "adhoc")
    assert t.params == params and t.user_attrs["adhoc"] is True and not counts(t)


def test_pruner_stops_a_bad_config_early(ray_cluster, env_for, tmp_path, data_cache):
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    art = env_for(url)
    lr = {"type": "float", "low": 1e-6, "high": 1.0, "log": True}
    spec = write_spec(tmp_path, "prune", tiny_spec(
        data_cache,
        study={"n_trials": 3, "concurrency": 1},
        trial={"budget_s": 6, "startup_allowance_s": 20, "eval_timeout_s": 20, "eval_fractions": [0.25, 0.5, 0.75],
               "heartbeat_s": 1, "stale_after_s": 8, "stop_grace_s": 5},
        pruner={"name": "median", "n_startup_trials": 2},
        **{"params.matrix_lr": lr, "params.embedding_lr": lr, "params.unembedding_lr": lr},
    ))
    study = optuna.create_study(study_name="prune", storage=st.open_storage(url))
    good = {"depth": 1, "model_dim": 32, "matrix_lr": 0.04, "embedding_lr": 0.6, "unembedding_lr": 0.004}
    study.enqueue_trial(good)
    study.enqueue_trial({**good, "depth": 2})
    study.enqueue_trial({**good, "matrix_lr": 1e-6, "embedding_lr": 1e-6, "unembedding_lr": 1e-6})
    run = run_sweep("run", str(spec), env=head_env(ray_cluster, url, art))
    assert run.returncode == 0, run.stdout + run.stderr

    trials = load_trials(url, "prune")
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "PRUNED"]
    bad = trials[2]
    assert list(bad.intermediate_values) == [2]  # pruned at the first eval point (0.25 of 6 s)
    assert bad.value > max(t.intermediate_values[2] for t in trials[:2])
    # Stopped by the prune's signal, well short of its 6 s budget (generous: a real clock on a shared machine).
    assert bad.user_attrs["status"] == "stopped" and bad.user_attrs["train_seconds"] < 6 - 1.0
    assert "pruned at 2 s" in bad.user_attrs["fail_reason"]
