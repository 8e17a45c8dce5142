"""Cold start-up rehearsal: a candidate's start-up as the scorer sees it, before it is submitted.

Official runs start cold: no NEFF of the candidate is cached where the scorer runs it, and the kit caps the
start-up (``TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS``, 900 s). Sweeps keep the shared warm cache, so a trial's
recorded start-up says little about a cold one (teams saw 497-839 s cold against 66-214 s warm). ``sweep export
--cold-rehearsal`` runs the candidate's trainer config once, through a trial's own launch (the supervisor, the
spec's environment profile: on a ``competition`` node the image venv's python), with the compile cache pointed
at a fresh empty directory, and stops it once the start-up is measured (the uncharged first steps and one
more). Over the margin (840 s by default: under the cap, as teams required of themselves) it says so in one
line, and the candidate is marked in the study (study attribute ``cold_rehearsals``, by trial number).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from sweep.neuron import environment
from sweep.run.supervisor import Supervisor, TrialTask

DEFAULT_MARGIN_S = 840.0
STARTUP_CAP_S = 900.0  # the kit's TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS
ATTR_REHEARSALS = "cold_rehearsals"  # study attribute: {trial number: rehearsal}


class RehearsalError(RuntimeError):
    """The rehearsal could not measure a start-up (one line)."""


def rehearsal_config(config: dict[str, Any]) -> dict[str, Any]:
    """The candidate's config, stopped once its start-up is measured: the uncharged steps and one more, no
    intermediate evaluation, the smallest final one, no checkpoint."""
    excluded = int(config.get("excluded_steps", 3))
    return {**config, "max_steps": excluded + 1, "eval_fractions": [], "save_checkpoint": False,
            "final_eval_tokens": int(config.get("batch_size", 1)) * int(config.get("seq_len", 1)),
            "core_bundle": ""}


def rehearse(spec: Any, config: dict[str, Any], workdir: Path, margin_s: float = DEFAULT_MARGIN_S,
             number: int = -1) -> dict[str, Any]:
    """Run ``config`` once on an empty compile cache; its cold start-up, the margin and whether it is over."""
    cache = Path(tempfile.mkdtemp(prefix="cold-cache-", dir=workdir))  # empty: every graph compiles
    python = environment.trainer_python(spec.environment.trial_env())
    task = TrialTask(study=spec.name, storage_url="", number=number, trial_id=-1, params={},
                     config=rehearsal_config(config), budget_s=spec.budget_s, deadline_s=spec.deadline_s,
                     eval_fractions=(1.0,), ranks=spec.ranks, trainer=spec.trainer, stop_grace_s=spec.stop_grace_s,
                     heartbeat_s=spec.heartbeat_s, env={**spec.env, **spec.environment.trial_env()},
                     compile_cache=str(cache), artifact_dir=str(workdir / "trial"),
                     run_as=spec.script.run_as if spec.script is not None else "")
    sup = Supervisor(task, python=python)
    t0 = time.time()
    try:
        out = sup.run()
    finally:
        sup.close()
    startup = (out.record or {}).get("startup_seconds")
    if out.state != "COMPLETE" or not isinstance(startup, (int, float)):
        reason = (out.reason or "no start-up recorded").splitlines()[0][:300]
        raise RehearsalError(f"the cold rehearsal ended {out.state}: {reason} (read {workdir / 'trial'}/trainer.log)")
    return {"startup_seconds": round(float(startup), 1), "margin_s": margin_s, "over": float(startup) > margin_s,
            "environment": spec.environment.profile, "cache": str(cache), "unix": round(t0)}


def verdict_line(number: int, r: dict[str, Any]) -> str:
    """One line: the cold start-up against the margin and the kit's cap."""
    if r["over"]:
        return (f"trial {number}: cold start-up {r['startup_seconds']:.0f} s is over the margin {r['margin_s']:g} s "
                f"(the kit caps it at {STARTUP_CAP_S:g} s); marked in the study as {ATTR_REHEARSALS}")
    return f"trial {number}: cold start-up {r['startup_seconds']:.0f} s, within the margin {r['margin_s']:g} s"


def mark(study: Any, number: int, r: dict[str, Any]) -> None:
    """Record the rehearsal with the study (a finished trial's attributes cannot change)."""
    done = dict(study.user_attrs.get(ATTR_REHEARSALS) or {})
    done[str(number)] = r
    study.set_user_attr(ATTR_REHEARSALS, done)
