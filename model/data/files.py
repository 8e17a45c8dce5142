"""Plumbing shared by the data room: its one error type, file fingerprints and locked, atomic builds.

Several processes (torchrun ranks, concurrent trials) may ask for the same cached file at once on a cold
cache. Every cached artefact is therefore built under a file lock into a temporary name in the same
folder and renamed into place: a reader either sees no file or a complete one, and only one process
does the work.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock, Timeout

__all__ = ["DataError", "build_once", "digest", "file_fingerprint", "try_lock"]

# Files up to this size are hashed whole; larger ones by evenly spaced samples (see file_fingerprint).
FULL_HASH_BYTES = 16 << 20
SAMPLE_COUNT = 16
SAMPLE_BYTES = 64 << 10


class DataError(ValueError):
    """A data problem. str() is one line: the file (or source) it concerns, a colon, the cause."""

    def __init__(self, path: str | os.PathLike[str], cause: str = "") -> None:
        self.path = str(path)
        self.cause = " ".join(str(cause).split())  # one line, whatever the cause text held
        super().__init__(f"{self.path}: {self.cause}" if self.cause else self.path)

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Exceptions cross process boundaries (multiprocessing, Ray) by pickling their args.
        return (DataError, (self.path, self.cause))


def digest(*parts: str | bytes, size: int = 16) -> str:
    """Hex digest of the parts, length-prefixed so that ("ab", "c") and ("a", "bc") differ."""
    h = hashlib.blake2b(digest_size=size)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


_MEMO: dict[tuple[str, int, int], str] = {}


def file_fingerprint(path: str | os.PathLike[str]) -> str:
    """A content fingerprint of a file that is the same on every machine holding the same bytes.

    Files up to FULL_HASH_BYTES are hashed whole. Larger ones (web-scale parquet shards) hash their
    size and SAMPLE_COUNT blocks spread evenly from the first to the last byte, which includes the
    parquet footer with its per-column statistics: cheap, and an edit that keeps the size and misses
    every sample is not a realistic way for a data shard to change. Modification times are left out on
    purpose so that a copied corpus keeps its fingerprint.
    """
    p = Path(path)
    try:
        st = p.stat()
        memo_key = (str(p.resolve()), st.st_size, st.st_mtime_ns)  # a load hashes each file once
        if memo_key in _MEMO:
            return _MEMO[memo_key]
        size = st.st_size
        h = hashlib.blake2b(digest_size=16)
        h.update(size.to_bytes(8, "little"))
        with open(p, "rb") as f:
            if size <= FULL_HASH_BYTES:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            else:
                for k in range(SAMPLE_COUNT):
                    f.seek((size - SAMPLE_BYTES) * k // (SAMPLE_COUNT - 1))
                    h.update(f.read(SAMPLE_BYTES))
    except OSError as e:
        raise DataError(p, f"cannot read: {e.strerror or e}") from e
    _MEMO[memo_key] = h.hexdigest()
    return _MEMO[memo_key]


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _lock_for(path: Path) -> FileLock:
    return FileLock(str(path) + ".lock")


@contextlib.contextmanager
def try_lock(path: Path, blocking: bool) -> Iterator[bool]:
    """Hold the build lock of `path`; with blocking=False yield False at once when someone else holds it."""
    lock = _lock_for(path)
    try:
        lock.acquire(timeout=-1 if blocking else 0)
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def build_once(path: str | os.PathLike[str], build: Callable[[Path], None], blocking: bool = True) -> bool:
    """Make sure `path` (a file or a folder) exists, calling build(tmp) at most once across processes.

    build writes the whole artefact to tmp (a sibling name unique to this process); it is then renamed
    to `path` atomically. Returns True when `path` exists afterwards; False only with blocking=False
    when another process holds the lock (it is building the same thing right now).
    """
    path = Path(path)
    if path.exists():
        return True
    path.parent.mkdir(parents=True, exist_ok=True)
    with try_lock(path, blocking) as held:
        if not held:
            return False
        if path.exists():  # built by another process while we waited for the lock
            return True
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        _remove(tmp)
        try:
            build(tmp)
            if tmp.is_file():
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                _remove(tmp)
    return True
