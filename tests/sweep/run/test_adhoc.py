"""Ad-hoc trials: ``sweep trial`` input checks, enqueueing for a running sweep, and a real ``ray job submit``
to a real ``ray start --head`` on loopback with token authentication."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from sweep import cli
from sweep import store as st
from sweep.run.outcome import counts
from sweep.spec import load as load_spec
from sweep.spec import spec_hash
from sweep.store import artifacts as art
from tests.ray_head import Head, ray_head
from tests.sweep_fixtures import (
    ROOT,
    head_env,
    load_trials,
    pg_available,
    pg_database,
    run_sweep,
    sweep_cmd,
    tiny_spec,
    wait_for,
    write_spec,
)

RAY = str(Path(sys.executable).parent / "ray")
GOOD = {"depth": 1, "model_dim": 32, "matrix_lr": 0.02}


def _spec(tmp_path: Path, name: str, cache: str | None = None, budget_s: float = 4, **sections) -> Path:
    trial = {"budget_s": budget_s, "startup_allowance_s": 30, "eval_timeout_s": 30, "eval_fractions": [0.5],
             "heartbeat_s": 1, "stale_after_s": 10, "stop_grace_s": 5}
    return write_spec(tmp_path, name, tiny_spec(cache, trial=trial, **sections))


def _last_json(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith('{"number"')]
    assert lines, text[-3000:]
    return json.loads(lines[-1])


# -- input checks: exit 2, one line naming the cause, nothing written --------------------------------------

BAD = [
    ({**GOOD, "depth": 3}, "depth: 3 is outside [1, 2]"),
    ({**GOOD, "depth": "2"}, "depth: '2' is not a number"),
    ({**GOOD, "depth": 1.5}, "depth: 1.5 is not an integer"),
    ({**GOOD, "model_dim": 40}, "model_dim: 40 is not on the grid"),
    ({**GOOD, "matrix_lr": True}, "matrix_lr: True is not a number"),
    ({**GOOD, "lr": 0.1}, "lr: unknown parameter"),
    ({**GOOD, "seq_len": 64}, "seq_len: is fixed, not a searched parameter"),
    ({"depth": 2, "model_dim": 64}, "constraints.narrow: violated"),
]


@pytest.mark.parametrize(("params", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_params_exit_2_with_one_line_and_write_nothing(params, message, tmp_path, monkeypatch, capsys):
    journal = tmp_path / "store" / "j.log"
    monkeypatch.setenv(st.ENV_STORAGE, f"journal:{journal}")
    monkeypatch.setenv(art.ENV_ARTIFACTS, str(tmp_path / "art"))
    spec = _spec(tmp_path, "bad", constraints={"narrow": "depth * model_dim <= 64"})
    assert cli.main(["trial", "--study", str(spec), "--params", json.dumps(params)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not journal.parent.exists() and not (tmp_path / "art").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--params", "{depth: 1}"], "--params: not JSON"),
    (["--params", "[1, 2]"], "--params: must be a JSON object"),
    (["--params", "@/no/such/file.json"], "--params @/no/such/file.json: cannot read"),
    (["--params", "{}", "--budget-s", "0"], "--budget-s: must be a positive number"),
    (["--params", "{}", "--budget-s", "nan"], "--budget-s: must be a positive number"),
    (["--params", "{}", "--budget-s", "1"], "eval points collide"),
    (["--params", "{}", "--now", "--no-wait"], "not allowed with argument"),
])
def test_bad_arguments_exit_2(args, message, tmp_path, monkeypatch, capsys):
    journal = tmp_path / "store" / "j.log"
    monkeypatch.setenv(st.ENV_STORAGE, f"journal:{journal}")
    spec = write_spec(tmp_path, "args", tiny_spec(trial={"budget_s": 4, "eval_timeout_s": 30,
                                                         "eval_fractions": [0.25, 0.5]}))
    try:
        rc = cli.main(["trial", "--study", str(spec), *args])
    except SystemExit as e:  # argparse's own checks
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not journal.parent.exists()


def test_no_wait_enqueues_partial_params_from_a_file(tmp_path, monkeypatch, capsys):
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    monkeypatch.setenv(st.ENV_STORAGE, url)
    spec = _spec(tmp_path, "queue")
    pfile = tmp_path / "p.json"
    pfile.write_text('{"depth": 2, "model_dim": 48.0}')
    assert cli.main(["trial", "--study", str(spec), "--params", f"@{pfile}", "--budget-s", "6", "--no-wait"]) == 0
    printed = _last_json(capsys.readouterr().out)
    (t,) = load_trials(url, "queue")
    assert printed["number"] == t.number and printed["state"] == "WAITING" == t.state.name
    fixed = t.system_attrs["fixed_params"]
    assert fixed["depth"] == 2 and fixed["model_dim"] == 48 and isinstance(fixed["model_dim"], int)
    assert 0.01 <= fixed["matrix_lr"] <= 0.05 and printed["params"] == fixed
    assert t.user_attrs == {"adhoc": True, "adhoc_sampled": ["matrix_lr"], "adhoc_budget_s": 6.0}
    assert not counts(t)


# -- a running sweep picks an enqueued trial up ------------------------------------------------------------

@pytest.mark.slow
def test_enqueued_trial_runs_in_a_running_sweep_and_the_command_prints_its_record(tmp_path, data_cache,
                                                                                  ray_cluster):
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    env = head_env(ray_cluster, url, tmp_path / "art")
    spec = _spec(tmp_path, "live", data_cache, budget_s=4, study={"n_trials": 1, "concurrency": 2, "seed": 1})
    waiter = subprocess.Popen(sweep_cmd("trial", "--study", str(spec), "--params", json.dumps(GOOD), "--budget-s", "3"),
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (tmp_path / "j.log").exists() and any(
            t.state.name == "WAITING" for t in load_trials(url, "live")), 60, what="the enqueued trial")
        sweep = run_sweep("run", str(spec), env=env, timeout=240)
        assert sweep.returncode == 0, sweep.stdout + sweep.stderr
        out, err = waiter.communicate(timeout=60)
    finally:
        if waiter.poll() is None:
            waiter.kill()
    assert waiter.returncode == 0, out + err
    assert "(ad hoc)" in sweep.stdout
    # The sweep ends saying where its best checkpoint is and what to run next; its local Ray says nothing of tokens.
    assert "checkpoint: " in sweep.stdout and f"-m sweep export {spec} --out submission/" in sweep.stdout
    assert "Token authentication" not in sweep.stdout + sweep.stderr + err, sweep.stderr[-3000:]
    printed = _last_json(out)
    trials = {t.number: t for t in load_trials(url, "live")}
    adhoc = trials[printed["number"]]
    assert printed["state"] == "COMPLETE" and printed["params"] == GOOD and printed["val_bpb"] == adhoc.value
    assert printed["record"]["status"] == "ok" and printed["record"]["train_seconds"] <= 3 + 1.0  # its own budget
    assert adhoc.user_attrs["adhoc"] is True and adhoc.user_attrs["adhoc_budget_s"] == 3.0
    assert sorted(adhoc.intermediate_values) == [2, 3]  # its own budget: eval at 1.5 -> 2 s, final at 3 s
    regular = [t for t in trials.values() if not t.user_attrs.get("adhoc")]
    assert len(regular) == 1 and sorted(regular[0].intermediate_values) == [2, 4]
    assert sum(counts(t) for t in trials.values()) == 1


# -- --now: the point runs to its end unless --prunable, and the command speaks of it alone -----------------

@pytest.mark.slow
def test_now_is_not_pruned_unless_prunable_and_a_pruned_trial_exits_0(tmp_path, monkeypatch, data_cache, capsys,
                                                                      ray_cluster):
    import optuna
    from optuna.trial import TrialState, create_trial

    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    monkeypatch.setenv(st.ENV_STORAGE, url)
    monkeypatch.setenv(art.ENV_ARTIFACTS, str(tmp_path / "art"))
    spec = _spec(tmp_path, "prn", data_cache, pruner={"name": "median", "n_startup_trials": 1, "n_warmup_steps": 0})
    # A finished trial no real one can match at the eval point (2 s): the median pruner stops whatever it may.
    study = optuna.create_study(study_name="prn", storage=st.open_storage(url))
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=0.0, params=GOOD, intermediate_values={2: 0.0},
                                 distributions=load_spec(spec).space.distributions(GOOD)))
    env = head_env(ray_cluster, url, tmp_path / "art")
    runs = [run_sweep("trial", "--study", str(spec), "--params", json.dumps(GOOD), "--now", *extra, env=env)
            for extra in ((), ("--prunable",))]
    for run in runs:
        assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    kept, pruned = (run.stdout for run in runs)
    assert _last_json(kept)["state"] == "COMPLETE" and _last_json(pruned)["state"] == "PRUNED"
    for out in (kept, pruned):  # its own lines only: no study progress, no best of the study
        assert "progress:" not in out and "best:" not in out and "next:" not in out, out
        assert all(line.startswith(("trial ", "ray:", '{"number"')) for line in out.splitlines()), out
    _, first, second = load_trials(url, "prn")
    assert first.state.name == "COMPLETE" and "adhoc_prunable" not in first.user_attrs
    assert second.state.name == "PRUNED" and second.user_attrs["adhoc_prunable"] is True
    # --prunable with its own budget cannot be honoured: the pruner's rungs are the spec's.
    assert cli.main(["trial", "--study", str(spec), "--params", "{}", "--budget-s", "6", "--prunable"]) == 2
    assert "--prunable: a trial with its own --budget-s 6 is never pruned" in capsys.readouterr().err


# -- ray job submit to a real head -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def jobs_head() -> Iterator[Head]:
    """A head with its Jobs API (the dashboard) on loopback and token authentication."""
    with ray_head(dashboard=True) as head:
        yield head


def _job(head: Head, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RAY, "job", *args, "--address", head.dashboard], env=_env(head), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _env(head: Head) -> dict[str, str]:
    env = {**os.environ, **head.env}
    env.pop("RAY_ADDRESS", None)
    return env


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)


def _job_status(head: Head, job_id: str) -> str:
    """The job's status as Ray's JobSubmissionClient reports it (in a process holding the token)."""
    code = ("import sys; from ray.job_submission import JobSubmissionClient as C; "
            "print(C(sys.argv[1]).get_job_status(sys.argv[2]).value)")
    proc = subprocess.run([sys.executable, "-c", code, head.dashboard, job_id], env=_env(head), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.skipif(not pg_available(), reason="PostgreSQL is not running")
def test_ray_job_submit_runs_an_adhoc_trial_into_the_study(jobs_head, tmp_path, data_cache):
    spec = _spec(tmp_path, "jobs", data_cache, budget_s=3)
    with pg_database() as url:
        # What `make job` sends: Ray leaves .git out of the working dir, so the commit travels as a variable.
        commit = _git("rev-parse", "HEAD").stdout.strip()
        dirty = _git("diff", "--quiet", "HEAD").returncode != 0
        runtime_env = {"env_vars": {"SWEEP_STORAGE": url, "SWEEP_ARTIFACTS": str(tmp_path / "art"),
                                    art.ENV_GIT_COMMIT: commit + ("-dirty" if dirty else "")}}
        submit = subprocess.run(
            [RAY, "job", "submit", "--address", jobs_head.dashboard, "--working-dir", ".",
             "--runtime-env-json", json.dumps(runtime_env), "--",
             sys.executable, "-m", "sweep", "trial", "--study", str(spec), "--params", json.dumps(GOOD), "--now"],
            env=_env(jobs_head), cwd=ROOT, capture_output=True, text=True, timeout=300)
        log = submit.stdout + submit.stderr
        assert submit.returncode == 0, log[-6000:]
        job_id = re.search(r"raysubmit_\w+", log).group(0)
        assert _job_status(jobs_head, job_id) == "SUCCEEDED"
        printed = _last_json(_job(jobs_head, "logs", job_id).stdout)

        (t,) = load_trials(url, "jobs")
        assert t.state.name == "COMPLETE" and t.params == GOOD and t.user_attrs["adhoc"] is True
        assert printed["number"] == t.number and printed["state"] == "COMPLETE" and printed["val_bpb"] == t.value
        assert t.user_attrs["spec_hash"] == spec_hash(spec)
        assert t.user_attrs["git_commit"] == commit and t.user_attrs["git_dirty"] is dirty
        names = {m["filename"] for m in art.list_artifacts(t)}
        assert names == {"config.json", "trainer.log", "events.jsonl", "result.json", "final.pt"}

    # Without the token the head refuses the submission.
    anon = {k: v for k, v in jobs_head.env.items() if not k.startswith("RAY_AUTH")}
    refused = subprocess.run([RAY, "job", "list", "--address", jobs_head.dashboard],
                             env={**anon, "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "token" in (refused.stdout + refused.stderr).lower()
