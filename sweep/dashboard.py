"""``python -m sweep dashboard [NAME]``: optuna-dashboard on the sweep's storage and artifact store.

The app is optuna-dashboard's own (``optuna_dashboard.wsgi``, the app ``run_server`` serves, with the
artifact store of :mod:`sweep.store.artifacts`, so each trial's uploads are listed and downloadable). We
serve it with wsgiref ourselves rather than through ``run_server`` because:

- the port is bound before the URL is printed: a busy port is one line and exit 2, and the printed
  URL answers at once;
- requests are served in threads: a browser loads the page, its bundle and several API calls at once;
- everything the process writes (access log, tracebacks from the app) passes through the storage
  URL's password scrubber, so a password in ``SWEEP_STORAGE`` never reaches a terminal or a log.

It binds 127.0.0.1 by default: the dashboard has no authentication and can delete studies. From
another machine use an SSH tunnel (``ssh -L 8080:127.0.0.1:8080 HEAD``); ``--host 0.0.0.0`` only on
a network you trust.
"""

from __future__ import annotations

import contextlib
import io
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Iterator
from socketserver import ThreadingMixIn
from typing import Any, TextIO
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from sweep import store as st
from sweep.store import artifacts

METRIC_NAMES = ["val_bpb"]


class ListenError(Exception):
    """The address cannot be bound (port in use, unknown host); bad input, exit 2."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a browser's open connection must not keep Ctrl-C waiting
    quiet = False


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if not getattr(self.server, "quiet", False):
            super().log_message(format, *args)


class _Scrubbed(io.TextIOBase):
    """A text stream that drops the storage password from everything written through it."""

    def __init__(self, inner: TextIO, url: str) -> None:
        self.inner = inner
        self.url = url

    def write(self, s: str) -> int:
        self.inner.write(st.scrub(s, self.url))
        return len(s)

    def flush(self) -> None:
        self.inner.flush()


def app(storage_url: str, artifacts_url: str) -> Any:
    """optuna-dashboard's WSGI app on the sweep's storage and artifact store."""
    import optuna
    from optuna_dashboard import wsgi

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = st.open_storage(storage_url, role="driver")
    return wsgi(storage, artifact_store=artifacts.open_store(artifacts_url))


def make_server(wsgi_app: Any, host: str = "127.0.0.1", port: int = 8080, quiet: bool = False) -> _Server:
    """Bind ``host:port`` (port 0: any free one) and return the server, not yet serving."""
    from wsgiref.simple_server import make_server as _make

    cls = _Server6 if ":" in host else _Server
    server = _make(host, port, wsgi_app, server_class=cls, handler_class=_Handler)
    server.quiet = quiet
    return server  # type: ignore[return-value]


def study_path(storage_url: str, name: str) -> str | None:
    """The dashboard page of study ``name``, or None when the store has no such study yet.

    Also names the objective ``val_bpb`` on a study made before the sweep did so itself.
    """
    import optuna

    storage = st.open_storage(storage_url, role="driver")
    try:
        study_id = st.retry(lambda: storage.get_study_id_from_name(name), url=storage_url)
    except KeyError:
        return None
    study = optuna.load_study(study_name=name, storage=storage)
    if study.metric_names is None and len(study.directions) == len(METRIC_NAMES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(METRIC_NAMES)
    return f"/dashboard/studies/{study_id}"


@contextlib.contextmanager
def running(storage_url: str, artifacts_url: str, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve in a background thread for the duration of the block; yields the base URL."""
    server = make_server(app(storage_url, artifacts_url), host, port, quiet=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield f"http://{_url_host(host)}:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def serve(storage_url: str, artifacts_url: str, host: str, port: int, study: str | None = None,
          out: TextIO | None = None) -> int:
    """Bind, print where to look, serve until interrupted. Raises OSError when the port is taken."""
    out = out or sys.stdout
    wsgi_app = app(storage_url, artifacts_url)
    try:
        server = make_server(wsgi_app, host, port)
    except OSError as e:
        raise ListenError(e.strerror or str(e)) from None
    path = "/dashboard"
    if study is not None:
        found = study_path(storage_url, study)
        if found is None:
            print(f"note: no study {study!r} in this storage yet; it appears once `python -m sweep run {study}` "
                  "creates it", file=out)
        else:
            path = found
    base = f"http://{_url_host(host)}:{server.server_port}"
    print(f"optuna-dashboard: {base}{path}", file=out)
    print(f"  storage {st.redact(storage_url)}; artifacts {artifacts_url}", file=out)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"  warning: listening on {host}: anyone who reaches this port can read and delete studies",
              file=out)
    out.flush()
    import optuna

    # Optuna's own handler holds the stderr of import time; route its records through the scrubbed one.
    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop is a clean exit too
    with contextlib.redirect_stdout(_Scrubbed(sys.stdout, storage_url)), \
            contextlib.redirect_stderr(_Scrubbed(sys.stderr, storage_url)):
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
    return 0


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
