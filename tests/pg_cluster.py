"""A private PostgreSQL cluster for the tests that stop, restart or cut off their store.

The machine's PostgreSQL (127.0.0.1:5432) serves other work too: a test may only stop, restart or
reconfigure a server it started. :class:`PgCluster` is one: ``initdb`` in a temporary directory, a
free port on 127.0.0.1, ``pg_ctl`` start/stop/restart on it, everything removed at the end. PostgreSQL
refuses to run as root, so as root its programs run as the ``postgres`` user, who owns the directory.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Where to find initdb/pg_ctl: $TRNSWEEP_PG_BIN, else PATH, else Debian's newest /usr/lib/postgresql/N/bin.
ENV_PG_BIN = "TRNSWEEP_PG_BIN"
SETTINGS = {  # a throwaway store: speed over durability, enough connections for a sweep's workers
    "listen_addresses": "'127.0.0.1'",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
    "shared_buffers": "32MB",
}


def pg_bin() -> Path | None:
    """The directory of PostgreSQL's server programs, or None where there is none."""
    if os.environ.get(ENV_PG_BIN):
        return Path(os.environ[ENV_PG_BIN])
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def _run_as() -> str | None:
    """The user PostgreSQL's programs run as: ``postgres`` under root (initdb refuses root), else us."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return None
    return "postgres"


def available() -> str | None:
    """Why a private cluster cannot be made here, or None when it can."""
    if pg_bin() is None or not (pg_bin() / "initdb").exists():
        return "PostgreSQL's initdb is not installed (set TRNSWEEP_PG_BIN to its bin directory)"
    if os.geteuid() == 0 and _run_as() is None:
        return "running as root and there is no postgres user to run PostgreSQL as"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgCluster:
    """One PostgreSQL server of our own: its data directory, socket and log live under ``root``."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = root
        self.data = root / "data"
        self.log = root / "server.log"
        self.port = port or free_port()
        self.user = _run_as()

    # -- the server ------------------------------------------------------------------------------

    def _pg(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        cmd = [str(pg_bin() / args[0]), *args[1:]]
        proc = subprocess.run(cmd, user=self.user, cwd=self.root, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            tail = self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:1])} failed ({proc.returncode}): {proc.stderr.strip()}\n{tail}")
        return proc

    def init(self) -> PgCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.user:
            shutil.chown(self.root, self.user)
        self._pg("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--locale=C",
                 "--no-sync", "--no-instructions")
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.writelines(f"{k} = {v}\n" for k, v in SETTINGS.items())
            conf.write(f"unix_socket_directories = '{self.root}'\n")
        return self

    def _options(self) -> str:
        return f"-p {self.port}"

    def start(self) -> None:
        """Start the server on its port (kept across stops: the clients' URLs name it)."""
        self._pg("pg_ctl", "start", "-w", "-t", "60", "-D", str(self.data), "-l", str(self.log),
                 "-o", self._options())

    def stop(self, mode: str = "fast") -> None:
        self._pg("pg_ctl", "stop", "-w", "-t", "60", "-m", mode, "-D", str(self.data))

    def restart(self) -> None:
        self._pg("pg_ctl", "restart", "-w", "-t", "60", "-m", "fast", "-D", str(self.data), "-l", str(self.log),
                 "-o", self._options())

    def pid(self) -> int | None:
        """The postmaster's pid (its own postmaster.pid), None when it is not running."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            os.kill(pid, 0)
        except (OSError, ValueError, IndexError):
            return None
        return pid

    def running(self) -> bool:
        return self.pid() is not None

    def remove(self) -> None:
        """Stop the server (ours: its own pid, never by name) and delete everything it wrote."""
        with contextlib.suppress(Exception):
            if self.running():
                self.stop("immediate")
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
            end = time.monotonic() + 10
            while self.pid() is not None and time.monotonic() < end:
                time.sleep(0.1)
        shutil.rmtree(self.root, ignore_errors=True)

    # -- clients ---------------------------------------------------------------------------------

    @property
    def params(self) -> dict[str, Any]:
        """psycopg2.connect keywords for the admin database."""
        return {"host": "127.0.0.1", "port": self.port, "user": "postgres", "dbname": "postgres"}

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{dbname}"

    def execute(self, sql: str, timeout_s: int = 3) -> list[tuple[Any, ...]] | None:
        """Run one statement in autocommit; its rows, or None when the server cannot be reached."""
        import psycopg2

        try:
            conn = psycopg2.connect(connect_timeout=timeout_s, **self.params)
        except psycopg2.OperationalError:
            return None
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(sql)
                return cur.fetchall() if cur.description else []
        finally:
            conn.close()

    def start_time(self) -> Any:
        rows = self.execute("SELECT pg_postmaster_start_time()")
        return rows[0][0] if rows else None

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """A fresh database on this cluster, dropped afterwards; yields its SQLAlchemy URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        assert self.execute(f'CREATE DATABASE "{name}"') is not None, f"cluster on port {self.port} unreachable"
        try:
            yield self.url(name)
        finally:
            end = time.monotonic() + 60  # over a fresh connection: a restarted server closed the old ones
            while self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)') is None and time.monotonic() < end:
                time.sleep(0.5)


@contextlib.contextmanager
def pg_cluster(prefix: str = "pgc-") -> Iterator[PgCluster]:
    """A started private cluster, stopped and removed on exit. Its directory is made directly under
    /tmp: a pytest tmp_path is private to root (mode 0700), where the postgres user cannot reach."""
    cluster = PgCluster(Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp")))
    try:
        cluster.init()
        for attempt in range(3):  # another process may take the free port before the server binds it
            try:
                cluster.start()
                break
            except RuntimeError:
                if attempt == 2 or cluster.running():
                    raise
                cluster.port = free_port()
        yield cluster
    finally:
        cluster.remove()
