"""CORE: accuracy on in-context learning tasks, centered by each task's random baseline (half of phase 2's score).

The bundle is read by model.core_bundle (its format is described there).

Scoring, as the reference implementation does it: multiple choice picks the choice whose tokens after the
choices' common prefix have the lowest mean loss; schema picks the context under which the shared
continuation (the options' common token suffix) has the lowest mean loss; language modelling is right when
greedy decoding reproduces every continuation token. Few-shot examples (gold answers filled in) are drawn
per example with a fixed seed and never include the example itself, and are joined by blank lines.
Centered accuracy = (acc - b) / (1 - b), b the random baseline as a fraction; CORE = the mean over tasks.

Shapes are static, as Neuron wants them, and few (each length is one more compiled graph): every row is
BOS plus the prompt, and waits for the shortest of a few fixed lengths (buckets: seq_len, seq_len/2, ...
down to a floor) that holds it, else is left-truncated to seq_len (BOS kept); it is right-padded with BOS to
its batch's length. Batches hold exactly batch_size rows, one forward each; a batch run part-filled is
topped up with the oldest rows waiting for shorter lengths, then with dummy rows. The model is causal, so
right padding leaves every scored position's logits as they are: the scores equal those of padding every
row to seq_len (buckets=1), at a fraction of the compute.

Examples are taken round-robin across tasks (each task's examples in a fixed shuffled order), so a run cut
short by its time limit has scored a similar share of every task. A bucket runs when full, but a row waiting
in a slowly filling bucket would let other tasks run ahead; so before a full batch runs, every bucket whose
oldest row is LAG_ROUNDS or more rounds older than the newest row read runs first, part-filled. Whenever
the time limit stops the evaluation, if the newest example scored is from round j, every example of rounds
up to j - LAG_ROUNDS has been scored: the tasks' counts differ by at most LAG_ROUNDS. Under
torch.distributed each rank scores every world_size-th example and the per-task counts are summed once at
the end.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.core_bundle import KINDS, Task, load_bundle

__all__ = ["KINDS", "CoreResult", "Task", "bucket_lengths", "evaluate_core", "fewshot_indices", "fit_row",
           "load_bundle", "task_rows"]  # KINDS, Task, load_bundle: from model.core_bundle

SELECT_SEED = 1337  # the fixed order in which a task's examples are taken (max_examples takes a prefix)
FEWSHOT_SEED = 1234  # example i draws its few-shot examples with Random(FEWSHOT_SEED + i)
EXAMPLE_SEPARATOR = "\n\n"
DEFAULT_BUCKETS = 4  # row lengths seq_len, /2, /4, /8: most rows of a 2048-token context fit in a short one
MIN_BUCKET = 64  # no bucket shorter: below it a forward saves little, and every length is one more graph
LAG_ROUNDS = 4  # how many rounds a slowly filling bucket may fall behind before it runs part-filled


class TextEncoder(Protocol):
    """What CORE needs of a tokenizer (model.data.tokenizer.Tokenizer and the kit's both qualify)."""

    bos_id: int

    def encode(self, text: str) -> list[int]: ...


@dataclass
class CoreResult:
    core: float | None  # mean centered accuracy over the tasks with at least one scored example
    tasks: dict[str, float]  # label -> centered accuracy
    accuracy: dict[str, float]  # label -> raw accuracy
    examples: int  # scored examples, all tasks and ranks
    seconds: float
    complete: bool  # False when the time limit stopped the evaluation early
    scored: dict[str, int] = field(default_factory=dict)  # label -> examples scored, all ranks
    shapes: list[tuple[int, int]] = field(default_factory=list)  # (rows, length) of the batches run, this rank
    padding: float = 0.0  # share of the token positions fed that were padding, dummy rows included, this rank

    def record(self) -> dict[str, Any]:
        """The trainer's record fields."""
        return {"core": self.core, "core_tasks": self.tasks, "core_seconds": self.seconds,
                "core_complete": self.complete, "core_examples": self.examples}


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


def bucket_lengths(seq_len: int, buckets: int, min_length: int = MIN_BUCKET) -> list[int]:
    """The row lengths, ascending: seq_len halved up to buckets - 1 times, none below min_length (or seq_len)."""
    if buckets < 1 or min_length < 1:
        raise ValueError(f"buckets and min_length must be at least 1, got {buckets} and {min_length}")
    floor = min(min_length, seq_len)
    return sorted({max(floor, seq_len >> k) for k in range(min(buckets, seq_len.bit_length()))})


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


def _order(tasks: Sequence[Task], max_examples: int) -> list[tuple[int, int, int]]:
    """(round, task, example) triples: each task's examples in a fixed shuffle (the first max_examples if
    > 0), interleaved round-robin across tasks; round j holds every task's j-th example."""
    per_task = []
    for t in tasks:
        idx = list(range(len(t.examples)))
        random.Random(SELECT_SEED).shuffle(idx)
        per_task.append(idx[:max_examples] if max_examples > 0 else idx)
    longest = max((len(p) for p in per_task), default=0)
    return [(j, ti, p[j]) for j in range(longest) for ti, p in enumerate(per_task) if j < len(p)]


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


class _Row(NamedTuple):
    pending: _Pending
    option: int  # which of the example's rows
    tokens: list[int]  # BOS first, neither truncated nor padded
    start: int
    end: int
    round: int


def _rows(tasks: Sequence[Task], order: Sequence[tuple[int, int, int]], tok: TextEncoder) -> Iterator[_Row]:
    """Lazily, so that tokenising counts against the time limit too."""
    for j, ti, idx in order:
        rows = task_rows(tasks[ti], idx, tok)
        pending = _Pending(ti, idx, len(rows))
        for r, (tokens, start, end) in enumerate(rows):
            yield _Row(pending, r, tokens, start, end, j)


def _batches(rows: Iterator[_Row], lengths: Sequence[int], batch_size: int) -> Iterator[tuple[int, list[_Row]]]:
    """(length, rows) in the order to run them. Each row waits in the shortest bucket that holds it. When a
    bucket fills, every bucket whose oldest row is LAG_ROUNDS rounds older than the newest row runs first,
    longest first, then the full one; at the end what is left runs, longest first. A part-filled batch is
    topped up with the oldest rows waiting in shorter buckets: a dummy row would cost as much."""
    waiting: dict[int, list[tuple[int, _Row]]] = {n: [] for n in lengths}  # (arrival, row), oldest first

    def take(n: int) -> list[_Row]:
        own, waiting[n] = waiting[n], []
        extra = list(islice(heapq.merge(*(waiting[m] for m in lengths if m < n)), batch_size - len(own)))
        taken = {seq for seq, _ in extra}
        for m in lengths:
            if m < n:
                waiting[m] = [w for w in waiting[m] if w[0] not in taken]
        return [row for _, row in own + extra]

    for seq, row in enumerate(rows):
        length = next((n for n in lengths if len(row.tokens) <= n), lengths[-1])
        waiting[length].append((seq, row))
        if len(waiting[length]) < batch_size:
            continue
        for n in [*(m for m in reversed(lengths) if m != length), length]:
            w = waiting[n]
            if w and (len(w) >= batch_size or w[0][1].round <= row.round - LAG_ROUNDS):
                yield n, take(n)
    for n in reversed(lengths):
        while waiting[n]:
            yield n, take(n)


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
    buckets: int = DEFAULT_BUCKETS,
    min_bucket: int = MIN_BUCKET,
    device: torch.device | str = "cpu",
    autocast=None,
    max_seconds: float = 3600.0,
    max_examples: int = 0,
    rank: int = 0,
    world_size: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> CoreResult:
    """Score `model` (ids (B, T) -> logits (B, T, V), causal) on `tasks`; see the module doc.

    Rows are padded to bucket_lengths(seq_len, buckets, min_bucket); buckets=1 pads every row to seq_len.
    Stops before a batch that would end past max_seconds (judged by the time of the last batch of the same
    length, or of any length before the first) and then reports what it scored with complete=False.
    max_examples > 0 limits each task to that many examples. autocast: a context manager for the forward
    (None: none); clock: seconds, replaceable in tests.
    """
    t0 = clock()
    lengths = bucket_lengths(seq_len, buckets, min_bucket)
    was_training = model.training
    model.eval()
    try:
        counts, fed = _score_all(model, tokenizer, tasks, _order(tasks, max_examples)[rank::world_size], lengths,
                                 batch_size, torch.device(device), autocast, max_seconds, clock, t0)
    finally:
        model.train(was_training)
    if dist.is_available() and dist.is_initialized() and world_size > 1:
        reduced = counts.to(device)
        dist.all_reduce(reduced)
        counts = reduced.cpu()
    return _result(tasks, counts, fed, batch_size, clock() - t0)


def _score_all(model: torch.nn.Module, tokenizer: TextEncoder, tasks: Sequence[Task],
               order: Sequence[tuple[int, int, int]], lengths: Sequence[int], batch_size: int, device: torch.device,
               autocast, max_seconds: float, clock: Callable[[], float], t0: float
               ) -> tuple[torch.Tensor, dict[int, list[int]]]:
    """Counts, (tasks + 1, 2) float32: per task (correct, scored), and a last row whose first entry is 1 if
    time ran out; and per bucket length [batches run, real tokens fed]."""
    autocast = autocast if autocast is not None else torch.autocast("cpu", enabled=False)
    counts = torch.zeros(len(tasks) + 1, 2, dtype=torch.float32)
    fed: dict[int, list[int]] = {}
    last_s: dict[int, float] = {}  # per length, the last batch's seconds
    last_any = 0.0
    for length, batch in _batches(_rows(tasks, order, tokenizer), lengths, batch_size):
        t_batch = clock()
        if t_batch - t0 + last_s.get(length, last_any) > max_seconds:
            counts[-1, 0] = 1.0
            break
        x = torch.full((batch_size, length), tokenizer.bos_id, dtype=torch.long)
        mask = torch.zeros(batch_size, length, dtype=torch.bool)
        real = 0
        for b, row in enumerate(batch):
            ids, start, end = fit_row(row.tokens, row.start, row.end, length, tokenizer.bos_id)
            x[b] = torch.tensor(ids, dtype=torch.long)
            mask[b, start:end] = True
            real += min(len(row.tokens), length)
        scores = _score_batch(model, x.to(device), mask.to(device), autocast)
        for b, row in enumerate(batch):
            pending = row.pending
            pending.scores[row.option] = (float(scores[0, b]), float(scores[1, b]))
            pending.left -= 1
            if pending.left == 0:
                counts[pending.task, 0] += _is_correct(tasks[pending.task], pending)
                counts[pending.task, 1] += 1
        tally = fed.setdefault(length, [0, 0])
        tally[0] += 1
        tally[1] += real
        last_any = last_s[length] = clock() - t_batch
    return counts, fed


def _result(tasks: Sequence[Task], counts: torch.Tensor, fed: dict[int, list[int]], batch_size: int,
            seconds: float) -> CoreResult:
    accuracy, centered = {}, {}
    for t, (correct, scored) in zip(tasks, counts[:-1].tolist(), strict=True):
        if scored:
            accuracy[t.label] = correct / scored
            centered[t.label] = (accuracy[t.label] - t.baseline) / (1.0 - t.baseline)
    core = sum(centered.values()) / len(centered) if centered else None
    positions = sum(n * batch_size * length for length, (n, _) in fed.items())
    padding = 1.0 - sum(real for _, real in fed.values()) / positions if positions else 0.0
    return CoreResult(core=core, tasks=centered, accuracy=accuracy, examples=int(counts[:-1, 1].sum()),
                      seconds=seconds, complete=not counts[-1, 0] and len(centered) == len(tasks),
                      scored={t.label: int(n) for t, n in zip(tasks, counts[:-1, 1].tolist(), strict=True)},
                      shapes=[(batch_size, length) for length in sorted(fed)], padding=padding)
