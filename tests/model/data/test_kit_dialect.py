"""The kit adapter on the competition kit's own dialect (the project's stand-in, fixture `kit_dialect`):
the dialect told from the kit's names, its loader's rank split left alone, its evaluate_bpb dict scored as one
process, its causality_check and step log, and the trainer's record on it. Ranks are simulated through torchrun's
environment, which the kit's get_dist_info reads when no process group is up."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from model.config import GPTConfig
from model.data import BatchLoader, DataError, validation_batches
from model.data.kit import KitBatchLoader, load_kit
from model.gpt import GPT
from tests.byte_kit import FAKE_PREPARE
from tests.conftest import ROOT, subprocess_env

B, T = 4, 32


@pytest.fixture
def kit(kit_dialect, monkeypatch):
    for name in ("NEURON_COMPETITION_R1_CACHE_DIR", "NEURON_COMPETITION_R1_TOKENIZER_PATH", "RANK", "WORLD_SIZE",
                 "LOCAL_RANK", "NEURON_COMPETITION_R1_STEP_LOG"):
        monkeypatch.delenv(name, raising=False)
    return load_kit(kit_dialect)


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=8192, depth=1, model_dim=32, head_dim=16, seq_len=T, kernels="torch"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def never(value: int) -> bool:
    raise AssertionError("the adapter asked the ranks whether the kit splits them: the kit dialect says it does")


def test_the_dialect_is_told_from_the_names_the_kit_defines(kit, kit_dialect, tmp_path, monkeypatch):
    tok = kit.module.ensure_tokenizer()
    assert kit.dialect == "kit" and kit.describe()["dialect"] == "kit" and kit.val_split == "public_val"
    assert kit.vocab_size == kit.module.TOKENIZER_VOCAB_SIZE == 8192 and kit.bos_id == tok.get_bos_token_id() == 8188
    assert torch.equal(kit.token_bytes, kit.module.get_token_bytes())

    other = tmp_path / "autoresearch" / "prepare.py"
    other.parent.mkdir()
    other.write_text(FAKE_PREPARE)
    assert load_kit(other).dialect == "autoresearch" and load_kit(other).val_split == "val"

    # A kit whose declared vocabulary is not its tokenizer's is refused, in one line naming the file.
    liar = tmp_path / "liar" / "prepare.py"
    liar.parent.mkdir()
    liar.write_text((kit_dialect / "prepare.py").read_text().replace("TOKENIZER_VOCAB_SIZE = 8192",
                                                                      "TOKENIZER_VOCAB_SIZE = 4096"))
    monkeypatch.setenv("NEURON_COMPETITION_R1_CACHE_DIR", str(kit_dialect))
    with pytest.raises(DataError, match="TOKENIZER_VOCAB_SIZE is 4096, its tokenizer has 8192 tokens") as err:
        load_kit(liar)
    assert str(liar) in str(err.value) and "\n" not in str(err.value)


def test_a_submissions_imported_prepare_is_the_one_the_adapter_uses(kit_dialect, tmp_path, monkeypatch):
    folder = tmp_path / "team"
    folder.mkdir()
    (folder / "prepare.py").write_bytes((kit_dialect / "prepare.py").read_bytes())
    monkeypatch.setenv("NEURON_COMPETITION_R1_CACHE_DIR", str(kit_dialect))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "prepare", raising=False)
    import prepare  # as train.py imports it

    assert load_kit(folder).module is prepare  # one module: one step log, one tokenizer


def test_training_batches_are_the_kits_own_split_by_rank_never_again(kit, monkeypatch):
    loader = BatchLoader(kit, B, T, same_on_all_ranks=never)
    assert isinstance(loader, KitBatchLoader)
    stream = kit.module.make_dataloader(kit.module.ensure_tokenizer(), B, T, "train", "cpu")
    whole = []
    for _ in range(3):
        x, y = next(loader)
        whole.append(x)
        kx, ky, state = next(stream)
        assert x.dtype == y.dtype == torch.int64 and torch.equal(x, kx.long()) and torch.equal(y, ky)
    assert loader.state == state

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ranked = BatchLoader(kit, B, T, rank=1, world_size=2, same_on_all_ranks=never)
    assert kit.split == "kit" and ranked.batch_size == B
    share = kit.module.make_dataloader(kit.module.ensure_tokenizer(), B, T, "train", "cpu")  # rank 1's, by the kit
    first = next(ranked)
    assert torch.equal(first[0], next(share)[0].long())
    assert not any(torch.equal(first[0], x) for x in whole)  # not the rows one rank reads first

    # Validation (when a run asks for it) is the kit's public_val split.
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    val = validation_batches(kit, B, T, B * T)
    vx, _, _ = next(kit.module.make_dataloader(kit.module.ensure_tokenizer(), B, T, "public_val", "cpu"))
    assert torch.equal(val[0][0], vx.long())


def test_the_score_is_the_kits_evaluate_bpb_dict_as_one_process_scores_it(kit, monkeypatch):
    model = tiny_gpt()
    theirs = kit.module.evaluate_bpb(model, kit.module.ensure_tokenizer(), B, T, "cpu", max_tokens=4096)
    ours = kit.score(model, B, T, 4096, torch.device("cpu"))
    assert set(ours) == {"val_bpb", "total_nats", "num_tokens", "num_bytes", "eval_seconds", "eval_timeout",
                         "eval_over_timeout"}
    assert ours["val_bpb"] == pytest.approx(theirs["val_bpb"], rel=1e-12) and ours["num_tokens"] == 4096
    assert not model.training  # left as it was

    # Rank 0 of 2: the kit alone reads half the rows; one_process() makes it read what eval-public reads.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    half = kit.module.evaluate_bpb(model, kit.module.ensure_tokenizer(), B, T, "cpu", max_tokens=4096)
    assert half["num_tokens"] == 2048 and half["val_bpb"] != theirs["val_bpb"]
    assert kit.scores_alone
    with kit.one_process():
        alone = kit.score(model, B, T, 4096, "cpu")
    assert alone["val_bpb"] == pytest.approx(theirs["val_bpb"], rel=1e-12) and alone["num_tokens"] == 4096
    assert kit.module.get_dist_info() == (True, 0, 0, 2)  # restored


class Leaky(torch.nn.Module):
    """Per-token losses that see the whole row: not causal."""

    def forward(self, x, y=None, reduction="mean"):
        loss = 5.0 + 1e-2 * x.float().mean(dim=1, keepdim=True).expand(y.shape)
        return loss.reshape(-1) if reduction == "none" else loss.mean()


def test_causality_check_and_the_step_log(kit, tmp_path, monkeypatch):
    assert kit.causality(tiny_gpt(), B, T, "cpu") == {"passed": True, "max_abs_diff": pytest.approx(0.0, abs=1e-5)}
    leaky = kit.causality(Leaky(), B, T, "cpu")
    assert leaky["passed"] is False and leaky["max_abs_diff"] > 1e-4

    log = tmp_path / "steps.log"
    monkeypatch.setenv("NEURON_COMPETITION_R1_STEP_LOG", str(log))
    for step in range(3):
        kit.step_boundary(step)
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["0", "1", "2"]


def test_the_trainer_on_the_kit_dialect_records_its_score_causality_and_clock(kit_dialect, tmp_path):
    config = {"data": f"kit:{kit_dialect / 'prepare.py'}", "vocab_size": 512, "depth": 1, "model_dim": 32,
              "head_dim": 16, "seq_len": T, "batch_size": B, "device": "cpu", "num_threads": 1, "max_steps": 4,
              "excluded_steps": 1, "eval_fractions": [], "final_eval_tokens": 4096, "compile_optimizer": False,
              "compile_loss": False}
    log = tmp_path / "steps.log"
    env = subprocess_env(NEURON_COMPETITION_R1_STEP_LOG=str(log))
    proc = subprocess.run([sys.executable, "-m", "model.train", "--config", json.dumps(config), "--budget-s", "60",
                           "--out-dir", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kit_dialect"] == "kit" and result["config"]["vocab_size"] == 8192  # the kit's, not the 512 asked
    assert result["causality"]["passed"] is True and result["kit_eval_ranks"] == 1
    assert result["val_bpb"] == result["kit_eval"]["val_bpb"] and result["val_tokens"] == 4096 == 128 * T
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["0", "1", "2", "3"]

    # The kit's scorer on the checkpoint, as eval-public loads it: the recorded figure.
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(kit_dialect)!r})
        import prepare
        from model.train import load_for_eval
        model = load_for_eval({str(tmp_path / 'out' / 'final.pt')!r}, "cpu")
        print(json.dumps(prepare.evaluate_bpb(model, prepare.ensure_tokenizer(), {B}, {T}, "cpu",
                                              max_tokens=4096)))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["val_bpb"] == pytest.approx(result["val_bpb"], abs=1e-6)
