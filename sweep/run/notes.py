"""What a person reads first in the dashboard: a trial's headline figures and the study's best trials.

optuna-dashboard 0.21 puts a trial's note above everything else on the trial's page, a study's note on
its Note page and saved plotly figures on the study's page; its own curve chart reads "Step" and
"Objective Value", and its user-attribute box shows a handful of the record's fifty fields. So the run
writes, through optuna-dashboard's public API (:func:`optuna_dashboard.save_note`,
:func:`optuna_dashboard.save_plotly_graph_object`):

- a **trial note** when the trial ends (:func:`trial_note`): val_bpb, tokens/s, steps, MFU, charged
  seconds, parameters, device, git commit, why it did not complete, where its files are;
- when a trial becomes the best or one of the :data:`TOP` best (a multi-objective study: joins the
  front), the driver writes the **study summary** (:func:`write_study_summary`; one writer per study,
  so trials ending together cannot leave it stale): the study note's "Best trials" table,
  linked to each trial's page, with the next commands; and, on the study's page itself, two figures:
  those trials' figures as a table, and their learning curves against charged seconds (val_bpb, or a
  script's own figure, named as such). A person's own text below the note's summary is kept.

All are small (tables of :data:`TOP` rows, a figure of :data:`TOP` curves), so storage grows by about a
kilobyte per trial and a few per rewrite of the summary. Writing them never fails a trial: the caller
guards each write (:func:`guarded`) and records what went wrong.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sweep import store as st
from sweep.run.outcome import (
    ATTR_ADHOC,
    ATTR_ARTIFACTS,
    ATTR_FAIL_KIND,
    ATTR_FAIL_REASON,
    ATTR_RETRY_OF,
    ATTR_SLOT_SECONDS,
)
from sweep.spec import objective as obj

log = logging.getLogger("sweep.run.notes")

TOP = 10  # trials in the study summary's table and figure
FIGURE_ID = "val_bpb-over-charged-seconds"  # the summary's figures' ids: each rewrite overwrites them
TABLE_ID = "best-trials"
_TITLE = {"x": 0.02, "y": 0.95, "yanchor": "top", "font": {"size": 15}}  # under the dashboard's tool bar
SUMMARY_HEAD = "## Best trials"  # the study note's summary starts with this line ...
SUMMARY_END = "---"  # ... and ends at the first line after it that is this rule; text below is a person's


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _fixed(digits: int) -> Callable[[Any], str]:
    return lambda v: "–" if _num(v) is None else f"{_num(v):.{digits}f}"


def _count(v: Any) -> str:
    x = _num(v)
    return "–" if x is None else f"{x:,.0f}"


def _si(v: Any) -> str:
    x = _num(v)
    if x is None:
        return "–"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:g}"


def _percent(v: Any) -> str:
    x = _num(v)
    return "–" if x is None else f"{100 * x:.1f}%"


def commit(attrs: Mapping[str, Any]) -> str:
    """The trial's code commit, short, with ``-dirty`` when tracked files differed from it."""
    c = str(attrs.get("git_commit") or "unknown")
    short = c[:10] if len(c) == 40 else c
    return f"{short}-dirty" if attrs.get("git_dirty") else short


# (record key, label, format): the figures a person looks for first, in this order.
HEADLINE: list[tuple[str, str, Callable[[Any], str]]] = [
    ("val_bpb", "val_bpb", _fixed(4)),
    ("tokens_per_second", "tokens/s", _count),
    ("steps", "steps", _count),
    ("mfu", "MFU", _percent),
    ("train_seconds", "charged s", _fixed(1)),
    ("params", "params", _si),
]


