"""The data room: tokenizer, token shards, packed batches, ranks, resumption, validation rows, errors.

A small corpus (the paragraphs of Python's help topics, four parquet shards) and a 512-token vocabulary
keep the whole file to seconds.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model.data import BatchLoader, DataError, TokenDataset, Tokenizer, load_dataset, validation_batches
from model.data.packing import DocPacker
from model.data.shards import TokenShard, write_token_shard
from tests.model.data.dataset_contract import assert_is_dataset, assert_protocol_is_exactly_members

ROOT = Path(__file__).resolve().parents[3]
VOCAB = 512


def paragraphs() -> list[str]:
    from pydoc_data.topics import topics

    return [p.strip() for name in sorted(topics) for p in topics[name].split("\n\n") if p.strip()]


def write_parquet(path: Path, texts: list[str], row_group_size: int = 200, **extra: list) -> Path:
    pq.write_table(pa.table({"text": texts, **extra}), path, row_group_size=row_group_size)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Four parquet shards of help-topic paragraphs; shard_3 is validation."""
    root = tmp_path_factory.mktemp("corpus")
    paras = paragraphs()
    for i in range(4):
        write_parquet(root / f"shard_{i}.parquet", paras[i::4])
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def ds(corpus, cache) -> TokenDataset:
    return load_dataset(str(corpus), VOCAB, cache_dir=cache)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(paragraphs()[::3], 400)


def assert_one_line_naming(err: pytest.ExceptionInfo, path: Path | str) -> None:
    msg = str(err.value)
    assert "\n" not in msg
    assert str(path) in msg, msg


# --- tokenizer -------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_any_unicode(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.bos_id not in ids
    assert tok.encode_batch([text, text[::-1]]) == [ids, tok.encode(text[::-1])]


@settings(max_examples=150, deadline=None)
@given(text=st.text())
def test_token_bytes_sum_to_utf8_length(tok, text):
    lengths = tok.token_bytes()
    ids = tok.encode(text)
    assert int(lengths[ids].sum()) == len(text.encode("utf-8"))
    assert lengths[tok.bos_id] == 0


def test_tokenizer_shape_and_bos(tok):
    assert tok.vocab_size == 400
    assert tok.bos_id == 399
    assert tok.bos_token == "<|bos|>"
    assert tok.encode("<|bos|>") != [tok.bos_id]  # special names in text stay text
    assert (tok.token_bytes()[:256] == 1).all()


def test_tokenizer_files_round_trip(tok, tmp_path):
    text = "Tokenizers are saved, loaded, and shipped: ünïcödé 12345 — ok."
    ours = Tokenizer.load(tok.save(tmp_path / "tok.json"))
    assert ours.encode(text) == tok.encode(text) and ours.fingerprint == tok.fingerprint

    # The competition kit's format: a pickled tiktoken Encoding whose BOS is <|reserved_0|>.
    ranks = tok.enc._mergeable_ranks
    enc = tiktoken.Encoding(
        name="kit",
        pat_str=tok.enc._pat_str,
        mergeable_ranks=ranks,
        special_tokens={f"<|reserved_{i}|>": len(ranks) + i for i in range(4)},
    )
    (tmp_path / "kit").mkdir()
    (tmp_path / "kit" / "tokenizer.pkl").write_bytes(pickle.dumps(enc))
    kit = Tokenizer.load(tmp_path / "kit")
    assert kit.vocab_size == len(ranks) + 4 and kit.bos_id == len(ranks)
    assert kit.encode(text) == tok.encode(text)
    assert (kit.token_bytes()[-4:] == 0).all()

    # A tiktoken ranks file: BOS is appended after the ranks.
    import base64

    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (tmp_path / "ranks.tiktoken").write_text("\n".join(lines) + "\n")
    plain = Tokenizer.load(tmp_path / "ranks.tiktoken")
    assert plain.fingerprint == tok.fingerprint


def test_tokenizer_pickle_cannot_run_code(tmp_path):
    evil = tmp_path / "tokenizer.pkl"
    evil.write_bytes(pickle.dumps(io.BytesIO(b"not a tokenizer")))
    with pytest.raises(DataError) as err:
        Tokenizer.load(evil)
    assert_one_line_naming(err, evil)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(DataError) as err:
        Tokenizer.load(garbage)
    assert_one_line_naming(err, garbage)


def test_tokenizer_training_is_deterministic():
    texts = paragraphs()[::5]
    assert Tokenizer.train(texts, 300).fingerprint == Tokenizer.train(texts, 300).fingerprint


