"""Pruners compared by replay on real learning curves: compute spent against the best val_bpb found.

Records the demo study's shape once with no pruning and an eval at every tenth of the budget
(``sweep/studies/demo-curves.toml``: tiny GPTs really trained on the CPU), cached under
``runs/replay-bench/`` keyed by the specs' text, so reruns only replay. Then replays TPE (the demo's
sampler) with each of no pruning, the median pruner, Hyperband and the learning-curve pruner, over
several sampler seeds, every recorded trial once per replay. Per pruner, medians over seeds of:
compute spent (charged seconds plus each trial's recorded start-up) and its saving against no
pruning, the best val_bpb found, the best found by the time half of no pruning's compute was spent,
and the fraction of seeds in which the study's true best trial was pruned.

``python -m bench replay_bench`` prints JSON lines; ``REPLAY_BENCH_SEEDS`` (default 7) sets the seeds.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STUDY = "demo-curves"
PRUNERS = ("none", "median", "hyperband", "learning_curve")
SAMPLER = ("tpe", ["n_startup_trials=4"])  # the demo study's sampler


def _cache_dir() -> Path:
    """One directory per version of the recording specs, so an edited spec records afresh."""
    digest = hashlib.sha256()
    for name in (STUDY, "demo"):
        digest.update((ROOT / "sweep" / "studies" / f"{name}.toml").read_bytes())
    return ROOT / "runs" / "replay-bench" / digest.hexdigest()[:12]


def record() -> tuple[Any, str, float]:
    """The recorded study (running it first unless the cache has it all), its storage URL, and the
    seconds spent recording now (0 when cached)."""
    import optuna

    from sweep import spec as sp
    from sweep import store as st

    spec = sp.load(STUDY)
    work = _cache_dir()
    work.mkdir(parents=True, exist_ok=True)
    url = st.resolve_url(f"journal:{work / 'optuna-journal.log'}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def finished() -> int:
        try:
            study = optuna.load_study(study_name=spec.name, storage=st.open_storage(url))
        except KeyError:
            return 0
        return sum(1 for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE")

    spent = 0.0
    if finished() < spec.n_trials:
        env = {**os.environ, "SWEEP_STORAGE": url, "SWEEP_ARTIFACTS": str(work / "artifacts"),
               "PYTHONUNBUFFERED": "1"}
        env.pop("RAY_ADDRESS", None)
        t0 = time.perf_counter()
        with open(work / "run.log", "ab") as log:
            rc = subprocess.run([sys.executable, "-m", "sweep", "run", STUDY], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, timeout=3600).returncode
        spent = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"recording {STUDY} failed (exit {rc}); see {work / 'run.log'}")
    return spec, url, spent


def _best_within(trajectory: list[dict[str, Any]], compute_s: float) -> float | None:
    """The best val_bpb found by the last trial that ended within ``compute_s``."""
    best = None
    for step in trajectory:
        if step["compute_s"] > compute_s:
            break
        best = step["best_val_bpb"]
    return best


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 4) if vals else None


def run() -> list[dict[str, Any]]:
    import optuna

    from sweep import store as st
    from sweep.ship import replay as rp

    spec, url, spent = record()
    trials = optuna.load_study(study_name=spec.name, storage=st.open_storage(url)).get_trials(deepcopy=False)
    recorded = rp.recorded_trials(trials, spec.budget_s)
    seeds = range(int(os.environ.get("REPLAY_BENCH_SEEDS", "7")))
    true_best = min(recorded, key=lambda r: r.value)
    rows: list[dict[str, Any]] = [{
        "name": "recording", "study": spec.name, "recorded_trials": len(recorded), "budget_s": spec.budget_s,
        "eval_steps": list(spec.eval_steps), "true_best_val_bpb": round(true_best.value, 4),
        "val_bpb_range": [round(min(r.value for r in recorded), 4), round(max(r.value for r in recorded), 4)],
        "startup_s_median": _median([r.startup_s for r in recorded]), "recorded_now_s": round(spent, 1),
    }]
    results: dict[str, list[dict[str, Any]]] = {}
    for name in PRUNERS:
        results[name] = []
        for seed in seeds:
            sampler, pruner = rp.components(spec, SAMPLER[0], SAMPLER[1], name, [], seed)
            results[name].append({**rp.replay(recorded, sampler, pruner, spec.budget_s).as_dict(),
                                  "options": pruner.options})
    full = statistics.median(r["full_compute_s"] for r in results["none"])
    for name in PRUNERS:
        res = results[name]
        rows.append({
            "name": "replay", "pruner": name, "options": res[0]["options"], "sampler": SAMPLER[0],
            "seeds": len(res), "trials": res[0]["trials"],
            "compute_s_median": _median([r["compute_s"] for r in res]),
            "compute_saved_frac_median": _median([r["compute_saved_frac"] for r in res]),
            "pruned_median": _median([r["pruned"] for r in res]),
            "best_val_bpb_median": _median([r["best_val_bpb"] for r in res]),
            "best_val_bpb_at_half_compute_median": _median([_best_within(r["trajectory"], full / 2) for r in res]),
            "true_best_pruned_frac": round(sum(bool(r["true_best_pruned"]) for r in res) / len(res), 3),
        })
    return rows


if __name__ == "__main__":
    for row in run():
        print(json.dumps({"suite": "replay_bench", **row}), flush=True)
