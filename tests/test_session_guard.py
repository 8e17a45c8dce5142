"""The harness itself: a run that ends uncleanly must not exit 0.

Each case is a throwaway pytest run in a subprocess whose root conftest loads ours (tests/conftest.py, its
guards included), so what it shows is what `make test` does: an error in a terminal-summary hook, a leaked
thread, a leaked child process and a Ray driver left connected each fail the session; a clean one passes and
runs its atexit handlers (the interpreter's own teardown, no hard exit).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import subprocess_env

ROOT_CONFTEST = 'pytest_plugins = ["tests.conftest"]\n'


def run_inner(tmp_path: Path, test_body: str, conftest_extra: str = "",
              args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(ROOT_CONFTEST + textwrap.dedent(conftest_extra))
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(test_body))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "--rootdir",
                           str(tmp_path), str(tmp_path / "test_inner.py")], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=180)


def test_a_clean_run_under_xdist_workers_exits_0(tmp_path):
    """The controller's children are its workers (and their resource trackers): none of them is a leak."""
    out = run_inner(tmp_path, "def test_a():\n    pass\n\ndef test_b():\n    pass\n", args=("-n", "2"))
    assert out.returncode == 0 and "2 passed" in out.stdout, out.stdout + out.stderr


def test_a_clean_run_exits_0_and_runs_its_atexit_handlers(tmp_path):
    out = run_inner(tmp_path, f"""
        import atexit
        from pathlib import Path

        def test_registers_an_atexit_handler():
            atexit.register(Path({str(tmp_path / "atexit-ran")!r}).write_text, "yes")
    """)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout and "session guard" not in out.stdout
    assert (tmp_path / "atexit-ran").read_text() == "yes"


def test_an_error_in_a_summary_hook_fails_the_run(tmp_path):
    out = run_inner(tmp_path, "def test_passes():\n    pass\n", conftest_extra="""
        def pytest_terminal_summary(terminalreporter):
            raise RuntimeError("boom in the summary hook")
    """)
    assert out.returncode != 0, out.stdout + out.stderr
    assert "boom in the summary hook" in out.stdout + out.stderr


def test_a_leaked_thread_fails_the_run_naming_it(tmp_path):
    out = run_inner(tmp_path, """
        import threading, time

        def test_leaks_a_thread():
            threading.Thread(target=time.sleep, args=(60,), name="leaky-sleeper", daemon=True).start()
    """)
    assert "1 passed" in out.stdout, out.stdout + out.stderr
    assert out.returncode == 1, out.stdout + out.stderr
    assert "left running at the session's end: thread 'leaky-sleeper' (daemon" in out.stdout, out.stdout


@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["one process", "xdist workers"])
def test_a_leaked_child_process_fails_the_run_naming_it(tmp_path, workers):
    pid_file = tmp_path / "child.pid"
    out = run_inner(tmp_path, f"""
        import subprocess
        from pathlib import Path

        def test_leaks_a_child():
            child = subprocess.Popen(["sleep", "61"])
            Path({str(pid_file)!r}).write_text(str(child.pid))
    """, args=workers)
    pid = int(pid_file.read_text())
    try:
        assert "1 passed" in out.stdout, out.stdout + out.stderr
        assert out.returncode == 1, out.stdout + out.stderr
        assert f"left running at the session's end: child process {pid}: sleep 61" in out.stdout, out.stdout
        if workers:  # found by the worker that ran the test, reported by the controller
            assert "FAILED: gw0: left running" in out.stdout or "FAILED: gw1: left running" in out.stdout, out.stdout
    finally:
        try:  # the inner run's child, started by this test (through its subprocess): signalled by its pid
            if "sleep" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.slow
def test_a_ray_driver_left_connected_fails_the_run_naming_the_test(tmp_path):
    out = run_inner(tmp_path, """
        import ray

        def test_connects_ray():
            ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
                     object_store_memory=80 * 1024**2)

        def test_after_it():
            ray.shutdown()
    """)
    assert "2 passed" in out.stdout, out.stdout + out.stderr
    assert out.returncode == 1, out.stdout + out.stderr
    assert "test_inner.py::test_connects_ray left a Ray driver connected in the pytest process" in out.stdout
    assert "test_after_it left" not in out.stdout
