"""The kit-dialect stand-in (sweep/studies/kit-demo/prepare.py) and the baseline-style train.py beside it.

One kit per module: both files copied into a scratch folder and `python prepare.py setup` run there once, as a
team does once per machine. Ranks of the loader are simulated through torchrun's environment (RANK,
WORLD_SIZE); the script's own runs are real two-rank torchrun launches with gloo on the CPU.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import ROOT, subprocess_env
from tests.kit_standin import import_prepare

KIT_DEMO = ROOT / "sweep" / "studies" / "kit-demo"
CPU = torch.device("cpu")
ENV_PREFIX = "NEURON_COMPETITION_R1_"
PROGRESS = re.compile(
    r"^step (\d{5}) \| loss (\d+\.\d{4}) \| lrm (\d\.\d{3}) \| dt (\d+\.\d{2})s \| tok/s (\d{1,3}(?:,\d{3})*) \| "
    r"remaining_steps (\d+) \| remaining_time (\d+)s \| epoch (\d+)$")
SUMMARY_KEYS = ["checkpoint_path", "training_seconds", "budget_seconds", "target_steps", "max_train_seconds",
                "startup_allowance_est", "charged_seconds_est", "over_budget", "total_seconds", "compiled",
                "num_steps", "total_tokens_M", "world_size", "lnc", "seq_len", "num_params_M",
                "causality_passed", "causality_max_abs", "public_val_bpb", "eval_seconds", "eval_timeout",
                "eval_over_timeout"]
EVAL_KEYS = {"val_bpb", "total_nats", "num_tokens", "num_bytes", "eval_seconds", "eval_timeout", "eval_over_timeout"}


def kit_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any kit variable of its own, plus `extra`."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith(ENV_PREFIX)}
    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def torchrun(kit: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py", *args]
    return subprocess.run(cmd, cwd=kit, env=env or kit_env(), capture_output=True, text=True, timeout=300)


def processes_in(folder: Path) -> list[int]:
    """Pids of live processes whose working directory is `folder`."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/cwd") == str(folder):
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    """A fresh kit: prepare.py and train.py copied into a scratch folder, `python prepare.py setup` run once."""
    root = tmp_path_factory.mktemp("kitdialect") / "kit"
    root.mkdir()
    for name in ("prepare.py", "train.py"):
        shutil.copy(KIT_DEMO / name, root / name)
    proc = subprocess.run([sys.executable, "prepare.py", "setup"], cwd=root, env=kit_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root


@pytest.fixture(scope="module")
def prepare(kit) -> Iterator[ModuleType]:
    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.startswith(ENV_PREFIX)] + ["RANK", "WORLD_SIZE", "LOCAL_RANK"]:
            mp.delenv(name, raising=False)
        yield import_prepare(kit / "prepare.py")


@pytest.fixture(scope="module")
def tokenizer(prepare):
    return prepare.ensure_tokenizer()


@pytest.fixture(scope="module")
def trained(kit) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The baseline-style script trained for 8 charged seconds on two ranks, with --eval-public."""
    step_log = kit / "steps.log"
    proc = torchrun(kit, "--max-train-seconds", "8", "--eval-public", "--eval-tokens", "16384",
                    env=kit_env(NEURON_COMPETITION_R1_STEP_LOG=str(step_log)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, step_log


def import_train(kit: Path, mp: pytest.MonkeyPatch, prepare: ModuleType) -> ModuleType:
    """The kit's train.py as a module, registered (and its `prepare` import resolved) for this test only."""
    mp.setitem(sys.modules, "prepare", prepare)
    spec = importlib.util.spec_from_file_location("kit_dialect_train", kit / "train.py")
    module = importlib.util.module_from_spec(spec)
    mp.setitem(sys.modules, "kit_dialect_train", module)
    spec.loader.exec_module(module)
    return module


class Bigram(nn.Module):
    """Next-token logits from the current token alone (causal), through a narrow table; takes the per-token
    keyword `keyword` only. With peek, the next input token leaks into each position's logits."""

    def __init__(self, vocab: int, keyword: str = "reduction", peek: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, vocab)
        self.keyword, self.peek = keyword, peek

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        if self.peek:
            h = h + self.embed(torch.roll(x, -1, dims=1))
        return self.head(h)

    def forward(self, x, y, **kw):
        unknown = set(kw) - {self.keyword}
        if unknown:
            raise TypeError(f"forward() got an unexpected keyword argument {unknown.pop()!r}")
        logits = self.logits(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1),
                               reduction=kw.get(self.keyword, "mean"))


