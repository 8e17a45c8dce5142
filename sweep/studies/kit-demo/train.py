"""A small baseline-style competition train.py in the kit's dialect: trnsweep's worked example of a team's script.

Written for trnsweep's kit-dialect demo and tests, to the shape teams' public copies of the kit's baseline
show (it copies none of them): argparse flags that each fall back to NEURON_COMPETITION_R1_<FLAG>, the
hyperparameters as module constants below, data, tokenizer and metric from the kit's prepare.py beside it,
the kit's clock (start-up measured at step TRAIN_STARTUP_STEPS_EXCLUDED, allowed up to
TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS; training stops when the charged time reaches --max-train-seconds less a
checkpoint reserve), record_step_boundary after each step's synchronise, the kit's progress line, `bad loss
detected` on every rank, out/final.pt from rank 0, load_for_eval(checkpoint_path, device) for the scorer, and
the summary block after `---`, last. A tiny GPT (rotary attention, relu^2 MLP) keeps it quick on the CPU.

    python prepare.py setup                              # once: data and tokenizer
    torchrun --standalone --nproc_per_node=2 train.py    # gloo on the CPU; one rank goes through torchrun too
    python prepare.py eval-public --train-py train.py --checkpoint out/final.pt

Team-style additions: --seed and --seq-len, built by the _hp helper. --device-type defaults to cpu here.
"""

from __future__ import annotations  # as in teams' scripts: the @dataclass needs this module in sys.modules

import time

T0 = time.time()  # the kit's clock runs from process start, imports included

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from prepare import (  # noqa: E402
    TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS,
    TRAIN_STARTUP_STEPS_EXCLUDED,
    TRAIN_TIME_BUDGET_SECONDS,
    causality_check,
    ensure_tokenizer,
    evaluate_bpb,
    get_dist_info,
    make_dataloader,
    print0,
    record_step_boundary,
)
from torch import nn  # noqa: E402

# ---- hyperparameters ---------------------------------------------------------------------------------
DEPTH = 2
MODEL_DIM = 64
N_HEAD = 2
MLP_RATIO = 4
DEVICE_BATCH_SIZE = 4  # sequences per rank and step
MATRIX_LR = 0.01
EMBED_LR = 0.05
UNEMBED_LR = 0.004
WEIGHT_DECAY = 0.0
ADAM_BETA1 = 0.9
ADAM_BETA2 = 0.95
WARMUP_RATIO = 0.0
WARMDOWN_RATIO = 0.4
FINAL_LR_FRAC = 0.0
LOSS_EMA_BETA = 0.9
CHECKPOINT_RESERVE_SECONDS = 1.0  # kept back from --max-train-seconds for saving the checkpoint
EVAL_BATCH_SIZE = 8
EVAL_CONTEXT_LEN = 4096  # load_for_eval's rotary tables: the scorer may evaluate at a longer context
ROTARY_BASE = 10000.0

ENV_PREFIX = "NEURON_COMPETITION_R1_"
PARSER = argparse.ArgumentParser(description="Neuron Competition R1 baseline")


def _env(flag, type_, default):
    """The flag's default: NEURON_COMPETITION_R1_<FLAG> when set, else `default`."""
    name = ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")
    raw = os.environ.get(name)
    if raw is None:
        return default
    if type_ is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    try:
        return type_(raw)
    except ValueError:
        PARSER.error(f"{name}={raw!r} is not a valid {type_.__name__} for {flag}")


def _hp(flag, type_, default):
    """A team's knob: a flag whose default falls back to its environment variable."""
    PARSER.add_argument(flag, type=type_, default=_env(flag, type_, default))


PARSER.add_argument("--device-type", choices=["cpu", "cuda"], default=_env("--device-type", str, "cpu"))
PARSER.add_argument("--num-steps", type=int, default=_env("--num-steps", int, 0), help="cap on steps (0: none)")
PARSER.add_argument("--max-train-seconds", type=float,
                    default=_env("--max-train-seconds", float, TRAIN_TIME_BUDGET_SECONDS))
PARSER.add_argument("--out-dir", default=_env("--out-dir", str, "out"))
PARSER.add_argument("--eval-public", action=argparse.BooleanOptionalAction, default=_env("--eval-public", bool, False))
PARSER.add_argument("--eval-tokens", type=int, default=_env("--eval-tokens", int, 4 * 524288))
PARSER.add_argument("--compile", action=argparse.BooleanOptionalAction, default=_env("--compile", bool, False))
PARSER.add_argument("--compile-only", action="store_true", default=_env("--compile-only", bool, False),
                    help="one synthetic step to warm the compile cache, then exit")
_hp("--seed", int, 42)
_hp("--seq-len", int, 256)


# ---- the model ---------------------------------------------------------------------------------------

@dataclass
class GPTConfig:
    vocab_size: int = 8192
    seq_len: int = 256
    depth: int = DEPTH
    model_dim: int = MODEL_DIM
    n_head: int = N_HEAD
    mlp_ratio: int = MLP_RATIO
    rotary_len: int = 256


