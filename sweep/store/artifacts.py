"""Trial artifacts through Optuna's artifact API, and the provenance every trial records.

Where they go: ``SWEEP_ARTIFACTS`` (else the spec's ``study.artifacts``, else ``runs/artifacts``) is a
local directory or ``s3://bucket/prefix``.

- Local ``DIR``: the supervisor's working files stay in ``DIR/STUDY/NUMBER/`` (the trainer writes
  there) and the uploads go to ``FileSystemArtifactStore(DIR/_store)``, one file per artifact id.
- ``s3://bucket/prefix``: working files are staged under ``runs/artifacts/STUDY/NUMBER/`` on the
  worker; uploads go to ``Boto3ArtifactStore`` on the bucket with keys ``prefix/ARTIFACT_ID``
  (credentials from boto3's usual chain: environment, profile, instance role).

What each finished trial uploads (before it is told, so the uploads belong to the trial):
``config.json`` (what the trainer got), ``trainer.log`` (its stderr), ``events.jsonl`` (its event
stream, the learning curve included) and ``result.json`` (the trainer's result record; when the
trainer left none — crash, deadline, kill — the supervisor's outcome in its place).

Checkpoints: a COMPLETE trial whose val_bpb beats every COMPLETE trial of the study at the moment
it is recorded also uploads ``final.pt``. So the study's best trial always has its checkpoint, only
improvements pay for a checkpoint upload (few: they thin out as the sweep converges), and a former
best keeps its own (deleting it would race with anyone downloading it).

optuna-dashboard lists the uploads of each trial (trial system attributes ``artifacts:ID``) and
serves them from the same store (``python -m sweep dashboard``).

``optuna.artifacts`` and ``boto3`` are imported inside the functions (start-up time of commands that
upload nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from sweep.store._optuna import study_id, study_storage

ENV_ARTIFACTS = "SWEEP_ARTIFACTS"
DEFAULT_ARTIFACTS = "runs/artifacts"
STORE_DIR = "_store"  # under a local artifacts directory, beside the STUDY/NUMBER working dirs
ENV_GIT_COMMIT = "SWEEP_GIT_COMMIT"  # wins over git, for code shipped without its .git
ATTR_WORKDIR = "artifacts"  # the trial user attribute holding its working directory on its node
CHECKPOINT = "final.pt"
RESULT = "result.json"  # the trainer's result record (or the supervisor's outcome when it left none)
OUTCOME = "outcome.json"  # the supervisor's outcome, always written in the working directory

REPO_ROOT = Path(__file__).resolve().parents[2]
# Explicit types so the dashboard shows logs as text (and .pt is not taken for a SNES page table).
MIME_TYPES = {".log": "text/plain", ".jsonl": "text/plain", ".json": "application/json",
              ".pt": "application/octet-stream"}


# -- where ------------------------------------------------------------------------------------------

def artifacts_url(spec_artifacts: str | None = None) -> str:
    """The artifact location in force; a local one made absolute (workers may start elsewhere)."""
    url = os.environ.get(ENV_ARTIFACTS) or spec_artifacts or DEFAULT_ARTIFACTS
    if is_s3(url):
        return url.rstrip("/")
    return str(Path(url).expanduser().resolve())


def is_s3(url: str) -> bool:
    return url.startswith("s3://")


def split_s3(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``; the prefix may be empty."""
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"artifacts {url!r}: no bucket (want s3://bucket/prefix)")
    return bucket, prefix.strip("/")


def scratch_root(url: str) -> Path:
    """Where trials keep their working files: the directory itself, or a local stage for S3."""
    return Path(DEFAULT_ARTIFACTS).resolve() if is_s3(url) else Path(url)


class PrefixedStore:
    """An artifact store whose keys all live under ``prefix/`` (Boto3ArtifactStore has no prefix)."""

    def __init__(self, inner: Any, prefix: str) -> None:
        self.inner = inner
        self.prefix = prefix.strip("/")

    def _key(self, artifact_id: str) -> str:
        return f"{self.prefix}/{artifact_id}" if self.prefix else artifact_id

    def open_reader(self, artifact_id: str) -> IO[bytes]:
        return self.inner.open_reader(self._key(artifact_id))

    def write(self, artifact_id: str, content_body: IO[bytes]) -> None:
        self.inner.write(self._key(artifact_id), content_body)

    def remove(self, artifact_id: str) -> None:
        self.inner.remove(self._key(artifact_id))