def val_stream(prepare: ModuleType, tokenizer, groups: list[int] | None = None) -> list[int]:
    """public_val's documents (of the given row groups, else all), BOS in front of each, as one token list."""
    path = Path(prepare.data_dir()) / "public_val_00000.parquet"
    f = pq.ParquetFile(path)
    out: list[int] = []
    for g in groups if groups is not None else range(f.num_row_groups):
        texts = f.read_row_group(g).column("text").to_pylist()
        for row in tokenizer.encode(texts, prepend=tokenizer.get_bos_token_id()):
            out.extend(row)
    return out


# ---- prepare.py -------------------------------------------------------------------------------------

def test_setup_builds_data_and_tokenizer_once_with_the_kit_constants(kit, prepare, tokenizer):
    assert sorted(os.listdir(kit / "data")) == ["public_val_00000.parquet"] + [f"train_{i:05d}.parquet"
                                                                                for i in range(7)]
    assert (kit / "tokenizer" / "tokenizer.json").is_file() and (kit / "tokenizer" / "token_bytes.pt").is_file()
    stamps = {p: p.stat().st_mtime_ns for p in [*(kit / "data").iterdir(), *(kit / "tokenizer").iterdir()]}
    again = subprocess.run([sys.executable, "prepare.py", "setup", "--build-tokenizer-if-missing"], cwd=kit,
                           env=kit_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # idempotent: nothing rebuilt

    assert (prepare.TRAIN_TIME_BUDGET_SECONDS, prepare.TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS,
            prepare.TRAIN_STARTUP_STEPS_EXCLUDED, prepare.EVAL_TIMEOUT_SECONDS,
            prepare.TOKENIZER_VOCAB_SIZE) == (1800, 900, 5, 1200, 8192)
    assert not any(hasattr(prepare, n) for n in ("MAX_SEQ_LEN", "EVAL_TOKENS", "TIME_BUDGET"))
    assert tokenizer.get_vocab_size() == 8192 and tokenizer.get_bos_token_id() == 8188
    text = "def main():\n    return 42  # the answer"
    ids = tokenizer.encode(text, prepend=tokenizer.get_bos_token_id())
    assert ids[0] == 8188 and tokenizer.enc.decode(ids[1:]) == text
    assert tokenizer.encode([text, text], num_threads=2) == [ids[1:], ids[1:]]
    lengths = prepare.get_token_bytes(device="cpu")
    assert lengths.shape == (8192,) and lengths[8188:].tolist() == [0, 0, 0, 0]
    assert sum(lengths[i].item() for i in ids[1:]) == len(text.encode())


def test_tokenizer_path_and_step_log_come_from_the_environment(kit, prepare, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_COMPETITION_R1_TOKENIZER_PATH", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        prepare.ensure_tokenizer()
    monkeypatch.setenv("NEURON_COMPETITION_R1_TOKENIZER_PATH", str(kit / "tokenizer" / "tokenizer.json"))
    assert prepare.ensure_tokenizer().get_bos_token_id() == 8188

    log = tmp_path / "steps.log"
    prepare.record_step_boundary(0)  # no step log named: nothing written anywhere
    monkeypatch.setenv("NEURON_COMPETITION_R1_STEP_LOG", str(log))
    prepare.record_step_boundary(0)
    prepare.record_step_boundary(1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    prepare.record_step_boundary(2)  # rank 1 writes nothing
    lines = [line.split() for line in log.read_text().splitlines()]
    assert [int(s) for s, _ in lines] == [0, 1] and float(lines[0][1]) <= float(lines[1][1])


def test_dataloader_yields_the_kit_batches(prepare, tokenizer):
    loader = prepare.make_dataloader(tokenizer, 3, 16, "train", CPU)
    x, y, info = next(loader)
    assert (x.dtype, y.dtype, tuple(x.shape), tuple(y.shape), info) == (torch.int32, torch.int64, (3, 16), (3, 16),
                                                                          {"epoch": 1})
    flat_x, flat_y = x.reshape(-1).long(), y.reshape(-1)
    assert torch.equal(flat_x[1:], flat_y[:-1])  # one stream: each target is the next input
    x2, _, _ = next(loader)
    assert x2[0, 0].item() == y[-1, -1].item()  # the next batch goes on where this one stopped
    assert x[0, 0].item() == tokenizer.get_bos_token_id()

    val = val_stream(prepare, tokenizer)
    vx, vy, _ = next(prepare.make_dataloader(tokenizer, 2, 8, "public_val", CPU))
    assert vx.reshape(-1).tolist() == val[:16] and vy.reshape(-1).tolist() == val[1:17]


def test_unknown_split_is_refused_by_name(prepare, tokenizer):
    with pytest.raises(ValueError, match="'val'"):
        prepare.make_dataloader(tokenizer, 1, 8, "val", CPU)
    with pytest.raises(ValueError, match="'private'"):
        prepare.evaluate_bpb(Bigram(8192), tokenizer, 1, 8, CPU, split="private", max_tokens=8)


def test_two_ranks_read_every_other_row_group_and_no_common_row(prepare, tokenizer, monkeypatch):
    groups = pq.ParquetFile(Path(prepare.data_dir()) / "public_val_00000.parquet").num_row_groups
    assert groups >= 4
    T = 32
    rows: dict[int, set[tuple[int, ...]]] = {}
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert prepare.get_dist_info() == (True, rank, 0, 2)
        expected = val_stream(prepare, tokenizer, list(range(rank, groups, 2)))
        loader = prepare.make_dataloader(tokenizer, 4, T, "public_val", CPU)
        got: list[int] = []
        rows[rank] = set()
        while len(got) < len(expected) - 4 * T:
            x, _, info = next(loader)
            assert info["epoch"] == 1
            got.extend(x.reshape(-1).tolist())
            rows[rank].update(tuple(r) for r in x.tolist())
        assert got == expected[:len(got)]  # exactly this rank's row groups, in order
    assert rows[0] and rows[1] and not rows[0] & rows[1]


def test_evaluate_bpb_equals_a_hand_computation(prepare, tokenizer):
    B, T, batches = 2, 64, 3
    model = Bigram(8192).eval()
    result = prepare.evaluate_bpb(model, tokenizer, B, T, CPU, split="public_val", max_tokens=batches * B * T,
                                  timeout_seconds=600)
    assert set(result) == EVAL_KEYS

    stream = torch.tensor(val_stream(prepare, tokenizer)[:batches * B * T + 1])
    with torch.no_grad():
        losses = F.cross_entropy(model.logits(stream[:-1].view(1, -1))[0], stream[1:], reduction="none").double()
    lengths = prepare.get_token_bytes()[stream[1:]].long()
    nats = losses[lengths > 0].sum().item()
    nbytes = lengths.sum().item()
    assert result["num_tokens"] == batches * B * T and result["num_bytes"] == nbytes
    assert math.isclose(result["total_nats"], nats, rel_tol=1e-9)
    assert math.isclose(result["val_bpb"], nats / (math.log(2) * nbytes), rel_tol=1e-9)
    assert result["eval_timeout"] == 600 and result["eval_over_timeout"] is False
    assert 0 < result["val_bpb"] < 20

    # teams' keyword gives the same figure; a model with neither keyword is refused by name
    other = prepare.evaluate_bpb(Bigram(8192, keyword="loss_reduction").eval(), tokenizer, B, T, CPU,
                                 max_tokens=batches * B * T)
    assert other["val_bpb"] == result["val_bpb"]
    with pytest.raises(TypeError, match="loss_reduction, reduction"):
        prepare.evaluate_bpb(Bigram(8192, keyword="how").eval(), tokenizer, B, T, CPU, max_tokens=B * T)
    late = prepare.evaluate_bpb(model, tokenizer, B, T, CPU, max_tokens=batches * B * T, timeout_seconds=0)
    assert late["eval_over_timeout"] is True and late["num_tokens"] == B * T  # stops after the batch in flight


def test_causality_check_passes_a_causal_model_and_fails_a_peeking_one(prepare, tokenizer):
    causal = prepare.causality_check(Bigram(8192).eval(), tokenizer, 2, 32, CPU)
    assert causal == {"passed": True, "max_abs_diff": 0.0}
    peeking = prepare.causality_check(Bigram(8192, peek=True).eval(), tokenizer, 2, 32, CPU)
    assert peeking["passed"] is False and peeking["max_abs_diff"] > 1e-2


# ---- train.py ---------------------------------------------------------------------------------------

def test_two_rank_run_prints_the_kit_progress_and_summary_and_saves_the_checkpoint(kit, trained):
    proc, step_log = trained
    lines = proc.stdout.splitlines()
    cut = lines.index("---")
    progress = [PROGRESS.match(line) for line in lines[:cut] if line.startswith("step ")]
    assert progress and all(progress), [line for line in lines[:cut] if not PROGRESS.match(line)]
    steps = [int(m.group(1)) for m in progress]
    summary = dict(line.split(": ", 1) for line in lines[cut + 1:])
    assert list(summary) == SUMMARY_KEYS and len(lines) - cut - 1 == len(SUMMARY_KEYS)  # the block is last
    n = int(summary["num_steps"])
    assert steps == [s for s in range(n) if s < 5 or s % 10 == 0]  # rank 0 only: no line twice
    assert n > 5 and int(progress[-1].group(8)) == 1
    assert (summary["world_size"], summary["seq_len"], summary["over_budget"], summary["compiled"],
            summary["causality_passed"], summary["eval_over_timeout"]) == ("2", "256", "False", "False", "True",
                                                                            "False")
    assert summary["checkpoint_path"] == "out/final.pt" and summary["budget_seconds"] == "1800"
    assert float(summary["max_train_seconds"]) == 8.0
    assert float(summary["charged_seconds_est"]) >= 8.0 - 1.0  # it stops only when the budget less its reserve is spent
    assert 0 < float(summary["public_val_bpb"]) < 4
    assert math.isclose(float(summary["total_tokens_M"]), n * 2 * 4 * 256 / 1e6, abs_tol=1e-3)

    ckpt = torch.load(kit / "out" / "final.pt", map_location="cpu", weights_only=True)
    assert set(ckpt) == {"model_state", "model_config", "meta"} and ckpt["meta"]["num_steps"] == n
    log = [line.split() for line in step_log.read_text().splitlines()]
    assert [int(s) for s, _ in log] == list(range(n))  # one line a step, from rank 0 alone
    times = [float(t) for _, t in log]
    assert times == sorted(times)


def test_eval_public_scores_the_checkpoint_as_load_for_eval_does_in_process(kit, trained, prepare, tokenizer):
    cmd = [sys.executable, "prepare.py", "eval-public", "--train-py", "train.py", "--checkpoint", "out/final.pt",
           "--seq-len", "512", "--eval-tokens", "16384", "--batch-size", "4", "--device", "cpu"]
    proc = subprocess.run(cmd, cwd=kit, env=kit_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = json.loads(proc.stdout)
    assert set(printed) == EVAL_KEYS and proc.stdout.strip() == json.dumps(printed, indent=2, sort_keys=True)
    assert printed["num_tokens"] == 16384

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        train = import_train(kit, mp, prepare)
        model = train.load_for_eval(str(kit / "out" / "final.pt"), CPU)
        assert not model.training
        torch.set_num_threads(1)  # as the scorer's process ran (OMP_NUM_THREADS=1)
        try:
            mine = prepare.evaluate_bpb(model, tokenizer, 4, 512, CPU, max_tokens=16384)
            x, y, _ = next(prepare.make_dataloader(tokenizer, 2, 512, "public_val", CPU))
            with torch.no_grad():
                a, b, mean = model(x, y, loss_reduction="none"), model(x, y, reduction="none"), model(x, y)
        finally:
            torch.set_num_threads(threads)
    assert abs(mine["val_bpb"] - printed["val_bpb"]) <= 1e-9
    assert torch.equal(a, b) and a.shape == (2 * 512,) and math.isclose(a.mean().item(), mean.item(), rel_tol=1e-5)


def test_bad_loss_stops_every_rank_and_leaves_no_process(kit, tmp_path):
    """A copy of the script whose learning rates blow the loss up, on the kit's data through the cache dir."""
    copy = tmp_path / "diverge"
    copy.mkdir()
    shutil.copy(kit / "prepare.py", copy / "prepare.py")
    text = (kit / "train.py").read_text()
    for name in ("MATRIX_LR", "EMBED_LR", "UNEMBED_LR"):
        text, n = re.subn(rf"^{name} = .*$", f"{name} = 1e9", text, count=1, flags=re.MULTILINE)
        assert n == 1
    (copy / "train.py").write_text(text)
    proc = torchrun(copy, "--max-train-seconds", "30",
                    env=kit_env(NEURON_COMPETITION_R1_CACHE_DIR=str(kit)))
    assert proc.returncode != 0
    for rank in (0, 1):
        assert re.search(rf"\[rank{rank}\]: RuntimeError: bad loss detected: ", proc.stderr), proc.stderr[-3000:]
    assert "---" not in proc.stdout.splitlines() and not (copy / "out").exists()
    assert processes_in(copy) == []
