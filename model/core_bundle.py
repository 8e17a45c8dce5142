"""A CORE evaluation bundle on disk: its task list, examples and random baselines, checked as they are read.

A bundle is a directory in the standard layout (DCLM's, as nanochat reads it):
    core.yaml            icl_tasks: a list of {label, dataset_uri, num_fewshot (an int, or a list whose first
                         entry counts), icl_task_type, continuation_delimiter (default " ")}
    eval_data/<uri>      one JSON object per line, by task type:
                           multiple_choice    {"query", "choices": [str, ...], "gold": index}
                           schema             {"context_options": [str, ...], "continuation", "gold": index}
                           language_modeling  {"context", "continuation"}
    eval_meta_data.csv   columns "Eval Task" (a label) and "Random baseline" (percent)
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from model.data import DataError

KINDS = ("multiple_choice", "schema", "language_modeling")


@dataclass(frozen=True)
class Task:
    label: str
    kind: str
    num_fewshot: int
    delimiter: str
    baseline: float  # random baseline as a fraction: 0.01 x the percentage, the reference's float
    examples: list[dict[str, Any]] = field(repr=False)



# --- the bundle --------------------------------------------------------------------------------------------


def _fewshot_count(value: Any, where: str) -> int:
    if isinstance(value, list) and value:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DataError(where, f"num_fewshot must be a non-negative int or a list of them, got {value!r}")
    return value


def _read_baselines(path: Path) -> dict[str, float]:
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise DataError(path, f"cannot read random baselines: {e.strerror or e}") from None
    out: dict[str, float] = {}
    for n, row in enumerate(rows, 2):
        label, value = row.get("Eval Task"), row.get("Random baseline")
        if label is None or value is None:
            raise DataError(path, 'needs the columns "Eval Task" and "Random baseline"')
        try:
            percent = float(value)
        except ValueError:
            raise DataError(f"{path}:{n}", f"random baseline {value!r} is not a number") from None
        if not 0 <= percent < 100:
            raise DataError(f"{path}:{n}", f"random baseline {percent} is not a percentage in [0, 100)")
        out[label.strip()] = 0.01 * percent  # as the reference writes it: the same float, not percent / 100
    return out


def _check_example(ex: Any, kind: str) -> str:
    """The first problem with one example of `kind`, or ""."""
    if not isinstance(ex, dict):
        return "is not a JSON object"

    def strings(key: str) -> bool:
        v = ex.get(key)
        return isinstance(v, list) and bool(v) and all(isinstance(s, str) for s in v)

    if kind == "multiple_choice":
        if not isinstance(ex.get("query"), str) or not strings("choices"):
            return 'needs "query" (a string) and "choices" (a non-empty list of strings)'
        options = ex["choices"]
    elif kind == "schema":
        if not strings("context_options") or not isinstance(ex.get("continuation"), str):
            return 'needs "context_options" (a non-empty list of strings) and "continuation" (a string)'
        options = ex["context_options"]
    else:
        if not isinstance(ex.get("context"), str) or not isinstance(ex.get("continuation"), str):
            return 'needs "context" and "continuation" (strings)'
        return "" if ex["continuation"] else "has an empty continuation"
    gold = ex.get("gold")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(options):
        return f'"gold" must index one of the {len(options)} options, got {gold!r}'
    return ""


def _read_examples(path: Path, kind: str) -> list[dict[str, Any]]:
    """One example per line, lines as a text file iterates them (the reference's way: \\n, \\r\\n or \\r end
    a line, but U+2028, U+0085 and the other breaks str.splitlines() knows may sit raw inside a JSON string),
    each stripped of surrounding whitespace; a blank line is skipped (the reference would stop on it)."""
    examples = []
    try:
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    ex = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}", f"malformed JSON line: {e.msg}") from None
                problem = _check_example(ex, kind)
                if problem:
                    raise DataError(f"{path}:{n}", f"{kind} example {problem}")
                examples.append(ex)
    except OSError as e:
        raise DataError(path, f"cannot read task data: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise DataError(path, "task data is not UTF-8") from None
    if not examples:
        raise DataError(path, "task data holds no examples")
    return examples


def load_bundle(root: str | Path) -> list[Task]:
    """Read and check a whole bundle; DataError (one line naming the file, and the line where there is one)."""
    root = Path(root)
    config_path = root / "core.yaml"
    try:
        config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise DataError(config_path, f"cannot read the task list: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise DataError(config_path, f"not valid YAML: {str(e).splitlines()[0]}") from None
    entries = config.get("icl_tasks") if isinstance(config, dict) else None
    if not isinstance(entries, list) or not entries:
        raise DataError(config_path, "needs a non-empty list icl_tasks")
    baselines = _read_baselines(root / "eval_meta_data.csv")
    tasks: list[Task] = []
    for i, entry in enumerate(entries):
        where = f"{config_path} task {i + 1}"
        if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) for k in ("label", "dataset_uri")):
            raise DataError(where, "needs a label and a dataset_uri (strings)")
        label, kind = entry["label"], entry.get("icl_task_type")
        if kind not in KINDS:
            raise DataError(where, f"{label}: icl_task_type must be one of {', '.join(KINDS)}, got {kind!r}")
        if label in (t.label for t in tasks):
            raise DataError(where, f"label {label!r} appears twice")
        if label not in baselines:
            raise DataError(root / "eval_meta_data.csv", f"no random baseline for task {label!r}")
        delimiter = entry.get("continuation_delimiter", " ")
        if not isinstance(delimiter, str):
            raise DataError(where, f"{label}: continuation_delimiter must be a string")
        tasks.append(Task(label, kind, _fewshot_count(entry.get("num_fewshot", 0), where), delimiter,
                          baselines[label], _read_examples(root / "eval_data" / entry["dataset_uri"], kind)))
    return tasks


# --- prompts and rows --------------------------------------------------------------------------------------
