"""The competition-kit adapter, against a stand-in prepare.py that implements the kit's documented functions
(tests.byte_kit.FAKE_PREPARE)."""

from __future__ import annotations

import math

import pytest
import torch

from model.data import BatchLoader, DataError, load_dataset, validation_batches
from model.data.kit import ENV_VAR, KitBatchLoader, KitData, load_kit
from tests.byte_kit import FAKE_PREPARE
from tests.model.data.dataset_contract import assert_is_dataset, assert_protocol_is_exactly_members


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