def open_store(url: str, s3_client: Any = None) -> Any:
    """The Optuna artifact store behind ``url`` (see :func:`artifacts_url`)."""
    if is_s3(url):
        import boto3
        from optuna.artifacts import Boto3ArtifactStore

        bucket, prefix = split_s3(url)
        # avoid_buf_copy: upload_artifact owns the file object, so boto3 may stream a checkpoint
        # straight from disk instead of copying it into memory first.
        inner = Boto3ArtifactStore(bucket, client=s3_client or boto3.client("s3"), avoid_buf_copy=True)
        return PrefixedStore(inner, prefix)
    from optuna.artifacts import FileSystemArtifactStore

    path = Path(url) / STORE_DIR
    path.mkdir(parents=True, exist_ok=True)
    return FileSystemArtifactStore(path)


# -- what -------------------------------------------------------------------------------------------

def upload_files(store: Any, trial: Any, files: Iterable[Path], storage: Any = None) -> dict[str, str]:
    """Upload each existing file to ``trial`` (a Trial, or a FrozenTrial with ``storage``).

    Returns ``{file name: artifact id}``; missing files are skipped (a trainer that never started
    leaves no log).
    """
    from optuna.artifacts import upload_artifact

    ids: dict[str, str] = {}
    for path in files:
        if not path.is_file():
            continue
        ids[path.name] = upload_artifact(artifact_store=store, file_path=str(path), study_or_trial=trial,
                                         storage=storage, mimetype=MIME_TYPES.get(path.suffix))
    return ids


def beats_best(study: Any, value: float) -> bool:
    """Whether ``value`` would be the study's best so far (True when nothing is complete yet)."""
    from optuna.study import StudyDirection

    try:
        best = study_storage(study).get_best_trial(study_id(study))
    except ValueError:  # no complete trial yet
        return True
    if best.value is None:
        return True
    return value < best.value if study.direction == StudyDirection.MINIMIZE else value > best.value


def list_artifacts(trial: Any) -> list[dict[str, Any]]:
    """The artifacts recorded on a FrozenTrial: ``[{"artifact_id", "filename", "mimetype", "encoding"}]``."""
    prefix = "artifacts:"
    return [json.loads(v) for k, v in sorted(trial.system_attrs.items()) if k.startswith(prefix)]


def trial_files(trial: Any, url: str, study: str) -> dict[str, str]:
    """Where a finished trial's checkpoint and result record can be found: ``{"dir", "checkpoint", "record"}``.

    Its working files (``DIR/STUDY/NUMBER/``, or where the trial said they went) when they are on this
    machine, else its uploads in the store behind ``url`` (a bucket's ``s3://`` key, a local store's
    file). A file found in neither is left out (a trial without a checkpoint has no ``checkpoint``).
    Paths under the current directory are shown relative to it, as a person would type them.
    """
    work = Path(trial.user_attrs.get(ATTR_WORKDIR) or scratch_root(url) / study / str(trial.number))
    uploads = {a.get("filename"): a.get("artifact_id") for a in list_artifacts(trial)}
    found: dict[str, str] = {}
    if work.is_dir():
        found["dir"] = shown_path(work) + "/"
    for key, names in (("checkpoint", (CHECKPOINT,)), ("record", (RESULT, OUTCOME))):
        for name in names:
            if (work / name).is_file():
                found[key] = shown_path(work / name)
            elif uploads.get(name):
                found[key] = stored_location(url, uploads[name])
            if key in found:
                break
    return found


def stored_location(url: str, artifact_id: str) -> str:
    """Where the store behind ``url`` keeps an upload: ``s3://bucket/prefix/ID`` or ``DIR/_store/ID``."""
    if is_s3(url):
        return f"{url.rstrip('/')}/{artifact_id}"
    return shown_path(Path(url) / STORE_DIR / artifact_id)


def shown_path(path: Path) -> str:
    """``path`` as a person would type it here: relative to the current directory when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# -- provenance -------------------------------------------------------------------------------------

def code_version(root: Path = REPO_ROOT) -> dict[str, Any]:
    """``git_commit`` (and ``git_dirty``: tracked files differ from it) of the code at ``root``.

    ``SWEEP_GIT_COMMIT`` (``SHA`` or ``SHA-dirty``) wins, for code shipped without its ``.git``: Ray
    leaves ``.git`` out of a job's working directory, and an image may have none. ``unknown`` when
    neither tells. Untracked files do not make a tree dirty: runs/ and caches live there.
    """
    env = os.environ.get(ENV_GIT_COMMIT, "").strip()
    if env:
        commit, dirty = (env[:-len("-dirty")], True) if env.endswith("-dirty") else (env, False)
        return {"git_commit": commit, "git_dirty": dirty}
    if not (root / ".git").exists():
        return {"git_commit": "unknown"}
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()

        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": "unknown"}
    return {"git_commit": commit, "git_dirty": dirty}
