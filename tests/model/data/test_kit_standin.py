"""The stand-in competition kit (tests/kit_standin, autoresearch's prepare.py semantics) and the adapter on it.

The stand-in's loader takes no rank and reuses its buffers; its evaluate_bpb takes no device and always runs
at MAX_SEQ_LEN (2048 here). The adapter must split ranks itself, copy what it keeps, and score the very rows
evaluate_bpb scores, whatever length the model trained at. Ranks are simulated by threads that meet in a
barrier, as a collective would: no process is launched.
"""

from __future__ import annotations

import inspect
import math
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from model.config import GPTConfig
from model.data import BatchLoader, load_dataset, scoring_set, validation_batches
from model.data.kit import KitBatchLoader, load_kit
from model.evaluate import evaluate_bpb, final_val_bpb
from model.gpt import GPT
from tests.conftest import KIT_EVAL_ROWS, TINY
from tests.kit_standin import PREPARE, VAL_NAME, import_prepare
from tests.model.data.dataset_contract import assert_is_dataset

CPU = torch.device("cpu")
VOCAB = TINY["vocab_size"]


def tiny_gpt(seq_len: int = 32, seed: int = 0) -> GPT:
    """A small GPT with random weights (far from the near-uniform initialisation, so that rows matter)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, depth=1, model_dim=32, head_dim=16, seq_len=seq_len, kernels="torch"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def as_ranks(world_size: int, fn):
    """fn(rank, same_on_all_ranks) on one thread per rank; same_on_all_ranks is a collective between them."""
    barrier = threading.Barrier(world_size)
    seen: list = [None] * world_size
    out: list = [None] * world_size
    errors: list = []

    def collective(rank: int):
        def same(value: int) -> bool:
            seen[rank] = value
            barrier.wait()
            agreed = len(set(seen)) == 1
            barrier.wait()
            return agreed
        return same

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank, collective(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the other ranks are released
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return out


def real_rows(per_rank: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> list[torch.Tensor]:
    """The rows of ranks' batches in global order (batch k of rank 0, of rank 1, ...), padding left out."""
    rows = []
    for k in range(len(per_rank[0])):
        for batches in per_rank:
            x, y = batches[k]
            rows += [torch.cat([x[i], y[i]]) for i in range(x.shape[0]) if y[i, 0] >= 0]
    return rows


def splitting_kit(tmp_path: Path, base: Path, constants: bool = True) -> Path:
    """A kit wrapping the stand-in: a loader that takes rank and world_size and deals batches round robin
    (`constants=False`: the kit says nothing of MAX_SEQ_LEN and EVAL_TOKENS, and its loader takes no rank)."""
    path = tmp_path / ("splitting" if constants else "silent") / "prepare.py"
    path.parent.mkdir()
    lines = [
        "import importlib.util",
        f"_spec = importlib.util.spec_from_file_location('standin_base', {str(base / 'prepare.py')!r})",
        "_base = importlib.util.module_from_spec(_spec)",
        "_spec.loader.exec_module(_base)",
        "Tokenizer, get_token_bytes, evaluate_bpb = _base.Tokenizer, _base.get_token_bytes, _base.evaluate_bpb",
    ]
    if constants:
        lines += [
            "MAX_SEQ_LEN, EVAL_TOKENS = _base.MAX_SEQ_LEN, _base.EVAL_TOKENS",
            "def make_dataloader(tokenizer, B, T, split, rank=0, world_size=1):",
            "    for k, batch in enumerate(_base.make_dataloader(tokenizer, B, T, split)):",
            "        if k % world_size == rank:",
            "            yield batch",
        ]
    else:
        lines += ["make_dataloader = _base.make_dataloader"]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- the stand-in is the kit's shape --------------------------------------------------------------------

# What the stand-in must have, written out from autoresearch's prepare.py (karpathy/autoresearch, the interface
# the stand-in's docstring names) and from the competition kit's clock constants (docs/competition.md), not
# read from the stand-in: each name with its signature or value.
AUTORESEARCH_SIGNATURES = {
    "make_dataloader": "(tokenizer, B, T, split, buffer_size=1000)",
    "evaluate_bpb": "(model, tokenizer, batch_size)",
    "get_token_bytes": "(device='cpu')",
    "train_tokenizer": "()",
    "Tokenizer.__init__": "(self, enc)",
    "Tokenizer.get_vocab_size": "(self)",
    "Tokenizer.get_bos_token_id": "(self)",
    "Tokenizer.encode": "(self, text, prepend=None, num_threads=8)",
    "Tokenizer.decode": "(self, ids)",
}
AUTORESEARCH_CONSTANTS = {"MAX_SEQ_LEN": 2048, "TIME_BUDGET": 300, "EVAL_TOKENS": 40 * 524288, "VOCAB_SIZE": 8192,
                          "VAL_FILENAME": "shard_06542.parquet", "BOS_TOKEN": "<|reserved_0|>",
                          "SPECIAL_TOKENS": ["<|reserved_0|>", "<|reserved_1|>", "<|reserved_2|>", "<|reserved_3|>"]}
