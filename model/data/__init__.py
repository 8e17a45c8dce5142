"""The trainer's data, in the order it flows: source -> tokenizer -> shards -> packing -> loader.

    source.py     which files make up a corpus, the validation shard, their documents (demo_text.py: the
                  offline demo corpus, built from the standard library)
    tokenizer.py  the byte-level BPE: trained once per corpus, saved as one file
    shards.py     each text file tokenised once into a memory-mapped .tok shard
    packing.py    documents packed into BOS-aligned rows of T+1 tokens
    loader.py     TokenDataset, the fixed-shape training batches, the validation rows and the final
                  evaluation's rows (scoring_set: the kit's rows, or a fixed sample of them)
    rows.py       under loader and kit: evaluation batches from rows, the fixed sample, ScoringSet
    kit.py        beside the path: the competition kit's prepare.py behind the same Dataset interface
    files.py      under all of them: DataError, fingerprints, locked atomic builds of cached files

The trainer needs only what this module exports: load_dataset, the Dataset it returns, BatchLoader,
validation_batches and scoring_set (all three serve either kind of Dataset, check_scoring before
training), ScoringSet and DataError.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

import torch

from model.data.files import DataError
from model.data.kit import KitData, KitTokenizer, load_kit
from model.data.loader import (
    DEFAULT_CACHE,
    DEFAULT_SAMPLE_CHARS,
    BatchLoader,
    TokenDataset,
    check_scoring,
    load_token_dataset,
    scoring_set,
    validation_batches,
)
from model.data.rows import ScoringSet
from model.data.tokenizer import Tokenizer

__all__ = [
    "BatchLoader",
    "DataError",
    "Dataset",
    "KitData",
    "ScoringSet",
    "TokenDataset",
    "Tokenizer",
    "check_scoring",
    "load_dataset",
    "scoring_set",
    "validation_batches",
]


@runtime_checkable
class Dataset(Protocol):
    """What the trainer needs of a dataset; TokenDataset (demo, parquet, text, .tok) and KitData both qualify.

    model.train sizes the model by vocab_size, records fingerprint, scores val_bpb with token_bytes and
    hands tokenizer to CORE and to the checkpoint; BatchLoader and validation_batches choose their path
    by is_kit and pad validation rows with bos_id; `python -m model.data` prints describe().
    """

    @property
    def tokenizer(self) -> Tokenizer | KitTokenizer: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def fingerprint(self) -> str: ...

    @property
    def token_bytes(self) -> torch.Tensor:
        """int32 (vocab_size,): UTF-8 bytes of each token, 0 for specials (the denominator of val_bpb)."""
        ...

    @property
    def is_kit(self) -> bool:
        """True when the kit's own loaders serve the batches (KitData), False for our packed rows."""
        ...

    def describe(self) -> dict[str, Any]:
        """JSON-able summary for result records."""
        ...


def load_dataset(
    source: str | os.PathLike[str] | None = None,
    vocab_size: int | None = 8192,
    cache_dir: str | os.PathLike[str] = DEFAULT_CACHE,
    tokenizer: str | os.PathLike[str] | Tokenizer | None = None,
    val_shard: str | os.PathLike[str] | None = None,
    *,
    column: str = "text",
    sample_chars: int = DEFAULT_SAMPLE_CHARS,
) -> Dataset:
    """The dataset of `source`: the competition kit's for "kit" or "kit:PATH", else our own.

    "kit" or "kit:PATH" imports the kit's prepare.py ($TRNSWEEP_KIT_PREPARE or PATH) and returns a
    KitData; the other arguments but vocab_size, checked, are unused. Any other source (None or "demo",
    a directory, a glob or a file) goes to model.data.loader.load_token_dataset, whose doc lists the
    arguments. Raises DataError (one line naming the file and the cause) for any problem with the data.
    """
    if source is not None and (os.fspath(source) == "kit" or os.fspath(source).startswith("kit:")):
        kit = load_kit(os.fspath(source)[4:] or None)
        if vocab_size is not None and kit.vocab_size != vocab_size:
            raise DataError(
                kit.path, f"kit tokenizer has {kit.vocab_size} tokens, not the vocab_size {vocab_size} asked"
            )
        return kit
    return load_token_dataset(
        source, vocab_size, cache_dir, tokenizer, val_shard, column=column, sample_chars=sample_chars
    )
