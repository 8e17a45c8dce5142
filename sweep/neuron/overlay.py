"""A script trial's private view of the shared compile cache, and the one way back into it.

A team's script is code the service does not control. Given the shared NEFF cache as its
``TORCH_NEURONX_NEFF_CACHE_DIR`` it could rewrite a graph that the next trial loads. A script trial instead gets
a directory of its own (in its work folder), seeded from the shared cache: each shared entry appears there as a
symbolic link to it (``link``) or a copy of it (``copy``), so TorchNeuron finds every graph compiled before, and
a graph it compiles is written through a temporary file renamed into place (the source's rule, docs/neuron.md),
which lands in the trial's directory, never in the shared one. Once the trial's processes are gone the
supervisor publishes what is new (:func:`publish`): regular files only, each copied whole under a name the
shared cache does not hold yet, never replacing an entry. An entry the trial changed is counted as refused.

``link`` keeps the shared cache safe only from a trial that cannot write the shared files, i.e. one running as
another user (``[trial] run_as``, :mod:`sweep.run.trialuser`); a trial running as the service's own user could
write through the link, so it gets copies (the cost: the shared cache's size per trial).
``SWEEP_NEFF_CACHE_SEED`` on the node chooses either.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sweep.neuron.launch import LaunchError

SEED_VAR = "SWEEP_NEFF_CACHE_SEED"
SEEDS = ("link", "copy")
PUBLISH_TMP = ".trnsweep-publish."  # a publication in progress: a dot file, so no seed or sync takes it


def seed_mode(environ: Mapping[str, str], other_user: bool) -> str:
    """The node's ``SWEEP_NEFF_CACHE_SEED``, else ``link`` for a trial of another user and ``copy`` for one of ours."""
    value = environ.get(SEED_VAR, "").strip()
    if value and value not in SEEDS:
        raise LaunchError(f"{SEED_VAR}={value!r}: must be one of {', '.join(SEEDS)}")
    return value or ("link" if other_user else "copy")


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class Overlay:
    """One shared cache directory and the trial's private one over it."""

    shared: Path
    private: Path
    mode: str
    seeded: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # relative path -> its stamp as seeded

    def seed(self) -> None:
        """Mirror the shared directory's tree into the private one: directories made, files linked or copied.

        Dot files are skipped: a writer's temporary file (TorchNeuron's ``.tmp.*``, a publication's) is not an
        entry yet."""
        self.private.mkdir(parents=True, exist_ok=True)
        for base, dirs, files in os.walk(self.shared):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            rel = Path(base).relative_to(self.shared)
            (self.private / rel).mkdir(parents=True, exist_ok=True)
            for name in files:
                if name.startswith("."):
                    continue
                src, dst = Path(base) / name, self.private / rel / name
                with contextlib.suppress(FileNotFoundError):  # evicted meanwhile: not an entry
                    if self.mode == "link":
                        dst.symlink_to(src)
                    else:
                        shutil.copyfile(src, dst)
                    self.seeded[str(rel / name)] = _stamp(os.lstat(dst))

    def publish(self) -> tuple[int, int]:
        """Copy the trial's new files into the shared directory; returns (published, refused).

        Only regular files, read without following links, each written whole to a temporary name and linked
        into place, which fails where the name exists: nothing already shared is ever replaced. A graph
        (``.neff``) comes after the other new files of its directory. A seeded entry that the trial replaced
        or changed is refused (counted, never published)."""
        published = refused = 0
        owner = os.stat(self.shared)
        for base, _dirs, files in os.walk(self.private):  # never into a linked directory
            rel_dir = Path(base).relative_to(self.private)
            for name in sorted(files, key=lambda n: (n.endswith(".neff"), n)):
                rel = str(rel_dir / name)
                st = os.lstat(Path(base) / name)
                if rel in self.seeded:
                    refused += _stamp(st) != self.seeded[rel]
                    continue
                if name.startswith(".") or not stat.S_ISREG(st.st_mode):
                    continue
                if _publish_file(Path(base) / name, self.shared, Path(rel), owner):
                    published += 1
        return published, refused


def _publish_file(src: Path, shared: Path, rel: Path, owner: os.stat_result) -> bool:
    """``src`` (a regular file, never a link) copied whole to ``shared / rel`` unless that exists; whether it was.
    What it creates belongs to the shared directory's owner (a root supervisor publishing into the node's cache,
    which the service's user syncs)."""
    dst = shared / rel
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as source:
        if not stat.S_ISREG(os.fstat(source.fileno()).st_mode) or os.path.lexists(dst):
            return False
        _make_dirs(shared, rel.parent, owner)
        tmp = dst.parent / f"{PUBLISH_TMP}{secrets.token_hex(8)}"
        try:
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as out:
                shutil.copyfileobj(source, out)
                out.flush()
                os.fsync(out.fileno())
                os.fchmod(out.fileno(), 0o644)  # whatever the umask: every trial and the node's sync read it
                _give(out.fileno(), owner)
            os.link(tmp, dst)  # fails where the name exists: an entry is never replaced
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
    return True


def _make_dirs(shared: Path, rel: Path, owner: os.stat_result) -> None:
    """The folders of ``rel`` under ``shared``, each made one belonging to the shared directory's owner."""
    path = shared
    for part in rel.parts:
        path = path / part
        try:
            path.mkdir()
        except FileExistsError:
            continue
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            _give(fd, owner)
        finally:
            os.close(fd)


def _give(fd: int, owner: os.stat_result) -> None:
    if os.geteuid() == 0 and (owner.st_uid, owner.st_gid) != (0, 0):
        os.fchown(fd, owner.st_uid, owner.st_gid)
