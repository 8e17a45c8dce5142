"""``python -m sweep COMMAND``: run, status, best, trial, dashboard, precompile, preflight, replay, promote,
export, compare: the command line.

Exit codes follow docs/design.md: 0 success, 2 bad input (one line naming the cause), 1 anything else.
Every command reads the study from ``SWEEP_STORAGE`` (else the spec's storage, else the embedded
journal under ``runs/``), so one study can be inspected from anywhere. This module only parses, resolves
the study and its storage, calls the command's one function and maps what it raises to an exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
from collections.abc import Callable
from typing import TextIO, cast

from sweep import dashboard
from sweep import store as st
from sweep.compare import command as compare
from sweep.printable import Printable
from sweep.run import precompile, preflight, preflight_cuda
from sweep.run.adhoc import run_adhoc
from sweep.run.driver import Driver, SweepAborted
from sweep.ship import export, promote, replay
from sweep.spec import SpecError, StudySpec, load
from sweep.spec.space import SpaceError
from sweep.store import artifacts
from sweep.study import UsageError, fail, load_study, parse_seconds, print_best, print_front, print_status


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like every other bad input
        print(f"sweep: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m sweep", description="Sweep GPT hyperparameters with Optuna on Ray.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="create or resume a study and run it to n_trials")
    r.add_argument("study", help="NAME (sweep/studies/NAME.toml) or a path to a .toml spec")
    s = sub.add_parser("status", help="trial counts by state and every trial")
    s.add_argument("study")
    s.add_argument("--json", action="store_true")
    b = sub.add_parser("best", help="the best complete trial and its result record (a pareto study: its front)")
    b.add_argument("study")
    b.add_argument("--json", action="store_true")
    t = sub.add_parser("trial", help="one ad-hoc trial with given parameters, recorded in the study; "
                       "enqueued for a running sweep unless --now")
    t.add_argument("--study", required=True)
    t.add_argument("--params", required=True, metavar="JSON_OR_@FILE",
                   help="JSON object of searched parameters, or @FILE holding one; missing ones are sampled")
    t.add_argument("--budget-s", type=parse_seconds, default=None, metavar="N",
                   help="charged training seconds (default: the spec's budget); such a trial is never pruned")
    t.add_argument("--prunable", action="store_true",
                   help="let the study's pruner stop it like a trial of the sweep (default: it runs to its end)")
    mode = t.add_mutually_exclusive_group()
    mode.add_argument("--now", action="store_true",
                      help="run it at once on this Ray (RAY_ADDRESS, else a local one) instead of enqueueing it")
    mode.add_argument("--no-wait", action="store_true", help="enqueue it and return without waiting for its result")
    d = sub.add_parser("dashboard", help="optuna-dashboard on the study's storage, with its trial artifacts")
    d.add_argument("study", nargs="?", help="NAME or spec path (its storage and artifacts); default: "
                   "SWEEP_STORAGE and SWEEP_ARTIFACTS, else runs/")
    d.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: no authentication)")
    d.add_argument("--port", type=int, default=8080)
    precompile.add_parser(sub)
    preflight.add_parser(sub)
    replay.add_parser(sub)
    promote.add_parser(sub)
    export.add_parser(sub)
    compare.add_parser(sub)
    return p


def entry() -> int:
    """``python -m sweep``: :func:`main`, and a quiet exit when the reader of stdout has gone (``| head``).

    The output that no one reads any more is dropped, with no traceback and no ``Exception ignored`` line at
    exit; the exit code is 1 (docs/design.md: not a success, not bad input).
    """
    try:
        code = main()
        sys.stdout.flush()  # what is still buffered, here rather than at exit where the error cannot be caught
        return code
    except BrokenPipeError:
        with contextlib.suppress(OSError):  # later writes and the flush at exit go nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def reader_gone(stream: TextIO) -> bool:
    """Whether ``stream`` is a pipe whose reading end is closed (a BrokenPipeError from it is no failure)."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # io.StringIO, a closed file, no poll on this platform
        return False


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    out = cast(TextIO, Printable(out or sys.stdout))  # figures and reasons come from trials: no escapes
    args = build_parser().parse_args(argv)
    url: str | None = None
    try:
        if args.command == "dashboard":
            dspec = load(args.study) if args.study else None
            url = st.resolve_url(dspec.storage if dspec else None)
            return _dashboard(dspec, url, args.host, args.port, out)
        spec = promote.load_spec(args.study, args.command)  # a linked study (NAME-promote-B) too
        url = st.resolve_url(spec.storage)
        return COMMANDS[args.command](spec, url, args, out)
    except (SpecError, UsageError, st.StorageError) as e:
        fail(str(e), url)
        return 2
    except SweepAborted as e:
        fail(str(e), url)
        return 2
    except SpaceError as e:
        fail(f"--params: {e}", url)
        return 2
    except BrokenPipeError as e:
        if reader_gone(out):
            raise  # entry() exits quietly
        fail(f"{type(e).__name__}: {e}", url)
        return 1
    except Exception as e:
        fail(f"{type(e).__name__}: {e}", url)
        return 1


def _run(spec: StudySpec, url: str, args: argparse.Namespace, out: TextIO) -> int:
    return Driver(spec, out=out).run()


def _status(spec: StudySpec, url: str, args: argparse.Namespace, out: TextIO) -> int:
    return print_status(load_study(spec, url), spec, args.json, out)


def _best(spec: StudySpec, url: str, args: argparse.Namespace, out: TextIO) -> int:
    show = print_front if spec.objective.multi else print_best
    return show(load_study(spec, url), spec, args.json, out)


def _dashboard(spec: StudySpec | None, url: str, host: str, port: int, out: TextIO) -> int:
    where = artifacts.artifacts_url(spec.artifacts if spec else None)
    try:
        return dashboard.serve(url, where, host, port, study=spec.name if spec else None, out=out)
    except dashboard.ListenError as e:
        raise UsageError(f"--host {host} --port {port}: cannot listen: {e}") from None


# Each command that runs on a study spec: (spec, storage URL, parsed arguments, output) -> exit code.
COMMANDS: dict[str, Callable[[StudySpec, str, argparse.Namespace, TextIO], int]] = {
    "run": _run,
    "status": _status,
    "best": _best,
    "trial": run_adhoc,
    "precompile": precompile.main,
    "preflight": preflight_cuda.main,  # the Neuron set, or the CUDA set where the spec trains on CUDA
    "replay": replay.main,
    "promote": promote.main,
    "export": export.main,
    "compare": compare.main,
}
