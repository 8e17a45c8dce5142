"""A plain nanochat-style GPT step, written the obvious way, as the yardstick for the trainer's throughput.

Same architecture and sizes as model.gpt (RMSNorm, rotary, QK-norm, ReLU² MLP, softcap, untied head), with
textbook Muon (fixed quintic Newton-Schulz coefficients, float lr) and torch.optim.AdamW.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class PlainBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, mlp_dim: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.fc = nn.Linear(dim, mlp_dim, bias=False)
        self.out = nn.Linear(mlp_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = F.rms_norm(x, (C,))
        q, k, v = self.qkv(h).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)

        def rope(t: torch.Tensor) -> torch.Tensor:
            a, b = t.chunk(2, dim=-1)
            return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

        q, k = F.rms_norm(rope(q), (q.size(-1),)), F.rms_norm(rope(k), (k.size(-1),))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.relu(self.fc(F.rms_norm(x, (C,)))).square())


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, depth: int, dim: int, head_dim: int, seq_len: int, softcap: float = 15.0):
        super().__init__()
        self.softcap = softcap
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(PlainBlock(dim, dim // head_dim, 4 * dim) for _ in range(depth))
        self.head = nn.Linear(dim, vocab, bias=False)
        freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        ang = torch.outer(torch.arange(seq_len).float(), freq)
        self.register_buffer("cos", ang.cos()[None, :, None, :])
        self.register_buffer("sin", ang.sin()[None, :, None, :])

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = F.rms_norm(self.wte(idx), (self.wte.embedding_dim,))
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        logits = self.head(F.rms_norm(x, (x.size(-1),))).float()
        logits = self.softcap * torch.tanh(logits / self.softcap)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return (x.T if tall else x).to(g.dtype)


class PlainMuon(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                g = p.grad.add(buf, alpha=group["momentum"])
                p.add_(newton_schulz(g), alpha=-group["lr"] * max(1, p.size(0) / p.size(1)) ** 0.5)


def plain_step_fn(vocab: int, depth: int, dim: int, head_dim: int, seq_len: int):
    """A closure running one plain training step on a batch."""
    model = PlainGPT(vocab, depth, dim, head_dim, seq_len)
    matrices = [p for p in model.blocks.parameters()]
    muon = PlainMuon(matrices)
    adam = torch.optim.AdamW([model.wte.weight, model.head.weight], lr=0.004, betas=(0.8, 0.95), fused=False)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        model(x, y).backward()
        muon.step()
        adam.step()
        model.zero_grad(set_to_none=True)

    return step
