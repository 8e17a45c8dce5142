"""A small training script in the competition's format: trnsweep's worked example of a team's own train.py.

Written for trnsweep's demo and tests (sweep/studies/script-demo.toml sweeps it) in the shape of the kit's
baseline: the hyperparameters are the module-level constants below, data, tokenizer and metric come from the
kit's prepare.py beside it, the clock is the kit's (TRAIN_TIME_BUDGET_SECONDS of training, the first
TRAIN_STARTUP_STEPS_EXCLUDED steps not charged), each step prints a progress line redrawn with a carriage
return, the weights go to out/final.pt, load_for_eval(checkpoint_path, device) rebuilds the model, and the
run ends on the summary block after a `---` line.

    python train.py                                     # one process
    torchrun --standalone --nproc_per_node=2 train.py   # data-parallel ranks (gloo on the CPU)
"""

import math
import os
import sys
import time

T0 = time.time()

import torch  # noqa: E402 - the clock starts before the imports, as the competition's does
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from prepare import (  # noqa: E402
    MAX_SEQ_LEN,
    TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS,
    TRAIN_STARTUP_STEPS_EXCLUDED,
    TRAIN_TIME_BUDGET_SECONDS,
    Tokenizer,
    evaluate_bpb,
    make_dataloader,
)
from torch import nn  # noqa: E402

# ---- hyperparameters: edit these (or let trnsweep search them) ---------------------------------------
DEPTH = 2
MODEL_DIM = 64
N_HEAD = 2
SEQ_LEN = 64
BATCH_SIZE = 8  # sequences per rank and step
LEARNING_RATE = 0.003
WEIGHT_DECAY = 0.0
WARMUP_RATIO = 0.0
WARMDOWN_RATIO = 0.5
SEED = 0
EVALUATE = True  # score val_bpb with the kit's evaluate_bpb at the end (False: leave it to the evaluator)
EVAL_BATCH_SIZE = 4
NUM_THREADS = 1


class Block(nn.Module):
    def __init__(self, dim, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(F.rms_norm(x, (d,))).view(b, t, 3, self.n_head, d // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.relu(self.up(F.rms_norm(x, (d,)))).square())


class GPT(nn.Module):
    """A plain causal transformer; positions up to the kit's MAX_SEQ_LEN, so it evaluates at its length."""

    def __init__(self, vocab_size, depth, dim, n_head, max_len):
        super().__init__()
        self.config = {"vocab_size": vocab_size, "depth": depth, "dim": dim, "n_head": n_head, "max_len": max_len}
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, n_head) for _ in range(depth))
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx, targets=None, reduction="mean"):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(F.rms_norm(x, (x.shape[-1],))).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


def load_for_eval(checkpoint_path, device="cpu"):
    """The trained model, causal and on one device, as the competition's evaluation asks."""
    ckpt = torch.load(checkpoint_path, map_location=device, weights_only=True)
    model = GPT(**ckpt["config"])
    model.load_state_dict(ckpt["state_dict"])
    return model.to(device).eval()


def lr_multiplier(progress):
    """Linear warmup, flat, then a linear warmdown to zero, keyed to the fraction of the budget done."""
    if WARMUP_RATIO > 0 and progress < WARMUP_RATIO:
        return (progress + 1e-3) / WARMUP_RATIO
    if WARMDOWN_RATIO > 0 and progress > 1 - WARMDOWN_RATIO:
        return max(0.0, (1 - progress) / WARMDOWN_RATIO)
    return 1.0


def main():
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(SEED)
    torch.set_num_threads(NUM_THREADS)
    tokenizer = Tokenizer.from_directory()
    model = GPT(tokenizer.get_vocab_size(), DEPTH, MODEL_DIM, N_HEAD, MAX_SEQ_LEN)
    num_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)
    loader = make_dataloader(tokenizer, BATCH_SIZE * world, SEQ_LEN, "train")  # rank r takes its rows of each
    training_seconds, startup_seconds, step, smooth = 0.0, 0.0, 0, 0.0
    while True:
        t0 = time.time()
        x, y, epoch = next(loader)
        x, y = x[rank * BATCH_SIZE:(rank + 1) * BATCH_SIZE], y[rank * BATCH_SIZE:(rank + 1) * BATCH_SIZE]
        progress = min(training_seconds / TRAIN_TIME_BUDGET_SECONDS, 1.0)
        lrm = lr_multiplier(progress)
        for group in opt.param_groups:
            group["lr"] = LEARNING_RATE * lrm
        loss = model(x, y)
        loss.backward()
        stats = torch.tensor([loss.item(), training_seconds])
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
            dist.broadcast(stats, 0)  # rank 0's clock decides for every rank
            loss_rank0 = stats[0].item()
        else:
            loss_rank0 = loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(loss_rank0) or loss_rank0 > 100:
            print("\nFAIL: the loss diverged", flush=True)
            sys.exit(1)
        dt = time.time() - t0
        step += 1
        if step > TRAIN_STARTUP_STEPS_EXCLUDED:
            training_seconds = stats[1].item() + dt
        elif step == TRAIN_STARTUP_STEPS_EXCLUDED:
            startup_seconds = time.time() - T0
        smooth = 0.9 * smooth + 0.1 * loss_rank0
        shown = smooth / (1 - 0.9 ** step)
        pct = 100 * min(training_seconds / TRAIN_TIME_BUDGET_SECONDS, 1.0)
        remaining = max(0.0, TRAIN_TIME_BUDGET_SECONDS - training_seconds)
        if rank == 0:
            print(f"\rstep {step:05d} ({pct:.1f}%) | loss: {shown:.6f} | lrm: {lrm:.2f} | dt: {dt * 1000:.0f}ms | "
                  f"tok/sec: {int(BATCH_SIZE * world * SEQ_LEN / dt):,} | epoch: {epoch} | "
                  f"remaining: {remaining:.0f}s    ", end="", flush=True)
        if training_seconds >= TRAIN_TIME_BUDGET_SECONDS:
            break
    if rank == 0:
        print(flush=True)
    summary = {}
    if rank == 0:
        model.eval()
        if EVALUATE:
            summary["val_bpb"] = f"{evaluate_bpb(model, tokenizer, EVAL_BATCH_SIZE):.6f}"
        os.makedirs("out", exist_ok=True)
        torch.save({"config": model.config, "state_dict": model.state_dict()}, os.path.join("out", "final.pt"))
        beyond = max(0.0, startup_seconds - TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS)
        summary.update({
            "training_seconds": f"{training_seconds:.1f}",
            "startup_allowance_est": f"{startup_seconds - beyond:.1f}",
            "charged_seconds_est": f"{training_seconds + beyond:.1f}",
            "over_budget": training_seconds + beyond > TRAIN_TIME_BUDGET_SECONDS + 1,
            "num_steps": step,
            "total_tokens_M": f"{step * BATCH_SIZE * world * SEQ_LEN / 1e6:.3f}",
            "world_size": world,
            "seq_len": SEQ_LEN,
            "num_params_M": f"{num_params / 1e6:.3f}",
        })
        print("---")
        for key, value in summary.items():
            print(f"{key + ':':<24}{value}")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