KIT_CLOCK_CONSTANTS = {"TRAIN_TIME_BUDGET_SECONDS": 1800, "TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS": 900,
                       "TRAIN_STARTUP_STEPS_EXCLUDED": 2}


def test_the_standin_has_the_kits_interface(standin_kit):
    pristine = import_prepare(PREPARE)  # the file as shipped, before tests rewrite its constants
    for name, value in {**AUTORESEARCH_CONSTANTS, **KIT_CLOCK_CONSTANTS}.items():
        assert getattr(pristine, name) == value, name
    assert list(inspect.signature(pristine.Tokenizer.from_directory).parameters) == ["tokenizer_dir"]
    kit = import_prepare(standin_kit / "prepare.py")
    for name, signature in AUTORESEARCH_SIGNATURES.items():
        owner, _, attr = name.rpartition(".")
        assert str(inspect.signature(getattr(getattr(kit, owner) if owner else kit, attr))) == signature, name
    assert kit.MAX_SEQ_LEN == 2048 and kit.EVAL_TOKENS == KIT_EVAL_ROWS * 2048  # as tests/conftest.py rewrote it
    tok = kit.Tokenizer.from_directory()
    bos = tok.get_bos_token_id()
    assert tok.get_vocab_size() == VOCAB and bos == VOCAB - 4  # four reserved specials after the merged tokens
    lengths = kit.get_token_bytes()
    assert lengths.dtype == torch.int32 and lengths.shape == (VOCAB,)
    assert (lengths[VOCAB - 4:] == 0).all() and (lengths[:VOCAB - 4] > 0).all()
    assert all(int(lengths[i]) == len(tok.decode([i]).encode()) for i in range(VOCAB - 4))
    ids = tok.encode("déjà vu", prepend=bos)
    assert ids[0] == bos and tok.decode(ids[1:]) == "déjà vu"
    assert tok.encode(["a b", "c"], prepend=bos) == [tok.encode("a b", prepend=bos), tok.encode("c", prepend=bos)]


def test_the_standin_loader_packs_best_fit_rows_into_buffers_it_reuses(standin_kit):
    kit = import_prepare(standin_kit / "prepare.py")
    tok = kit.Tokenizer.from_directory()
    bos = tok.get_bos_token_id()
    B, T = 4, 256
    it = kit.make_dataloader(tok, B, T, "val")
    x, y, epoch = next(it)
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (B, T)
    assert (x[:, 0] == bos).all() and torch.equal(x[:, 1:], y[:, :-1])
    first = torch.cat([x[0], y[0, -1:]])
    kept = x.clone()
    x2, _, _ = next(it)
    assert x2.data_ptr() == x.data_ptr() and not torch.equal(x, kept)  # one buffer, overwritten

    # Row 0 starts with the first of the longest documents that fit whole in T + 1 tokens, among those the
    # buffer held: whole batches of 128, row group by row group, until there were at least 1000.
    # The shard is read again, the epoch counted up, as often as it takes (the demo's has fewer than 1000).
    f = pq.ParquetFile(standin_kit / "data" / VAL_NAME)
    texts: list[str] = []
    passes = 0
    while len(texts) < 1000:
        passes += 1
        for g in range(f.num_row_groups):
            group = f.read_row_group(g).column("text").to_pylist()
            for i in range(0, len(group), 128):
                if len(texts) < 1000:
                    texts += group[i:i + 128]
    assert epoch == passes
    docs = tok.encode(texts, prepend=bos)
    best = max((d for d in docs if len(d) <= T + 1), key=len)  # max keeps the first of equals
    assert first[:len(best)].tolist() == best

    for _ in range(2000):  # the validation stream is endless: it starts over, the epoch counted up
        if next(it)[2] > epoch:
            break
    else:
        pytest.fail("the validation stream never started over")


# ---- the adapter on it ---------------------------------------------------------------------------------

