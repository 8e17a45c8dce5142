"""CORE: accuracy on in-context learning tasks, centered by each task's random baseline (half of phase 2's score).

The bundle is read by model.core_bundle (its format is described there).

Scoring is the reference's, example by example: nanochat's core_eval.py as its scripts/base_eval.py drives
it (tests/model/test_core_reference.py works each convention out by hand).
- Order and few-shot examples: a task's examples are shuffled with Random(SELECT_SEED), and max_examples > 0
  keeps the first that many (reference_order); the example at position j of that list draws its few-shot
  examples with Random(FEWSHOT_SEED + j).sample(every other position, k), from the examples kept
  (fewshot_indices). They carry their gold answers and are joined by blank lines.
- Rows: BOS, then the whole prompt tokenised at once. Multiple choice scores each choice's tokens after the
  choices' common token prefix; schema, the options' common token suffix (the continuation) under each
  context; language modelling, the tokens after the prompt without the continuation (stripped). A row longer
  than seq_len (the reference's max_seq_len) keeps its last seq_len tokens, BOS dropped, its span shifted.
- An empty span (a choice that is a token prefix of another, a schema with no shared suffix, an answer whose
  first token lands on the row's first position) has a NaN mean loss, and the pick is the reference's index
  of min() over the mean losses: option 0 when its loss is NaN, else the first option of least loss
  (reference_pick). Language modelling is right when greedy decoding reproduces every continuation token.
- Accuracy is a float32 mean, as the reference's; centered accuracy = (acc - b) / (1 - b), b = 0.01 x the
  random baseline in percent; CORE = the mean over tasks.
Where the reference would stop on an error (an answer that starts left of the kept tokens, a
language-modelling prompt that does not tokenise to a prefix of the full one, more few-shot examples asked
than a task has others, a blank line in a task file) this goes on, as cut_rows, task_rows, fewshot_indices
and model.core_bundle say.

What differs is how the work is done, and none of it changes an example's score (the picks are the same):
shapes are static, as Neuron wants them, and few (each length is one more compiled graph): every row waits
for the shortest of a few fixed lengths (buckets: seq_len, seq_len/2, ... down to a floor) that holds it,
else is cut to seq_len as above; it is right-padded with BOS to its batch's length (the reference pads an
example's rows to the longest of them). Batches hold exactly batch_size rows, one forward each; a batch run
part-filled is topped up with the oldest rows waiting for shorter lengths, then with dummy rows. The model is
causal, so right padding leaves every scored position's logits as they are: the scores equal those of padding
every row to seq_len (buckets=1), at a fraction of the compute.

Examples are taken round-robin across tasks (the reference scores one task after another), so a run cut
short by its time limit has scored a similar share of every task. A bucket runs when full, but a row waiting
in a slowly filling bucket would let other tasks run ahead; so before a full batch runs, every bucket whose
oldest row is LAG_ROUNDS or more rounds older than the newest row read runs first, part-filled. Whenever
the time limit stops the evaluation, if the newest example scored is from round j, every example of rounds
up to j - LAG_ROUNDS has been scored: the tasks' counts differ by at most LAG_ROUNDS. Under
torch.distributed each rank scores every world_size-th example of that order (the reference strides each
task's) and the per-task counts are summed once at the end.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from model.core_bundle import KINDS, Task, load_bundle

__all__ = ["KINDS", "CoreResult", "Task", "bucket_lengths", "cut_rows", "evaluate_core", "fewshot_indices",
           "load_bundle", "reference_order", "reference_pick", "reference_view",
           "task_rows"]  # KINDS, Task, load_bundle: from model.core_bundle

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
    # label -> {example's line in its file (0-based): the option picked (multiple choice, schema), or 1 if greedy
    # decoding reproduced the continuation else 0 (language modelling)}, this rank's examples
    picks: dict[str, dict[int, int]] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The trainer's record fields."""
        return {"core": self.core, "core_tasks": self.tasks, "core_seconds": self.seconds,
                "core_complete": self.complete, "core_examples": self.examples}


