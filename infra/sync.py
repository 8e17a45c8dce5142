"""Copy new files between a local directory and S3, safely for a compile cache that is being written.

Used on cluster nodes (cron, every few minutes) for two trees:

- the Neuron compile cache: a node pulls what other nodes compiled before its first trial, and
  pushes what it compiled, so a graph shape is compiled once per cluster rather than once per node;
- trial artifacts (``runs/artifacts``): the supervisor writes them on the worker that ran the trial,
  and the worker disappears when the autoscaler scales down.

Only additions travel, never deletions. A file is pushed only once it has not changed for
``min_age_s`` (a compiler still writing it must not publish half a NEFF: a truncated cache entry
is worse than none), lock and temporary files never, and a pulled file is written under a temporary
name and renamed into place, so a reader sees the whole file or nothing.
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.aws import BadInput, call

_SKIP_SUFFIXES = (".lock", ".tmp", ".partial", ".swp")


@dataclass(frozen=True)
class S3Url:
    bucket: str
    prefix: str  # no leading or trailing '/'

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel


def parse_s3(url: str) -> S3Url:
    if not url.startswith("s3://"):
        raise BadInput(f"{url!r}: not an s3:// URL")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    if not bucket:
        raise BadInput(f"{url!r}: no bucket")
    return S3Url(bucket, prefix.strip("/"))


def _skip(name: str) -> bool:
    return name.startswith(".") or name.endswith(_SKIP_SUFFIXES)


def remote_files(s3: Any, url: S3Url) -> dict[str, int]:
    """Relative key -> size of every object under the prefix."""
    out: dict[str, int] = {}
    base = f"{url.prefix}/" if url.prefix else ""
    paginator = s3.get_paginator("list_objects_v2")
    pages = call(f"list s3://{url.bucket}/{base}", lambda: list(paginator.paginate(Bucket=url.bucket, Prefix=base)))
    for page in pages:
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(base):]
            if rel and not rel.endswith("/"):
                out[rel] = int(obj["Size"])
    return out


def local_files(root: Path, min_age_s: float = 0.0, now: float | None = None) -> dict[str, int]:
    """Relative path -> size of regular files under ``root`` not modified within ``min_age_s``."""
    now = time.time() if now is None else now
    out: dict[str, int] = {}
    if not root.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if _skip(name):
                continue
            path = Path(dirpath) / name
            try:
                st = path.lstat()
            except FileNotFoundError:  # removed while walking
                continue
            if not path.is_file() or path.is_symlink() or now - st.st_mtime < min_age_s:
                continue
            out[path.relative_to(root).as_posix()] = st.st_size
    return out


def push(s3: Any, root: Path, url: S3Url, min_age_s: float = 300.0, workers: int = 8) -> int:
    """Upload local files that S3 lacks (or holds with another size); returns how many."""
    remote = remote_files(s3, url)
    todo = [rel for rel, size in local_files(root, min_age_s).items() if remote.get(rel) != size]

    def upload(rel: str) -> None:
        call(f"upload {rel}", s3.upload_file, str(root / rel), url.bucket, url.key(rel))

    _run(upload, todo, workers)
    return len(todo)


def pull(s3: Any, url: S3Url, root: Path, workers: int = 8) -> int:
    """Download objects the local tree lacks (or holds with another size); returns how many."""
    local = local_files(root)
    todo = [rel for rel, size in remote_files(s3, url).items() if local.get(rel) != size and not _unsafe(rel)]

    def download(rel: str) -> None:
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".partial")
        os.close(fd)
        try:
            call(f"download {rel}", s3.download_file, url.bucket, url.key(rel), tmp)
            os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    _run(download, todo, workers)
    return len(todo)


def _unsafe(rel: str) -> bool:
    """Keys that would escape the local root (``..``) or hide as dot files are never written."""
    parts = rel.split("/")
    return any(p in ("", ".", "..") for p in parts) or rel.startswith("/") or _skip(parts[-1])


def _run(fn: Any, items: list[str], workers: int) -> None:
    if not items:
        return
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for future in [pool.submit(fn, item) for item in items]:
            future.result()


def sync(s3: Any, src: str, dst: str, min_age_s: float = 300.0) -> tuple[str, int]:
    """``src`` -> ``dst`` where exactly one side is ``s3://``; returns (direction, files copied)."""
    if src.startswith("s3://") == dst.startswith("s3://"):
        raise BadInput("sync: exactly one of SRC and DST must be an s3:// URL")
    if dst.startswith("s3://"):
        return "push", push(s3, Path(src).expanduser(), parse_s3(dst), min_age_s=min_age_s)
    root = Path(dst).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return "pull", pull(s3, parse_s3(src), root)
