"""The public recipe written plainly: autoresearch's GPT and optimiser (train.py at 228791f), for bench.recipe_bench.

What it has, so the bench compares the trainer's defaults with the recipe as published (docs/recipe.md):
- model: RMSNorm without weights, rotary embeddings (base 10000), QK-norm, ReLU² MLP (4x), untied head,
  logit softcap 15; value embeddings on alternating layers ending with the last, each mixed into V through
  a per-head gate 2 * sigmoid(W x[:32]); per-layer residual and x0 scalars (x0 starting at 0.1); attention
  windows from a pattern of S (half the sequence) and L (full), the last layer full, through a mask on
  PyTorch's SDPA; init: embeddings N(0, 1), head N(0, 0.001), inputs uniform of std 1/sqrt(width), output
  projections and gates 0, value embeddings uniform as the inputs.
- optimiser: Muon (Nesterov momentum, Polar Express in bfloat16, NorMuon beta2 0.95, step scaled by
  sqrt(max(1, rows/cols)), cautious weight decay 0.2 decaying linearly to 0) for the block matrices; AdamW
  (betas 0.8, 0.95; eps 1e-10; no decay) for the rest, its rates scaled by (width/768)^-0.5 except the
  scalars': embeddings and value embeddings 0.6, head 0.004, residual scalars 0.005, x0 scalars 0.5 with
  beta1 0.96; learning rates flat then down linearly to 0 over the last half of the run's time; Muon's
  momentum 0.85 -> 0.95 over its first 300 steps.
Everything runs in float32 here (the CPU), where autoresearch keeps embeddings in bfloat16 on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.optim import POLAR_EXPRESS  # the paper's coefficients (arXiv:2505.16932), as autoresearch uses them


@dataclass
class RefConfig:
    vocab_size: int = 8192
    depth: int = 4
    dim: int = 256
    head_dim: int = 128
    seq_len: int = 256
    window_pattern: str = "SSSL"

    @property
    def n_head(self) -> int:
        return self.dim // self.head_dim

    def windows(self) -> list[int]:
        """Per layer: tokens each position sees (the pattern tiled, the last layer always full)."""
        sizes = [self.seq_len // 2 if self.window_pattern[i % len(self.window_pattern)] == "S" else self.seq_len
                 for i in range(self.depth)]
        return sizes[:-1] + [self.seq_len]


def _norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos + second * sin, second * cos - first * sin), dim=-1)


class RefBlock(nn.Module):
    GATE_CHANNELS = 32

    def __init__(self, cfg: RefConfig, value_embed: bool) -> None:
        super().__init__()
        d = cfg.dim
        self.cfg = cfg
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.fc, self.proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)
        self.gate = nn.Linear(self.GATE_CHANNELS, cfg.n_head, bias=False) if value_embed else None

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        B, T, d = x.shape
        h, hd = self.cfg.n_head, self.cfg.head_dim
        a = _norm(x)
        q, k, v = (lin(a).view(B, T, h, hd) for lin in (self.q, self.k, self.v))
        if ve is not None:
            share = 2 * torch.sigmoid(self.gate(a[..., :self.GATE_CHANNELS]))
            v = v + share.unsqueeze(-1) * ve.view(B, T, h, hd)
        q, k = _norm(_rotate(q, cos, sin)), _norm(_rotate(k, cos, sin))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, is_causal=mask is None)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, d))
        return x + self.proj(F.relu(self.fc(_norm(x))).square())


class RefGPT(nn.Module):
    def __init__(self, cfg: RefConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, n = cfg.dim, cfg.depth
        ve_layers = [i for i in range(n) if i % 2 == (n - 1) % 2]
        self.wte = nn.Embedding(cfg.vocab_size, d)
        self.blocks = nn.ModuleList(RefBlock(cfg, i in ve_layers) for i in range(n))
        self.head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.ve = nn.ModuleDict({str(i): nn.Embedding(cfg.vocab_size, d) for i in ve_layers})
        self.resid = nn.Parameter(torch.ones(n))
        self.x0 = nn.Parameter(torch.full((n,), 0.1))
        freq = 10000.0 ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        angle = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), freq)
        self.register_buffer("cos", angle.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angle.sin()[None, :, None, :], persistent=False)
        self.windows = cfg.windows()
        with torch.no_grad():
            s = math.sqrt(3.0 / d)
            nn.init.normal_(self.wte.weight, std=1.0)
            nn.init.normal_(self.head.weight, std=0.001)
            for b in self.blocks:
                for lin in (b.q, b.k, b.v, b.fc):
                    nn.init.uniform_(lin.weight, -s, s)
                nn.init.zeros_(b.o.weight)
                nn.init.zeros_(b.proj.weight)
                if b.gate is not None:
                    nn.init.zeros_(b.gate.weight)
            for e in self.ve.values():
                nn.init.uniform_(e.weight, -s, s)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        T = idx.size(1)
        cos, sin = self.cos[:, :T], self.sin[:, :T]
        pos = torch.arange(T, device=idx.device)
        back = pos[:, None] - pos[None, :]
        x = x0 = _norm(self.wte(idx))
        for i, block in enumerate(self.blocks):
            x = self.resid[i] * x + self.x0[i] * x0
            ve = self.ve[str(i)](idx) if str(i) in self.ve else None
            mask = (back >= 0) & (back < self.windows[i]) if self.windows[i] < T else None
            x = block(x, ve, cos, sin, mask)
        logits = self.head(_norm(x)).float()
        logits = 15.0 * torch.tanh(logits / 15.0)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1,
                               reduction=reduction)


def _polar(g: torch.Tensor) -> torch.Tensor:
    """Polar Express in bfloat16 over the last two dimensions (a stack of same-shape matrices at once)."""
    x = g.bfloat16()
    wide = x.size(-2) <= x.size(-1)
    x = x if wide else x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    for a, b, c in POLAR_EXPRESS:
        m = x @ x.mT
        x = a * x + (b * m + c * m @ m) @ x
    return (x if wide else x.mT).float()


def _muon_stack_step(grads: torch.Tensor, params: torch.Tensor, momentum: torch.Tensor, second: torch.Tensor,
                     mu: torch.Tensor, lr: torch.Tensor, wd: torch.Tensor) -> None:
    """One Muon step of K same-shape matrices stacked (K, rows, cols), in place: Nesterov momentum, Polar Express,
    NorMuon (beta2 0.95, each matrix back to its own norm), cautious weight decay; ``lr`` carries the shape scale."""
    momentum.lerp_(grads, 1 - mu)
    u = _polar(grads.lerp(momentum, mu))
    dim = -1 if params.size(-2) >= params.size(-1) else -2
    ms = u.square().mean(dim=dim, keepdim=True)
    second.lerp_(ms, 1 - 0.95)
    r = second.clamp_min(1e-10).rsqrt()
    before = ms.sum(dim=(-2, -1), keepdim=True).sqrt()
    after = (ms * r.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    u = u * r * (before / after.clamp_min(1e-10))
    params.sub_(lr * u + lr * wd * params * ((u * params) >= 0))


def _adamw_step(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor,
                lr: torch.Tensor, beta1: float, beta2: float) -> None:
    """One AdamW step (eps 1e-10, no weight decay), as torch.optim.AdamW computes it, with 0-dim lr and step."""
    step += 1
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v.sqrt() / (1 - beta2 ** step).sqrt()).add_(1e-10)
    p.addcdiv_(m, denom, value=-(lr / (1 - beta1 ** step)))


def _compiled(fn):
    """As the recipe compiles its fused steps: whole graphs, fixed shapes."""
    return torch.compile(fn, dynamic=False, fullgraph=True)


class RefOptimizer:
    """Muon for the block matrices, AdamW for the rest, with autoresearch's schedules (see the module doc).

    The block matrices are grouped by shape and stepped as one stack per shape, and AdamW one tensor at a time,
    through plain functions; ``compile=True`` compiles them as the recipe compiles its fused steps (a graph per
    shape, at the first step), and is what the bench runs. The hyperparameters the schedules change are 0-dim
    tensors, so a compiled step never recompiles for them.
    """

    def __init__(self, model: RefGPT, matrix_lr: float = 0.04, embedding_lr: float = 0.6,
                 unembedding_lr: float = 0.004, scalar_lr: float = 0.5, weight_decay: float = 0.2,
                 warmdown: float = 0.5, compile: bool = False) -> None:
        scale = (model.cfg.dim / 768) ** -0.5
        betas = (0.8, 0.95)
        self.adam = [  # (params, base lr, (beta1, beta2))
            ([model.head.weight], unembedding_lr * scale, betas),
            ([model.wte.weight], embedding_lr * scale, betas),
            ([e.weight for e in model.ve.values()], embedding_lr * scale, betas),
            ([model.resid], scalar_lr * 0.01, betas),
            ([model.x0], scalar_lr, (0.96, 0.95)),
        ]
        self.adam_lr = [torch.tensor(base) for _, base, _ in self.adam]
        self.adam_state = {p: (torch.zeros_like(p), torch.zeros_like(p), torch.zeros(()))
                           for params, _, _ in self.adam for p in params}
        shapes: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
        for p in model.blocks.parameters():
            shapes.setdefault(tuple(p.shape), []).append(p)
        self.stacks = []  # (params, momentum, second moment, shape-scaled lr)
        for (rows, cols), params in shapes.items():
            second = (len(params), rows, 1) if rows >= cols else (len(params), 1, cols)
            self.stacks.append((params, torch.zeros(len(params), rows, cols), torch.zeros(second),
                                max(1.0, rows / cols) ** 0.5))
        self.matrix_lr, self.weight_decay, self.warmdown = matrix_lr, weight_decay, warmdown
        self.lr_mult = 1.0
        self.mu, self.wd = torch.tensor(0.85), torch.tensor(weight_decay)
        self.stack_lr = torch.tensor(0.0)
        self.muon_step = _compiled(_muon_stack_step) if compile else _muon_stack_step
        self.adamw_step = _compiled(_adamw_step) if compile else _adamw_step

    def schedule(self, progress: float, step: int) -> None:
        self.lr_mult = 1.0 if progress < 1 - self.warmdown else max(0.0, (1 - progress) / self.warmdown)
        ramp = min(step / 300, 1.0)
        self.mu.fill_(0.85 * (1 - ramp) + 0.95 * ramp)
        self.wd.fill_(self.weight_decay * (1 - progress))
        for lr, (_, base, _) in zip(self.adam_lr, self.adam, strict=True):
            lr.fill_(base * self.lr_mult)

    @torch.no_grad()
    def step(self) -> None:
        for params, momentum, second, shape_scale in self.stacks:
            stacked = torch.stack([p.data for p in params])
            lr = torch.tensor(self.matrix_lr * self.lr_mult * shape_scale)
            self.muon_step(torch.stack([p.grad for p in params]), stacked, momentum, second, self.mu, lr, self.wd)
            for p, new in zip(params, stacked, strict=True):
                p.copy_(new)
        for (params, _, (b1, b2)), lr in zip(self.adam, self.adam_lr, strict=True):
            for p in params:
                m, v, step = self.adam_state[p]
                self.adamw_step(p, p.grad, m, v, step, lr, b1, b2)
