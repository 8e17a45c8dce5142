"""A pytest plugin that fails the run on what its tests left behind: threads, child processes, a Ray driver.

A suite that exits 0 must have ended cleanly. At the session's end (every fixture torn down) it names each
Python thread still alive beyond those alive at its start, and each live process descended from the pytest
process; after each test it names a test that left a Ray driver connected in the pytest process, where none
may run (tests.ray_head says why). Any of these fails the session, exit 1, with a section saying what was left.

Exempt, by identity, the two a library keeps for the life of the process by design: multiprocessing's resource
tracker (the child a spawn-context pool leaves to the interpreter's exit) and tqdm's monitor thread (which
torch.fx's disabled progress bars start under torch.compile). Under pytest-xdist (``make test`` runs two
workers) each worker checks its own descendants and reports to the controller, which fails the run on any
worker's findings. tests/conftest.py loads the plugin; ``pytest -p tests.session_guard`` elsewhere.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

GRACE_S = 5.0  # a thread or process already ending gets this long before it counts as left behind
_STATE: dict[str, Any] = {"threads": set(), "ray": [], "connected": False, "problems": [], "workers": {}}


def _children(root: int) -> dict[int, str]:
    """Live (not zombie) descendants of ``root``: pid -> command line."""
    parent: dict[int, int] = {}
    cmd: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            line = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if fields[0] != "Z":
            parent[int(d.name)] = int(fields[1])
            cmd[int(d.name)] = line
    out = {}
    for pid in parent:
        p = parent.get(pid)
        while p is not None and p != root and p > 1:
            p = parent.get(p)
        if p == root:
            out[pid] = cmd[pid]
    return out


def _exempt_pids() -> set[int]:
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    pid = getattr(getattr(tracker, "_resource_tracker", None), "_pid", None)
    return {pid} if pid else set()


def _exempt_threads() -> set[int | None]:
    tqdm = sys.modules.get("tqdm.std")
    monitor = getattr(getattr(tqdm, "tqdm", None), "monitor", None)
    return {monitor.ident} if isinstance(monitor, threading.Thread) else set()


def _threads() -> list[threading.Thread]:
    skip = _STATE["threads"] | _exempt_threads()
    return [t for t in threading.enumerate() if t is not threading.main_thread() and t.ident not in skip]


def left_behind() -> list[str]:
    """What the session left running, each as one line (empty when it ended cleanly)."""
    end = time.monotonic() + GRACE_S
    while time.monotonic() < end and (_threads() or set(_children(os.getpid())) - _exempt_pids()):
        time.sleep(0.1)
    lines = [f"thread {t.name!r} ({'daemon' if t.daemon else 'non-daemon'}, target "
             f"{getattr(getattr(t, '_target', None), '__qualname__', '?')})" for t in _threads()]
    exempt = _exempt_pids()
    lines += [f"child process {pid}: {cmd[:160]}" for pid, cmd in sorted(_children(os.getpid()).items())
              if pid not in exempt]
    return lines


def pytest_sessionstart(session: pytest.Session) -> None:
    _STATE["threads"] = {t.ident for t in threading.enumerate()}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    yield
    ray = sys.modules.get("ray")
    connected = ray is not None and ray.is_initialized()
    if connected and not _STATE["connected"]:  # the test that connected it (a module fixture's first test)
        _STATE["ray"].append(item.nodeid)
    _STATE["connected"] = connected


def _xdist_controller(config: pytest.Config) -> bool:
    """Whether this process hands the tests to pytest-xdist workers (``-n N``) and runs none itself."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    problems = [f"{nodeid} left a Ray driver connected in the pytest process (use tests.ray_head)"
                for nodeid in _STATE["ray"]]
    if _xdist_controller(session.config):
        # The workers are this process's children, and each checks its own descendants at its session's end
        # (below); what they found comes back through xdist's workeroutput (pytest_testnodedown).
        problems += [f"{worker}: {line}" for worker, lines in _STATE["workers"].items() for line in lines]
        problems += [f"left running at the session's end: thread {t.name!r}" for t in _threads()]
    else:
        problems += [f"left running at the session's end: {line}" for line in left_behind()]
    if hasattr(session.config, "workerinput"):
        session.config.workeroutput["session_guard"] = problems  # type: ignore[attr-defined]
    if problems:
        _STATE["problems"] = problems
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """On the xdist controller: a worker's findings (its threads, descendants, Ray drivers left behind)."""
    lines = getattr(node, "workeroutput", {}).get("session_guard") or []
    if lines:
        _STATE["workers"][node.gateway.id] = list(lines)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _STATE["problems"]:
        terminalreporter.section("session guard", red=True)
        for line in _STATE["problems"]:
            terminalreporter.write_line(f"FAILED: {line}", red=True)
