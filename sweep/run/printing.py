"""What ``sweep run`` prints: one line per event, built from the trials (the driver only says them).

Kept apart from the driver's loop so the wording of a run's log is in one short place; every line
here is part of the command's output that users and tests read.
"""

from __future__ import annotations

from typing import Any

from sweep.run.outcome import ATTR_ADHOC, ATTR_FAIL_KIND, ATTR_RERUN_OF, ATTR_RETRY_OF, CONSTRAINT, INFRA, counts
from sweep.spec import StudySpec
from sweep.spec import objective as obj
from sweep.study import (
    best_trial,
    file_lines,
    fmt_params,
    headline,
    python_cmd,
    record_of,
    storage_shown,
    study_arg,
)


def state_counts(trials: list[Any]) -> dict[str, int]:
    """How many trials are in each state, by state name."""
    states: dict[str, int] = {}
    for t in trials:
        states[t.state.name] = states.get(t.state.name, 0) + 1
    return states


def fmt_counts(states: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(states.items()))


def fmt_elapsed(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def one_line(e: BaseException) -> str:
    """An exception as ``Type: first line``, at most 300 characters."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _num(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "?"


def opening_line(name: str, trials: list[Any]) -> str | None:
    """What the driver says of the trials a study holds when it starts: nothing for an empty study,
    ``starting`` when every one is still queued (a promotion's replicates, ad-hoc trials), else ``resuming``."""
    if not trials:
        return None
    states = state_counts(trials)
    if set(states) == {"WAITING"}:
        return f"starting study {name}: {len(trials)} queued trial(s) to run first"
    return f"resuming study {name}: {len(trials)} trials so far ({fmt_counts(states)})"


def started_line(number: int, params: dict[str, Any], user_attrs: dict[str, Any]) -> str:
    note = f" (retry of trial {user_attrs[ATTR_RETRY_OF]})" if ATTR_RETRY_OF in user_attrs else ""
    note += (f" (re-run of trial {user_attrs[ATTR_RERUN_OF]}, lost to the infrastructure)"
             if ATTR_RERUN_OF in user_attrs else "")
    note += " (ad hoc)" if user_attrs.get(ATTR_ADHOC) else ""
    return f"trial {number} started{note}: {fmt_params(params)}"


def report_line(number: int, step: int, value: float, label: str = "val_bpb") -> str:
    """One intermediate value; ``label`` says what it is (a script's curve is its own: sweep.spec.script)."""
    return f"trial {number}: t={step}s {label}={value:.4f}"


def outcome_line(number: int, r: dict[str, Any], objective: obj.Objective) -> str:
    """How a trial ended, from the outcome its supervisor returned (:meth:`Outcome.as_dict`)."""
    rec = r.get("record") or {}
    if r["state"] == "COMPLETE":
        return (f"trial {number} COMPLETE {obj.fmt_values(objective, r['values'], rec)} "
                f"train={_num(rec.get('train_seconds'))}s steps={rec.get('steps')} slot={r['slot_seconds']:.1f}s")
    if r["state"] == "PRUNED":
        return f"trial {number} PRUNED: {r['reason']}"
    return f"trial {number} FAIL ({r['fail_kind']}): {r['reason']}"


def progress_line(trials: list[Any], spec: StudySpec, running: int, elapsed_s: float) -> str:
    done = sum(counts(t) for t in trials)
    kinds = [t.user_attrs.get(ATTR_FAIL_KIND) for t in trials if t.state.name == "FAIL"]
    failed = sum(1 for k in kinds if k not in (CONSTRAINT, INFRA))
    infra = sum(1 for k in kinds if k == INFRA)
    objective = spec.objective
    if objective.multi:
        best_s = f"pareto front {len(obj.front(trials, objective.directions))} trial(s)"
    else:
        best = best_trial(trials, spec.direction)
        best_s = f"best {best.value:.4f} (trial {best.number})" if best else "best -"
    return (f"progress: done {done}/{spec.n_trials}, running {running}, "
            f"pruned {state_counts(trials).get('PRUNED', 0)}, failed {failed}, "
            f"{f'lost to the infrastructure {infra} (not counted), ' if infra else ''}{best_s}, "
            f"elapsed {fmt_elapsed(elapsed_s)}")


def best_lines(trials: list[Any], spec: StudySpec) -> list[str]:
    """The run's best trial on one line, or a pareto study's front one line each."""
    objective = spec.objective
    if objective.multi:
        members = obj.front(trials, objective.directions)
        if not members:
            return ["no trial completed"]
        return [f"pareto front: trial {t.number} {obj.fmt_values(objective, t.values, t.user_attrs)} "
                f"{fmt_params(t.params)}" for t in members]
    best = best_trial(trials, spec.direction)
    if best is None:
        return ["no trial completed"]
    return [f"best: trial {best.number} {obj.fmt_values(objective, [best.value], best.user_attrs)} "
            f"{fmt_params(best.params)}"]


def summary_lines(trials: list[Any], spec: StudySpec, url: str, next_steps: bool = True) -> list[str]:
    """The run's last lines: the best trial (a pareto study: its front), its record's headline figures,
    where its checkpoint and result record are, where the study is kept, and what to run next."""
    objective = spec.objective
    if objective.multi:
        best = obj.front(trials, objective.directions)
    else:
        one = best_trial(trials, spec.direction)
        best = [one] if one is not None else []
    name = study_arg(spec)
    py = python_cmd()
    lines: list[str] = []
    for line, t in zip(best_lines(trials, spec), best or [None], strict=True):
        lines.append(line)
        if t is not None:
            lines.append(f"  record:     {headline(record_of(t), t.user_attrs, skip=objective.metrics)}")
            lines += file_lines(t, spec)
    lines.append(f"study {spec.name}: {len(trials)} trials ({fmt_counts(state_counts(trials))}) "
                 f"in {storage_shown(url)}")
    if not best:
        return [*lines, f"next: `{py} -m sweep status {name}` lists every trial, with why it failed"]
    if not next_steps:
        return lines
    number = best[0].number
    by = f" --by {objective.metrics[0]}" if objective.multi else ""
    pick = f" --trial {number}" if objective.multi else ""
    steps = [
        (f"make dashboard STUDY={name}", "learning curves and records at http://127.0.0.1:8080"),
        (f"{py} -m sweep best {name}", "this trial again"),
        (f"{py} -m sweep promote {name} --top 3 --seeds 3 --budget-s {spec.budget_s:g}{by}",
         "the 3 best again, 3 seeds each: beyond noise?"),
        (f"{py} -m sweep export {name}{pick} --out submission/", f"the competition's files for trial {number}"),
    ]
    width = max(len(cmd) for cmd, _ in steps)
    return [*lines, "next:", *(f"  {cmd:<{width}}  # {why}" for cmd, why in steps)]
