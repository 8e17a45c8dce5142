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
    x = g.bfloat16()
    wide = x.size(0) <= x.size(1)
    x = x if wide else x.T
    x = x / (x.norm() * 1.02 + 1e-6)
    for a, b, c in POLAR_EXPRESS:
        m = x @ x.T
        x = a * x + (b * m + c * m @ m) @ x
    return (x if wide else x.T).float()


class RefOptimizer:
    """Muon for the block matrices, AdamW for the rest, with autoresearch's schedules (see the module doc)."""

    def __init__(self, model: RefGPT, matrix_lr: float = 0.04, embedding_lr: float = 0.6,
                 unembedding_lr: float = 0.004, scalar_lr: float = 0.5, weight_decay: float = 0.2,
                 warmdown: float = 0.5) -> None:
        scale = (model.cfg.dim / 768) ** -0.5
        betas = (0.8, 0.95)
        groups = [
            dict(params=[model.head.weight], lr=unembedding_lr * scale, betas=betas),
            dict(params=[model.wte.weight], lr=embedding_lr * scale, betas=betas),
            dict(params=[e.weight for e in model.ve.values()], lr=embedding_lr * scale, betas=betas),
            dict(params=[model.resid], lr=scalar_lr * 0.01, betas=betas),
            dict(params=[model.x0], lr=scalar_lr, betas=(0.96, 0.95)),
        ]
        self.adam = torch.optim.AdamW(groups, eps=1e-10, weight_decay=0.0, foreach=False)
        self.initial = [g["lr"] for g in self.adam.param_groups]
        self.matrices = [p for p in model.blocks.parameters()]
        self.momentum = [torch.zeros_like(p) for p in self.matrices]
        self.second = [torch.zeros((p.size(0), 1) if p.size(0) >= p.size(1) else (1, p.size(1)))
                       for p in self.matrices]
        self.matrix_lr, self.weight_decay, self.warmdown = matrix_lr, weight_decay, warmdown
        self.lr_mult, self.mu, self.wd = 1.0, 0.85, weight_decay

    def schedule(self, progress: float, step: int) -> None:
        self.lr_mult = 1.0 if progress < 1 - self.warmdown else max(0.0, (1 - progress) / self.warmdown)
        ramp = min(step / 300, 1.0)
        self.mu = 0.85 * (1 - ramp) + 0.95 * ramp
        self.wd = self.weight_decay * (1 - progress)
        for group, lr in zip(self.adam.param_groups, self.initial, strict=True):
            group["lr"] = lr * self.lr_mult

    @torch.no_grad()
    def step(self) -> None:
        for p, buf, second in zip(self.matrices, self.momentum, self.second, strict=True):
            buf.lerp_(p.grad, 1 - self.mu)
            u = _polar(p.grad.lerp(buf, self.mu))
            dim = -1 if p.size(0) >= p.size(1) else -2
            ms = u.square().mean(dim=dim, keepdim=True)
            second.lerp_(ms, 1 - 0.95)
            r = second.clamp_min(1e-10).rsqrt()
            u = u * r * (ms.sum().sqrt() / (ms * r.square()).sum().sqrt().clamp_min(1e-10))
            lr = self.matrix_lr * self.lr_mult * max(1.0, p.size(0) / p.size(1)) ** 0.5
            p.sub_(lr * u + lr * self.wd * p * ((u * p) >= 0))
        self.adam.step()
