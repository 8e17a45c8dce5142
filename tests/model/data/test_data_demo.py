"""The demo corpus: built from the Python installation alone, with no network, the same every time."""

from __future__ import annotations

import json
import socket

import pyarrow.parquet as pq
import pytest

from model.data import BatchLoader, load_dataset, validation_batches
from model.data.demo_text import SHARDS, build_demo_corpus
from tests.model.data.dataset_contract import assert_is_dataset


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the demo corpus tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_demo_corpus_is_deterministic_and_offline(tmp_path, no_network):
    a = build_demo_corpus(tmp_path / "a", max_files=40)
    b = build_demo_corpus(tmp_path / "b", max_files=40)
    names = sorted(p.name for p in a.glob("*.parquet"))
    assert names == [f"shard_{i:05d}.parquet" for i in range(SHARDS)]
    for name in names:
        ta, tb = pq.read_table(a / name), pq.read_table(b / name)
        assert ta.column("text").to_pylist() == tb.column("text").to_pylist()
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "MANIFEST.json").read_text() == (b / "MANIFEST.json").read_text()
    assert not list(tmp_path.glob(".*.tmp"))


def test_demo_dataset_end_to_end(tmp_path, no_network):
    cache = tmp_path / "runs" / "cache"
    ds = load_dataset(None, 2048, cache_dir=cache)
    demo = tmp_path / "runs" / "data" / "demo"
    manifest = json.loads((demo / "MANIFEST.json").read_text())
    chars = sum(s["chars"] for s in manifest["shards"].values())
    assert 2_000_000 < chars < 10_000_000, chars  # "a few MB of real text"
    assert ds.val_shard.path.name.startswith(f"shard_{SHARDS - 1:05d}")
    assert len(ds.train_shards) == SHARDS - 1
    assert ds.vocab_size == 2048 and ds.val_tokens > 50_000
    text = ds.tokenizer.decode(ds.val_shard.tokens[:2000].tolist())
    assert sum(w in text for w in (" the ", " of ", " is ", " and ")) >= 3  # English-ish

    x, y = next(BatchLoader(ds, 16, 256))
    assert x.shape == (16, 256) and (x[:, 0] == ds.bos_id).all()
    assert len(validation_batches(ds, 16, 256, 65536)) == 16

    again = load_dataset("demo", 2048, cache_dir=cache)  # cached: same files, same fingerprint
    assert again.fingerprint == ds.fingerprint
    assert_is_dataset(ds, is_kit=False)
