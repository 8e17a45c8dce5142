"""BOS-aligned best-fit packing of documents into fixed rows, and the vectorised gather of those rows.

The competition kit packs documents into rows of T+1 tokens that each start with BOS: from a buffer of
about a thousand documents it repeatedly takes the longest document that still fits the row, and when
none fits it crops the shortest one to fill the row exactly (no padding, every position trained on).
`DocPacker` does the same, but only plans: it works on document lengths and emits segments
(document, offset, length), a few per row, so its Python loop runs once per document and never per
token. `DocTable.gather` then copies the planned tokens out of the memory-mapped shards with numpy
fancy indexing.

Cropping: with crop="drop" (the kit's behaviour and the default) the cropped tail of a document is
discarded. With crop="keep" the tail goes back into the buffer as a piece of its own, which starts with
BOS written over the token just before the cut (a token the previous piece already had as a target), so
no target token is lost, at the cost of rows that begin mid-document.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence

import numpy as np

from model.data.files import DataError
from model.data.shards import TokenShard

__all__ = ["CROP_MODES", "DocPacker", "DocTable", "Segments"]

CROP_MODES = ("drop", "keep")
_CHUNK = 4096  # documents moved from the order into Python lists at a time

Segments = tuple[list[int], list[int], list[int], list[int]]  # docs, offsets, lengths, row ends


class DocTable:
    """All documents of some shards, numbered 0..n_docs-1 in shard order."""

    def __init__(self, shards: Sequence[TokenShard]) -> None:
        self.shards = list(shards)
        self.doc_shard = np.concatenate(
            [np.full(s.n_docs, i, dtype=np.int32) for i, s in enumerate(self.shards)]
            or [np.empty(0, np.int32)]
        )
        self.doc_start = np.concatenate([s.doc_starts for s in self.shards] or [np.empty(0, np.int64)])
        self.doc_len = np.concatenate([s.doc_lens for s in self.shards] or [np.empty(0, np.int64)])
        self.bos_id = self.shards[0].bos_id if self.shards else 0
        self.vocab_size = self.shards[0].vocab_size if self.shards else 0

    @property
    def n_docs(self) -> int:
        return int(self.doc_len.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.doc_len.sum())

    def gather(
        self, docs: Sequence[int], offsets: Sequence[int], lengths: Sequence[int], capacity: int
    ) -> np.ndarray:
        """int64 (rows, capacity): the planned segments laid end to end, BOS at the start of each."""
        d = np.asarray(docs, dtype=np.int64)
        lens = np.asarray(lengths, dtype=np.int64)
        src = self.doc_start[d] + np.asarray(offsets, dtype=np.int64)
        dst = np.cumsum(lens) - lens
        n = int(lens.sum())
        out = np.empty(n, dtype=np.int64)
        which = self.doc_shard[d]
        groups = [np.arange(len(d))] if len(self.shards) == 1 else _groups(which)
        for segs in groups:
            shard = self.shards[int(which[segs[0]])]
            seg_lens = lens[segs]
            total = int(seg_lens.sum())
            run = np.arange(total) - np.repeat(
                np.cumsum(seg_lens) - seg_lens, seg_lens
            )  # offset within segment
            values = shard.tokens[np.repeat(src[segs], seg_lens) + run]
            if total and int(values.max()) >= self.vocab_size:
                raise DataError(
                    shard.path,
                    f"token id {int(values.max())} is outside the vocabulary of {self.vocab_size}: "
                    "tokenizer/shard mismatch or corrupt shard",
                )
            out[np.repeat(dst[segs], seg_lens) + run] = values
        out[dst] = self.bos_id  # a piece cut from inside a document starts with BOS too
        return out.reshape(-1, capacity)


def _groups(which: np.ndarray) -> list[np.ndarray]:
    """Indices of segments grouped by shard (stable within a group)."""
    order = np.argsort(which, kind="stable")
    cuts = np.flatnonzero(np.diff(which[order])) + 1
    return np.split(order, cuts)


class DocPacker:
    """Plans rows of `capacity` tokens from a stream of documents (see the module doc).

    order(epoch) gives the document order of each epoch; the stream runs through epoch 0, 1, 2, ...
    forever. order=None makes a finite stream of the documents in table order, for validation: the plan
    then ends when the documents do, and an incomplete last row is dropped.
    """

    def __init__(
        self,
        doc_len: np.ndarray,
        capacity: int,
        order: Callable[[int], np.ndarray] | None,
        buffer_docs: int = 1000,
        crop: str = "drop",
    ) -> None:
        if crop not in CROP_MODES:
            raise ValueError(f"crop must be one of {CROP_MODES}, not {crop!r}")
        if capacity < 2:
            raise ValueError(f"rows need at least 2 tokens, not {capacity}")
        self.doc_len = doc_len
        self.capacity = capacity
        self.order = order
        self.buffer_docs = max(1, buffer_docs)
        self.keep = crop == "keep"
        self.epoch = 0
        self._epoch_order = order(0) if order is not None else None
        self._cursor = 0  # next position in the epoch's order
        self._ids: list[int] = []
        self._lens: list[int] = []
        self._pos = 0  # next position in _ids / _lens
        self._buf_lens: list[int] = []  # sorted; parallel to _buf_items
        self._buf_items: list[tuple[int, int]] = []  # (document, offset of the piece)

    def _next_chunk(self) -> bool:
        n = int(self.doc_len.shape[0])
        if n == 0:
            return False
        if self._cursor >= n:
            if self.order is None:
                return False
            self.epoch += 1
            self._epoch_order = self.order(self.epoch)
            self._cursor = 0
        end = min(n, self._cursor + _CHUNK)
        ids = (
            self._epoch_order[self._cursor : end]
            if self._epoch_order is not None
            else np.arange(self._cursor, end)
        )
        self._ids = ids.tolist()
        self._lens = self.doc_len[ids].tolist()
        self._pos = 0
        self._cursor = end
        return True

    def _refill(self) -> None:
        lens, items = self._buf_lens, self._buf_items
        while len(lens) < self.buffer_docs:
            if self._pos >= len(self._ids) and not self._next_chunk():
                return
            length = self._lens[self._pos]
            i = bisect_right(lens, length)
            lens.insert(i, length)
            items.insert(i, (self._ids[self._pos], 0))
            self._pos += 1

    def next_rows(self, n_rows: int) -> Segments:
        """Plan the next n_rows rows (fewer only when a finite stream runs out)."""
        docs: list[int] = []
        offs: list[int] = []
        lens: list[int] = []
        row_ends: list[int] = []
        buf_lens, buf_items = self._buf_lens, self._buf_items
        for _ in range(n_rows):
            room = self.capacity
            mark = len(docs)
            while room:
                if len(buf_lens) < self.buffer_docs:
                    self._refill()
                if not buf_lens:  # a finite stream ran dry: drop the incomplete row
                    del docs[mark:], offs[mark:], lens[mark:]
                    return docs, offs, lens, row_ends
                i = bisect_right(buf_lens, room) - 1
                if i >= 0:  # the longest piece that fits whole
                    length = buf_lens.pop(i)
                    doc, off = buf_items.pop(i)
                    docs.append(doc)
                    offs.append(off)
                    lens.append(length)
                    room -= length
                    continue
                length = buf_lens.pop(0)  # nothing fits: crop the shortest
                doc, off = buf_items.pop(0)
                docs.append(doc)
                offs.append(off)
                lens.append(room)
                if self.keep:
                    rest = length - room + 1
                    j = bisect_right(buf_lens, rest)
                    buf_lens.insert(j, rest)
                    buf_items.insert(j, (doc, off + room - 1))
                room = 0
            row_ends.append(len(docs))
        return docs, offs, lens, row_ends

    def skip(self, n_rows: int) -> int:
        """Advance by n_rows rows without gathering them; returns the rows actually skipped."""
        done = 0
        while done < n_rows:
            got = len(self.next_rows(min(4096, n_rows - done))[3])
            if not got:
                break
            done += got
        return done
