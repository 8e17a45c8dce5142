"""Artifact stores (local and S3 under moto), the supervisor's uploads and checkpoint policy, provenance."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import optuna
import pytest
from optuna.artifacts import download_artifact

from sweep import store as st
from sweep.run import remote
from sweep.run.outcome import Outcome
from sweep.run.supervisor import TrialTask
from sweep.spec import spec_hash
from sweep.store import artifacts as art
from tests.sweep_fixtures import ROOT, tiny_spec, write_spec


@pytest.fixture
def study(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = st.open_storage(st.resolve_url(f"journal:{tmp_path / 'j.log'}"))
    return optuna.create_study(study_name="arts", storage=storage)


def _files(d: Path) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"depth": 2}\n')
    (d / "trainer.log").write_text("step 1\nstep 2\n")
    (d / "final.pt").write_bytes(bytes(range(256)) * 64)
    return [d / "config.json", d / "trainer.log", d / "final.pt", d / "missing.txt"]


def _download(store, meta, tmp_path: Path) -> bytes:
    out = tmp_path / f"dl-{meta['artifact_id']}"
    download_artifact(artifact_store=store, artifact_id=meta["artifact_id"], file_path=str(out))
    return out.read_bytes()


def test_urls_and_scratch(monkeypatch, tmp_path):
    monkeypatch.delenv(art.ENV_ARTIFACTS, raising=False)
    monkeypatch.chdir(tmp_path)
    assert art.artifacts_url() == str(tmp_path / "runs" / "artifacts")
    assert art.artifacts_url("rel/dir") == str(tmp_path / "rel" / "dir")
    monkeypatch.setenv(art.ENV_ARTIFACTS, "s3://bkt/sweeps/phase1/")
    assert art.artifacts_url("ignored") == "s3://bkt/sweeps/phase1"
    assert art.split_s3("s3://bkt/sweeps/phase1") == ("bkt", "sweeps/phase1")
    assert art.split_s3("s3://bkt") == ("bkt", "")
    assert art.scratch_root("s3://bkt/x") == tmp_path / "runs" / "artifacts"
    with pytest.raises(ValueError, match="no bucket"):
        art.split_s3("s3:///x")


def test_local_store_round_trip(study, tmp_path):
    store = art.open_store(str(tmp_path / "art"))
    trial = study.ask()
    ids = art.upload_files(store, trial, _files(tmp_path / "work"))
    assert sorted(ids) == ["config.json", "final.pt", "trainer.log"]  # the missing file is skipped
    metas = {m["filename"]: m for m in art.list_artifacts(study._storage.get_trial(trial._trial_id))}
    assert metas["trainer.log"]["mimetype"] == "text/plain"
    assert metas["final.pt"]["mimetype"] == "application/octet-stream"
    for name, meta in metas.items():
        assert meta["artifact_id"] == ids[name]
        assert (tmp_path / "art" / art.STORE_DIR / ids[name]).is_file()
        assert _download(store, meta, tmp_path) == (tmp_path / "work" / name).read_bytes()


def test_s3_store_round_trip_under_moto(study, tmp_path, monkeypatch):
    import boto3
    import moto

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    with moto.mock_aws():
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket="sweep-bucket")
        store = art.open_store("s3://sweep-bucket/studies/phase1")
        trial = study.ask()
        ids = art.upload_files(store, trial, _files(tmp_path / "work"))
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="sweep-bucket")["Contents"])
        assert keys == sorted(f"studies/phase1/{i}" for i in ids.values())
        for meta in art.list_artifacts(study._storage.get_trial(trial._trial_id)):
            assert _download(store, meta, tmp_path) == (tmp_path / "work" / meta["filename"]).read_bytes()
        store.remove(ids["trainer.log"])
        assert len(s3.list_objects_v2(Bucket="sweep-bucket")["Contents"]) == 2
        with pytest.raises(optuna.artifacts.exceptions.ArtifactNotFound):
            store.open_reader(ids["trainer.log"])


def _task(store_url: str, work: Path, **kw) -> TrialTask:
    return TrialTask(study="arts", storage_url="journal:/unused", number=0, trial_id=0, params={}, config={},
                            budget_s=4, deadline_s=30, eval_fractions=(0.5,), artifact_dir=str(work),
                            artifact_store=store_url, **kw)


def test_supervisor_uploads_and_only_a_new_best_uploads_its_checkpoint(study, tmp_path):
    store_url = str(tmp_path / "art")
    uploaded = {}
    for number, value in enumerate([3.0, 2.5, 2.7]):
        trial = study.ask()
        work = tmp_path / f"w{number}"
        _files(work)
        (work / "events.jsonl").write_text('{"event": "step"}\n')
        record = {"status": "ok", "val_bpb": value}
        out = Outcome(number=trial.number, state="COMPLETE", value=value, values=[value], record=record)
        remote.upload_artifacts(study, trial, _task(store_url, work), out, work)
        study.tell(trial, value)
        frozen = study._storage.get_trial(trial._trial_id)
        uploaded[value] = sorted(m["filename"] for m in art.list_artifacts(frozen))
        assert json.loads((work / "result.json").read_text()) == {"status": "ok", "val_bpb": value}
    base = ["config.json", "events.jsonl", "result.json", "trainer.log"]
    assert uploaded == {3.0: sorted([*base, "final.pt"]), 2.5: sorted([*base, "final.pt"]), 2.7: base}

    # A crash leaves no record: result.json holds the supervisor's outcome instead, and no checkpoint goes up.
    trial = study.ask()
    work = tmp_path / "crash"
    _files(work)
    out = Outcome(number=trial.number, state="FAIL", fail_kind="crash", reason="trainer killed by SIGKILL")
    remote.upload_artifacts(study, trial, _task(store_url, work), out, work)
    frozen = study._storage.get_trial(trial._trial_id)
    assert "final.pt" not in {m["filename"] for m in art.list_artifacts(frozen)}
    assert json.loads((work / "result.json").read_text())["fail_kind"] == "crash"


def test_a_failed_upload_is_recorded_not_raised(study, tmp_path, monkeypatch):
    import moto
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    with moto.mock_aws():  # no bucket: every write fails
        trial = study.ask()
        work = tmp_path / "w"
        _files(work)
        out = Outcome(number=trial.number, state="COMPLETE", value=1.0, values=[1.0], record={"status": "ok"})
        remote.upload_artifacts(study, trial, _task("s3://no-such-bucket/p", work), out, work)
    attrs = study._storage.get_trial(trial._trial_id).user_attrs
    assert "NoSuchBucket" in attrs["artifact_error"]


def test_beats_best_follows_the_direction(tmp_path):
    storage = st.open_storage(st.resolve_url(f"journal:{tmp_path / 'j.log'}"))
    low = optuna.create_study(study_name="low", storage=storage)
    assert art.beats_best(low, 5.0)
    low.add_trial(optuna.trial.create_trial(value=2.0))
    assert art.beats_best(low, 1.9) and not art.beats_best(low, 2.0) and not art.beats_best(low, 2.1)
    high = optuna.create_study(study_name="high", storage=storage, direction="maximize")
    high.add_trial(optuna.trial.create_trial(value=2.0))
    assert art.beats_best(high, 2.1) and not art.beats_best(high, 1.9)


def test_code_version(monkeypatch, tmp_path):
    monkeypatch.delenv(art.ENV_GIT_COMMIT, raising=False)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    v = art.code_version()
    assert v["git_commit"] == head and isinstance(v["git_dirty"], bool)
    assert art.code_version(tmp_path) == {"git_commit": "unknown"}
    monkeypatch.setenv(art.ENV_GIT_COMMIT, "abc123")
    assert art.code_version() == {"git_commit": "abc123", "git_dirty": False}
    monkeypatch.setenv(art.ENV_GIT_COMMIT, "abc123-dirty")
    assert art.code_version() == {"git_commit": "abc123", "git_dirty": True}


def test_spec_hash_ignores_layout_but_not_values(tmp_path):
    sections = tiny_spec()
    a = write_spec(tmp_path, "a", sections)
    b = tmp_path / "b.toml"
    b.write_text("# the same spec, commented and spaced differently\n\n" + a.read_text().replace(" = ", "="))
    c = write_spec(tmp_path, "c", {**sections, "study": {**sections["study"], "n_trials": 5}})
    d = tmp_path / "d.toml"
    d.write_text('extends = "a"\n')
    assert spec_hash(a) == spec_hash(b) == spec_hash(d) != spec_hash(c)
    assert len(spec_hash(a)) == 16
    assert spec_hash(tmp_path / "gone.toml") == "unknown"


def test_prefixed_store_keys():
    class Mem:
        def __init__(self):
            self.d = {}

        def write(self, k, body):
            self.d[k] = body.read()

        def open_reader(self, k):
            return io.BytesIO(self.d[k])

        def remove(self, k):
            del self.d[k]

    mem = Mem()
    store = art.PrefixedStore(mem, "/a/b/")
    store.write("id1", io.BytesIO(b"x"))
    assert list(mem.d) == ["a/b/id1"] and store.open_reader("id1").read() == b"x"
    store.remove("id1")
    assert mem.d == {}
