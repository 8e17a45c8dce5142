"""The data path's last step: a corpus opened as a TokenDataset, its training batches, its validation rows.

    ds = load_token_dataset(source, vocab_size, cache_dir="runs/cache", tokenizer=None, val_shard=None)
    loader = BatchLoader(ds, batch_size=B, seq_len=T, rank=r, world_size=W, position=p, seed=0)
    x, y = next(loader)          # int64 (B, T) each, y = x shifted by one
    val = validation_batches(ds, batch_size=B, seq_len=T, n_tokens=N, rank=r, world_size=W)
    final = scoring_set(ds, batch_size=B, seq_len=T, n_tokens=N, sample_rows=n, eval_seq_len=E, rank=r, ...)

The trainer calls these through model.data (load_dataset there also opens the competition kit, whose
KitData BatchLoader, validation_batches and scoring_set hand to model.data.kit). Sources and their formats:
model.data.source; tokenizer files: model.data.tokenizer; token shards: model.data.shards; packing:
model.data.packing; the demo corpus: model.data.demo_text.

Cache layout under cache_dir (default runs/cache; the demo corpus goes to cache_dir/../data/demo):
    tokenizers/<key>.json       a trained tokenizer, key = (training files' content, vocab_size, sample)
    tokens/<tokenizer>/<stem>-<key>.tok   one token shard per text file, key = (file content, column)
Every entry is built once under a file lock and renamed into place, so concurrent processes on a cold
cache (torchrun ranks, trials) share the work and never read a half-written file.

Global row stream and ranks. The training rows of a seed form one infinite stream, the same for every
world size: row 0, 1, 2, ... Step k of rank r of W, each with batch B, reads rows
[p + r*B, p + (r+1)*B) where p = position = k*W*B counts the rows all ranks have consumed together.
So at any position, the batches of ranks 0..W-1 stacked in rank order are exactly the batch one rank
reads with batch W*B; in particular two ranks with B read, without overlap, exactly the tokens one
rank reads with 2B. A rank never sees part of another rank's row. Resuming: BatchLoader(...,
position=loader.position) continues exactly where `loader` stood, with any batch size and world size
(the position counts rows, not steps). Each epoch reshuffles the documents with numpy's generator
seeded by (seed, epoch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.data.demo_text import build_demo_corpus
from model.data.files import DataError, build_once, digest, file_fingerprint
from model.data.kit import KitBatchLoader, KitData
from model.data.packing import CROP_MODES, DocPacker, DocTable
from model.data.rows import IGNORE_INDEX, ScoringSet, batch_rows, sample_indices
from model.data.shards import TokenShard, pretokenize
from model.data.source import SourceFiles, resolve_source, sample_texts
from model.data.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_CACHE",
    "IGNORE_INDEX",
    "BatchLoader",
    "TokenDataset",
    "check_scoring",
    "load_token_dataset",
    "scoring_set",
    "validation_batches",
    "validation_rows",
]

DEFAULT_CACHE = "runs/cache"
DEFAULT_SAMPLE_CHARS = 200_000_000  # tokenizer training sample: ample for 8192 tokens on web text
TOKENIZER_TRAIN_VERSION = 1


@dataclass(eq=False)
class TokenDataset:
    """A tokenised corpus: the memory-mapped training shards, the validation shard and the tokenizer."""

    tokenizer: Tokenizer
    train_shards: list[TokenShard]
    val_shard: TokenShard
    fingerprint: str
    source: str
    token_bytes: torch.Tensor = field(repr=False)
    is_kit = False

    def __post_init__(self) -> None:
        self.train_docs = DocTable(self.train_shards)
        self.val_docs = DocTable([self.val_shard])
        if self.train_docs.n_docs == 0:
            raise DataError(self.source, "empty source: the training shards hold no documents")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def train_tokens(self) -> int:
        return self.train_docs.n_tokens

    @property
    def val_tokens(self) -> int:
        return self.val_docs.n_tokens

    def describe(self) -> dict[str, Any]:
        """JSON-able summary for result records."""
        return {
            "source": self.source,
            "fingerprint": self.fingerprint,
            "tokenizer": self.tokenizer.fingerprint,
            "vocab_size": self.vocab_size,
            "train_shards": len(self.train_shards),
            "train_docs": self.train_docs.n_docs,
            "train_tokens": self.train_tokens,
            "val_shard": str(self.val_shard.path),
            "val_tokens": self.val_tokens,
        }


def _train_tokenizer(
    files: SourceFiles, vocab_size: int, cache_dir: Path, sample_chars: int, column: str
) -> Tokenizer:
    fps = [file_fingerprint(p) for p in files.train]
    key = digest(str(TOKENIZER_TRAIN_VERSION), str(vocab_size), str(sample_chars), column, *fps, size=8)
    path = cache_dir / "tokenizers" / f"bpe{vocab_size}-{key}.json"

    def build(tmp: Path) -> None:
        try:
            tok = Tokenizer.train(sample_texts(files.train, sample_chars, column), vocab_size)
        except ValueError as e:
            if isinstance(e, DataError):
                raise
            raise DataError(files.source, f"cannot train the tokenizer: {e}") from e
        tmp.write_text(tok.to_json(), encoding="utf-8")

    build_once(path, build)
    return Tokenizer.load(path)


def load_token_dataset(
    source: str | os.PathLike[str] | None = None,
    vocab_size: int | None = 8192,
    cache_dir: str | os.PathLike[str] = DEFAULT_CACHE,
    tokenizer: str | os.PathLike[str] | Tokenizer | None = None,
    val_shard: str | os.PathLike[str] | None = None,
    *,
    column: str = "text",
    sample_chars: int = DEFAULT_SAMPLE_CHARS,
) -> TokenDataset:
    """Resolve `source`, get its tokenizer, tokenise it once into the cache and map it.

    source: None or "demo" for the demo corpus (built on first use); else a directory, a glob or a file of
    .parquet (column `column`) or .txt documents, or of .tok token shards (then `tokenizer` is required).
    The last shard in sorted order is validation unless val_shard names a file or a shard.
    tokenizer: None to train a BPE of vocab_size tokens on the first sample_chars characters of the
    training shards (cached), else a Tokenizer or a tokenizer file (formats: model.data.tokenizer); when
    both are given, vocab_size must match the file's or be None.
    Raises DataError (one line naming the file and the cause) for any problem with the data.
    """
    cache = Path(cache_dir)
    if source is None or os.fspath(source) == "demo":
        source = build_demo_corpus(cache.parent / "data" / "demo")
    files = resolve_source(source, val_shard)

    if isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    elif tokenizer is not None:
        tok = Tokenizer.load(tokenizer)
    elif files.pretokenized:
        raise DataError(
            files.val, "token shards (.tok) need the tokenizer they were made with (tokenizer=...)"
        )
    else:
        if vocab_size is None:
            raise ValueError("vocab_size is needed to train a tokenizer")
        tok = _train_tokenizer(files, vocab_size, cache, sample_chars, column)
    if vocab_size is not None and tok.vocab_size != vocab_size:
        raise DataError(
            tok.origin or files.source,
            f"tokenizer has {tok.vocab_size} tokens, but vocab_size {vocab_size} was asked",
        )

    paths = list(files.all) if files.pretokenized else pretokenize(files.all, tok, cache, column)
    shards = [TokenShard.open(p, tok) for p in paths]
    fingerprint = digest(
        *(file_fingerprint(p) for p in files.train),
        "val",
        file_fingerprint(files.val),
        tok.fingerprint,
        column,
        size=6,
    )
    return TokenDataset(
        tokenizer=tok,
        train_shards=shards[:-1],
        val_shard=shards[-1],
        fingerprint=fingerprint,
        source=os.fspath(files.source),
        token_bytes=torch.from_numpy(tok.token_bytes().copy()),
    )


def _check_geometry(batch_size: int, seq_len: int, rank: int, world_size: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be positive, not {batch_size} and {seq_len}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")


class BatchLoader:
    """Endless fixed-shape training batches: next() -> (x, y), int64 CPU tensors of shape (B, T).

    x and y are views of one (B, T+1) tensor of packed rows (y = row[:, 1:]); every row starts with BOS.
    See the module doc for how ranks split the row stream and what `position` means. Given a KitData
    (model.data.kit) instead of a TokenDataset, the constructor returns the kit's loader behind the same interface.
    """

    def __new__(cls, ds: TokenDataset | KitData, *args: Any, **kwargs: Any) -> Any:
        if getattr(ds, "is_kit", False):
            return KitBatchLoader(ds, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        ds: TokenDataset,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        position: int = 0,
        seed: int = 0,
        *,
        buffer_docs: int = 1000,
        crop: str = "drop",
        same_on_all_ranks: Any = None,  # the kit's loader needs it (model.data.kit); rows here split by construction
    ) -> None:
        _check_geometry(batch_size, seq_len, rank, world_size)
        if position < 0 or seed < 0:
            raise ValueError(f"position and seed must be non-negative, not {position} and {seed}")
        if crop not in CROP_MODES:
            raise ValueError(f"crop must be one of {CROP_MODES}, not {crop!r}")
        self.ds = ds
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        n_docs = ds.train_docs.n_docs
        self._packer = DocPacker(
            ds.train_docs.doc_len,
            seq_len + 1,
            lambda epoch: np.random.default_rng([seed, epoch]).permutation(n_docs),
            buffer_docs,
            crop,
        )
        self._packer.skip(position)
        self.position = position

    @property
    def epoch(self) -> int:
        """The epoch of the last document taken into the packing buffer (0-based)."""
        return self._packer.epoch

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        b = self.batch_size
        docs, offs, lens, ends = self._packer.next_rows(self.world_size * b)
        lo = ends[self.rank * b - 1] if self.rank else 0
        hi = ends[(self.rank + 1) * b - 1]
        rows = self.ds.train_docs.gather(docs[lo:hi], offs[lo:hi], lens[lo:hi], self.seq_len + 1)
        self.position += self.world_size * b
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:]


def validation_rows(
    ds: TokenDataset, seq_len: int, n_tokens: int, *, buffer_docs: int = 1000, crop: str = "drop"
) -> np.ndarray:
    """int64 (rows, T+1): the fixed validation rows, packed like training rows from the validation
    shard in file order, max(1, n_tokens // T) of them (fewer if the shard runs out first)."""
    cap = seq_len + 1
    if ds.val_tokens < cap:
        raise DataError(
            ds.val_shard.path, f"validation shard has {ds.val_tokens} tokens, fewer than one row of {cap}"
        )
    packer = DocPacker(ds.val_docs.doc_len, cap, None, buffer_docs, crop)
    docs, offs, lens, ends = packer.next_rows(max(1, n_tokens // seq_len))
    if not ends:
        raise DataError(ds.val_shard.path, f"validation shard packs into no complete row of {cap} tokens")
    return ds.val_docs.gather(docs, offs, lens, cap)


def validation_batches(
    ds: TokenDataset | KitData,
    batch_size: int,
    seq_len: int,
    n_tokens: int,
    rank: int = 0,
    world_size: int = 1,
    *,
    buffer_docs: int = 1000,
    crop: str = "drop",
    same_on_all_ranks: Any = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The validation set as a list of (x, y), int64 tensors of exactly (B, T) each.

    The rows depend only on the validation shard, the tokenizer, T and n_tokens (see validation_rows), so
    every run, process and trial of a study scores the same tokens. Batch k of rank r holds rows
    [k*W*B + r*B, k*W*B + (r+1)*B); every rank gets the same number of batches, ceil(rows / (W*B)), and
    rows past the end are padding: x = BOS, y = -1 (IGNORE_INDEX, use it as the loss's ignore_index and
    mask y >= 0 before indexing token_bytes). x and y are separate contiguous tensors here.
    `same_on_all_ranks` serves the kit (model.data.kit's module doc).
    """
    if getattr(ds, "is_kit", False):
        return ds.validation_batches(batch_size, seq_len, n_tokens, rank, world_size, same_on_all_ranks)
    _check_geometry(batch_size, seq_len, rank, world_size)
    rows = validation_rows(ds, seq_len, n_tokens, buffer_docs=buffer_docs, crop=crop)
    return batch_rows(rows[:, :-1], rows[:, 1:], batch_size, rank, world_size, ds.bos_id)


def check_scoring(ds: TokenDataset | KitData, eval_seq_len: int) -> None:
    """Raise DataError (ValueError for a negative length) when scoring_set could not score at eval_seq_len:
    on the kit's data it must be 0 or the kit's MAX_SEQ_LEN."""
    if eval_seq_len < 0:
        raise ValueError(f"eval_seq_len must not be negative, not {eval_seq_len}")
    kit_len = getattr(ds, "eval_seq_len", None) if getattr(ds, "is_kit", False) else None
    if eval_seq_len and kit_len is not None and eval_seq_len != kit_len:
        raise DataError(ds.path, f"the kit evaluates at its MAX_SEQ_LEN {kit_len}, not at the eval_seq_len "
                                 f"{eval_seq_len} asked")


def scoring_set(
    ds: TokenDataset | KitData,
    batch_size: int,
    seq_len: int,
    n_tokens: int,
    sample_rows: int = 0,
    eval_seq_len: int = 0,
    rank: int = 0,
    world_size: int = 1,
    *,
    same_on_all_ranks: Any = None,
) -> ScoringSet | None:
    """The final evaluation's rows, split across ranks: the scorer's rows, or a fixed sample of them.

    On the kit's data: the rows its evaluate_bpb scores (its MAX_SEQ_LEN and EVAL_TOKENS decide; seq_len,
    n_tokens and eval_seq_len, which must be 0 or MAX_SEQ_LEN, do not), None when the kit does not say
    which (then score with KitData.evaluate). Else the first n_tokens // T rows of the validation stream at
    T = eval_seq_len or seq_len, as the kit's evaluate_bpb takes the first rows of its own. sample_rows > 0
    scores a uniform random sample of that many of them instead (model.data.rows: the same rows in every
    run; BpbResult.stderr gives the standard error).
    """
    if sample_rows < 0:
        raise ValueError(f"sample_rows must not be negative, not {sample_rows}")
    check_scoring(ds, eval_seq_len)
    if getattr(ds, "is_kit", False):
        return ds.scoring_set(batch_size, sample_rows, rank, world_size, same_on_all_ranks)
    length = eval_seq_len or seq_len
    _check_geometry(batch_size, length, rank, world_size)
    rows = validation_rows(ds, length, n_tokens)
    population = rows.shape[0]
    rows = rows[sample_indices(population, sample_rows)]
    batches = batch_rows(rows[:, :-1], rows[:, 1:], batch_size, rank, world_size, ds.bos_id)
    return ScoringSet(batches, rows.shape[0], population, length)
