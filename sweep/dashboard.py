"""``python -m sweep dashboard [NAME]``: optuna-dashboard on the sweep's storage and artifact store.

The app is optuna-dashboard's own (``optuna_dashboard.wsgi``, the app ``run_server`` serves, with the
artifact store of :mod:`sweep.store.artifacts`, so each trial's uploads are listed and downloadable). We
serve it with wsgiref ourselves rather than through ``run_server`` because:

- the port is bound before the URL is printed: a busy port is one line and exit 2, and the printed
  URL answers at once;
- requests are served in threads: a browser loads the page, its bundle and several API calls at once;
- everything the process writes (access log, tracebacks from the app) passes through the storage
  URL's password scrubber, so a password in ``SWEEP_STORAGE`` never reaches a terminal or a log.

What a person sees first is the sweep's own: each trial's note holds its headline figures and the study's
note and figure its best trials (:mod:`sweep.run.notes` writes them as trials end; ``sweep dashboard
NAME`` rewrites the study's on start, for studies made before). Three things of optuna-dashboard 0.21's
page itself are mended in serving (:class:`Mended`):

- ``/dashboard/studies/N/trialTable`` renders an empty page: 0.21 dropped the Trials (Table) page (its
  table is now on Smart Selection) but kept the route, so old links and habits land on nothing. We
  redirect it to ``/dashboard/studies/N/smartSelection``, whose table has a row per trial.
- the trial table's rows are a screen tall each: a cell wraps its value, and a trial's ``config`` (a
  dict) and ``record_fields`` (a list) are hundreds of characters. The page we serve adds one style
  rule: a table cell is one line, a long value ends in an ellipsis (the trial's page shows it whole).
- its "Intermediate values" chart names its axes "Step" and "Objective Value", fixed in the bundle;
  here a step is a charged second and the value what was reported for pruning: val_bpb, or for a
  study of a team's script the script's own figure, which the trial's ``curve_metric`` attribute names
  (:mod:`sweep.run.supervisor`). The chart is one for every study, so the served bundle says both. An
  optuna-dashboard whose bundle lacks the exact text is served untouched.

It binds 127.0.0.1 by default: the dashboard has no authentication and can delete studies. From
another machine use an SSH tunnel (``ssh -L 8080:127.0.0.1:8080 HEAD``); ``--host 0.0.0.0`` only on
a network you trust. A request must name this server in its Host header (:class:`HostCheck`), so a web
page whose DNS name is rebound to 127.0.0.1 cannot drive the dashboard from the user's browser.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import ipaddress
import re
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any, TextIO
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from sweep import store as st
from sweep.run import notes
from sweep.store import artifacts

METRIC_NAMES = ["val_bpb"]
TRIAL_TABLE = re.compile(r"/dashboard/studies/(\d+)/trialTable/?")
# The "Intermediate values" chart's axis titles in optuna-dashboard 0.21.0's bundle, and ours.
AXES_0_21 = 'yaxis:{title:"Objective Value",type:i?"log":"linear"},xaxis:{title:"Step",type:"linear"}'
AXES_OURS = AXES_0_21.replace('"Objective Value"', "\"reported value: val_bpb, or the trial's curve_metric\"").replace(
    '"Step"', '"charged seconds"')
# One line per table cell: long values (a trial's config, its record's field list) end in an ellipsis.
CELL_STYLE = ("<style>/* trnsweep */ td.MuiTableCell-body { max-width: 22em; white-space: nowrap; overflow: hidden;"
              " text-overflow: ellipsis; }</style>")


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
    """optuna-dashboard's WSGI app on the sweep's storage and artifact store, mended (:class:`Mended`)."""
    import optuna
    from optuna_dashboard import wsgi

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = st.open_storage(storage_url, role="driver")
    return Mended(wsgi(storage, artifact_store=artifacts.open_store(artifacts_url)))


StartResponse = Callable[..., Any]


class Mended:
    """optuna-dashboard's WSGI app with the mends of the module docstring; every other request passes."""

    def __init__(self, inner: Any, bundle: Path | None = None) -> None:
        self.inner = inner
        self.bundle_path = bundle or _bundle_path()
        self._bundle: tuple[bytes, bytes, str] | None = None  # (plain, gzipped, etag) once patched
        self._lock = threading.Lock()
        self.patched: bool | None = None  # None: not read yet; False: the bundle lacks the text, served as is

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") in ("GET", "HEAD"):
            m = TRIAL_TABLE.fullmatch(path)
            if m:
                query = environ.get("QUERY_STRING")
                where = f"/dashboard/studies/{m.group(1)}/smartSelection" + (f"?{query}" if query else "")
                start_response("302 Found", [("Location", where), ("Content-Length", "0")])
                return [b""]
            if path == "/static/bundle.js":
                served = self._serve_bundle(environ, start_response)
                if served is not None:
                    return served
            if path == "/dashboard" or path.startswith("/dashboard/"):
                return self._serve_page(environ, start_response)
        return self.inner(environ, start_response)

    def _serve_page(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        """The app's page (every /dashboard address serves the same index.html) with :data:`CELL_STYLE`."""
        env = {k: v for k, v in environ.items() if k not in ("HTTP_IF_MODIFIED_SINCE", "HTTP_IF_NONE_MATCH")}
        got: list[Any] = []
        result = self.inner(env, lambda status, headers, *exc: got.extend([status, headers]))
        try:
            body = b"".join(result)
        finally:
            if hasattr(result, "close"):
                result.close()
        status, headers = got
        if status.startswith("200") and b"</head>" in body:
            body = body.replace(b"</head>", CELL_STYLE.encode() + b"</head>", 1)
            headers = [(k, v) for k, v in headers if k.lower() not in ("content-length", "last-modified", "etag")]
            headers += [("Content-Length", str(len(body))), ("Cache-Control", "no-cache")]
        start_response(status, headers)
        return [b""] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    def patched_bundle(self) -> tuple[bytes, bytes, str] | None:
        """The bundle with our axis titles (plain, gzipped, etag); None when it lacks the 0.21.0 text."""
        with self._lock:
            if self.patched is None:
                text = self.bundle_path.read_bytes()
                old, new = AXES_0_21.encode(), AXES_OURS.encode()
                self.patched = text.count(old) == 1
                if self.patched:
                    plain = text.replace(old, new)
                    etag = '"sweep-' + hashlib.sha256(plain).hexdigest()[:16] + '"'
                    self._bundle = (plain, gzip.compress(plain, compresslevel=6, mtime=0), etag)
            return self._bundle

    def _serve_bundle(self, environ: dict[str, Any], start_response: StartResponse) -> list[bytes] | None:
        try:
            bundle = self.patched_bundle()
        except OSError:
            return None
        if bundle is None:
            return None
        plain, zipped, etag = bundle
        if environ.get("HTTP_IF_NONE_MATCH") == etag:
            start_response("304 Not Modified", [("ETag", etag)])
            return [b""]
        use_gzip = "gzip" in environ.get("HTTP_ACCEPT_ENCODING", "")
        body = zipped if use_gzip else plain
        headers = [("Content-Type", "application/javascript"), ("Content-Length", str(len(body))),
                   ("ETag", etag), ("Cache-Control", "no-cache"), ("Vary", "Accept-Encoding")]
        if use_gzip:
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [b""] if environ.get("REQUEST_METHOD") == "HEAD" else [body]


def _bundle_path() -> Path:
    import optuna_dashboard

    return Path(optuna_dashboard.__file__).parent / "public" / "bundle.js"


WILDCARDS = ("", "0.0.0.0", "::")


class HostCheck:
    """Answers 403 to a request whose Host header names another server (a DNS-rebinding page's name).

    Allowed: localhost, a loopback address, the bound host, and, bound to every interface, any address
    literal and this machine's own names; at any port (an SSH tunnel's local port differs from ours). A
    rebinding attack needs a DNS name the attacker controls, which none of these is. A request without a
    Host header (HTTP/1.0, not a browser) passes.
    """

    def __init__(self, inner: Any, bind_host: str) -> None:
        self.inner = inner
        self.wildcard = bind_host in WILDCARDS
        self.names = {"localhost", bind_host.lower().strip("[]")} - {""}
        if self.wildcard:
            self.names |= {socket.gethostname().lower(), socket.getfqdn().lower()}

    def allowed(self, header: str) -> bool:
        host = header.strip().lower()
        if host.startswith("["):  # [v6] or [v6]:port
            host = host[1:].partition("]")[0]
        elif host.count(":") == 1:
            host = host.partition(":")[0]
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host.rstrip(".") in self.names
        return address.is_loopback or self.wildcard or host in self.names

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        header = environ.get("HTTP_HOST")
        if header is not None and not self.allowed(header):
            body = b"403: this dashboard answers only to its own host name (Host header refused)\n"
            start_response("403 Forbidden", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
            return [body]
        return self.inner(environ, start_response)


def make_server(wsgi_app: Any, host: str = "127.0.0.1", port: int = 8080, quiet: bool = False) -> _Server:
    """Bind ``host:port`` (port 0: any free one) and return the server, not yet serving."""
    from wsgiref.simple_server import make_server as _make

    cls = _Server6 if ":" in host else _Server
    server = _make(host, port, HostCheck(wsgi_app, host), server_class=cls, handler_class=_Handler)
    server.quiet = quiet
    return server  # type: ignore[return-value]


def study_path(storage_url: str, name: str) -> str | None:
    """The dashboard page of study ``name``, or None when the store has no such study yet.

    Also names the objective ``val_bpb`` on a study made before the sweep did so itself, and rewrites the
    study's summary (note and figures, :mod:`sweep.run.notes`): a study made before the sweep wrote one
    gets it, and one left stale (two drivers on one study) is brought up to date. A failure there is a
    warning, no more.
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
    notes.guarded(f"study {name}: summary", lambda: notes.write_study_summary(study, url=storage_url), storage_url)
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