# --- dataset and token shards ----------------------------------------------------------------------------


def test_dataset_shape(ds, corpus):
    assert ds.vocab_size == VOCAB == ds.tokenizer.vocab_size
    assert ds.token_bytes.dtype == torch.int32 and ds.token_bytes.shape == (VOCAB,)
    assert ds.token_bytes[ds.bos_id] == 0
    assert len(ds.train_shards) == 3 and ds.val_shard.path.name.startswith("shard_3")
    assert len(ds.fingerprint) == 12
    info = ds.describe()
    assert info["train_tokens"] == sum(s.n_tokens for s in ds.train_shards) > 50_000


def test_token_shard_holds_the_documents(ds, corpus):
    shard = ds.val_shard
    texts = paragraphs()[3::4]
    assert shard.n_docs == len(texts)
    tokens = np.asarray(shard.tokens)
    for i in (0, 1, len(texts) // 2, len(texts) - 1):
        start, end = shard.doc_starts[i], shard.doc_starts[i] + shard.doc_lens[i]
        assert tokens[start] == ds.bos_id
        assert ds.tokenizer.decode(tokens[start + 1 : end]) == texts[i]
    assert shard.tokens.dtype == np.uint16


def test_cache_is_reused(ds, corpus, cache):
    again = load_dataset(str(corpus), VOCAB, cache_dir=cache)
    assert again.fingerprint == ds.fingerprint
    assert [s.path for s in again.train_shards] == [s.path for s in ds.train_shards]
    assert again.tokenizer.fingerprint == ds.tokenizer.fingerprint


def test_txt_source_and_named_val_shard(tmp_path, corpus):
    paras = paragraphs()
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text("\n\n".join(paras[i::3]) + "\n", encoding="utf-8")
    d = load_dataset(str(tmp_path / "part*.txt"), 300, cache_dir=tmp_path / "cache", val_shard="part0.txt")
    assert d.val_shard.n_docs == len(paras[0::3])
    assert [s.n_docs for s in d.train_shards] == [len(paras[1::3]), len(paras[2::3])]


def test_pretokenized_source_needs_its_own_tokenizer(ds, tok, tmp_path):
    shards = tmp_path / "tok"
    shards.mkdir()
    for s in [*ds.train_shards, ds.val_shard]:
        (shards / s.path.name).write_bytes(s.path.read_bytes())
    tok_file = ds.tokenizer.save(tmp_path / "tok.json")
    same = load_dataset(str(shards), None, cache_dir=tmp_path / "c", tokenizer=str(tok_file))
    assert same.train_tokens == ds.train_tokens

    other = tok.save(tmp_path / "other.json")
    with pytest.raises(DataError) as err:
        load_dataset(str(shards), None, cache_dir=tmp_path / "c", tokenizer=str(other))
    assert "mismatch" in str(err.value)
    assert_one_line_naming(err, shards)


def test_every_token_dataset_kind_satisfies_the_dataset_protocol(ds, tmp_path):
    """parquet, .txt and .tok sources (the demo corpus: test_data_demo.py; the kit: test_data_kit.py)."""
    assert_is_dataset(ds, is_kit=False)
    assert_protocol_is_exactly_members(ds)
    (tmp_path / "txt").mkdir()
    (tmp_path / "tok").mkdir()
    paras = paragraphs()
    for i in range(2):
        (tmp_path / "txt" / f"part{i}.txt").write_text("\n\n".join(paras[i::2]) + "\n", encoding="utf-8")
    for s in [*ds.train_shards, ds.val_shard]:
        (tmp_path / "tok" / s.path.name).write_bytes(s.path.read_bytes())
    for kind in ("txt", "tok"):
        d = load_dataset(str(tmp_path / kind), None, cache_dir=tmp_path / "cache", tokenizer=ds.tokenizer)
        assert_is_dataset(d, is_kit=False)


def test_vocab_size_must_match_a_given_tokenizer(ds, corpus, tmp_path):
    tok_file = ds.tokenizer.save(tmp_path / "tok.json")
    with pytest.raises(DataError) as err:
        load_dataset(str(corpus), 1024, cache_dir=tmp_path, tokenizer=str(tok_file))
    assert_one_line_naming(err, tok_file)


@pytest.mark.parametrize("damage", ["truncate", "magic", "index", "extend"])
def test_damaged_token_shard_is_a_data_error(ds, tmp_path, damage):
    path = tmp_path / "shard.tok"
    data = bytearray(ds.val_shard.path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "magic":
        data[:8] = b"GARBAGE!"
    elif damage == "index":
        data[-8:] = (12345).to_bytes(8, "little")
    else:
        data += b"\0" * 8
    path.write_bytes(bytes(data))
    with pytest.raises(DataError) as err:
        TokenShard.open(path, ds.tokenizer)
    assert_one_line_naming(err, path)


def test_tiny_token_shard_file_is_a_data_error(tmp_path):
    path = tmp_path / "short.tok"
    path.write_bytes(b"TRNS")
    with pytest.raises(DataError, match="truncated") as err:
        TokenShard.open(path)
    assert_one_line_naming(err, path)


def test_shard_tokens_outside_the_vocabulary_are_caught_when_read(ds, tmp_path, corpus):
    small = Tokenizer.train(paragraphs()[::7], 300)
    big_vocab_shard = tmp_path / "big.tok"
    write_token_shard(corpus / "shard_0.parquet", ds.tokenizer, big_vocab_shard)
    shard = TokenShard.open(big_vocab_shard)
    # Pretend the shard came with the small tokenizer: the header check is bypassed, the reader still refuses.
    shard.vocab_size = small.vocab_size
    fake = TokenDataset(small, [shard], shard, "x", "test", torch.from_numpy(small.token_bytes()))
    loader = BatchLoader(fake, 8, 64)
    with pytest.raises(DataError) as err:
        for _ in range(50):
            next(loader)
    assert_one_line_naming(err, big_vocab_shard)


def test_parquet_without_text_column(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["hello"] * 10)
    bad = tmp_path / "b.parquet"
    pq.write_table(pa.table({"content": ["hello"] * 10}), bad)
    write_parquet(tmp_path / "c.parquet", ["world"] * 10)
    with pytest.raises(DataError) as err:
        load_dataset(str(tmp_path), 300, cache_dir=tmp_path / "cache")
    assert "'text'" in str(err.value)
    assert_one_line_naming(err, bad)


def test_unreadable_parquet(tmp_path):
    bad = tmp_path / "a.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    write_parquet(tmp_path / "b.parquet", ["x"])
    with pytest.raises(DataError) as err:
        load_dataset(str(tmp_path), 300, cache_dir=tmp_path / "cache")
    assert_one_line_naming(err, bad)


def test_empty_sources(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="empty source") as err:
        load_dataset(str(empty), 300, cache_dir=tmp_path / "cache")
    assert_one_line_naming(err, empty)

    blank = tmp_path / "blank"
    blank.mkdir()
    write_parquet(blank / "a.parquet", ["", ""])
    write_parquet(blank / "b.parquet", ["some text here"])
    tok = Tokenizer.train(paragraphs()[::9], 300)
    with pytest.raises(DataError, match="no documents") as err:
        load_dataset(str(blank), None, cache_dir=tmp_path / "cache", tokenizer=tok)
    assert_one_line_naming(err, blank)

    with pytest.raises(DataError, match="no such file") as err:
        load_dataset(str(tmp_path / "missing"), 300, cache_dir=tmp_path / "cache")
    assert_one_line_naming(err, tmp_path / "missing")

    with pytest.raises(DataError, match="one shard") as err:
        load_dataset(str(blank / "b.parquet"), 300, cache_dir=tmp_path / "cache")
    assert_one_line_naming(err, blank / "b.parquet")


def test_too_little_text_for_the_vocabulary(tmp_path):
    write_parquet(tmp_path / "a.parquet", ["tiny tiny text"])
    write_parquet(tmp_path / "b.parquet", ["tiny"])
    with pytest.raises(DataError, match="supports") as err:
        load_dataset(str(tmp_path), 4096, cache_dir=tmp_path / "cache")
    assert_one_line_naming(err, tmp_path)


# --- training batches ------------------------------------------------------------------------------------


def doc_token_set(ds: TokenDataset) -> set[tuple[int, ...]]:
    docs = set()
    for s in ds.train_shards:
        tokens = np.asarray(s.tokens)
        for start, length in zip(s.doc_starts.tolist(), s.doc_lens.tolist(), strict=True):
            docs.add(tuple(tokens[start + 1 : start + length].tolist()))
    return docs


def test_batches_are_packed_documents(ds):
    B, T = 8, 64
    loader = BatchLoader(ds, B, T)
    docs = doc_token_set(ds)
    prefixes = {d[:k] for d in docs for k in range(1, min(len(d), T) + 1)}
    for _ in range(20):
        x, y = next(loader)
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
        assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()  # views of one row
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert (x[:, 0] == ds.bos_id).all()
        rows = torch.cat([x, y[:, -1:]], dim=1).numpy()
        for row in rows:
            starts = np.flatnonzero(row == ds.bos_id).tolist() + [len(row)]
            assert starts[0] == 0
            pieces = [tuple(row[a + 1 : b].tolist()) for a, b in zip(starts[:-1], starts[1:], strict=True)]
            for piece in pieces[:-1]:
                assert piece in docs  # whole documents inside a row
            assert pieces[-1] in docs or pieces[-1] in prefixes or pieces[-1] == ()  # the last may be cropped


def take(loader: BatchLoader, n: int) -> list[torch.Tensor]:
    return [torch.cat([x, y[:, -1:]], dim=1) for x, y in (next(loader) for _ in range(n))]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_split_the_single_rank_stream(ds, world_size):
    B, T, steps = 4, 32, 30
    single = take(BatchLoader(ds, world_size * B, T), steps)
    per_rank = [take(BatchLoader(ds, B, T, rank=r, world_size=world_size), steps) for r in range(world_size)]
    for k in range(steps):
        stacked = torch.cat([per_rank[r][k] for r in range(world_size)])
        assert torch.equal(stacked, single[k])  # whole rows, in rank order: no row is split across ranks
    # No overlap: every row of the stream is read by exactly one rank, so the multisets match too.
    all_rows = [tuple(row.tolist()) for r in range(world_size) for b in per_rank[r] for row in b]
    assert sorted(all_rows) == sorted(tuple(row.tolist()) for b in single for row in b)


def test_resume_from_position(ds):
    B, T = 4, 48
    loader = BatchLoader(ds, B, T, seed=3)
    take(loader, 7)
    position = loader.position
    assert position == 7 * B
    expected = take(loader, 5)
    resumed = BatchLoader(ds, B, T, seed=3, position=position)
    assert all(torch.equal(a, b) for a, b in zip(take(resumed, 5), expected, strict=True))
    # The position is a row count: two ranks of batch B/2 resume there as well.
    halves = [
        take(BatchLoader(ds, B // 2, T, rank=r, world_size=2, seed=3, position=position), 5) for r in (0, 1)
    ]
    assert all(torch.equal(torch.cat([h0, h1]), e) for h0, h1, e in zip(*halves, expected, strict=True))


def test_epochs_reshuffle_deterministically_and_resume_across_them(ds):
    B, T = 16, 256
    loader = BatchLoader(ds, B, T)
    steps = 0
    while loader.epoch < 2:
        next(loader)
        steps += 1
    tail = take(loader, 3)
    again = BatchLoader(ds, B, T, position=loader.position - 3 * B)
    assert again.epoch == 2
    assert all(torch.equal(a, b) for a, b in zip(take(again, 3), tail, strict=True))
    first = take(BatchLoader(ds, B, T), 2)
    assert all(torch.equal(a, b) for a, b in zip(take(BatchLoader(ds, B, T), 2), first, strict=True))
    assert not torch.equal(take(BatchLoader(ds, B, T, seed=1), 1)[0], first[0])


def test_keep_crop_loses_no_target_tokens(ds):
    cap = 33
    packer = DocPacker(ds.val_docs.doc_len, cap, None, buffer_docs=16, crop="keep")
    docs, offs, lens, ends = packer.next_rows(10**6)  # the whole finite stream
    assert len(ends) > 100
    covered: dict[int, list[tuple[int, int]]] = {}
    for d, o, n in zip(docs, offs, lens, strict=True):
        covered.setdefault(d, []).append((o + 1, o + n))  # target positions of the piece
    doc_len = ds.val_docs.doc_len
    for spans in covered.values():
        spans.sort()
        assert spans[0][0] == 1 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    complete = [d for d, spans in covered.items() if spans[-1][1] == doc_len[d]]
    assert len(complete) >= ds.val_docs.n_docs - cap  # all but those of the dropped, incomplete last row
    # The gathered rows hold those pieces: BOS, then the document's tokens after the cut.
    k = ends[20]
    rows = ds.val_docs.gather(docs[:k], offs[:k], lens[:k], cap)
    tokens = np.asarray(ds.val_shard.tokens)
    pos = 0
    for d, o, n in zip(docs[:k], offs[:k], lens[:k], strict=True):
        flat = rows.reshape(-1)[pos : pos + n]
        start = ds.val_shard.doc_starts[d]
        assert flat[0] == ds.bos_id and (flat[1:] == tokens[start + o + 1 : start + o + n]).all()
        pos += n


def test_bad_loader_arguments(ds):
    for kwargs in ({"rank": 2, "world_size": 2}, {"position": -1}, {"crop": "pad"}):
        with pytest.raises(ValueError):
            BatchLoader(ds, 4, 16, **kwargs)
    with pytest.raises(ValueError):
        BatchLoader(ds, 0, 16)


# --- validation ------------------------------------------------------------------------------------------


def digest_batches(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for x, y in batches:
        h.update(x.numpy().tobytes())
        h.update(y.numpy().tobytes())
    return h.hexdigest()


def test_validation_batches_shape_and_padding(ds):
    B, T, N = 8, 64, 64 * 20  # 20 rows: 2 full batches and one of 4 real rows and 4 padding rows
    val = validation_batches(ds, B, T, N)
    assert len(val) == 3
    for x, y in val:
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    x, y = val[-1]
    assert (y[4:] == -1).all() and (x[4:] == ds.bos_id).all()
    assert (y[:4] >= 0).all() and (x[:, 0] == ds.bos_id).all()
    assert sum(int((y >= 0).sum()) for _, y in val) == 20 * T
    assert validation_batches(ds, B, T, 10)[0][1][1:].eq(-1).all()  # at least one row


def test_validation_rows_split_across_ranks(ds):
    B, T, N = 4, 32, 32 * 37
    single = [row for x, y in validation_batches(ds, 2 * B, T, N) for row in torch.cat([x, y[:, -1:]], 1)]
    ranks = [validation_batches(ds, B, T, N, rank=r, world_size=2) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1])  # every rank runs the same number of eval steps
    for k in range(len(ranks[0])):
        stacked = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in (ranks[0][k], ranks[1][k])])
        assert all(
            torch.equal(a, b) for a, b in zip(stacked, single[k * 2 * B : (k + 1) * 2 * B], strict=True)
        )


def test_validation_set_is_identical_across_runs_and_processes(ds, corpus, cache):
    B, T, N = 8, 64, 8192
    here = digest_batches(validation_batches(ds, B, T, N))
    assert (
        digest_batches(validation_batches(load_dataset(str(corpus), VOCAB, cache_dir=cache), B, T, N)) == here
    )
    code = (
        "import hashlib, sys\n"
        "from model.data import load_dataset, validation_batches\n"
        f"ds = load_dataset({str(corpus)!r}, {VOCAB}, cache_dir={str(cache)!r})\n"
        "h = hashlib.sha256()\n"
        f"for x, y in validation_batches(ds, {B}, {T}, {N}):\n"
        "    h.update(x.numpy().tobytes()); h.update(y.numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here


def test_validation_shard_too_small(tmp_path, ds):
    write_parquet(tmp_path / "a.parquet", paragraphs()[:200])
    write_parquet(tmp_path / "b.parquet", ["a very short validation text"])
    small = load_dataset(str(tmp_path), None, cache_dir=tmp_path / "cache", tokenizer=ds.tokenizer)
    with pytest.raises(DataError, match="fewer than one row") as err:
        validation_batches(small, 4, 64, 4096)
    assert_one_line_naming(err, small.val_shard.path)


# --- several processes on a cold cache -------------------------------------------------------------------


def test_concurrent_cold_cache(tmp_path, corpus):
    cache = tmp_path / "cache"
    code = (
        "import sys, json\n"
        "from model.data import load_dataset\n"
        f"ds = load_dataset({str(corpus)!r}, 300, cache_dir={str(cache)!r})\n"
        "print(json.dumps(ds.describe()))\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert len({out for out, _ in outs}) == 1
    assert not list(cache.rglob("*.tmp"))
    assert len(list((cache / "tokenizers").glob("*.json"))) == 1
    assert len(list((cache / "tokens").rglob("*.tok"))) == 4


def test_data_error_pickles():
    err = pickle.loads(pickle.dumps(DataError("/x/y.parquet", "bad\nthing")))
    assert isinstance(err, DataError) and str(err) == "/x/y.parquet: bad thing"


def test_cli_builds_and_describes(corpus, cache, capsys):
    from model.data.__main__ import main

    assert main([str(corpus), "--vocab-size", str(VOCAB), "--cache-dir", str(cache)]) == 0
    assert f'"vocab_size": {VOCAB}' in capsys.readouterr().out
    assert main([str(corpus / "missing"), "--cache-dir", str(cache)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing" in err
