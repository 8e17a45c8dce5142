"""Sweep orchestration overhead: how much of a trial slot goes to training and evaluation.

For the demo study's model and search space, shortened to two trials at a time (one wave on a
2-core machine), at several budgets: each trial's share of its slot spent in charged training and
evaluation, ``(train_seconds + eval_seconds) / slot_seconds``, where the slot is the supervisor's
own wall time from the Ray task's start to just before it tells the result. The rest splits into
the trainer's start-up (``startup_seconds``: interpreter, imports, data, model build, excluded
first steps), the trainer's exit after its result line (interpreter teardown), both the trainer's
own cost, and the sweep's overhead (everything else: opening the study, spawning the trainer and
the reaper, reaping, storing the record). A second share uses Optuna's ask-to-tell
interval, which adds Ray scheduling and worker start-up.

Also the time from invoking ``python -m sweep run`` to the first training step, split into Ray
start-up, first submission and the trainer's launch.

``python -m bench.sweep_bench`` prints JSON lines. ``SWEEP_BENCH_BUDGETS`` (default ``20,60``)
picks the budgets in charged seconds; the target is >= 97% at 60 s.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TRIALS = 2


def _spec_text(budget_s: float) -> str:
    """The demo study, one wave of trials at the given budget, no pruning (every slot runs fully)."""
    return (f'extends = "{ROOT / "sweep" / "studies" / "demo.toml"}"\n'
            f"[study]\nn_trials = {TRIALS}\nconcurrency = {TRIALS}\n"
            f"[trial]\nbudget_s = {budget_s}\n[pruner]\nname = \"none\"\n")


def _run_study(budget_s: float, work: Path) -> dict[str, Any]:
    spec = work / f"bench{int(budget_s)}.toml"
    spec.write_text(_spec_text(budget_s))
    storage = f"journal:{work / 'journal.log'}"
    env = {**os.environ, "SWEEP_STORAGE": storage, "SWEEP_ARTIFACTS": str(work / "art"), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    stamps: dict[str, float] = {}
    t_invoke = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "sweep", "run", str(spec)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            now = time.time()
            for key, prefix in (("ray_ready", "ray:"), ("first_submit", "trial 0 started")):
                if line.startswith(prefix) and key not in stamps:
                    stamps[key] = now

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    rc = proc.wait(timeout=budget_s * 4 + 300)
    reader.join(5)
    if rc != 0:
        raise RuntimeError(f"sweep exited {rc}")

    import optuna

    from sweep import store as st

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trials = optuna.load_study(study_name=spec.stem, storage=st.open_storage(st.resolve_url(storage))).get_trials()
    return {"t_invoke": t_invoke, "stamps": stamps, "trials": trials}


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else float("nan")


def measure(budget_s: float) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp:
        res = _run_study(budget_s, Path(tmp))
    trials = [t for t in res["trials"] if t.state.name == "COMPLETE"]
    work, work_steps, startup, exits, overhead, study_share, slots = [], [], [], [], [], [], []
    for t in trials:
        a = t.user_attrs
        slot = a["slot_seconds"]
        busy = a["train_seconds"] + a["eval_seconds"]
        # The excluded first steps train the model too; the competition only leaves them uncharged.
        excluded = a.get("excluded_seconds", 0.0)
        exit_s = a.get("supervisor_seconds", {}).get("exit_after_result", 0.0)
        slots.append(slot)
        work.append(busy / slot)
        work_steps.append((busy + excluded) / slot)
        startup.append((a["startup_seconds"] - excluded) / slot)
        exits.append(exit_s / slot)
        overhead.append(max(0.0, slot - busy - a["startup_seconds"] - exit_s) / slot)
        study_share.append(busy / (t.datetime_complete - t.datetime_start).total_seconds())
    t0 = res["t_invoke"]
    first_step = min((t.user_attrs["first_step_unix"] for t in trials if "first_step_unix" in t.user_attrs),
                     default=float("nan"))
    first_launch = min((t.user_attrs["launch_unix"] for t in trials if "launch_unix" in t.user_attrs),
                       default=float("nan"))
    rows = [{
        "name": "slot_share", "budget_s": budget_s, "trials": len(trials), "concurrency": TRIALS,
        "train_eval_share_median": _median(work), "train_eval_share_min": round(min(work), 4) if work else None,
        "all_steps_eval_share_median": _median(work_steps),
        "startup_share_median": _median(startup), "trainer_exit_share_median": _median(exits),
        "sweep_overhead_share_median": _median(overhead),
        "ask_to_tell_share_median": _median(study_share), "slot_seconds_median": _median(slots),
        "target_share": 0.97,
    }, {
        "name": "time_to_first_step", "budget_s": budget_s,
        "seconds": round(first_step - t0, 3),
        "ray_ready_s": round(res["stamps"].get("ray_ready", float("nan")) - t0, 3),
        "first_submit_s": round(res["stamps"].get("first_submit", float("nan")) - t0, 3),
        "trainer_launch_s": round(first_launch - t0, 3),
    }]
    return rows


def run() -> list[dict[str, Any]]:
    budgets = [float(b) for b in os.environ.get("SWEEP_BENCH_BUDGETS", "20,60").split(",") if b.strip()]
    rows: list[dict[str, Any]] = []
    for b in budgets:
        rows += measure(b)
    return rows


if __name__ == "__main__":
    for row in run():
        print(json.dumps({"suite": "sweep_bench", **row}), flush=True)