def test_the_adapter_reads_the_standin_and_copies_what_it_keeps(standin_kit):
    kit = load_dataset(f"kit:{standin_kit}", VOCAB)
    assert_is_dataset(kit, is_kit=True)
    assert (kit.eval_seq_len, kit.eval_tokens) == (2048, KIT_EVAL_ROWS * 2048)
    assert torch.equal(kit.token_bytes, kit.module.get_token_bytes())
    B, T = 3, 48
    loader = BatchLoader(kit, B, T)
    assert isinstance(loader, KitBatchLoader)
    kept = [next(loader) for _ in range(4)]  # the kit overwrites its buffer each batch: these must be copies
    fresh = kit.module.make_dataloader(kit.tokenizer.kit, B, T, "train")
    for x, y in kept:
        fx, fy, _ = next(fresh)
        assert x.dtype == y.dtype == torch.int64 and torch.equal(x, fx) and torch.equal(y, fy)


def test_final_val_bpb_is_the_kits_evaluate_bpb_at_2048_for_a_model_trained_shorter(standin_kit):
    kit = load_kit(standin_kit)
    model = tiny_gpt(seq_len=32)
    B = 4
    theirs = kit.module.evaluate_bpb(model, kit.tokenizer.kit, B)  # the kit's metric, at its MAX_SEQ_LEN
    assert model.cos.size(1) == 2048  # the rotary tables grew to the kit's length
    ours = final_val_bpb(model, kit, B, 32, 65536, 0, 0, CPU)
    assert ours["val_bpb"] == pytest.approx(theirs, rel=1e-6) and ours["val_bpb_stderr"] == 0.0
    assert ours["val_seq_len"] == 2048 and ours["val_rows"] == ours["val_population_rows"] == KIT_EVAL_ROWS
    assert ours["val_tokens"] <= KIT_EVAL_ROWS * 2048 < ours["val_bytes"]

    # The kit's own evaluate_bpb through the adapter (a kit that names no rows): the same figure, and the
    # model saw exactly those rows.
    bpb, seen = kit.evaluate(model, B, CPU)
    assert bpb == pytest.approx(theirs, rel=1e-12) and seen["rows"] == KIT_EVAL_ROWS
    assert seen["nats"] / (math.log(2) * seen["bytes"]) == pytest.approx(theirs, rel=1e-6)
    assert (seen["tokens"], seen["bytes"]) == (ours["val_tokens"], ours["val_bytes"])


def test_a_sample_of_the_kits_rows_is_fixed_and_carries_its_standard_error(standin_kit):
    kit = load_kit(standin_kit)
    model = tiny_gpt(seq_len=64, seed=1)
    full = final_val_bpb(model, kit, 4, 64, 65536, 0, 0, CPU)
    part = final_val_bpb(model, kit, 4, 64, 65536, 6, 0, CPU)
    assert (part["val_rows"], part["val_population_rows"]) == (6, KIT_EVAL_ROWS)
    assert part["val_bpb_stderr"] > 0 and abs(part["val_bpb"] - full["val_bpb"]) < 4 * part["val_bpb_stderr"]
    assert final_val_bpb(model, kit, 4, 64, 65536, 6, 0, CPU) == part  # the same rows every time
    with pytest.raises(ValueError, match="MAX_SEQ_LEN 2048"):
        scoring_set(kit, 4, 64, 65536, eval_seq_len=1024)


def test_a_kit_that_names_no_rows_is_scored_by_its_own_evaluate_bpb(standin_kit, tmp_path):
    kit = load_kit(splitting_kit(tmp_path, standin_kit, constants=False))
    assert kit.eval_seq_len is None and scoring_set(kit, 4, 32, 65536) is None
    model = tiny_gpt()
    got = final_val_bpb(model, kit, 4, 32, 65536, 0, 0, CPU)
    with torch.inference_mode():  # as final_val_bpb calls it: the same cross-entropy path, so the same digits
        theirs = kit.module.evaluate_bpb(model, kit.tokenizer.kit, 4)
    assert got["val_bpb"] == pytest.approx(theirs, rel=1e-12)
    # Outside inference mode the loss takes F.cross_entropy unchunked: equal to float32 rounding (how many
    # digits agree depends on the CPU's vector width).
    assert got["val_bpb"] == pytest.approx(kit.module.evaluate_bpb(model, kit.tokenizer.kit, 4), rel=1e-6)
    assert got["val_rows"] == KIT_EVAL_ROWS and got["val_bpb_stderr"] == 0.0


# ---- ranks -----------------------------------------------------------------------------------------------

