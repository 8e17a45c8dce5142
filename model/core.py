"""CORE: accuracy on in-context learning tasks, centered by each task's random baseline (half of phase 2's score).

A bundle is a directory in the standard layout (DCLM's, as nanochat reads it):
    core.yaml            icl_tasks: a list of {label, dataset_uri, num_fewshot (an int, or a list whose first
                         entry counts), icl_task_type, continuation_delimiter (default " ")}
    eval_data/<uri>      one JSON object per line, by task type:
                           multiple_choice    {"query", "choices": [str, ...], "gold": index}
                           schema             {"context_options": [str, ...], "continuation", "gold": index}
                           language_modeling  {"context", "continuation"}
    eval_meta_data.csv   columns "Eval Task" (a label) and "Random baseline" (percent)

Scoring, as the reference implementation does it: multiple choice picks the choice whose tokens after the
choices' common prefix have the lowest mean loss; schema picks the context under which the shared
continuation (the options' common token suffix) has the lowest mean loss; language modelling is right when
greedy decoding reproduces every continuation token. Few-shot examples (gold answers filled in) are drawn
per example with a fixed seed and never include the example itself, and are joined by blank lines.
Centered accuracy = (acc - b) / (1 - b), b the random baseline as a fraction; CORE = the mean over tasks.

Shapes are static, as Neuron wants them: every row is BOS plus the prompt, left-truncated to seq_len
(BOS kept) and right-padded with BOS, and batches hold exactly batch_size rows, one forward each. Examples
are taken round-robin across tasks (each task's examples in a fixed shuffled order), so a run cut short by
its time limit has scored a similar share of every task. Under torch.distributed each rank scores every
world_size-th example and the per-task counts are summed once at the end.
"""

from __future__ import annotations

import csv
import json
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from model.dataio import DataError

__all__ = ["KINDS", "CoreResult", "Task", "evaluate_core", "fewshot_indices", "fit_row", "load_bundle",
           "task_rows"]

KINDS = ("multiple_choice", "schema", "language_modeling")
SELECT_SEED = 1337  # the fixed order in which a task's examples are taken (max_examples takes a prefix)
FEWSHOT_SEED = 1234  # example i draws its few-shot examples with Random(FEWSHOT_SEED + i)
EXAMPLE_SEPARATOR = "\n\n"


class TextEncoder(Protocol):
    """What CORE needs of a tokenizer (model.tokenizer.Tokenizer and the kit's both qualify)."""

    bos_id: int

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Task:
    label: str
    kind: str
    num_fewshot: int
    delimiter: str
    baseline: float  # random baseline as a fraction
    examples: list[dict[str, Any]] = field(repr=False)


@dataclass
class CoreResult:
    core: float | None  # mean centered accuracy over the tasks with at least one scored example
    tasks: dict[str, float]  # label -> centered accuracy
    accuracy: dict[str, float]  # label -> raw accuracy
    examples: int  # scored examples, all tasks and ranks
    seconds: float
    complete: bool  # False when the time limit stopped the evaluation early

    def record(self) -> dict[str, Any]:
        """The trainer's record fields."""
        return {"core": self.core, "core_tasks": self.tasks, "core_seconds": self.seconds,
                "core_complete": self.complete, "core_examples": self.examples}


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
        out[label.strip()] = percent / 100.0
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
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DataError(path, f"cannot read task data: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise DataError(path, "task data is not UTF-8") from None
    examples = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ex = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}", f"malformed JSON line: {e.msg}") from None
        problem = _check_example(ex, kind)
        if problem:
            raise DataError(f"{path}:{n}", f"{kind} example {problem}")
        examples.append(ex)
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


def fewshot_indices(n: int, idx: int, k: int) -> list[int]:
    """k distinct example indices out of n, never idx, the same on every call and machine."""
    pool = [i for i in range(n) if i != idx]
    return random.Random(FEWSHOT_SEED + idx).sample(pool, min(k, len(pool)))


