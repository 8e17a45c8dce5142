"""Binary token shards: one text file tokenised once, then memory-mapped by every reader.

Layout of a `.tok` file (little-endian):
    header, 64 bytes: magic b"TRNSTOK1", version u32, itemsize u32 (2: uint16 tokens, 4: uint32),
        vocab_size u32, bos_id u32, n_tokens u64, n_docs u64, tokenizer fingerprint (16 ASCII hex
        digits), zero padding
    tokens: n_tokens x itemsize; each document is BOS followed by its tokens, documents back to back
    zero padding to a multiple of 8 bytes
    doc_starts: n_docs x int64, the offset of each document's BOS, increasing
The document index is stored rather than found by scanning for BOS so that opening a shard costs
O(documents), not O(tokens). Opening checks the header, the exact file size, the index and the BOS at
every document start, so a truncated or overwritten file fails loudly instead of training on garbage.
"""

from __future__ import annotations

import itertools
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.data.files import DataError, build_once, digest, file_fingerprint
from model.data.source import iter_documents
from model.data.tokenizer import Tokenizer

__all__ = ["HEADER_SIZE", "MAGIC", "TokenShard", "pretokenize", "token_shard_path", "write_token_shard"]

MAGIC = b"TRNSTOK1"
VERSION = 1
HEADER = struct.Struct("<8sIIIIQQ16s")
HEADER_SIZE = 64


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _index_offset(n_tokens: int, itemsize: int) -> int:
    end = HEADER_SIZE + n_tokens * itemsize
    return end + (-end) % 8


@dataclass(eq=False)
class TokenShard:
    """A memory-mapped token shard and its document index."""

    path: Path
    tokens: np.ndarray  # uint16 or uint32, memory-mapped
    doc_starts: np.ndarray  # int64 (n_docs,)
    vocab_size: int
    bos_id: int
    tokenizer_fingerprint: str

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def n_docs(self) -> int:
        return int(self.doc_starts.shape[0])

    @property
    def doc_lens(self) -> np.ndarray:
        """int64 (n_docs,): each document's length, its BOS included."""
        return np.diff(self.doc_starts, append=self.n_tokens)

    @classmethod
    def open(cls, path: str | os.PathLike[str], tokenizer: Tokenizer | None = None) -> TokenShard:
        """Map `path`, checking it whole and, when given, that it was made by `tokenizer`."""
        path = Path(path)
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(HEADER_SIZE)
        except OSError as e:
            raise DataError(path, f"cannot read token shard: {e.strerror or e}") from e
        if len(head) < HEADER_SIZE:
            raise DataError(
                path, f"truncated token shard: {size} bytes, shorter than its {HEADER_SIZE}-byte header"
            )
        magic, version, itemsize, vocab, bos, n_tokens, n_docs, fp = HEADER.unpack_from(head)
        if magic != MAGIC:
            raise DataError(path, "not a token shard (bad magic number)")
        if version != VERSION:
            raise DataError(path, f"token shard version {version}; this code reads version {VERSION}")
        if itemsize != _dtype_for(vocab).itemsize:
            raise DataError(path, f"corrupt token shard header (itemsize {itemsize} for vocab {vocab})")
        index_at = _index_offset(n_tokens, itemsize)
        expected = index_at + 8 * n_docs
        if size != expected:
            state = "truncated" if size < expected else "corrupt"
            raise DataError(path, f"{state} token shard: {size} bytes, its header says {expected}")
        fingerprint = fp.decode("ascii", "replace")
        if tokenizer is not None and (
            fingerprint != tokenizer.fingerprint or vocab != tokenizer.vocab_size or bos != tokenizer.bos_id
        ):
            raise DataError(
                path,
                f"tokenizer/shard mismatch: made by tokenizer {fingerprint} (vocab {vocab}, BOS {bos}), "
                f"given {tokenizer.fingerprint} (vocab {tokenizer.vocab_size}, BOS {tokenizer.bos_id})",
            )
        dtype = np.dtype(f"<u{itemsize}")
        if n_tokens:
            tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(n_tokens,))
        else:
            tokens = np.empty(0, dtype=dtype)
        starts = np.fromfile(path, dtype="<i8", count=n_docs, offset=index_at).astype(np.int64, copy=False)
        ok = (n_docs > 0) == (n_tokens > 0)
        if ok and n_docs:
            ok = bool(starts[0] == 0 and starts[-1] < n_tokens and np.all(np.diff(starts) > 0))
            ok = ok and bool(np.all(tokens[starts] == bos))
        if not ok:
            raise DataError(path, "corrupt token shard: the document index does not match the tokens")
        return cls(path, tokens, starts, int(vocab), int(bos), fingerprint)


def write_token_shard(src: Path, tokenizer: Tokenizer, out: Path, column: str = "text") -> None:
    """Tokenise the documents of `src` into a new token shard at `out` (see the module doc)."""
    dtype = _dtype_for(tokenizer.vocab_size)
    bos = tokenizer.bos_id
    starts: list[np.ndarray] = []
    n_tokens = 0
    with open(out, "wb") as f:
        f.write(bytes(HEADER_SIZE))
        for texts in iter_documents(src, column):
            ids = [x for x in tokenizer.encode_batch(texts) if x]
            if not ids:
                continue
            lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + 1
            offsets = np.cumsum(lens) - lens  # where each document's BOS goes
            total = int(lens.sum())
            chunk = np.empty(total, dtype=dtype)
            body = np.ones(total, dtype=bool)
            body[offsets] = False
            chunk[body] = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=total - len(ids))
            chunk[offsets] = bos
            f.write(chunk.tobytes())
            starts.append(offsets + n_tokens)
            n_tokens += total
        index = np.concatenate(starts) if starts else np.empty(0, dtype=np.int64)
        f.write(bytes(_index_offset(n_tokens, dtype.itemsize) - HEADER_SIZE - n_tokens * dtype.itemsize))
        f.write(index.astype("<i8").tobytes())
        f.seek(0)
        fp = tokenizer.fingerprint.encode("ascii")
        head = HEADER.pack(
            MAGIC, VERSION, dtype.itemsize, tokenizer.vocab_size, bos, n_tokens, len(index), fp
        )
        f.write(head.ljust(HEADER_SIZE, b"\0"))


def token_shard_path(cache_dir: Path, tokenizer: Tokenizer, src: Path, column: str = "text") -> Path:
    """Cache path of the token shard of `src`: keyed by tokenizer and file content, not by location."""
    key = digest(file_fingerprint(src), column, str(VERSION), size=8)
    return Path(cache_dir) / "tokens" / tokenizer.fingerprint / f"{src.stem}-{key}.tok"


def pretokenize(
    sources: Iterable[Path], tokenizer: Tokenizer, cache_dir: Path, column: str = "text"
) -> list[Path]:
    """Token shards for `sources` (same order), building the missing ones.

    Safe and cooperative across processes: each process first takes the shards nobody else is building
    (starting at an offset set by its pid so that ranks spread over different files), then waits for
    the rest, so N processes on a cold cache tokenise N files at a time and nobody duplicates work.
    """
    sources = list(sources)
    outs = [token_shard_path(cache_dir, tokenizer, s, column) for s in sources]
    jobs = [(s, o) for s, o in zip(sources, outs, strict=True) if not o.exists()]
    if jobs:
        start = os.getpid() % len(jobs)
        jobs = jobs[start:] + jobs[:start]
        for blocking in (False, True):
            for src, out in jobs:
                build_once(out, lambda tmp, src=src: write_token_shard(src, tokenizer, tmp, column), blocking)
            jobs = [(s, o) for s, o in jobs if not o.exists()]
    return outs
