"""Adapter for the competition kit's `prepare.py`, so a sweep can measure exactly what the leaderboard does.

Two dialects, told apart by the names the module defines (`KitData.dialect`, recorded as `kit_dialect`):

"kit", the competition's own (docs/competition.md): `ensure_tokenizer()`, `make_dataloader(tokenizer, B, T,
split, device)` with splits "train" and "public_val", already split by rank (rank r reads its own rows: the
adapter never splits again), `evaluate_bpb(model, tokenizer, B, T, device, split=, max_tokens=,
timeout_seconds=) -> dict` (val_bpb, total_nats, num_tokens, num_bytes, eval_seconds, eval_timeout,
eval_over_timeout) at the context and token count the caller chooses, `causality_check(model, tokenizer, B,
T, device) -> {"passed", "max_abs_diff"}`, `record_step_boundary(step)` (the official clock reads its step
log) and `TOKENIZER_VOCAB_SIZE`. `KitData.score`, `causality` and `step_boundary` serve it.

"autoresearch", upstream autoresearch's prepare.py, the kit's closest public relative (a stand-in written to
its interface and semantics is sweep/studies/script-demo/prepare.py; tests/kit_standin builds copies of
it). What this adapter uses of it, and assumes no more of:
- a tokenizer: `get_tokenizer()` if defined, else `Tokenizer.from_directory()`; its methods
  get_vocab_size(), get_bos_token_id(), encode(str | list[str]) and decode(ids);
- `make_dataloader(tokenizer, B, T, split, ...)`, split "train" or "val": an endless iterator of
  (x (B, T), y (B, T) int64, state), x int32 or int64, both possibly views of buffers the next batch
  overwrites (the adapter copies what it keeps). Optional parameters are passed only when declared:
  `device` ("cpu"), `rank` and `world_size`;
- `get_token_bytes(device)`: int32 (vocab,) byte lengths, 0 for specials;
- `evaluate_bpb(model, tokenizer, batch_size)`: the leaderboard's metric, model(x, y, reduction="none")
  on rows of MAX_SEQ_LEN tokens; `device` only if declared;
- the constants MAX_SEQ_LEN and EVAL_TOKENS, when defined: the rows evaluate_bpb scores.
load_kit(path) imports it (path: prepare.py or its folder; default: $TRNSWEEP_KIT_PREPARE) and returns a
KitData with the members of model.data.Dataset that the trainer uses; BatchLoader, validation_batches and
scoring_set of model.data accept a KitData and come here.

Ranks. autoresearch's loader takes no rank: under torchrun every rank would read the same batches. So the
adapter asks whether the kit's first training batch differs between ranks (one collective, through the
caller's `same_on_all_ranks`); if it does not, it reads the kit's stream W*B rows at a time and gives rank
r rows [r*B, (r+1)*B) of each, so ranks are disjoint and together read exactly what one rank reads with
batch W*B (as model.data.loader does). Without `same_on_all_ranks` it goes by the signature: a loader
that declares `rank` or `world_size` splits, one that does not is split here.

The final evaluation scores the rows the kit's evaluate_bpb scores, (EVAL_TOKENS // (B*T)) * B rows of
T = MAX_SEQ_LEN from the start of the validation stream, read as the kit's loader gives them, or a fixed
uniform sample of them (model.data.rows). A kit that does not say which rows it scores (no MAX_SEQ_LEN or
EVAL_TOKENS), or whose validation stream is split across ranks out of the adapter's reach, is scored by
its own evaluate_bpb (`evaluate`), on every rank. Other deviations forced by the kit: batches cannot be
resumed except by replaying them (a position resumes by skipping position / (B*W) batches), the seed is
the kit's own, and x, y are separate tensors rather than views of one row.

Long file: one adapter speaks both of the kit's dialects, whose pieces (tokenizer, batches, scoring) pair up
and read best side by side.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from model.data.files import DataError, digest
from model.data.rows import IGNORE_INDEX, ScoringSet, batch_rows, sample_indices
from model.data.tokenizer import Tokenizer, special_tokens

__all__ = ["ENV_VAR", "KitBatchLoader", "KitData", "KitTokenizer", "batch_digest", "dialect_of", "load_kit"]

ENV_VAR = "TRNSWEEP_KIT_PREPARE"
KIT, AUTORESEARCH = "kit", "autoresearch"  # the two dialects (see the module doc)
# The kit dialect's validation split (the official score reads a private one of the same shape).
KIT_VAL_SPLIT = "public_val"
_PROBE = "The kit's tokenizer, fingerprinted: 0123456789 — ünïcödé ✓"


def _call(fn: Callable[..., Any], *args: Any, **optional: Any) -> Any:
    """Call fn(*args, **the optional keywords fn declares)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(*args)
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return fn(*args, **{k: v for k, v in optional.items() if accepts_any or k in params})