def reference_order(n: int, max_examples: int = 0) -> list[int]:
    """The order in which the reference takes a task's n examples (their indices in the file): shuffled with
    Random(SELECT_SEED), then the first max_examples if > 0."""
    order = list(range(n))
    random.Random(SELECT_SEED).shuffle(order)  # a shuffle's swaps depend only on the length: as of the examples
    return order[:max_examples] if max_examples > 0 else order


def reference_view(task: Task, max_examples: int = 0) -> tuple[Task, list[int]]:
    """The task as the reference scores it: its examples in reference_order (the few-shot examples are drawn
    from these, by position), and the file index of each."""
    order = reference_order(len(task.examples), max_examples)
    return replace(task, examples=[task.examples[i] for i in order]), order


def fewshot_indices(n: int, idx: int, k: int) -> list[int]:
    """k distinct positions out of n, never idx, the same on every call and machine: as the reference draws
    them (which would stop on k >= n; here that takes all the others)."""
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
    """The full prompt of each option, and (language modelling) the prompt without the answer."""
    ex, d = task.examples[idx], task.delimiter
    shots = [task.examples[i] for i in fewshot_indices(len(task.examples), idx, task.num_fewshot)]
    if task.kind == "multiple_choice":
        head = "".join(f"{s['query']}{d}{s['choices'][s['gold']]}{EXAMPLE_SEPARATOR}" for s in shots)
        return [f"{head}{ex['query']}{d}{c}" for c in ex["choices"]], ""
    if task.kind == "schema":
        head = "".join(f"{s['context_options'][s['gold']]}{d}{s['continuation']}{EXAMPLE_SEPARATOR}"
                       for s in shots)
        return [f"{head}{c}{d}{ex['continuation']}" for c in ex["context_options"]], ""
    head = "".join(f"{s['context'].strip()}{d}{s['continuation']}{EXAMPLE_SEPARATOR}" for s in shots)
    context = f"{head}{ex['context'].strip()}{d}"
    # Trailing whitespace would merge into the continuation's first token and break the prefix.
    return [context + ex["continuation"]], context.strip()


def task_rows(task: Task, idx: int, tok: TextEncoder) -> list[tuple[list[int], int, int]]:
    """(tokens with BOS first, start, end) per option: tokens[start:end] are the scored answer, maybe none.

    idx is a position in task.examples, and the few-shot examples come from task.examples: pass the view
    of reference_view() to draw them as the reference does. Each prompt is tokenised whole. Multiple
    choice: the answer starts where the options' tokens part, so a choice that is a token prefix of another
    has an empty span. Schema: the answer is the options' common token suffix, empty when there is none.
    Language modelling: the answer starts where the prompt without the continuation ends (where the two
    part, should that prompt not be a token prefix: the reference stops on an assertion there). A span
    that would take in BOS (schema options all alike) is empty, as the reference's slice from -1 is.
    """
    prompts, context = _prompts(task, idx)
    seqs = [[tok.bos_id, *tok.encode(p)] for p in prompts]
    if task.kind == "schema":
        starts = [len(s) - _common_suffix(seqs) for s in seqs]
    elif task.kind == "multiple_choice":
        starts = [_common_prefix(seqs)] * len(seqs)
    else:
        starts = [_common_prefix([[tok.bos_id, *tok.encode(context)], *seqs])]
    return [(s, start if start >= 1 else len(s), len(s)) for s, start in zip(seqs, starts, strict=True)]


def bucket_lengths(seq_len: int, buckets: int, min_length: int = MIN_BUCKET) -> list[int]:
    """The row lengths, ascending: seq_len halved up to buckets - 1 times, none below min_length (or seq_len)."""
    if buckets < 1 or min_length < 1:
        raise ValueError(f"buckets and min_length must be at least 1, got {buckets} and {min_length}")
    floor = min(min_length, seq_len)
    return sorted({max(floor, seq_len >> k) for k in range(min(buckets, seq_len.bit_length()))})


