"""The byte-level BPE tokenizer: trained with rustbpe, served by tiktoken, saved as one file.

Like the competition's tokenizer: GPT-4-style split pattern (digits in runs of one or two), byte-level
merges, and a BOS special token appended after the merges. `vocab_size` counts every token, specials
included; with our own training BOS is the only special, so vocab_size - 1 tokens are learned.

Files accepted by Tokenizer.load (a folder is searched for tokenizer.json, then tokenizer.pkl):
- our own format (written by save): one JSON object {"format": "trnsweep-tokenizer", "version": 1,
  "pattern", "bos_token", "special_tokens": {name: id}, "ranks": [base64 of token 0, token 1, ...]};
- a pickled tiktoken.Encoding, as the competition kit ships it (`tokenizer.pkl`); it is unpickled with
  a loader that only admits tiktoken's Encoding class, so such a file cannot run arbitrary code;
- a tiktoken ranks file (lines "<base64 token> <rank>", e.g. cl100k_base.tiktoken): the split pattern
  is SPLIT_PATTERN unless given, and BOS is appended after the highest rank.
BOS is the special named by `bos_token`, else the first present of <|bos|>, <|reserved_0|> (the kit's
name) and <|endoftext|>.

This is the one module that reads tiktoken's private fields (_special_tokens, _mergeable_ranks, _pat_str:
tiktoken has no public accessors for them); the kit adapter goes through special_tokens() below.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import pickle
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tiktoken

from model.data.files import DataError, build_once, digest

__all__ = ["BOS_TOKEN", "SPLIT_PATTERN", "Tokenizer", "special_tokens"]

SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}|"""
    r""" ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)
BOS_TOKEN = "<|bos|>"
BOS_CANDIDATES = (BOS_TOKEN, "<|reserved_0|>", "<|endoftext|>")
FORMAT = "trnsweep-tokenizer"
FORMAT_VERSION = 1
MIN_VOCAB = 257  # 256 bytes + BOS


def special_tokens(enc: Any) -> dict[str, int] | None:
    """The special-token name -> id map of a tiktoken Encoding; None when `enc` has none."""
    return getattr(enc, "_special_tokens", None)  # tiktoken keeps no public name -> id map


class _EncodingUnpickler(pickle.Unpickler):
    """Admits tiktoken's Encoding and nothing else: a tokenizer file must not be able to run code."""

    def find_class(self, module: str, name: str) -> type:
        if (module, name) == ("tiktoken.core", "Encoding"):
            return tiktoken.Encoding
        raise pickle.UnpicklingError(f"forbidden class {module}.{name} in a tokenizer pickle")