def _rotary_tables(length, head_dim):
    inv = 1.0 / (ROTARY_BASE ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv)
    return angles.cos()[None, None], angles.sin()[None, None]


def _rotate(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.model_dim
        self.n_head = config.n_head
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, config.mlp_ratio * d, bias=False)
        self.down = nn.Linear(config.mlp_ratio * d, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = self.qkv(F.rms_norm(x, (d,))).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = _rotate(F.rms_norm(q, (q.shape[-1],)), cos, sin), _rotate(F.rms_norm(k, (k.shape[-1],)), cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.relu(self.up(F.rms_norm(x, (d,)))).square())


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.model_dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.depth))
        self.lm_head = nn.Linear(config.model_dim, config.vocab_size, bias=False)
        nn.init.normal_(self.wte.weight, std=1.0)
        nn.init.zeros_(self.lm_head.weight)
        for block in self.blocks:
            nn.init.zeros_(block.proj.weight)
            nn.init.zeros_(block.down.weight)
        if (config.model_dim // config.n_head) % 2:
            raise ValueError(f"the head size {config.model_dim} / {config.n_head} must be even for rotary")
        cos, sin = _rotary_tables(config.rotary_len, config.model_dim // config.n_head)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx, targets=None, loss_reduction="mean", reduction=None):
        """Logits without targets; else the cross-entropy, mean or per token (loss_reduction or reduction)."""
        t = idx.shape[1]
        if t > self.cos.shape[2]:
            raise ValueError(f"context {t} is longer than the rotary tables ({self.cos.shape[2]})")
        cos, sin = self.cos[:, :, :t], self.sin[:, :, :t]
        x = F.rms_norm(self.wte(idx), (self.config.model_dim,))
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(F.rms_norm(x, (self.config.model_dim,))).float()
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction=reduction if reduction is not None else loss_reduction)


def load_for_eval(checkpoint_path, device):
    """The trained model for the organiser's scorer: eval mode, rotary tables for up to EVAL_CONTEXT_LEN."""
    ckpt = torch.load(checkpoint_path, map_location=device, weights_only=True)
    config = GPTConfig(**ckpt["model_config"])
    config.rotary_len = max(config.rotary_len, EVAL_CONTEXT_LEN)
    model = GPT(config)
    model.load_state_dict(ckpt["model_state"])
    return model.to(device).eval()


# ---- training ----------------------------------------------------------------------------------------

def lr_multiplier(progress):
    if WARMUP_RATIO > 0 and progress < WARMUP_RATIO:
        return (progress + 1e-3) / WARMUP_RATIO
    if WARMDOWN_RATIO > 0 and progress > 1 - WARMDOWN_RATIO:
        return FINAL_LR_FRAC + (1 - FINAL_LR_FRAC) * max(0.0, (1 - progress) / WARMDOWN_RATIO)
    return 1.0


def build_optimizer(model):
    groups = [
        {"params": [model.wte.weight], "lr": EMBED_LR},
        {"params": [model.lm_head.weight], "lr": UNEMBED_LR},
        {"params": [p for b in model.blocks for p in b.parameters()], "lr": MATRIX_LR},
    ]
    for g in groups:
        g["initial_lr"] = g["lr"]
    return torch.optim.AdamW(groups, betas=(ADAM_BETA1, ADAM_BETA2), weight_decay=WEIGHT_DECAY)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce_grads(params, loss, world):
    """Every rank's gradients averaged, in one collective that carries the loss along; returns the mean loss."""
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1).float()])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n
    return flat[-1].item()