def cut_rows(kind: str, rows: Sequence[tuple[list[int], int, int]], seq_len: int
             ) -> list[tuple[list[int], int, int]]:
    """An example's rows (task_rows) as the reference feeds them to a model whose max_seq_len is seq_len: a
    longer row keeps its last seq_len tokens, BOS dropped, and its span shifts with them.

    An answer whose first token lands on the row's first position has nothing before it to predict it from:
    its span is empty (start == end), as the reference's slice from start - 1 = -1 is. Where the reference
    stops instead (an answer that starts left of the window, or for language modelling on its first
    position: an assertion, a shape mismatch), every row of the example is scored on what fits, its answer
    from the row's second position on.
    """
    least = 1 if kind == "language_modeling" else 0
    beyond = any(start - max(0, len(tokens) - seq_len) < least for tokens, start, _ in rows)
    out = []
    for tokens, start, end in rows:
        cut = max(0, len(tokens) - seq_len)
        if cut:
            tokens, start, end = tokens[cut:], start - cut, end - cut
            if start < 1:
                start = min(1, end) if beyond else end
        out.append((tokens, start, end))
    return out


# --- scoring -----------------------------------------------------------------------------------------------


def _order(views: Sequence[Task]) -> list[tuple[int, int, int]]:
    """(round, task, position) triples over the reference views, interleaved round-robin across tasks: round
    j holds every task's j-th example."""
    longest = max((len(t.examples) for t in views), default=0)
    return [(j, ti, j) for j in range(longest) for ti, t in enumerate(views) if j < len(t.examples)]


