"""A sweep's driver in a process of its own, with the settings a test changes: the pytest process runs none.

``python -m tests.driver_child SPEC [--poll-s S] [--set module:NAME=JSON ...]`` runs
``Driver(load(SPEC), poll_s=S).run()`` after setting each module attribute (a test's shorter waits, as
``monkeypatch.setattr`` did when the driver ran inside pytest), prints the driver's lines on stdout and exits
with its exit code. RAY_ADDRESS, SWEEP_STORAGE and SWEEP_ARTIFACTS come from the environment, as for
``python -m sweep run``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys


def apply(assignment: str) -> None:
    """``module:NAME=JSON``: set the module's attribute NAME to the JSON value."""
    target, _, value = assignment.partition("=")
    module, _, name = target.partition(":")
    mod = importlib.import_module(module)
    if not hasattr(mod, name):
        raise SystemExit(f"driver_child: {module} has no attribute {name!r}")
    setattr(mod, name, json.loads(value))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.driver_child")
    parser.add_argument("spec")
    parser.add_argument("--poll-s", type=float, default=1.0)
    parser.add_argument("--set", action="append", default=[], dest="assignments")
    args = parser.parse_args(argv)
    for assignment in args.assignments:
        apply(assignment)
    from sweep.run.driver import Driver
    from sweep.spec import load

    return Driver(load(args.spec), out=sys.stdout, poll_s=args.poll_s).run()


if __name__ == "__main__":
    sys.exit(main())