def headline(attrs: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(label, text) of each headline figure, the git commit last; ``–`` where the record lacks it."""
    return [(label, fmt(attrs.get(key))) for key, label, fmt in HEADLINE] + [("git commit", f"`{commit(attrs)}`")]


def _cell(s: Any) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def trial_note(number: int, state: str, values: Sequence[float] | None, attrs: Mapping[str, Any],
               params: Mapping[str, Any], metric_names: Sequence[str] = ("val_bpb",)) -> str:
    """The trial's note: a title line, its headline figures as a table, then what else a person asks."""
    lines = [f"### Trial {number}: {state}"]
    if values and list(metric_names) != ["val_bpb"]:
        lines[0] += " · " + ", ".join(f"{m} {v:.4f}" for m, v in zip(metric_names, values, strict=False))
    pairs = headline(attrs)
    if attrs.get("core") is not None:
        pairs.insert(1, ("CORE", _fixed(4)(attrs.get("core"))))
    lines += ["", "| " + " | ".join(label for label, _ in pairs) + " |", "|" + "---|" * len(pairs),
              "| " + " | ".join(_cell(text) for _, text in pairs) + " |", ""]
    facts: list[str] = []
    if attrs.get(ATTR_FAIL_KIND):
        facts.append(f"**{attrs[ATTR_FAIL_KIND]}**: {_cell(attrs.get(ATTR_FAIL_REASON) or '')}".rstrip(": "))
    elif attrs.get(ATTR_FAIL_REASON):
        facts.append(f"**why**: {_cell(attrs[ATTR_FAIL_REASON])}")
    if attrs.get(ATTR_ADHOC):
        facts.append("**ad-hoc** (`sweep trial`): does not count towards n_trials")
    if attrs.get(ATTR_RETRY_OF) is not None:
        facts.append(f"**retry of** trial {attrs[ATTR_RETRY_OF]}")
    if params:
        facts.append("**params**: " + ", ".join(f"{k}={_short(v)}" for k, v in sorted(params.items())))
    device = attrs.get("device")
    if device:
        world = attrs.get("world_size")
        facts.append(f"**device**: {device}" + (f" x {world}" if world and world != 1 else ""))
    timing = [f"{label} {_fixed(1)(attrs.get(key))} s" for key, label in
              (("startup_seconds", "start-up"), ("eval_seconds", "eval"), (ATTR_SLOT_SECONDS, "slot"))
              if _num(attrs.get(key)) is not None]
    if timing:
        facts.append("**time**: " + ", ".join(timing))
    split = step_split(attrs)
    if split:
        facts.append(f"**step time** (charged steps): {split}")
    if attrs.get(ATTR_ARTIFACTS):
        facts.append(f"**files** (on the node that ran it): `{attrs[ATTR_ARTIFACTS]}`")
    lines += [f"- {f}" for f in facts]
    return "\n".join(lines).rstrip() + "\n"


# The trainer's step parts (model.train.STEP_PARTS; sweep/ knows the record, not the trainer), as labelled.
STEP_PARTS = (("forward", "forward"), ("backward", "backward"), ("optimizer", "optimizer"), ("data", "data"),
              ("all_reduce", "all-reduce"), ("sync", "device wait"))


def step_split(attrs: Mapping[str, Any]) -> str:
    """Where the charged steps' seconds went, as shares of their sum ("" for a record without the parts):
    what a slow trial shows first."""
    seconds = {label: _num(attrs.get(f"{key}_seconds")) for key, label in STEP_PARTS}
    total = _num(attrs.get("step_seconds_sum"))
    if not total or any(v is None for v in seconds.values()):
        return ""
    shown = [f"{label} {100 * v / total:.0f}%" for label, v in seconds.items() if v and 100 * v / total >= 0.5]
    for part in ("optimizer", "loss"):
        if attrs.get(f"{part}_compiled"):
            took = _num(attrs.get(f"{part}_compile_seconds"))
            shown.append(f"{part} compiled" + (f" in {took:.0f} s of start-up" if took else ""))
    return ", ".join(shown)


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# -- the study summary ---------------------------------------------------------------------------------

def best_trials(study: Any, top: int | None = None, current: Any = None) -> list[Any]:
    """The study's best complete trials, best first: by value (one objective) or the front by the first.

    ``current``: a FrozenTrial read just now, which counts even where the study's trial list is a few
    seconds old (a worker's throttled cache, :mod:`sweep.store.caches`).
    """
    from optuna.study import StudyDirection
    from optuna.trial import TrialState

    trials = {t.number: t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))}
    if current is not None:
        trials[current.number] = current
    done = [t for t in trials.values() if t.state == TrialState.COMPLETE and t.values is not None
            and all(math.isfinite(v) for v in t.values)]
    directions = [d.name.lower() for d in study.directions]
    if len(directions) > 1:
        done = obj.front(sorted(done, key=lambda t: t.number), directions)
    sign = -1 if study.directions[0] == StudyDirection.MAXIMIZE else 1
    return sorted(done, key=lambda t: (sign * t.values[0], t.number))[:TOP if top is None else top]


def in_summary(study: Any, current: Any) -> bool:
    """Whether the FrozenTrial ``current`` belongs in the study summary: a new best, or one of the
    :data:`TOP` best (a multi-objective study: on the front)."""
    return any(t.number == current.number for t in best_trials(study, current=current))


def metric_names(study: Any) -> list[str]:
    names = study.metric_names
    return list(names) if names else [f"value {i}" for i in range(len(study.directions))]


def summary(study: Any, best: Sequence[Any]) -> str:
    """The study note's summary: the best trials' figures, linked to their pages; the next commands."""
    sid = st.study_id(study)
    names = metric_names(study)
    extra = [(k, label, fmt) for k, label, fmt in HEADLINE if k not in names]
    head = ["trial", *names, *(label for _, label, _ in extra), "git commit"]
    lines = [SUMMARY_HEAD, "", f"The {len(best)} best of the study's complete trials "
             f"({'best first' if len(names) == 1 else 'its Pareto front, by ' + names[0]}); "
             "trnsweep rewrites this part when a new best appears; write your own notes below the line.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in best:
        row = [f"[{t.number}](/dashboard/studies/{sid}/trials?numbers={t.number})",
               *(_fixed(4)(v) for v in t.values), *(fmt(t.user_attrs.get(k)) for k, _, fmt in extra),
               f"`{commit(t.user_attrs)}`"]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    if best:
        b = best[0]
        lines += ["", f"Trial {b.number}: " + ", ".join(f"{k}={_short(v)}" for k, v in sorted(b.params.items())),
                  "", f"Next: `python -m sweep export {study.study_name} --trial {b.number} --out DIR`, "
                  f"`python -m sweep promote {study.study_name} --top 3 --budget-s B --seeds S`"]
    lines += ["", SUMMARY_END]
    return "\n".join(lines) + "\n"


def merge_note(old: str, new_summary: str) -> str:
    """The study note with its summary replaced: a person's text outside the summary stays."""
    lines = old.splitlines()
    if SUMMARY_HEAD in lines:
        start = lines.index(SUMMARY_HEAD)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() == SUMMARY_END), len(lines) - 1)
        lines = lines[:start] + lines[end + 1:]
    rest = re.sub(r"\n{3,}", "\n\n", "\n".join(lines).strip("\n"))
    return new_summary + ("\n" + rest + "\n" if rest else "")


