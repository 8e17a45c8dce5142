"""``make clean`` removes caches and keeps every study and artifact; ``make clean-studies`` removes them, after
saying what it removes. Run on a copy of the Makefile in a scratch directory."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def _make(where: Path, target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-s", target], cwd=where, capture_output=True, text=True, timeout=60)


def test_clean_keeps_studies_and_clean_studies_says_what_it_removes(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    keep = ["runs/optuna-journal.log", "runs/artifacts/demo/0/final.pt", "runs/artifacts/_store/abc",
            "runs/aws/trnsweep/cluster.yaml", "runs/data/demo/a.txt"]
    caches = ["runs/cache/tokenizers/t.json", ".pytest_cache/v", ".ruff_cache/x", "pkg/__pycache__/m.pyc"]
    for f in keep + caches:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x")

    assert _make(tmp_path, "clean").returncode == 0
    assert all((tmp_path / f).exists() for f in keep)
    assert not any((tmp_path / f).exists() for f in caches)

    done = _make(tmp_path, "clean-studies")
    assert done.returncode == 0, done.stderr
    for gone in ("runs/artifacts", "runs/optuna-journal.log", "runs/data"):
        assert gone in done.stdout and not (tmp_path / gone).exists()
    assert (tmp_path / "runs/aws/trnsweep/cluster.yaml").exists()  # `ray down` needs it
    again = _make(tmp_path, "clean-studies")
    assert again.returncode == 0 and "nothing under runs/ to remove" in again.stdout