class Tokenizer:
    """A tiktoken.Encoding plus the BOS id, with the few methods the data pipeline and trainer need."""

    def __init__(self, enc: tiktoken.Encoding, bos_token: str | None = None, origin: str = "") -> None:
        specials = enc._special_tokens  # tiktoken keeps no public name -> id map
        names = [bos_token] if bos_token else [n for n in BOS_CANDIDATES if n in specials]
        if not names or names[0] not in specials:
            looked = ", ".join(names or BOS_CANDIDATES)
            raise DataError(origin or enc.name, f"no BOS special token (looked for {looked})")
        self.enc = enc
        self.bos_token = names[0]
        self.bos_id = int(specials[self.bos_token])
        self.special_ids = frozenset(int(i) for i in specials.values())
        self.origin = origin
        self._fingerprint: str | None = None
        self._token_bytes: np.ndarray | None = None

    # --- the interface ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.enc.n_vocab)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token names in the text are ordinary text, never specials."""
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(list(texts), num_threads=num_threads or os.cpu_count() or 1)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; a sequence cut inside a multi-byte character decodes to U+FFFD there."""
        return self.enc.decode([int(i) for i in ids])

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self.enc.decode_bytes([int(i) for i in ids])

    def token_bytes(self) -> np.ndarray:
        """int32 (vocab_size,): byte length of each token, 0 for specials: the denominator of val_bpb.

        The raw length of the token's bytes, so that the sum over a text's tokens is its UTF-8 length even
        when a token holds part of a multi-byte character.
        """
        if self._token_bytes is None:
            lengths = np.zeros(self.vocab_size, dtype=np.int32)
            for i in range(self.vocab_size):
                if i in self.special_ids:
                    continue
                with contextlib.suppress(KeyError):  # a hole in a sparse vocabulary counts no bytes
                    lengths[i] = len(self.enc.decode_single_token_bytes(i))
            self._token_bytes = lengths
        return self._token_bytes

    @property
    def fingerprint(self) -> str:
        """16 hex digits over pattern, merges and specials: equal tokenizers have equal fingerprints."""
        if self._fingerprint is None:
            ranks = sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
            parts: list[str | bytes] = [
                self.enc._pat_str,
                json.dumps(sorted(self.enc._special_tokens.items())),
            ]
            parts.append(
                b"".join(len(t).to_bytes(2, "little") + t + r.to_bytes(4, "little") for t, r in ranks)
            )
            parts.append(self.bos_token)
            self._fingerprint = digest(*parts, size=8)
        return self._fingerprint

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token}, fingerprint={self.fingerprint})"
        )

    # --- training ----------------------------------------------------------------------------------------

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, pattern: str = SPLIT_PATTERN) -> Tokenizer:
        """Learn a byte-level BPE of vocab_size tokens (BOS included) from `texts` with rustbpe.

        Raises ValueError when the texts are too few to learn that many merges.
        """
        import rustbpe  # only training needs it

        if vocab_size < MIN_VOCAB:
            raise ValueError(f"vocab_size {vocab_size} is below {MIN_VOCAB} (256 bytes and BOS)")
        bpe = rustbpe.Tokenizer()
        bpe.train_from_iterator(iter(texts), vocab_size - 1, pattern=pattern)
        ranks = {bytes(tok): int(rank) for tok, rank in bpe.get_mergeable_ranks()}
        if len(ranks) != vocab_size - 1:
            raise ValueError(f"the text only supports {len(ranks) + 1} tokens, not the {vocab_size} asked")
        return cls.from_ranks(ranks, pattern, origin="trained")

    @classmethod
    def from_ranks(
        cls,
        ranks: dict[bytes, int],
        pattern: str = SPLIT_PATTERN,
        bos_token: str = BOS_TOKEN,
        origin: str = "",
    ) -> Tokenizer:
        """Serve `ranks` through tiktoken with BOS right after the highest rank."""
        enc = tiktoken.Encoding(
            name=f"trnsweep-{len(ranks) + 1}",
            pat_str=pattern,
            mergeable_ranks=ranks,
            special_tokens={bos_token: max(ranks.values()) + 1},
        )
        return cls(enc, bos_token, origin)

    # --- files -------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        ranks = sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
        dense = [r for _, r in ranks] == list(range(len(ranks)))
        record = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "pattern": self.enc._pat_str,
            "bos_token": self.bos_token,
            "special_tokens": dict(sorted(self.enc._special_tokens.items(), key=lambda kv: kv[1])),
            "ranks": [base64.b64encode(t).decode() for t, _ in ranks],
        }
        if not dense:
            record["rank_ids"] = [r for _, r in ranks]
        return json.dumps(record, ensure_ascii=True)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write our one-file JSON format atomically (replacing any file there); returns the path."""
        path = Path(path)
        if path.exists():
            path.unlink()
        build_once(path, lambda tmp: tmp.write_text(self.to_json(), encoding="utf-8"))
        return path

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], bos_token: str | None = None, pattern: str | None = None
    ) -> Tokenizer:
        """Read any of the formats in the module doc; DataError naming the file when it is none of them."""
        p = Path(path).expanduser()
        if p.is_dir():
            found = [p / n for n in ("tokenizer.json", "tokenizer.pkl") if (p / n).is_file()]
            if not found:
                raise DataError(p, "folder holds no tokenizer.json or tokenizer.pkl")
            p = found[0]
        try:
            data = p.read_bytes()
        except OSError as e:
            raise DataError(p, f"cannot read tokenizer: {e.strerror or e}") from e
        try:
            if data[:1] == b"{":
                return cls._from_json(data, p)
            if data[:1] == b"\x80":
                enc = _EncodingUnpickler(io.BytesIO(data)).load()
                if not isinstance(enc, tiktoken.Encoding):
                    raise DataError(p, f"pickle holds a {type(enc).__name__}, not a tiktoken Encoding")
                return cls(enc, bos_token, str(p))
            return cls._from_ranks_file(data, p, bos_token or BOS_TOKEN, pattern or SPLIT_PATTERN)
        except DataError:
            raise
        except Exception as e:  # any parse failure of a foreign file is a data problem of that file
            raise DataError(p, f"not a tokenizer file ({type(e).__name__}: {e})") from e

    @classmethod
    def _from_json(cls, data: bytes, p: Path) -> Tokenizer:
        record = json.loads(data)
        if record.get("format") != FORMAT or record.get("version") != FORMAT_VERSION:
            raise DataError(p, f"JSON is not a {FORMAT} v{FORMAT_VERSION} file")
        tokens = [base64.b64decode(t) for t in record["ranks"]]
        ids = record.get("rank_ids", range(len(tokens)))
        enc = tiktoken.Encoding(
            name=f"trnsweep-{p.stem}",
            pat_str=record["pattern"],
            mergeable_ranks=dict(zip(tokens, ids, strict=True)),
            special_tokens={k: int(v) for k, v in record["special_tokens"].items()},
        )
        return cls(enc, record["bos_token"], str(p))

    @classmethod
    def _from_ranks_file(cls, data: bytes, p: Path, bos_token: str, pattern: str) -> Tokenizer:
        ranks: dict[bytes, int] = {}
        for n, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise DataError(p, f"line {n} is not '<base64 token> <rank>'")
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        if not ranks:
            raise DataError(p, "tokenizer file is empty")
        return cls.from_ranks(ranks, pattern, bos_token, str(p))