def _common_prefix(seqs: Sequence[Sequence[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs[1:]):
            return i
    return n


def _common_suffix(seqs: Sequence[Sequence[int]]) -> int:
    return _common_prefix([s[::-1] for s in seqs])


def _prompts(task: Task, idx: int) -> tuple[list[str], str]:
    """The full prompt of each option, and the prompt without the answer (multiple choice, language modelling)."""
    ex, d = task.examples[idx], task.delimiter
    shots = [task.examples[i] for i in fewshot_indices(len(task.examples), idx, task.num_fewshot)]
    if task.kind == "multiple_choice":
        head = "".join(f"{s['query']}{d}{s['choices'][s['gold']]}{EXAMPLE_SEPARATOR}" for s in shots)
        return [f"{head}{ex['query']}{d}{c}" for c in ex["choices"]], f"{head}{ex['query']}{d}"
    if task.kind == "schema":
        head = "".join(f"{s['context_options'][s['gold']]}{d}{s['continuation']}{EXAMPLE_SEPARATOR}"
                       for s in shots)
        return [f"{head}{c}{d}{ex['continuation']}" for c in ex["context_options"]], ""
    head = "".join(f"{s['context'].strip()}{d}{s['continuation']}{EXAMPLE_SEPARATOR}" for s in shots)
    context = f"{head}{ex['context'].strip()}{d}"
    # Trailing whitespace would merge into the continuation's first token and break the prefix.
    return [context + ex["continuation"]], context.strip()


def task_rows(task: Task, idx: int, tok: TextEncoder) -> list[tuple[list[int], int, int]]:
    """(tokens with BOS first, start, end) per option: tokens[start:end] are the scored continuation."""
    prompts, context = _prompts(task, idx)
    seqs = [[tok.bos_id, *tok.encode(p)] for p in prompts]
    if task.kind == "schema":
        shared = max(1, min(_common_suffix(seqs), min(len(s) for s in seqs) - 1))
        return [(s, len(s) - shared, len(s)) for s in seqs]
    # Tokenised whole, the answer starts where the options' tokens part (or where the context's end).
    others = seqs if len(seqs) > 1 else [[tok.bos_id, *tok.encode(context)], *seqs]
    start = _common_prefix(others)
    # Every option keeps at least one scored token, and BOS is never scored.
    return [(s, max(1, min(start, len(s) - 1)), len(s)) for s in seqs]


def fit_row(tokens: Sequence[int], start: int, end: int, seq_len: int, bos_id: int) -> tuple[list[int], int, int]:
    """Left-truncate to seq_len keeping BOS first, then right-pad with BOS; start/end follow the shift.

    A continuation longer than the row loses its own first tokens (start is at least 1).
    """
    cut = max(0, len(tokens) - seq_len)
    if cut:
        tokens = [tokens[0], *tokens[cut + 1:]]
        start, end = max(1, start - cut), end - cut
    return [*tokens, *[bos_id] * (seq_len - len(tokens))], start, end


# --- scoring -----------------------------------------------------------------------------------------------


def _order(tasks: Sequence[Task], max_examples: int) -> list[tuple[int, int]]:
    """(task, example) pairs: each task's examples in a fixed shuffle (the first max_examples if > 0),
    interleaved round-robin across tasks."""
    per_task = []
    for t in tasks:
        idx = list(range(len(t.examples)))
        random.Random(SELECT_SEED).shuffle(idx)
        per_task.append(idx[:max_examples] if max_examples > 0 else idx)
    longest = max((len(p) for p in per_task), default=0)
    return [(ti, p[j]) for j in range(longest) for ti, p in enumerate(per_task) if j < len(p)]


@torch.no_grad()
def _score_batch(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, autocast) -> torch.Tensor:
    """(2, B) on the host: mean loss over each row's masked targets, and 1.0 where greedy matches them all."""
    with autocast:
        logits = model(x)
    logits = logits[:, :-1].float()
    targets = x[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    nll = nll.view_as(targets)
    m = mask[:, 1:]
    mean = (nll * m).sum(1) / m.sum(1).clamp(min=1)
    match = ((logits.argmax(-1) == targets) | ~m).all(1)
    return torch.stack([mean, match.float()]).cpu()


class _Pending:
    """Rows of one example awaiting their scores."""

    __slots__ = ("task", "idx", "left", "scores")

    def __init__(self, task: int, idx: int, n_rows: int) -> None:
        self.task, self.idx, self.left = task, idx, n_rows
        self.scores: list[tuple[float, float]] = [(math.nan, 0.0)] * n_rows


def _rows(tasks: Sequence[Task], order: Sequence[tuple[int, int]], tok: TextEncoder, seq_len: int
          ) -> Iterator[tuple[_Pending, int, list[int], int, int]]:
    """Lazily, so that tokenising counts against the time limit too."""
    for ti, idx in order:
        rows = task_rows(tasks[ti], idx, tok)
        pending = _Pending(ti, idx, len(rows))
        for r, (tokens, start, end) in enumerate(rows):
            yield (pending, r, *fit_row(tokens, start, end, seq_len, tok.bos_id))


def _is_correct(task: Task, pending: _Pending) -> bool:
    if task.kind == "language_modeling":
        return pending.scores[0][1] == 1.0
    losses = [s[0] for s in pending.scores]
    return losses.index(min(losses)) == task.examples[pending.idx]["gold"]


def evaluate_core(
    model: torch.nn.Module,
    tokenizer: TextEncoder,
    tasks: Sequence[Task],
    *,
    seq_len: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    autocast=None,
    max_seconds: float = 3600.0,
    max_examples: int = 0,
    rank: int = 0,
    world_size: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> CoreResult:
    """Score `model` (ids (B, T) -> logits (B, T, V)) on `tasks`; see the module doc.

    Stops before a batch that would end past max_seconds (judged by the last batch's time) and then
    reports what it scored with complete=False. max_examples > 0 limits each task to that many examples.
    autocast: a context manager for the forward (None: none); clock: seconds, replaceable in tests.
    """
    t0 = clock()
    was_training = model.training
    model.eval()
    try:
        counts = _score_all(model, tokenizer, tasks, _order(tasks, max_examples)[rank::world_size], seq_len,
                            batch_size, torch.device(device), autocast, max_seconds, clock, t0)
    finally:
        model.train(was_training)
    if dist.is_available() and dist.is_initialized() and world_size > 1:
        reduced = counts.to(device)
        dist.all_reduce(reduced)
        counts = reduced.cpu()
    return _result(tasks, counts, clock() - t0)


def _score_all(model: torch.nn.Module, tokenizer: TextEncoder, tasks: Sequence[Task],
               order: Sequence[tuple[int, int]], seq_len: int, batch_size: int, device: torch.device, autocast,
               max_seconds: float, clock: Callable[[], float], t0: float) -> torch.Tensor:
    """(tasks + 1, 2) float32: per task (correct, scored); the last row's first entry is 1 if time ran out."""
    autocast = autocast if autocast is not None else torch.autocast("cpu", enabled=False)
    counts = torch.zeros(len(tasks) + 1, 2, dtype=torch.float32)
    rows = _rows(tasks, order, tokenizer, seq_len)
    last_batch_s = 0.0
    while True:
        t_batch = clock()
        batch = [r for _, r in zip(range(batch_size), rows, strict=False)]
        if not batch:
            return counts
        if clock() - t0 + last_batch_s > max_seconds:
            counts[-1, 0] = 1.0
            return counts
        x = torch.full((batch_size, seq_len), tokenizer.bos_id, dtype=torch.long)
        mask = torch.zeros(batch_size, seq_len, dtype=torch.bool)
        for b, (_, _, ids, start, end) in enumerate(batch):
            x[b] = torch.tensor(ids, dtype=torch.long)
            mask[b, start:end] = True
        scores = _score_batch(model, x.to(device), mask.to(device), autocast)
        for b, (pending, r, *_rest) in enumerate(batch):
            pending.scores[r] = (float(scores[0, b]), float(scores[1, b]))
            pending.left -= 1
            if pending.left == 0:
                counts[pending.task, 0] += _is_correct(tasks[pending.task], pending)
                counts[pending.task, 1] += 1
        last_batch_s = clock() - t_batch


def _result(tasks: Sequence[Task], counts: torch.Tensor, seconds: float) -> CoreResult:
    accuracy, centered = {}, {}
    for t, (correct, scored) in zip(tasks, counts[:-1].tolist(), strict=True):
        if scored:
            accuracy[t.label] = correct / scored
            centered[t.label] = (accuracy[t.label] - t.baseline) / (1.0 - t.baseline)
    core = sum(centered.values()) / len(centered) if centered else None
    return CoreResult(core=core, tasks=centered, accuracy=accuracy, examples=int(counts[:-1, 1].sum()),
                      seconds=seconds, complete=not counts[-1, 0] and len(centered) == len(tasks))
