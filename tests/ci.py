"""Skips that would hide behaviour under CI: there (CI=true, which .ci/run's runner sets) they fail instead.

A laptop without mount rights or without initdb may skip the tests that need them; CI runs every row, so a
missing capability there is a broken CI machine, said as a failure naming the cause.
"""

from __future__ import annotations

import os

import pytest


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def skip_unless_ci(reason: str) -> None:
    """Skip the running test with ``reason``, or fail it with the same reason under CI."""
    if under_ci():
        pytest.fail(f"CI runs this test, but {reason}", pytrace=False)
    pytest.skip(reason)
