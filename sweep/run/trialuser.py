"""A script trial as a user of its own: ``[trial] run_as`` in the spec, else the node's ``SWEEP_TRIAL_USER``.

The supervisor runs inside a Ray worker, whose user holds the Ray token (``~/.ray/auth_token``, the worker's
``RAY_AUTH_TOKEN``), the storage proxy's token (in the task) and, on the head, the service's files. A team's
script run as that user could read them all (its files, ``/proc/PID/environ`` of its processes). So the
supervisor starts the script trainer (and with it the script and the scorer) as the trial user instead:
``subprocess.Popen(user=, group=, extra_groups=)`` with that user's own groups, none of the service's. That
needs the supervisor to be root (on a cluster's trn2 workers Ray runs as root: infra/ray/trn2.yaml).

The trial user owns the trial's folder while the trial runs (:meth:`TrialUser.hand_over`), not the supervisor's
own files in it; afterwards everything there goes back to the service's user (:meth:`TrialUser.take_back`),
with every link and special file at its top removed, before the supervisor reads, writes or uploads anything
there. Each file is changed through a descriptor opened without following links, so a link planted by a
process of the trial never turns a change onto a file elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

USER_VAR = "SWEEP_TRIAL_USER"  # the node's trial user (cluster.env), for a spec that names none
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)
_NOT_KEPT = stat.S_ISUID | stat.S_ISGID | 0o022  # taken back: no set-id bits, no writing by group or others


class TrialUserError(ValueError):
    """A trial user this node cannot start the trial as; the message is one line."""


def wanted(run_as: str, environ: Mapping[str, str]) -> str:
    """The trial user's name: the spec's ``run_as``, else the node's ``SWEEP_TRIAL_USER``; "" for none."""
    return (run_as or environ.get(USER_VAR, "")).strip()


@dataclass(frozen=True)
class TrialUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # its supplementary groups as the system lists them (its own group included)

    @classmethod
    def resolve(cls, name: str) -> TrialUser:
        """The user ``name`` (or a numeric uid) on this node, if the supervisor can start a process as it."""
        try:
            pw = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        except (KeyError, OverflowError):
            raise TrialUserError(f"run_as: no user {name!r} on this node") from None
        if pw.pw_uid == 0:
            raise TrialUserError(f"run_as: {name!r} is root, which reaches everything a trial must not")
        euid = os.geteuid()
        if euid not in (0, pw.pw_uid):
            raise TrialUserError(f"run_as {name!r}: the supervisor runs as uid {euid}, not root, so it cannot start "
                                 "a trial as another user")
        return cls(pw.pw_name, pw.pw_uid, pw.pw_gid, tuple(sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid)))))

    def popen_args(self) -> dict[str, Any]:
        """Popen's arguments that start the process as this user (none where the supervisor already is it)."""
        if os.geteuid() == self.uid:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def env(self, home: Path) -> dict[str, str]:
        """What a process of this user expects of its environment; its home is the trial's folder."""
        return {"HOME": str(home), "USER": self.name, "LOGNAME": self.name}

    def allows(self, st: os.stat_result, want: int) -> bool:
        """Whether the mode bits of ``st`` give this user ``want`` (os.R_OK | os.W_OK | os.X_OK bits)."""
        if st.st_uid == self.uid:
            shift = 6
        elif st.st_gid == self.gid or st.st_gid in self.groups:
            shift = 3
        else:
            shift = 0
        return (st.st_mode >> shift) & want == want

    def unreachable(self, path: str | Path, want: int = os.R_OK) -> str | None:
        """Why this user cannot reach ``path`` with ``want`` (a folder on the way it may not search, or the path's
        own mode), or None when it can."""
        real = Path(os.path.realpath(path))
        for folder in reversed(real.parents):
            try:
                if not self.allows(os.stat(folder), os.X_OK):
                    return f"{folder} is not searchable by {self.name}"
            except OSError as e:
                return f"{folder}: {e.strerror or e}"
        try:
            if not self.allows(os.stat(real), want):
                kind = "/".join(w for bit, w in ((os.R_OK, "read"), (os.W_OK, "write"), (os.X_OK, "run"))
                                if want & bit)
                return f"{real} is not {kind}able by {self.name}".replace("runable", "runnable")
        except OSError as e:
            return f"{real}: {e.strerror or e}"
        return None

    def hand_over(self, folder: Path, keep: Iterable[str] = ()) -> None:
        """``folder`` and what is in it to this user, but the entries at its top named in ``keep`` (the
        supervisor's own files, which the trial only reads)."""
        _chown_tree(folder, self.uid, self.gid, set(keep), 0)

    @staticmethod
    def take_back(folder: Path) -> None:
        """After the trial: ``folder`` and everything in it to the supervisor's user, without set-id bits or
        writing by others; then every link or special file at its top removed, so nothing the supervisor
        writes or uploads there afterwards follows a link the trial left."""
        _chown_tree(folder, os.geteuid(), os.getegid(), set(), _NOT_KEPT)
        top = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            for entry in os.scandir(top):
                mode = entry.stat(follow_symlinks=False).st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.name, dir_fd=top)
        finally:
            os.close(top)


def _chown_tree(folder: Path, uid: int, gid: int, keep: set[str], clear: int) -> None:
    """Every directory and file under ``folder`` (links left as they are, never followed) to ``uid``:``gid``,
    the mode bits ``clear`` cleared; the folder itself first, so no process of the trial adds to it meanwhile."""
    top = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _own(top, uid, gid, clear)
    finally:
        os.close(top)
    for dirpath, _dirnames, filenames, dirfd in os.fwalk(folder, follow_symlinks=False):
        _own(dirfd, uid, gid, clear)
        for name in filenames:
            if name in keep and dirpath == str(folder):
                continue
            try:
                fd = os.open(name, _OPEN_FLAGS, dir_fd=dirfd)
            except OSError:  # a link (O_NOFOLLOW), a socket, gone meanwhile: nothing to change through it
                continue
            try:
                _own(fd, uid, gid, clear)
            finally:
                os.close(fd)


def _own(fd: int, uid: int, gid: int, clear: int) -> None:
    st = os.fstat(fd)
    if (st.st_uid, st.st_gid) != (uid, gid):
        os.fchown(fd, uid, gid)
    if stat.S_IMODE(st.st_mode) & clear:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~clear)