def curves(t: Any) -> list[tuple[float, float]]:
    """A trial's learning curve, (charged second, value) in its :func:`~sweep.spec.objective.curve_metric`
    (val_bpb, or a script's own figure): the kept curve where its reports are not that curve (pareto and
    composite objectives), else its reports."""
    kept = t.user_attrs.get(obj.curve_attr(obj.curve_metric(t)))
    points = kept if kept else sorted(t.intermediate_values.items())
    return [(float(s), float(v)) for s, v in points if _num(v) is not None]


def curves_figure(best: Sequence[Any], names: Sequence[str]) -> Any:
    """A plotly figure: each best trial's learning curve against charged seconds, best first, named by its
    metric (val_bpb, or a script's own figure: a study's curves are one metric)."""
    import plotly.graph_objects as go

    metric = " / ".join(dict.fromkeys(obj.curve_metric(t) for t in best)) or "val_bpb"
    fig = go.Figure(layout={
        "template": "none",  # the default template alone is 7 kB of JSON in the study's attributes
        "title": {"text": f"{metric} against charged seconds: the {len(best)} best trials", **_TITLE},
        "xaxis": {"title": {"text": "charged seconds"}, "zeroline": False},
        "yaxis": {"title": {"text": metric}, "zeroline": False},
        "margin": {"l": 60, "r": 20, "t": 70, "b": 50},
        "legend": {"x": 1, "y": 1, "xanchor": "right"},
    })
    for t in best:
        points = curves(t)
        if not points:
            continue
        label = ", ".join(f"{n} {v:.4f}" for n, v in zip(names, t.values, strict=False))
        fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers",
                                 name=f"trial {t.number} ({label})"))
    return fig


def table_figure(study: Any, best: Sequence[Any]) -> Any:
    """A plotly table of the best trials' headline figures, for the study's page (its note is a click away)."""
    import plotly.graph_objects as go

    names = metric_names(study)
    extra = [(k, label, fmt) for k, label, fmt in HEADLINE if k not in names and k not in ("train_seconds", "params")]
    head = ["trial", *names, *(label for _, label, _ in extra), "git commit"]
    rows = [[str(t.number), *(_fixed(4)(v) for v in t.values), *(fmt(t.user_attrs.get(k)) for k, _, fmt in extra),
             commit(t.user_attrs)] for t in best]
    columns = [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in head]
    fig = go.Figure(go.Table(header={"values": [f"<b>{h}</b>" for h in head], "align": "left"},
                             cells={"values": columns, "align": "left", "height": 26},
                             columnwidth=[0.6, *[1] * (len(head) - 2), 1.6]),
                    layout={"template": "none", "title": {"text": f"Best trials ({len(best)})", **_TITLE},
                            "margin": {"l": 10, "r": 10, "t": 70, "b": 10}})
    return fig


def write_trial_note(trial: Any, body: str, url: str = "") -> None:
    """Save ``body`` as the note of ``trial`` (an ``optuna.Trial``), retried like every store write."""
    from optuna_dashboard import save_note

    st.retry(lambda: save_note(trial, body), what="trial note", url=url)


def write_study_summary(study: Any, current: Any = None, url: str = "") -> bool:
    """Rewrite the study note's summary and the curves figure from the study as stored (and ``current``, see
    :func:`best_trials`); False when no trial is complete yet (nothing is written)."""
    from optuna_dashboard import get_note, save_note, save_plotly_graph_object

    best = best_trials(study, current=current)
    if not best:
        return False
    note = merge_note(st.retry(lambda: get_note(study), what="study note", url=url), summary(study, best))
    figures = {TABLE_ID: table_figure(study, best), FIGURE_ID: curves_figure(best, metric_names(study))}
    st.retry(lambda: save_note(study, note), what="study note", url=url)
    for fid, fig in figures.items():
        st.retry(lambda fid=fid, fig=fig: save_plotly_graph_object(study, fig, graph_object_id=fid),
                 what=f"figure {fid}", url=url)
    return True


def guarded(what: str, fn: Callable[[], Any], url: str = "") -> str | None:
    """Run ``fn``; None when it worked, else one scrubbed line saying why (logged as a warning)."""
    try:
        fn()
    except Exception as e:  # a note is never worth a trial
        reason = st.scrub(f"{type(e).__name__}: {e}", url)[:500]
        log.warning("%s failed: %s", what, reason)
        return reason
    return None
