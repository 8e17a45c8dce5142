"""Optuna's gRPC storage proxy: the child process the driver starts in front of the database
(:class:`StorageProxy`), and the server that process runs (:func:`serve_proxy`, :func:`main`).

Workers then talk to the proxy (``grpc://HOST:PORT/?password=TOKEN``) instead of the database, so the
database sees one small pool however many workers run. The proxy answers only calls that carry the
per-run token of its URL (a random one each time the driver starts it; it reaches the proxy through its
environment): on a cluster it listens on the node's address, where anything on the network reaches it.
Started by hand without a token (``python -m sweep.store proxy``), it serves on a loopback address only.

``grpc``, ``optuna`` and ``ray`` are imported inside the functions (start-up time of the processes that
never run or reach a proxy).
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time

from sweep.redact import redact, scrub
from sweep.store import _optuna
from sweep.store.caches import CoalescedReads
from sweep.store.opening import open_storage, quiet_experimental
from sweep.store.retry import first_line
from sweep.store.schema import ensure_indexes
from sweep.store.urls import ENV_PROXY, ENV_PROXY_HOST, ENV_STORAGE, PROXY_SCHEME, StorageError, is_database, is_proxy

PROXY_THREADS = 16  # gRPC server threads; calls beyond the pool wait for a connection
PROXY_READ_TTL_S = 0.5  # the proxy serves one read of the study's trials to every worker asking within this
ENV_PROXY_TOKEN = "SWEEP_STORAGE_PROXY_TOKEN"  # the clients' token, given to the proxy process only


def proxy_host() -> str:
    """The address the proxy binds: this node's address in a Ray cluster, loopback for a local Ray.

    Never 0.0.0.0: it listens only where the workers reach it (and asks them for its token).
    """
    host = os.environ.get(ENV_PROXY_HOST)
    if host:
        return host
    if os.environ.get("RAY_ADDRESS"):
        with contextlib.suppress(Exception):
            import ray

            return ray.util.get_node_ip_address()
    return "127.0.0.1"


class StorageProxy:
    """Optuna's gRPC storage proxy in a child process of the driver, in front of ``url``.

    The child gets the URL through its environment (never its command line, which ``ps`` shows),
    keeps one bounded connection pool and exits when the driver does (it watches its parent).
    """

    def __init__(self, url: str, host: str | None = None, threads: int = PROXY_THREADS,
                 ready_timeout_s: float = 60.0) -> None:
        if not is_database(url) or is_proxy(url):
            raise StorageError(f"storage {redact(url)}: the gRPC proxy needs a database URL")
        self.host = host or proxy_host()
        self.proc: subprocess.Popen[bytes] | None = None
        self.token = secrets.token_urlsafe(32)
        last: Exception | None = None
        for _ in range(3):  # a port taken between choosing and binding: choose again
            self.port = _free_port(self.host)
            env = {**os.environ, ENV_STORAGE: url, ENV_PROXY_TOKEN: self.token}
            env.pop(ENV_PROXY, None)
            # Its log goes to an unnamed file, read back only if it fails to start: a pipe nobody
            # reads would block a chatty proxy.
            self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sweep.store", "proxy", "--host", self.host, "--port", str(self.port),
                 "--threads", str(threads)],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log)
            try:
                self._wait_ready(ready_timeout_s)
                return
            except Exception as e:
                last = e
                self.close()
        raise StorageError(f"storage proxy on {self.host}: did not start ({scrub(str(last), url)})")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{PROXY_SCHEME}{host}:{self.port}/?password={self.token}"  # masked by redact() like any password

    def _wait_ready(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        with quiet_experimental():
            client = _optuna.token_grpc_client(self.host, self.port, self.token)
        try:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    self._log.seek(0)
                    lines = [ln for ln in self._log.read().decode("utf-8", "replace").splitlines() if ln.strip()]
                    raise RuntimeError(lines[-1] if lines else f"exit {self.proc.returncode}")
                try:
                    client.wait_server_ready(timeout=min(1.0, max(0.1, end - time.monotonic())))
                    client.get_all_studies()  # the database behind it answers too
                    return
                except Exception:
                    if time.monotonic() > end:
                        raise
        finally:
            client.close()

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.proc = None


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_proxy(url: str, host: str, port: int, threads: int = PROXY_THREADS,
                read_ttl_s: float = PROXY_READ_TTL_S, token: str | None = None) -> None:
    """Run Optuna's gRPC proxy in front of ``url`` until SIGTERM or until the parent process exits.

    Optuna's own service (``run_grpc_proxy_server`` builds the same server), with two changes: a
    client's trial read is answered from the coalesced snapshot by bisection rather than by
    filtering every trial of the study on each call (:func:`sweep.store._optuna.add_proxy_service`),
    and with a ``token`` a call without it is refused; without one only a loopback address is served.
    """
    if not token and not _loopback(host):
        raise OSError(f"will not serve {host} without a client token ({ENV_PROXY_TOKEN}): anyone on the "
                      "network could read and write the studies")
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Many short calls share one interpreter with a few long ones (a refresh, an ask): switch
    # threads more often than every 5 ms so the short ones do not queue behind them.
    sys.setswitchinterval(0.001)
    backend = open_storage(url, "proxy")
    ensure_indexes(backend, url)
    storage = CoalescedReads(_optuna.cached(backend), read_ttl_s)

    parent = os.getppid()

    def orphan_watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphan_watch, daemon=True).start()
    server = grpc.server(ThreadPoolExecutor(max_workers=threads),
                         interceptors=[_optuna.token_check(token)] if token else None)
    with quiet_experimental():
        _optuna.add_proxy_service(server, storage)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    server.wait_for_termination()


def main(argv: list[str] | None = None) -> int:
    """``python -m sweep.store proxy --host H --port P``: the proxy process (URL from SWEEP_STORAGE)."""
    parser = argparse.ArgumentParser(prog="python -m sweep.store")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("proxy", help="serve the study store to workers over gRPC")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=PROXY_THREADS)
    p.add_argument("--read-ttl-s", type=float, default=PROXY_READ_TTL_S)
    args = parser.parse_args(argv)
    url = os.environ.get(ENV_STORAGE)
    if not url or not is_database(url) or is_proxy(url):
        print(f"sweep.store: {ENV_STORAGE} must name a database", file=sys.stderr)
        return 2
    try:
        serve_proxy(url, args.host, args.port, args.threads, args.read_ttl_s, os.environ.get(ENV_PROXY_TOKEN))
    except Exception as e:
        print(f"sweep.store: proxy: {scrub(first_line(e), url)}", file=sys.stderr)
        return 1
    return 0