def main(argv=None):
    args = PARSER.parse_args(argv)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo" if args.device_type == "cpu" else "nccl")
    ddp, rank, local_rank, world = get_dist_info()
    device = torch.device("cuda", local_rank) if args.device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(args.seed)
    B, T = DEVICE_BATCH_SIZE, args.seq_len
    tokenizer = ensure_tokenizer()
    config = GPTConfig(vocab_size=tokenizer.get_vocab_size(), seq_len=T, rotary_len=T)
    model = GPT(config).to(device)
    params = list(model.parameters())
    num_params = sum(p.numel() for p in params)
    optimizer = build_optimizer(model)
    step_model = torch.compile(model) if args.compile else model

    if args.compile_only:
        x = torch.randint(0, config.vocab_size, (B, T), device=device, dtype=torch.int32)
        step_model(x, x.long()).backward()
        optimizer.zero_grad(set_to_none=True)
        print0(f"compile-only: one synthetic step done in {time.time() - T0:.1f}s")
        if dist.is_initialized():
            dist.destroy_process_group()
        return

    loader = make_dataloader(tokenizer, B, T, "train", device)
    tokens_per_step = B * T * world
    reserve = min(CHECKPOINT_RESERVE_SECONDS, 0.1 * args.max_train_seconds)
    step, ema, allowance, measured_at, charged = 0, 0.0, None, None, 0.0
    epoch = 1
    while not (args.num_steps and step >= args.num_steps):
        t0 = time.time()
        x, y, info = next(loader)
        epoch = info["epoch"]
        progress = min(1.0, charged / args.max_train_seconds)
        if args.num_steps:
            progress = max(progress, step / args.num_steps)
        lrm = lr_multiplier(progress)
        for g in optimizer.param_groups:
            g["lr"] = g["initial_lr"] * lrm
        loss = step_model(x, y)
        loss.backward()
        loss_value = all_reduce_grads(params, loss, world) if ddp else loss.item()
        if not math.isfinite(loss_value) or loss_value > 100:
            raise RuntimeError(f"bad loss detected: {loss_value}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        record_step_boundary(step)
        now = time.time()
        dt = now - t0
        if step + 1 == TRAIN_STARTUP_STEPS_EXCLUDED:
            allowance = min(now - T0, TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS)
            measured_at = now
        if allowance is not None:
            charged = now - T0 - allowance
        stop = torch.tensor([float(charged + reserve >= args.max_train_seconds)])
        if ddp:
            dist.broadcast(stop, 0)  # rank 0's clock decides for every rank
        ema = LOSS_EMA_BETA * ema + (1 - LOSS_EMA_BETA) * loss_value
        smooth = ema / (1 - LOSS_EMA_BETA ** (step + 1))
        remaining_time = max(0.0, args.max_train_seconds - charged)
        if args.num_steps:
            remaining_steps = args.num_steps - step - 1
        elif measured_at is not None and step + 1 > TRAIN_STARTUP_STEPS_EXCLUDED:
            per_step = (now - measured_at) / (step + 1 - TRAIN_STARTUP_STEPS_EXCLUDED)
            remaining_steps = int(max(0.0, remaining_time - reserve) / per_step)
        else:
            remaining_steps = int(max(0.0, remaining_time - reserve) / dt)
        if step < 5 or step % 10 == 0:
            print0(f"step {step:05d} | loss {smooth:.4f} | lrm {lrm:.3f} | dt {dt:.2f}s | "
                  f"tok/s {int(tokens_per_step / dt):,} | remaining_steps {remaining_steps} | "
                  f"remaining_time {remaining_time:.0f}s | epoch {epoch}")
        step += 1
        if stop.item():
            break
    if allowance is None:  # stopped before the start-up was measured: all of it counts as start-up
        allowance = min(time.time() - T0, TRAIN_STARTUP_ALLOWANCE_CAP_SECONDS)
        measured_at = time.time()
    training_seconds = time.time() - measured_at

    checkpoint_path = os.path.join(args.out_dir, "final.pt")
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        meta = {"num_steps": step, "seed": args.seed, "seq_len": T, "world_size": world, "epoch": epoch,
                "total_tokens": step * tokens_per_step}
        torch.save({"model_state": model.state_dict(), "model_config": asdict(config), "meta": meta},
                   checkpoint_path)
    if ddp:
        dist.barrier()
    charged_after = time.time() - T0 - allowance

    summary = {
        "checkpoint_path": checkpoint_path,
        "training_seconds": f"{training_seconds:.1f}",
        "budget_seconds": TRAIN_TIME_BUDGET_SECONDS,
        "target_steps": args.num_steps,
        "max_train_seconds": f"{args.max_train_seconds:.1f}",
        "startup_allowance_est": f"{allowance:.1f}",
        "charged_seconds_est": f"{charged_after:.1f}",
        "over_budget": charged_after > TRAIN_TIME_BUDGET_SECONDS,
    }
    if args.eval_public:
        model.eval()
        causal = causality_check(model, tokenizer, EVAL_BATCH_SIZE, T, device)
        result = evaluate_bpb(model, tokenizer, EVAL_BATCH_SIZE, T, device, split="public_val",
                              max_tokens=args.eval_tokens)
    summary.update({
        "total_seconds": f"{time.time() - T0:.1f}",
        "compiled": bool(args.compile),
        "num_steps": step,
        "total_tokens_M": f"{step * tokens_per_step / 1e6:.3f}",
        "world_size": world,
        "lnc": int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1")),
        "seq_len": T,
        "num_params_M": f"{num_params / 1e6:.3f}",
    })
    if args.eval_public:
        summary.update({
            "causality_passed": causal["passed"],
            "causality_max_abs": f"{causal['max_abs_diff']:.3e}",
            "public_val_bpb": f"{result['val_bpb']:.6f}",
            "eval_seconds": f"{result['eval_seconds']:.1f}",
            "eval_timeout": result["eval_timeout"],
            "eval_over_timeout": result["eval_over_timeout"],
        })
    if dist.is_initialized():
        dist.destroy_process_group()
    print0("---")
    for key, value in summary.items():
        print0(f"{key}: {value}")


if __name__ == "__main__":
    main()
