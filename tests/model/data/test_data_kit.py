"""The competition-kit adapter, against a stand-in prepare.py that implements the kit's documented functions.

The real kit is not public; FAKE_PREPARE follows what is known of it (model/data/kit.py's module doc): a
tiktoken tokenizer with four reserved specials, BOS = <|reserved_0|>, make_dataloader yielding
(x int32, y int64, state), get_token_bytes and evaluate_bpb.
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from model.data import BatchLoader, DataError, load_dataset, validation_batches
from model.data.kit import ENV_VAR, KitBatchLoader, KitData, load_kit
from tests.model.data.dataset_contract import assert_is_dataset, assert_protocol_is_exactly_members

FAKE_PREPARE = textwrap.dedent(
    '''
    """Stand-in for the competition kit's prepare.py: byte-level tokenizer, tiny corpus."""
    import tiktoken
    import torch

    TOKENIZER_VOCAB_SIZE = 260
    BOS_TOKEN = "<|reserved_0|>"
    EVAL_SEQ_LEN = 16
    DOCS = {
        "train": [f"training document number {i}: " + "lorem ipsum dolor " * (i % 7) for i in range(200)],
        "val": [f"validation text {i}, déjà vu " * (1 + i % 3) for i in range(50)],
    }


    class Tokenizer:
        def __init__(self, enc):
            self.enc = enc
            self.bos_token_id = enc.encode_single_token(BOS_TOKEN)

        @classmethod
        def from_directory(cls, tokenizer_dir=None):
            ranks = {bytes([i]): i for i in range(256)}
            specials = {f"<|reserved_{i}|>": 256 + i for i in range(4)}
            return cls(tiktoken.Encoding(name="fake", pat_str=r"\\S+|\\s+", mergeable_ranks=ranks,
                                         special_tokens=specials))

        def get_vocab_size(self):
            return self.enc.n_vocab

        def get_bos_token_id(self):
            return self.bos_token_id

        def encode(self, text, prepend=None):
            if isinstance(text, str):
                ids = self.enc.encode_ordinary(text)
                return [prepend, *ids] if prepend is not None else ids
            return [self.encode(t, prepend) for t in text]

        def decode(self, ids):
            return self.enc.decode(ids)


    def get_token_bytes(device="cpu"):
        return torch.tensor([1] * 256 + [0] * 4, dtype=torch.int32, device=device)


    def make_dataloader(tokenizer, B, T, split, device="cpu"):
        bos = tokenizer.get_bos_token_id()
        stream = [t for doc in DOCS[split] for t in tokenizer.encode(doc, prepend=bos)]
        pos, epoch = 0, 1
        while True:
            rows = []
            for _ in range(B):
                if pos + T + 1 > len(stream):
                    pos, epoch = 0, epoch + 1
                rows.append([bos] + stream[pos + 1 : pos + T + 1])
                pos += T
            t = torch.tensor(rows, dtype=torch.long, device=device)
            yield t[:, :-1].to(torch.int32), t[:, 1:].contiguous(), {"epoch": epoch, "pos": pos}


    @torch.no_grad()
    def evaluate_bpb(model, tokenizer, batch_size):
        token_bytes = get_token_bytes()
        loader = make_dataloader(tokenizer, batch_size, EVAL_SEQ_LEN, "val")
        nats, nbytes = 0.0, 0
        for _ in range(3):
            x, y, _ = next(loader)
            loss = model(x, y, reduction="none").view(-1)
            b = token_bytes[y.view(-1)]
            nats += (loss * (b > 0)).sum().item()
            nbytes += b.sum().item()
        return nats / (__import__("math").log(2) * nbytes)
    '''
)


@pytest.fixture
def prepare(tmp_path):
    path = tmp_path / "kit" / "prepare.py"
    path.parent.mkdir()
    path.write_text(FAKE_PREPARE)
    return path


class Uniform(torch.nn.Module):
    """Predicts every token of the 260-token vocabulary with equal probability."""

    def forward(self, x, y, reduction="mean"):
        return torch.full(y.shape, math.log(260.0))


def test_load_kit_exposes_the_dataset_interface(prepare, monkeypatch):
    kit = load_kit(prepare)
    assert isinstance(kit, KitData) and kit.is_kit
    assert kit.vocab_size == 260 and kit.bos_id == 256
    assert kit.token_bytes.dtype == torch.int32 and kit.token_bytes.shape == (260,)
    assert kit.tokenizer.decode(kit.tokenizer.encode("déjà vu")) == "déjà vu"
    assert kit.tokenizer.encode_batch(["a", "bc"]) == [[97], [98, 99]]
    assert kit.tokenizer.as_tokenizer() is not None  # the kit's tiktoken Encoding is reachable
    assert len(kit.fingerprint) == 12

    monkeypatch.setenv(ENV_VAR, str(prepare.parent))
    assert load_kit().fingerprint == kit.fingerprint
    assert load_dataset("kit", 260).fingerprint == kit.fingerprint
    assert load_dataset(f"kit:{prepare}", None).fingerprint == kit.fingerprint


def test_the_kit_adapter_satisfies_the_dataset_protocol(prepare):
    kit = load_dataset(f"kit:{prepare}", 260)
    assert isinstance(kit, KitData)
    assert_is_dataset(kit, is_kit=True)
    assert_protocol_is_exactly_members(kit)


def test_kit_batches_and_resume(prepare):
    kit = load_kit(prepare)
    B, T = 4, 16
    loader = BatchLoader(kit, B, T)
    assert isinstance(loader, KitBatchLoader)
    batches = [next(loader) for _ in range(6)]
    for x, y in batches:
        assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
        assert (x[:, 0] == kit.bos_id).all() and torch.equal(x[:, 1:], y[:, :-1])
    assert loader.position == 6 * B and loader.state["epoch"] >= 1
    resumed = BatchLoader(kit, B, T, position=3 * B)
    for expected in batches[3:]:
        got = next(resumed)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(ValueError):
        BatchLoader(kit, B, T, position=3)


def test_kit_validation_and_metric(prepare):
    kit = load_kit(prepare)
    B, T = 4, 16
    val = validation_batches(kit, B, T, T * 10)
    assert len(val) == 3
    assert all(x.shape == y.shape == (B, T) for x, y in val)
    x, y = val[-1]
    assert (y[2:] == -1).all() and (x[2:] == kit.bos_id).all() and (y[:2] >= 0).all()
    assert kit.evaluate_bpb(Uniform(), 4) == pytest.approx(math.log2(260))


def test_kit_errors_name_the_file(prepare, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(DataError, match=ENV_VAR):
        load_kit()
    with pytest.raises(DataError, match="vocab_size") as err:
        load_dataset(f"kit:{prepare}", 8192)
    assert str(prepare) in str(err.value)

    partial = tmp_path / "partial" / "prepare.py"
    partial.parent.mkdir()
    partial.write_text(FAKE_PREPARE.replace("def evaluate_bpb", "def _evaluate_bpb"))
    with pytest.raises(DataError, match="evaluate_bpb") as err:
        load_kit(partial)
    assert str(partial) in str(err.value) and "\n" not in str(err.value)

    broken = tmp_path / "broken" / "prepare.py"
    broken.parent.mkdir()
    broken.write_text("import a_module_that_is_not_there\n")
    with pytest.raises(DataError, match="import failed") as err:
        load_kit(broken)
    assert str(broken) in str(err.value)
