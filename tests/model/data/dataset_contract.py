"""The contract of model.data.Dataset, checked the same way for every kind of dataset (test_data*.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from model.data import Dataset

# What the trainer uses of a dataset: the Protocol must ask for exactly these, no more, no fewer.
MEMBERS = ("tokenizer", "vocab_size", "bos_id", "fingerprint", "token_bytes", "is_kit", "describe")


def assert_is_dataset(ds: Any, is_kit: bool) -> None:
    """`ds` passes isinstance(ds, Dataset) and its members hold what the trainer expects of them."""
    assert isinstance(ds, Dataset), f"{type(ds).__name__} does not satisfy model.data.Dataset"
    assert ds.is_kit is is_kit
    assert isinstance(ds.vocab_size, int) and ds.vocab_size == ds.tokenizer.vocab_size
    assert isinstance(ds.bos_id, int) and ds.bos_id == ds.tokenizer.bos_id
    assert isinstance(ds.fingerprint, str) and ds.fingerprint
    assert isinstance(ds.token_bytes, torch.Tensor)
    assert ds.token_bytes.dtype == torch.int32 and ds.token_bytes.shape == (ds.vocab_size,)
    assert int(ds.token_bytes[ds.bos_id]) == 0
    ids = ds.tokenizer.encode("a checkpoint's tokenizer")
    assert ids and all(isinstance(i, int) for i in ids)
    info = ds.describe()
    assert info["fingerprint"] == ds.fingerprint and info["vocab_size"] == ds.vocab_size


def assert_protocol_is_exactly_members(ds: Any) -> None:
    """A stand-in with MEMBERS is a Dataset; without any one of them it is not."""
    assert isinstance(SimpleNamespace(**{m: getattr(ds, m) for m in MEMBERS}), Dataset)
    for missing in MEMBERS:
        stand_in = SimpleNamespace(**{m: getattr(ds, m) for m in MEMBERS if m != missing})
        assert not isinstance(stand_in, Dataset), f"Dataset does not require {missing}"