class KitTokenizer:
    """The kit's tokenizer behind the interface of model.data.tokenizer.Tokenizer."""

    def __init__(self, kit_tokenizer: Any) -> None:
        self.kit = kit_tokenizer
        self.vocab_size = int(kit_tokenizer.get_vocab_size())
        self.bos_id = int(kit_tokenizer.get_bos_token_id())
        self._ours: Tokenizer | None = None
        enc = getattr(kit_tokenizer, "enc", None)
        specials = special_tokens(enc) if enc is not None else None
        if specials is not None:
            names = [n for n, i in specials.items() if i == self.bos_id]
            if names:
                self._ours = Tokenizer(enc, names[0], "kit")

    def encode(self, text: str) -> list[int]:
        return list(self.kit.encode(text))

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        return [list(ids) for ids in self.kit.encode(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self.kit.decode([int(i) for i in ids])

    def as_tokenizer(self) -> Tokenizer | None:
        """Our Tokenizer over the kit's tiktoken Encoding, when the kit exposes it (as `.enc`)."""
        return self._ours

    def save(self, path: str | os.PathLike[str]) -> Path:
        if self._ours is None:
            raise NotImplementedError("the kit's tokenizer exposes no tiktoken Encoding to save")
        return self._ours.save(path)

    @property
    def fingerprint(self) -> str:
        if self._ours is not None:
            return self._ours.fingerprint
        return digest(str(self.vocab_size), str(self.bos_id), repr(self.encode(_PROBE)), size=8)


SameOnAllRanks = Callable[[int], bool]  # a collective: is this integer the same on every rank?


def _declares(fn: Callable[..., Any], *names: str) -> bool:
    """Whether fn takes any of `names` as keywords (or takes **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) or any(n in params for n in names)


def batch_digest(x: torch.Tensor, y: torch.Tensor) -> int:
    """A 62-bit digest of a batch's tokens (fits an int64 collective)."""
    h = hashlib.sha256()
    for t in (x, y):
        h.update(t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 2


def _int_constant(module: ModuleType, name: str) -> int | None:
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(eq=False)
class KitData:
    """The kit's data behind the interface of model.data.Dataset (see the module doc)."""

    module: ModuleType
    path: Path
    tokenizer: KitTokenizer
    token_bytes: torch.Tensor = field(repr=False)
    fingerprint: str
    device: str = "cpu"
    is_kit = True
    # Who splits the kit's rows across ranks: "kit" (its loader gives each rank its own) or "adapter".
    split: str | None = None
    dialect: str = AUTORESEARCH  # KIT or AUTORESEARCH: which prepare.py this is (see the module doc)

    @property
    def val_split(self) -> str:
        """The validation split's name in this dialect."""
        return KIT_VAL_SPLIT if self.dialect == KIT else "val"

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def source(self) -> str:
        return f"kit:{self.path}"

    @property
    def eval_seq_len(self) -> int | None:
        """The kit's MAX_SEQ_LEN: the row length of its evaluate_bpb (None when it does not say)."""
        return _int_constant(self.module, "MAX_SEQ_LEN")

    @property
    def eval_tokens(self) -> int | None:
        """The kit's EVAL_TOKENS: how many tokens its evaluate_bpb scores (None when it does not say)."""
        return _int_constant(self.module, "EVAL_TOKENS")

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "fingerprint": self.fingerprint,
            "tokenizer": self.tokenizer.fingerprint,
            "vocab_size": self.vocab_size,
            "eval_seq_len": self.eval_seq_len,
            "eval_tokens": self.eval_tokens,
            "dialect": self.dialect,
        }

    @property
    def loader_takes_ranks(self) -> bool:
        if self.dialect == KIT:
            return True  # it reads the rank from the process group itself
        return _declares(self.module.make_dataloader, "rank", "world_size")

    def make_loader(
        self, batch_size: int, seq_len: int, split: str, rank: int = 0, world_size: int = 1
    ) -> Iterator:
        """The kit's own make_dataloader(tokenizer, B, T, split, ...), as it yields."""
        return _call(
            self.module.make_dataloader,
            self.tokenizer.kit,
            batch_size,
            seq_len,
            split,
            device=self.device,
            rank=rank,
            world_size=world_size,
        )

    def split_mode(
        self, batch_size: int, seq_len: int, rank: int, world_size: int,
        same_on_all_ranks: SameOnAllRanks | None = None,
    ) -> str:
        """"kit" when the kit's loader gives each rank rows of its own, else "adapter" (decided once; see the
        module doc). Every rank must call it at the same point when `same_on_all_ranks` is a collective."""
        if world_size == 1:
            return "adapter"  # one rank reads the whole stream either way
        if self.dialect == KIT:
            self.split = "kit"  # its make_dataloader is split by rank already: never split again
        if self.split is None:
            if same_on_all_ranks is None:
                self.split = "kit" if self.loader_takes_ranks else "adapter"
            else:
                x, y, _ = next(self.make_loader(batch_size, seq_len, "train", rank, world_size))
                self.split = "adapter" if same_on_all_ranks(batch_digest(x, y)) else "kit"
        return self.split

    def rows(self, split: str, seq_len: int, batch_size: int, wanted: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Rows `wanted` (sorted indices) of the kit's whole `split` stream read B rows at a time: (xs, ys)
        int64 (len(wanted), T), copies."""
        it = self.make_loader(batch_size, seq_len, split)
        xs = torch.empty((len(wanted), seq_len), dtype=torch.int64)
        ys = torch.empty((len(wanted), seq_len), dtype=torch.int64)
        k, first = 0, 0
        while k < len(wanted):
            x, y, _ = next(it)
            while k < len(wanted) and wanted[k] < first + batch_size:
                xs[k] = x[wanted[k] - first]
                ys[k] = y[wanted[k] - first]
                k += 1
            first += batch_size
        return xs, ys

    def validation_batches(
        self, batch_size: int, seq_len: int, n_tokens: int, rank: int = 0, world_size: int = 1,
        same_on_all_ranks: SameOnAllRanks | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Same shapes, rows and padding rule as model.data.validation_batches: the first max(1, n_tokens // T)
        rows of the kit's validation stream, shared across ranks."""
        n_rows = max(1, n_tokens // seq_len)
        if self.split_mode(batch_size, seq_len, rank, world_size, same_on_all_ranks) == "adapter":
            xs, ys = self.rows(self.val_split, seq_len, batch_size, range(n_rows))
            return batch_rows(xs, ys, batch_size, rank, world_size, self.bos_id)
        # The kit's loader gives this rank its own rows: take this rank's share of them.
        step = world_size * batch_size
        it = self.make_loader(batch_size, seq_len, self.val_split, rank, world_size)
        batches = []
        for start in range(0, n_rows, step):
            valid = max(0, min(batch_size, n_rows - start - rank * batch_size))
            x = torch.full((batch_size, seq_len), self.bos_id, dtype=torch.int64)
            y = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.int64)
            if valid:
                kx, ky, _ = next(it)
                x[:valid] = kx[:valid]
                y[:valid] = ky[:valid]
            batches.append((x, y))
        return batches

    def scoring_set(
        self, batch_size: int, sample_rows: int = 0, rank: int = 0, world_size: int = 1,
        same_on_all_ranks: SameOnAllRanks | None = None,
    ) -> ScoringSet | None:
        """The rows evaluate_bpb(model, tokenizer, batch_size) scores, or a fixed sample of `sample_rows` of them,
        split across ranks; None when the kit does not say which rows those are (score with `evaluate`)."""
        seq_len, tokens = self.eval_seq_len, self.eval_tokens
        if self.dialect == KIT or seq_len is None or tokens is None:
            return None
        mode = self.split_mode(batch_size, seq_len, rank, world_size, same_on_all_ranks)
        if mode == "kit" and not self.loader_takes_ranks:
            return None  # this rank's validation stream is its share, not the stream evaluate_bpb reads
        population = tokens // (batch_size * seq_len) * batch_size
        if population == 0:
            raise DataError(self.path, f"EVAL_TOKENS {tokens} is less than one batch of {batch_size} x {seq_len}")
        wanted = sample_indices(population, sample_rows)
        xs, ys = self.rows("val", seq_len, batch_size, wanted.tolist())
        batches = batch_rows(xs, ys, batch_size, rank, world_size, self.bos_id)
        return ScoringSet(batches, len(wanted), population, seq_len)

    def evaluate(self, model: torch.nn.Module, batch_size: int, device: Any = None, autocast: Any = None
                 ) -> tuple[float, dict[str, float]]:
        """The kit's own evaluate_bpb(model, tokenizer, batch_size), with the model on `device` (inputs moved
        there, losses moved back) under `autocast`; returns its figure and what the model saw: nats over
        targets of positive byte length, those targets, their bytes and the rows."""
        tally = _Tally(model, self.token_bytes, device, autocast)
        was_training = model.training
        model.eval()
        try:
            bpb = float(_call(self.module.evaluate_bpb, tally, self.tokenizer.kit, batch_size, device=self.device))
        finally:
            model.train(was_training)
        return bpb, tally.totals

    def evaluate_bpb(self, model: Any, batch_size: int) -> Any:
        """The kit's fixed metric, evaluate_bpb(model, tokenizer, batch_size), returned as is."""
        return _call(self.module.evaluate_bpb, model, self.tokenizer.kit, batch_size, device=self.device)

    # ---- the kit dialect's scorer, causality check and step log ----

    @contextlib.contextmanager
    def one_process(self) -> Iterator[None]:
        """While it lasts, the kit's get_dist_info() answers a single process, (False, 0, 0, 1), as it does
        in `prepare.py eval-public`: the kit's evaluate_bpb then reads the whole split on this rank rather
        than this rank's share, so a multi-rank run scores exactly what the official scorer scores."""
        original = getattr(self.module, "get_dist_info", None)
        if callable(original):
            self.module.get_dist_info = _single_process
        try:
            yield
        finally:
            if callable(original):
                self.module.get_dist_info = original

    @property
    def scores_alone(self) -> bool:
        """Whether one_process() can make the kit score as a single process (it defines get_dist_info)."""
        return callable(getattr(self.module, "get_dist_info", None))

    def score(self, model: torch.nn.Module, batch_size: int, seq_len: int, max_tokens: int,
              device: Any) -> dict[str, Any]:
        """The kit dialect's evaluate_bpb(model, tokenizer, B, T, device, split="public_val", max_tokens=N) on
        `model` in eval mode, called as `prepare.py eval-public` calls the submission's model (float32, no
        autocast of ours); returns the kit's dict as it is, its values made plain numbers."""
        self._require(KIT, "evaluate_bpb(model, tokenizer, B, T, device, ...)")
        was_training = model.training
        model.eval()
        try:
            got = self.module.evaluate_bpb(_Tally(model, self.token_bytes, None, None), self.tokenizer.kit,
                                           batch_size, seq_len, _device_name(device), split=self.val_split,
                                           max_tokens=max_tokens)
        finally:
            model.train(was_training)
        if not isinstance(got, dict) or "val_bpb" not in got:
            raise DataError(self.path, f"evaluate_bpb returned {type(got).__name__}, not a dict with val_bpb")
        return {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in got.items()}

    def causality(self, model: torch.nn.Module, batch_size: int, seq_len: int, device: Any) -> dict[str, Any] | None:
        """The kit's causality_check(model, tokenizer, B, T, device) -> {"passed", "max_abs_diff"}; None when
        the kit defines none."""
        check = getattr(self.module, "causality_check", None)
        if not callable(check):
            return None
        was_training = model.training
        model.eval()
        try:
            got = check(_Tally(model, self.token_bytes, None, None), self.tokenizer.kit, batch_size, seq_len,
                        _device_name(device))
        finally:
            model.train(was_training)
        return {"passed": bool(got["passed"]), "max_abs_diff": float(got["max_abs_diff"])}

    def step_boundary(self, step: int) -> None:
        """The kit's record_step_boundary(step), after each step's synchronise; nothing when it has none."""
        record = getattr(self.module, "record_step_boundary", None)
        if callable(record):
            record(step)

    def _require(self, dialect: str, what: str) -> None:
        if self.dialect != dialect:
            raise DataError(self.path, f"is a prepare.py of the {self.dialect} dialect: it has no {what}")


def _single_process() -> tuple[bool, int, int, int]:
    return False, 0, 0, 1


def _device_name(device: Any) -> str:
    """A device as the kit takes it: "cpu", "cuda:0", "neuron" (a string, as its command line passes it)."""
    return str(device) if device is not None else "cpu"


class _Tally(torch.nn.Module):
    """The model as the kit's evaluate_bpb calls it, counting what it scores (as model.evaluate does)."""

    def __init__(self, model: torch.nn.Module, token_bytes: torch.Tensor, device: Any, autocast: Any) -> None:
        super().__init__()
        self.model = model
        self.token_bytes = token_bytes.to("cpu", torch.int64)
        self.device = device
        self.autocast = autocast
        self.totals = {"nats": 0.0, "tokens": 0, "bytes": 0, "rows": 0}

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, reduction: str = "mean",
                loss_reduction: str | None = None) -> torch.Tensor:
        """Logits without targets; else the loss, per token (shaped as y) under either keyword teams' models
        take, reduction="none" (autoresearch's) or loss_reduction="none"."""
        reduction = loss_reduction or reduction
        device = self.device if self.device is not None else x.device
        xd = x.to(device, torch.int64)
        if y is None:
            if self.autocast is None:
                return self.model(xd)
            with self.autocast:
                return self.model(xd).float()
        yd = y.to(device, torch.int64)
        if self.autocast is None:
            loss = self.model(xd, yd, reduction=reduction)
        else:
            with self.autocast:
                loss = self.model(xd, yd, reduction=reduction)
        if reduction == "none":
            loss = loss.reshape(y.shape)
            yc = y.to("cpu", torch.int64).reshape(-1)
            nbytes = torch.where(yc >= 0, self.token_bytes[yc.clamp(min=0)], 0)
            counted = nbytes > 0
            self.totals["nats"] += float((loss.detach().double().cpu().reshape(-1) * counted).sum())
            self.totals["tokens"] += int(counted.sum())
            self.totals["bytes"] += int(nbytes.sum())
            self.totals["rows"] += int(y.shape[0])
        return loss.float().to(y.device)

    def grow_rotary(self, length: int) -> None:
        if hasattr(self.model, "grow_rotary"):
            self.model.grow_rotary(length)


class KitBatchLoader:
    """The kit's training loader behind BatchLoader's interface: next() -> (x, y) int64 CPU (B, T), copies.

    Ranks are split as the module doc says: by the kit when its loader does, else here (rank r takes rows
    [r*B, (r+1)*B) of each batch of W*B rows).
    """

    def __init__(
        self,
        kit: KitData,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        position: int = 0,
        seed: int = 0,
        *,
        same_on_all_ranks: SameOnAllRanks | None = None,
        **_ignored: Any,
    ) -> None:
        step = batch_size * world_size
        if position % step:
            raise ValueError(
                f"the kit's loader resumes only at whole steps: position {position} % {step} != 0"
            )
        self.kit = kit
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.seed = seed  # the kit's loader has no seed of ours; kept for the record
        self.state: Any = None
        self.split = kit.split_mode(batch_size, seq_len, rank, world_size, same_on_all_ranks)
        if self.split == "adapter":
            self._it = kit.make_loader(step, seq_len, "train")
            self._rows = slice(rank * batch_size, (rank + 1) * batch_size)
        else:
            self._it = kit.make_loader(batch_size, seq_len, "train", rank, world_size)
            self._rows = slice(0, batch_size)
        for _ in range(position // step):
            next(self._it)
        self.position = position

    def __iter__(self) -> KitBatchLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, self.state = next(self._it)
        self.position += self.batch_size * self.world_size
        # Copies: the kit may hand out views of buffers that its next batch overwrites.
        return (x[self._rows].to("cpu", torch.int64, copy=True),
                y[self._rows].to("cpu", torch.int64, copy=True))


_MODULES: dict[str, ModuleType] = {}


def _import(path: Path) -> ModuleType:
    key = str(path.resolve())
    if key in _MODULES:
        return _MODULES[key]
    for module in list(sys.modules.values()):  # imported already (a submission's `import prepare`): that one
        where = getattr(module, "__file__", None)
        if where and Path(where).resolve() == Path(key):
            _MODULES[key] = module
            return module
    name = "trnsweep_kit_" + hashlib.sha1(key.encode()).hexdigest()[:10]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise DataError(path, "cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))  # the kit may import its sibling files
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise DataError(path, f"import failed: {type(e).__name__}: {e}") from e
    finally:
        if str(path.parent) in sys.path:
            sys.path.remove(str(path.parent))
    _MODULES[key] = module
    return module


def load_kit(path: str | os.PathLike[str] | None = None, device: str = "cpu") -> KitData:
    """Import the kit's prepare.py (a file, its folder, or $TRNSWEEP_KIT_PREPARE) and wrap it."""
    where = path if path is not None else os.environ.get(ENV_VAR)
    if not where:
        raise DataError(ENV_VAR, "no kit: pass the path of prepare.py or set the environment variable")
    p = Path(where).expanduser()
    if p.is_dir():
        p = p / "prepare.py"
    if not p.is_file():
        raise DataError(p, "no such prepare.py")
    module = _import(p)
    dialect = dialect_of(module)
    for name in ("make_dataloader", "get_token_bytes", "evaluate_bpb"):
        if not callable(getattr(module, name, None)):
            raise DataError(p, f"prepare.py defines no {name}()")
    try:
        if dialect == KIT:
            kit_tok = module.ensure_tokenizer()
        elif callable(getattr(module, "get_tokenizer", None)):
            kit_tok = module.get_tokenizer()
        elif hasattr(module, "Tokenizer") and hasattr(module.Tokenizer, "from_directory"):
            kit_tok = module.Tokenizer.from_directory()
        else:
            raise DataError(p, "prepare.py has neither get_tokenizer() nor Tokenizer.from_directory()")
        tokenizer = KitTokenizer(kit_tok)
        token_bytes = _call(module.get_token_bytes, device="cpu")
    except DataError:
        raise
    except Exception as e:
        raise DataError(p, f"the kit's tokenizer failed to load: {type(e).__name__}: {e}") from e
    token_bytes = torch.as_tensor(token_bytes).to("cpu", torch.int32)
    if token_bytes.shape != (tokenizer.vocab_size,):
        shape = tuple(token_bytes.shape)
        raise DataError(p, f"get_token_bytes has shape {shape}, the vocabulary {tokenizer.vocab_size} tokens")
    declared = _int_constant(module, "TOKENIZER_VOCAB_SIZE")
    if dialect == KIT and declared is not None and declared != tokenizer.vocab_size:
        raise DataError(p, f"TOKENIZER_VOCAB_SIZE is {declared}, its tokenizer has {tokenizer.vocab_size} tokens")
    fingerprint = digest(p.read_bytes(), tokenizer.fingerprint, token_bytes.numpy().tobytes(), size=6)
    return KitData(module, p, tokenizer, token_bytes, fingerprint, device, dialect=dialect)


def dialect_of(module: ModuleType) -> str:
    """KIT when the module defines the competition kit's names (ensure_tokenizer, make_dataloader), else
    AUTORESEARCH (Tokenizer.from_directory or get_tokenizer, evaluate_bpb(model, tokenizer, batch_size))."""
    if callable(getattr(module, "ensure_tokenizer", None)) and callable(getattr(module, "make_dataloader", None)):
        return KIT
    return AUTORESEARCH
