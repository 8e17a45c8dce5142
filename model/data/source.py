"""Text sources: which files make up a corpus, which one is validation, and their documents.

A source is a directory, a glob or a single file. Accepted files:
- `.parquet` with a string column `text` (the competition's ClimbMix shards): one document per row, read
  one row group at a time so a shard never has to fit in memory; null and empty rows are skipped.
- `.txt` (UTF-8): one document per paragraph, paragraphs being separated by blank lines.
- `.tok`: token shards written by model.data.shards (already tokenised; a tokenizer must be given with them).
Files are sorted by path; the last one is the validation shard unless another one is named.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from model.data.files import DataError

__all__ = ["SourceFiles", "TEXT_SUFFIXES", "TOKEN_SUFFIX", "iter_documents", "resolve_source", "sample_texts"]

TEXT_SUFFIXES = (".parquet", ".txt")
TOKEN_SUFFIX = ".tok"
_SUFFIXES = (*TEXT_SUFFIXES, TOKEN_SUFFIX)


@dataclass(frozen=True)
class SourceFiles:
    """The resolved files of a source: training shards (sorted) and the validation shard."""

    train: tuple[Path, ...]
    val: Path
    source: str

    @property
    def pretokenized(self) -> bool:
        return self.val.suffix == TOKEN_SUFFIX

    @property
    def all(self) -> tuple[Path, ...]:
        return (*self.train, self.val)


def _is_data_file(p: Path) -> bool:
    return p.is_file() and p.suffix in _SUFFIXES and not p.name.startswith(".")


def resolve_source(
    source: str | os.PathLike[str], val_shard: str | os.PathLike[str] | None = None
) -> SourceFiles:
    """List the files of `source` and split off the validation shard; DataError when that is impossible."""
    text = os.fspath(source)
    p = Path(text).expanduser()
    if p.is_dir():
        files = sorted((f for f in p.iterdir() if _is_data_file(f)), key=str)
    elif p.is_file():
        if p.suffix not in _SUFFIXES:
            raise DataError(p, f"unsupported file type {p.suffix!r} (expected {', '.join(_SUFFIXES)})")
        files = [p]
    elif glob.has_magic(text):
        files = sorted(
            (Path(f) for f in glob.glob(os.path.expanduser(text)) if _is_data_file(Path(f))), key=str
        )
    else:
        raise DataError(p, "no such file or directory")
    if not files:
        raise DataError(text, f"empty source: no {', '.join(_SUFFIXES)} files")
    kinds = {f.suffix == TOKEN_SUFFIX for f in files}
    if len(kinds) > 1:
        raise DataError(text, "mixes .tok token shards with text files; use one kind per source")

    if val_shard is None:
        val, train = files[-1], files[:-1]
        if not train:
            raise DataError(
                val, "the source has one shard; need two or more (the last is validation) or val_shard"
            )
    else:
        named = Path(val_shard).expanduser()
        matches = [f for f in files if f.name == os.fspath(val_shard)]
        if named.is_file():
            val = named
        elif matches:
            val = matches[0]
        else:
            raise DataError(
                val_shard, "validation shard not found (neither a file nor a shard of the source)"
            )
        train = [f for f in files if f.resolve() != val.resolve()]
        if not train:
            raise DataError(text, "no training shards left once the validation shard is set aside")
        if (val.suffix == TOKEN_SUFFIX) != (train[0].suffix == TOKEN_SUFFIX):
            raise DataError(
                val, "validation shard is not of the same kind (.tok or text) as the training shards"
            )
    return SourceFiles(train=tuple(train), val=val, source=text)


def _parquet_documents(path: Path, column: str, batch_rows: int) -> Iterator[list[str]]:
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise DataError(path, f"not a readable parquet file ({e})") from e
    if column not in schema.names:
        raise DataError(path, f"no {column!r} column (columns: {', '.join(schema.names) or 'none'})")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise DataError(path, f"column {column!r} holds {kind}, not strings")
    for group in range(pf.num_row_groups):
        try:
            texts = pf.read_row_group(group, columns=[column]).column(0).to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise DataError(path, f"row group {group} is unreadable ({e})") from e
        texts = [t for t in texts if t]
        for i in range(0, len(texts), batch_rows):
            yield texts[i : i + batch_rows]


def _txt_documents(path: Path, batch_rows: int) -> Iterator[list[str]]:
    batch: list[str] = []
    para: list[str] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    para.append(line)
                    continue
                if para:
                    batch.append("".join(para).rstrip("\n"))
                    para = []
                if len(batch) >= batch_rows:
                    yield batch
                    batch = []
    except UnicodeDecodeError as e:
        raise DataError(path, f"not UTF-8 text ({e.reason})") from e
    except OSError as e:
        raise DataError(path, f"cannot read: {e.strerror or e}") from e
    if para:
        batch.append("".join(para).rstrip("\n"))
    if batch:
        yield batch


def iter_documents(
    path: str | os.PathLike[str], column: str = "text", batch_rows: int = 1024
) -> Iterator[list[str]]:
    """Yield the non-empty documents of one text file in order, in lists of at most batch_rows."""
    p = Path(path)
    if p.suffix == ".parquet":
        yield from _parquet_documents(p, column, batch_rows)
    elif p.suffix == ".txt":
        yield from _txt_documents(p, batch_rows)
    else:
        raise DataError(p, f"not a text file ({p.suffix!r}); expected .parquet or .txt")


def sample_texts(
    paths: Sequence[Path], max_chars: int, column: str = "text", doc_cap: int = 10_000
) -> Iterator[str]:
    """The first max_chars characters of the documents of `paths` in order, each cut at doc_cap.

    Enough for a BPE on shuffled web text (ClimbMix is shuffled); deterministic, so every process that
    trains the same tokenizer from the same files learns the same merges.
    """
    total = 0
    for p in paths:
        for docs in iter_documents(p, column):
            for doc in docs:
                doc = doc[:doc_cap]
                total += len(doc)
                yield doc
                if total >= max_chars:
                    return
