"""Adapter for the competition kit's `prepare.py`, so a sweep can measure exactly what the leaderboard does.

The kit is not public; what it is known (and reported) to offer, and what this adapter uses:
- a tokenizer: `get_tokenizer()` if defined, else `Tokenizer.from_directory()`; its methods
  get_vocab_size(), get_bos_token_id(), encode(str | list[str]) and decode(ids);
- `make_dataloader(tokenizer, B, T, split, device)`, split "train" or "val", an endless iterator of
  (x int32 (B, T), y int64 (B, T), state); a `device` parameter is passed "cpu" when it exists, and
  `rank`/`world_size` when they exist (otherwise the kit splits ranks itself, through torch.distributed,
  as the competition's torchrun launch expects);
- `get_token_bytes(device)`: int32 (vocab,) byte lengths, 0 for specials;
- `evaluate_bpb(model, tokenizer, batch_size)`: the leaderboard's metric (the model is called as
  model(x, y, reduction="none")).
load_kit(path) imports it (path: prepare.py or its folder; default: $TRNSWEEP_KIT_PREPARE) and returns a
KitData with the members of model.data.Dataset that the trainer uses; BatchLoader and validation_batches
of model.data accept a KitData and come here. Deviations forced by the kit: batches cannot be resumed
except by replaying them (a position resumes by skipping position / (B*W) batches), the seed is the
kit's own, and x, y are separate tensors rather than views of one row.
"""

from __future__ import annotations

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
from model.data.tokenizer import Tokenizer, special_tokens

__all__ = ["ENV_VAR", "KitBatchLoader", "KitData", "KitTokenizer", "load_kit"]

ENV_VAR = "TRNSWEEP_KIT_PREPARE"
IGNORE_INDEX = -1
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

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def source(self) -> str:
        return f"kit:{self.path}"

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "fingerprint": self.fingerprint,
            "tokenizer": self.tokenizer.fingerprint,
            "vocab_size": self.vocab_size,
        }

    def make_loader(
        self, batch_size: int, seq_len: int, split: str, rank: int = 0, world_size: int = 1
    ) -> Iterator:
        """The kit's own make_dataloader(tokenizer, B, T, split, ...)."""
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

    def validation_batches(
        self, batch_size: int, seq_len: int, n_tokens: int, rank: int = 0, world_size: int = 1
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Same shapes and padding rule as model.data.validation_batches, rows from the kit's val loader."""
        n_rows = max(1, n_tokens // seq_len)
        step = world_size * batch_size
        it = self.make_loader(batch_size, seq_len, "val", rank, world_size)
        batches = []
        for start in range(0, n_rows, step):
            valid = max(0, min(batch_size, n_rows - start - rank * batch_size))
            x = torch.full((batch_size, seq_len), self.bos_id, dtype=torch.int64)
            y = torch.full((batch_size, seq_len), IGNORE_INDEX, dtype=torch.int64)
            if valid:
                kx, ky, _ = next(it)
                x[:valid] = kx[:valid].to("cpu", torch.int64)
                y[:valid] = ky[:valid].to("cpu", torch.int64)
            batches.append((x, y))
        return batches

    def evaluate_bpb(self, model: Any, batch_size: int) -> Any:
        """The kit's fixed metric, evaluate_bpb(model, tokenizer, batch_size), returned as is."""
        return _call(self.module.evaluate_bpb, model, self.tokenizer.kit, batch_size, device=self.device)


class KitBatchLoader:
    """The kit's training loader behind BatchLoader's interface: next() -> (x, y) int64 CPU (B, T)."""

    def __init__(
        self,
        kit: KitData,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        position: int = 0,
        seed: int = 0,
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
        self._it = kit.make_loader(batch_size, seq_len, "train", rank, world_size)
        for _ in range(position // step):
            next(self._it)
        self.position = position

    def __iter__(self) -> KitBatchLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y, self.state = next(self._it)
        self.position += self.batch_size * self.world_size
        return x.to("cpu", torch.int64), y.to("cpu", torch.int64)


_MODULES: dict[str, ModuleType] = {}


def _import(path: Path) -> ModuleType:
    key = str(path.resolve())
    if key in _MODULES:
        return _MODULES[key]
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
    for name in ("make_dataloader", "get_token_bytes", "evaluate_bpb"):
        if not callable(getattr(module, name, None)):
            raise DataError(p, f"prepare.py defines no {name}()")
    try:
        if callable(getattr(module, "get_tokenizer", None)):
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
    fingerprint = digest(p.read_bytes(), tokenizer.fingerprint, token_bytes.numpy().tobytes(), size=6)
    return KitData(module, p, tokenizer, token_bytes, fingerprint, device)