@torch.no_grad()
def _score_batch(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, autocast) -> torch.Tensor:
    """(2, B) on the host: mean loss over each row's masked targets (NaN where none, as the mean of an empty
    slice is), and 1.0 where there are some and greedy decoding reproduces them all."""
    with autocast:
        logits = model(x)
    logits = logits[:, :-1].float()
    targets = x[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    nll = nll.view_as(targets)
    m = mask[:, 1:]
    mean = torch.where(m, nll, 0.0).sum(1) / m.sum(1)
    match = ((logits.argmax(-1) == targets) | ~m).all(1) & m.any(1)
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
    tokens: list[int]  # as cut_rows leaves them (at most seq_len, BOS first unless cut), not padded
    start: int
    end: int
    round: int


def _rows(tasks: Sequence[Task], order: Sequence[tuple[int, int, int]], tok: TextEncoder, seq_len: int
          ) -> Iterator[_Row]:
    """Lazily, so that tokenising counts against the time limit too."""
    for j, ti, idx in order:
        rows = cut_rows(tasks[ti].kind, task_rows(tasks[ti], idx, tok), seq_len)
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


def reference_pick(losses: Sequence[float]) -> int:
    """The option the reference picks from mean losses, NaN for an empty span: it takes the index of min()
    over the list, and min() keeps its first item until a smaller one comes, which NaN never is nor is
    smaller than. So: option 0 when its loss is NaN, else the first option of least loss among the numbers."""
    if math.isnan(losses[0]):
        return 0
    best = min(x for x in losses if not math.isnan(x))
    return next(i for i, x in enumerate(losses) if x == best)


def _pick(task: Task, pending: _Pending) -> int:
    """The option picked (multiple choice, schema); language modelling: 1 if greedy reproduced it, else 0."""
    if task.kind == "language_modeling":
        return int(pending.scores[0][1] == 1.0)
    return reference_pick([s[0] for s in pending.scores])


def _is_correct(task: Task, pending: _Pending, pick: int) -> bool:
    return pick == (1 if task.kind == "language_modeling" else task.examples[pending.idx]["gold"])


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
    max_examples > 0 limits each task to the first that many of reference_order (few-shot examples are then
    drawn from those only, as in the reference). autocast: a context manager for the forward (None: none);
    clock: seconds, replaceable in tests. seq_len is also the reference's max_seq_len (cut_rows).
    """
    t0 = clock()
    lengths = bucket_lengths(seq_len, buckets, min_bucket)
    views, orders = zip(*(reference_view(t, max_examples) for t in tasks), strict=True) if tasks else ((), ())
    was_training = model.training
    model.eval()
    try:
        counts, fed, picks = _score_all(model, tokenizer, views, _order(views)[rank::world_size], lengths,
                                        batch_size, torch.device(device), autocast, max_seconds, clock, t0)
    finally:
        model.train(was_training)
    if dist.is_available() and dist.is_initialized() and world_size > 1:
        reduced = counts.to(device)
        dist.all_reduce(reduced)
        counts = reduced.cpu()
    result = _result(tasks, counts, fed, batch_size, clock() - t0)
    result.picks = {t.label: dict(sorted((order[pos], pick) for pos, pick in p.items()))
                    for t, order, p in zip(tasks, orders, picks, strict=True)}
    return result


def _score_all(model: torch.nn.Module, tokenizer: TextEncoder, tasks: Sequence[Task],
               order: Sequence[tuple[int, int, int]], lengths: Sequence[int], batch_size: int, device: torch.device,
               autocast, max_seconds: float, clock: Callable[[], float], t0: float
               ) -> tuple[torch.Tensor, dict[int, list[int]], list[dict[int, int]]]:
    """Counts, (tasks + 1, 2) float32: per task (correct, scored), and a last row whose first entry is 1 if
    time ran out; per bucket length [batches run, real tokens fed]; per task, position -> pick (this rank)."""
    autocast = autocast if autocast is not None else torch.autocast("cpu", enabled=False)
    counts = torch.zeros(len(tasks) + 1, 2, dtype=torch.float32)
    fed: dict[int, list[int]] = {}
    picks: list[dict[int, int]] = [{} for _ in tasks]
    last_s: dict[int, float] = {}  # per length, the last batch's seconds
    last_any = 0.0
    seq_len = lengths[-1]  # the longest
    for length, batch in _batches(_rows(tasks, order, tokenizer, seq_len), lengths, batch_size):
        t_batch = clock()
        if t_batch - t0 + last_s.get(length, last_any) > max_seconds:
            counts[-1, 0] = 1.0
            break
        x = torch.full((batch_size, length), tokenizer.bos_id, dtype=torch.long)
        mask = torch.zeros(batch_size, length, dtype=torch.bool)
        real = 0
        for b, row in enumerate(batch):  # right-padded with BOS, as x was filled
            x[b, :len(row.tokens)] = torch.tensor(row.tokens, dtype=torch.long)
            mask[b, row.start:row.end] = True
            real += len(row.tokens)
        scores = _score_batch(model, x.to(device), mask.to(device), autocast)
        for b, row in enumerate(batch):
            pending = row.pending
            pending.scores[row.option] = (float(scores[0, b]), float(scores[1, b]))
            pending.left -= 1
            if pending.left == 0:
                task = tasks[pending.task]
                pick = picks[pending.task][pending.idx] = _pick(task, pending)
                counts[pending.task, 0] += _is_correct(task, pending, pick)
                counts[pending.task, 1] += 1
        tally = fed.setdefault(length, [0, 0])
        tally[0] += 1
        tally[1] += real
        last_any = last_s[length] = clock() - t_batch
    return counts, fed, picks


def _result(tasks: Sequence[Task], counts: torch.Tensor, fed: dict[int, list[int]], batch_size: int,
            seconds: float) -> CoreResult:
    accuracy, centered = {}, {}
    for t, (correct, scored) in zip(tasks, counts[:-1], strict=True):
        if scored:
            accuracy[t.label] = (correct / scored).item()  # float32, as the reference's mean of a float32 tensor
            centered[t.label] = (accuracy[t.label] - t.baseline) / (1.0 - t.baseline)
    core = sum(centered.values()) / len(centered) if centered else None
    positions = sum(n * batch_size * length for length, (n, _) in fed.items())
    padding = 1.0 - sum(real for _, real in fed.values()) / positions if positions else 0.0
    return CoreResult(core=core, tasks=centered, accuracy=accuracy, examples=int(counts[:-1, 1].sum()),
                      seconds=seconds, complete=not counts[-1, 0] and len(centered) == len(tasks),
                      scored={t.label: int(n) for t, n in zip(tasks, counts[:-1, 1].tolist(), strict=True)},
                      shapes=[(batch_size, length) for length in sorted(fed)], padding=padding)
