"""The command line as a stranger meets it: headed tables, ``best`` saying where the checkpoint is, a missing
study listing the ones there are, a closed pipe ending quietly, no Ray notice on a laptop's local Ray."""

from __future__ import annotations

import json
import logging
import os
import subprocess

import optuna
from optuna.trial import TrialState, create_trial

from sweep import cli
from sweep import store as st
from sweep.run import driver as drv
from sweep.spec import load
from sweep.spec.files import shipped_studies
from sweep.store import artifacts as art
from tests.sweep_fixtures import ROOT, sweep_cmd, sweep_env, tiny_spec, write_spec

POINT = {"depth": 1, "model_dim": 32, "matrix_lr": 0.02}
RECORD = {"status": "ok", "val_bpb": 2.25, "steps": 120, "train_seconds": 4.0, "tokens_per_second": 2345.6,
          "params": 1_234_567, "mfu": 0.0123, "device": "cpu"}


def _study(tmp_path, monkeypatch, trials: int = 2):
    """Spec ``cli`` and its study in a journal under ``tmp_path``: ``trials`` complete trials, trial 0 the best,
    with its checkpoint and record where a sweep leaves them."""
    url = st.resolve_url(f"journal:{tmp_path / 'j.log'}")
    monkeypatch.setenv(st.ENV_STORAGE, url)
    monkeypatch.setenv(art.ENV_ARTIFACTS, str(tmp_path / "art"))
    path = write_spec(tmp_path, "cli", tiny_spec())
    spec = load(path)
    work = tmp_path / "art" / "cli" / "0"
    work.mkdir(parents=True)
    (work / "final.pt").write_bytes(b"weights")
    (work / "result.json").write_text(json.dumps(RECORD))
    study = optuna.create_study(study_name="cli", storage=st.open_storage(url))
    for n in range(trials):
        attrs = {**RECORD, "val_bpb": 2.25 + n, "record_fields": sorted(RECORD), "artifacts": str(work),
                 "git_commit": "0123456789abcdef"}
        study.add_trial(create_trial(state=TrialState.COMPLETE, value=2.25 + n, params=POINT,
                                     distributions=spec.space.distributions(POINT), user_attrs=attrs))
    return path, url


def test_status_rows_have_a_header(tmp_path, monkeypatch, capsys):
    path, _ = _study(tmp_path, monkeypatch)
    assert cli.main(["status", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "study cli: COMPLETE 2"
    assert lines[1].split() == ["trial", "state", "val_bpb", "parameters"]
    assert lines[2].split()[:3] == ["0", "COMPLETE", "2.2500"]
    assert lines[1].index("val_bpb") + len("val_bpb") == lines[2].index("2.2500") + len("2.2500")  # aligned
    assert lines[-1] == "environment: latest-sdk"  # the spec's profile (sweep.neuron.environment)


def test_best_prints_the_record_headline_and_where_the_checkpoint_is(tmp_path, monkeypatch, capsys):
    path, _ = _study(tmp_path, monkeypatch)
    assert cli.main(["best", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("best: trial 0 val_bpb=2.2500\n")
    assert "steps=120 train_seconds=4.0 tokens_per_second=2346 mfu=1.23% params=1.23M device=cpu" in out
    assert "git_commit=0123456789ab" in out
    assert f"checkpoint: {tmp_path / 'art' / 'cli' / '0' / 'final.pt'}" in out
    assert f"result:     {tmp_path / 'art' / 'cli' / '0' / 'result.json'}" in out
    assert "parameters:\n    depth = 1\n" in out
    assert cli.main(["best", str(path), "--json"]) == 0  # the JSON contract is unchanged
    assert set(json.loads(capsys.readouterr().out)) == {"number", "params", "val_bpb", "record"}


def test_an_unknown_study_is_named_once_with_the_studies_there_are(capsys):
    assert cli.main(["run", "nosuchstudy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.count("nosuchstudy") == 1, err
    assert "demo" in shipped_studies() and "phase1" in shipped_studies()
    assert ", ".join(shipped_studies()) in err
    assert cli.main(["status", "/no/such/dir/x.toml"]) == 2
    assert capsys.readouterr().err.count("/no/such/dir/x.toml") == 1


def test_status_json_into_a_closed_pipe_exits_quietly(tmp_path, monkeypatch):
    path, url = _study(tmp_path, monkeypatch, trials=40)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte: `| head -0`, or `| head -1` on a long output
    try:
        proc = subprocess.run(sweep_cmd("status", str(path), "--json"), env=sweep_env(url, tmp_path / "art"),
                              cwd=ROOT, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 1
    assert proc.stderr == "", proc.stderr  # no traceback, no "Exception ignored", no "sweep: BrokenPipeError"


def test_a_local_ray_start_drops_the_token_notice_and_keeps_the_rest():
    logger = logging.getLogger(drv.TOKEN_LOGGER)
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        with drv.quiet_local_token_notice():
            logger.warning(drv.TOKEN_NOTICE + ". Set RAY_AUTH_MODE=disabled to opt out.")
            logger.warning("Token authentication is enabled but no token was found")
        assert seen == ["Token authentication is enabled but no token was found"]
        logger.warning(drv.TOKEN_NOTICE + ".")  # outside a local start (joining a cluster) it is kept
        assert seen[-1] == drv.TOKEN_NOTICE + "."
    finally:
        logger.removeHandler(handler)
