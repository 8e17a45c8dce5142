"""The guard of the machine's PostgreSQL (tests.pg_guard) fires when a run restarts it, and only then.

A private cluster plays the machine's server; a pytest run in a subprocess, with the guard loaded and
pointed at that cluster, restarts it (or leaves it alone) from inside a passing test.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests import pg_cluster
from tests.ci import under_ci
from tests.conftest import subprocess_env
from tests.pg_guard import ENV_MACHINE_PG

pytestmark = pytest.mark.skipif(pg_cluster.available() is not None and not under_ci(),
                              reason=str(pg_cluster.available()))

INNER = textwrap.dedent("""
    import os
    from pathlib import Path

    from tests.pg_cluster import PgCluster


    def test_passes_and_maybe_restarts_the_server():
        if os.environ.get("RESTART") == "1":
            PgCluster(Path(os.environ["CLUSTER_ROOT"]), port=int(os.environ["CLUSTER_PORT"])).restart()
""")


@pytest.fixture(scope="module")
def machine() -> pg_cluster.PgCluster:
    with pg_cluster.pg_cluster() as cluster:
        yield cluster


def run_inner(tmp_path, machine: pg_cluster.PgCluster, restart: bool) -> subprocess.CompletedProcess[str]:
    test = tmp_path / "test_inner.py"
    test.write_text(INNER)
    env = subprocess_env(**{ENV_MACHINE_PG: f"127.0.0.1:{machine.port}", "CLUSTER_ROOT": str(machine.root),
                            "CLUSTER_PORT": str(machine.port), "RESTART": "1" if restart else "0"})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.pg_guard", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(test)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def test_a_run_that_leaves_the_server_alone_passes(tmp_path, machine):
    out = run_inner(tmp_path, machine, restart=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "machine PostgreSQL guard" not in out.stdout


def test_a_run_that_restarts_the_server_fails_though_its_tests_pass(tmp_path, machine):
    before = machine.start_time()
    out = run_inner(tmp_path, machine, restart=True)
    assert machine.start_time() != before  # the inner run did restart it
    assert "1 passed" in out.stdout
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"the machine's PostgreSQL (127.0.0.1:{machine.port}" in out.stdout
    assert "was restarted at" in out.stdout