def test_the_adapter_splits_a_loader_that_takes_no_rank(standin_kit):
    B, T = 2, 64
    naive = load_kit(standin_kit).make_loader(B, T, "train", rank=1, world_size=2)  # the rank goes nowhere
    assert torch.equal(next(naive)[0], next(load_kit(standin_kit).make_loader(B, T, "train"))[0])

    def ranks_read(rank, same):
        kit = load_kit(standin_kit)
        loader = BatchLoader(kit, B, T, rank=rank, world_size=2, same_on_all_ranks=same)
        return kit.split, [next(loader) for _ in range(3)]

    load_kit(standin_kit)  # imported once, before the threads share it
    for collective in (True, False):  # asked of the data through a collective, or read off the signature
        got = as_ranks(2, ranks_read if collective else (lambda rank, same: ranks_read(rank, None)))
        assert [mode for mode, _ in got] == ["adapter", "adapter"]
        single = BatchLoader(load_kit(standin_kit), 2 * B, T)
        for (x0, y0), (x1, y1) in zip(got[0][1], got[1][1], strict=True):
            x, y = next(single)  # rank 0 reads the first B rows of each 2B, rank 1 the next B: disjoint
            assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)


def test_a_loader_that_splits_ranks_is_left_to_do_so(standin_kit, tmp_path):
    path = splitting_kit(tmp_path, standin_kit)
    B, T = 2, 64

    def ranks_read(rank, same):
        kit = load_kit(path)
        loader = BatchLoader(kit, B, T, rank=rank, world_size=2, same_on_all_ranks=same)
        return kit.split, [next(loader) for _ in range(2)]

    load_kit(path)  # imported once, before the threads share it
    got = as_ranks(2, ranks_read)
    assert [mode for mode, _ in got] == ["kit", "kit"]
    stream = load_kit(standin_kit).make_loader(B, T, "train")
    batches = [next(stream)[0].clone() for _ in range(4)]
    assert torch.equal(got[0][1][0][0], batches[0]) and torch.equal(got[1][1][0][0], batches[1])
    assert torch.equal(got[0][1][1][0], batches[2]) and torch.equal(got[1][1][1][0], batches[3])


def test_validation_and_scoring_rows_are_shared_across_ranks_without_overlap(standin_kit):
    B, T = 2, 64

    def ranks_score(rank, same):
        kit = load_kit(standin_kit)
        val = validation_batches(kit, B, T, 10 * T, rank, 2, same_on_all_ranks=same)
        final = scoring_set(kit, B, T, 65536, rank=rank, world_size=2, same_on_all_ranks=same)
        return val, final

    one = load_kit(standin_kit)  # imported once, before the threads share it
    (val0, final0), (val1, final1) = as_ranks(2, ranks_score)
    val = validation_batches(one, 2 * B, T, 10 * T)
    final = scoring_set(one, 2 * B, T, 65536)
    assert [torch.equal(a, b) for a, b in zip(real_rows([val0, val1]), real_rows([val]), strict=True)] == [True] * 10
    rows = real_rows([final.batches])
    assert len(rows) == KIT_EVAL_ROWS == final0.population == final1.population
    assert all(torch.equal(a, b) for a, b in zip(real_rows([final0.batches, final1.batches]), rows, strict=True))

    # Scored rank by rank and summed, as the all-reduce does: the single rank's figure.
    model = tiny_gpt()
    parts = [evaluate_bpb(model, f.batches, one.token_bytes, CPU) for f in (final0, final1)]
    whole = evaluate_bpb(model, final.batches, one.token_bytes, CPU)
    assert sum(p.bytes for p in parts) == whole.bytes and sum(p.rows for p in parts) == whole.rows
    assert sum(p.nats for p in parts) == pytest.approx(whole.nats, rel=1e-9)


# ---- our own data -------------------------------------------------------------------------------------

def test_our_own_final_rows_are_fixed_and_at_the_length_asked(data_cache):
    ds = load_dataset(None, VOCAB, cache_dir=data_cache)
    full = scoring_set(ds, 4, 32, 128 * 12, eval_seq_len=128)
    assert (full.seq_len, full.rows, full.population) == (128, 12, 12) and full.exact
    assert [tuple(x.shape) for x, _ in full.batches] == [(4, 128)] * 3
    part = scoring_set(ds, 4, 32, 128 * 12, sample_rows=5, eval_seq_len=128)
    assert (part.rows, part.population) == (5, 12) and not part.exact
    rows = real_rows([full.batches])
    sampled = real_rows([part.batches])
    assert all(any(torch.equal(s, r) for r in rows) for s in sampled)  # a sample of the same rows
    again = real_rows([scoring_set(ds, 4, 32, 128 * 12, sample_rows=5, eval_seq_len=128).batches])
    assert all(torch.equal(a, b) for a, b in zip(sampled, again, strict=True))
