"""A nanochat-style GPT: RMSNorm without weights, rotary embeddings, QK-norm, ReLU² MLP, logit softcap, and the
public recipe's extras (gated value embeddings, residual and x0 scalars, windows, smear, backout: docs/recipe.md).

Everything a sweep may vary lives in `model.config.GPTConfig`, which a flat parameter dict fills; its
parameter count and FLOPs per token are `model.counts`' (torch-free, for the sweep too). The model keeps
static shapes in training (rotary tables sized to `seq_len`) so compiled graphs never change between steps.
It evaluates at any length: a longer input (the competition kit's evaluate_bpb always runs at its
MAX_SEQ_LEN, 2048, whatever the model trained at) grows the tables once, eagerly, to that length. Growing
changes no value: a position's angles are the same in a table of any length.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.ops import Ops
from model import counts, kernel_choice
from model.config import GPTConfig


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of each head; x is (B, T, H, D)."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def window_mask(length: int, window: int, device: torch.device) -> torch.Tensor | None:
    """A causal mask letting each position see its last `window` tokens (itself included); None: plain causal
    (window 0 stands for no window at all)."""
    if window <= 0 or window >= length:
        return None
    pos = torch.arange(length, device=device)
    back = pos[:, None] - pos[None, :]
    return (back >= 0) & (back < window)


def has_value_embed(config: GPTConfig, layer: int) -> bool:
    """Value embeddings sit on alternating layers counted back from the last, which always has one."""
    return config.value_embeds and layer % 2 == (config.depth - 1) % 2


class Attention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int, ops: Ops) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        d, hd = config.model_dim, config.head_dim
        self.c_q = nn.Linear(d, config.n_head * hd, bias=False)
        self.c_k = nn.Linear(d, config.n_kv_head * hd, bias=False)
        self.c_v = nn.Linear(d, config.n_kv_head * hd, bias=False)
        self.c_proj = nn.Linear(config.n_head * hd, d, bias=False)
        self.has_value_embed = has_value_embed(config, layer)
        # The gate reads the first ve_gate_channels of the block's input: a per-token, per-head share of the
        # value embedding (ResFormer-style value residual); a Muon matrix like the other block weights.
        self.ve_gate = (nn.Linear(config.ve_gate_width, config.n_kv_head, bias=False)
                        if self.has_value_embed and config.ve_gate_width else None)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, value_embed: torch.Tensor | None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        cfg = self.config
        q = self.c_q(x).view(B, T, cfg.n_head, cfg.head_dim)
        k = self.c_k(x).view(B, T, cfg.n_kv_head, cfg.head_dim)
        v = self.c_v(x).view(B, T, cfg.n_kv_head, cfg.head_dim)
        if value_embed is not None:
            value_embed = value_embed.view(B, T, cfg.n_kv_head, cfg.head_dim)
            if self.ve_gate is not None:
                gate = cfg.ve_gate_scale * torch.sigmoid(self.ve_gate(x[..., :cfg.ve_gate_width]))
                value_embed = gate.unsqueeze(-1) * value_embed
            v = v + value_embed
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cfg.qk_norm:
            q, k = self.ops.rms_norm(q), self.ops.rms_norm(k)
        if cfg.qk_scale != 1.0:
            q, k = q * cfg.qk_scale, k * cfg.qk_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cfg.n_kv_head != cfg.n_head:
            # Explicit repeat rather than SDPA's enable_gqa: every backend, Neuron's included, lowers it.
            repeat = cfg.n_head // cfg.n_kv_head
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.c_fc = nn.Linear(config.model_dim, config.mlp_dim, bias=False)
        self.c_proj = nn.Linear(config.mlp_dim, config.model_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.relu2_mlp(x, self.c_fc.weight, self.c_proj.weight)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.attn = Attention(config, layer, ops)
        self.mlp = MLP(config, ops)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, value_embed: torch.Tensor | None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.ops.rms_norm(x), cos, sin, value_embed, mask)
        return x + self.mlp(self.ops.rms_norm(x))


SMEAR_CHANNELS = 24  # the smear gate reads this many leading channels of the embedding (nanochat's choice)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # kernels="auto": the NKI kernels only where this node's preflight passed them (model.kernel_choice)
        self.kernel_choice = kernel_choice.resolve(config.kernels, config.model_dim, config.mlp_dim)
        self.ops = self.kernel_choice.ops()
        self.wte = nn.Embedding(config.vocab_size, config.model_dim)
        self.blocks = nn.ModuleList(Block(config, i, self.ops) for i in range(config.depth))
        self.lm_head = nn.Linear(config.model_dim, config.vocab_size, bias=False)
        kv_dim = config.n_kv_head * config.head_dim
        self.value_embeds = nn.ModuleDict(
            {str(i): nn.Embedding(config.vocab_size, kv_dim) for i, b in enumerate(self.blocks)
             if b.attn.has_value_embed}
        )
        if config.residual_scalars:
            self.resid_lambdas = nn.Parameter(torch.ones(config.depth))
            self.x0_lambdas = nn.Parameter(torch.full((config.depth,), config.x0_init))
        if config.smear:
            self.smear_gate = nn.Linear(min(SMEAR_CHANNELS, config.model_dim), 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        if config.backout:
            self.backout_lambda = nn.Parameter(torch.full((1,), 0.2))
        # Short windows in tokens; 0 for full layers, which stay full at any evaluation length.
        self.windows = [w if w < config.seq_len else 0 for w in config.window_sizes()]
        cos, sin = rotary_tables(config.seq_len, config.head_dim, config.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.init_weights()

    def compile_loss(self) -> bool:
        """Train through the compiled cross-entropy (kernels.ops.compiled_cross_entropy) where the ops are
        PyTorch's; False where they are not (the NKI kernels are fused already)."""
        if self.ops.impl != "torch":
            return False
        self.ops = replace(self.ops, compiled_loss=True)
        return True

    def fall_back_to_torch_ops(self, error: BaseException) -> None:
        """The NKI kernels failed (compile or run) at the first step: the plain PyTorch ops from now on, recorded."""
        self.kernel_choice = kernel_choice.fall_back(self.kernel_choice, error)
        self.ops = self.kernel_choice.ops()
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = self.ops

    @torch.no_grad()
    def init_weights(self) -> None:
        """nanochat's scheme: normal embeddings, uniform inputs (value embeddings alike), zero output projections
        and gates, residual scalars at 1 and x0_init."""
        cfg = self.config
        bound = math.sqrt(3.0) * cfg.model_dim**-0.5
        nn.init.normal_(self.wte.weight, std=cfg.embed_init_std)
        for ve in self.value_embeds.values():
            nn.init.uniform_(ve.weight, -bound, bound)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
                nn.init.uniform_(lin.weight, -bound, bound)
            nn.init.uniform_(block.mlp.c_fc.weight, -bound * cfg.fc_init_scale, bound * cfg.fc_init_scale)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
            if block.attn.ve_gate is not None:
                nn.init.zeros_(block.attn.ve_gate.weight)  # sigmoid(0) * 2 = 1: the plain sum at the start
        if cfg.smear:
            nn.init.uniform_(self.smear_gate.weight, 0.0, 0.02)
        if cfg.head_init_std > 0:
            nn.init.normal_(self.lm_head.weight, std=cfg.head_init_std)
        else:
            nn.init.zeros_(self.lm_head.weight)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """Logits (B, T, V) without targets; else the cross-entropy, ignoring targets equal to -1."""
        T = idx.size(1)
        if self.cos.size(1) < T:  # never in training (T == seq_len): compiled graphs see fixed tables
            self.grow_rotary(T)
        cos, sin = self.cos[:, :T], self.sin[:, :T]
        cfg = self.config
        x = self.ops.rms_norm(self.wte(idx))
        if cfg.smear:  # each token takes a gated share of its predecessor's embedding: cheap bigram information
            gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[:, 1:, :self.smear_gate.in_features]))
            x = torch.cat((x[:, :1], x[:, 1:] + gate * x[:, :-1]), dim=1)
        x0 = x
        masks = {w: window_mask(T, w, idx.device) for w in set(self.windows)}
        backout_at, x_mid = cfg.depth // 2, None
        for i, block in enumerate(self.blocks):
            if cfg.residual_scalars:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx) if str(i) in self.value_embeds else None
            x = block(x, cos, sin, ve, masks[self.windows[i]])
            if cfg.backout and i == backout_at:
                x_mid = x
        if x_mid is not None:
            x = x - self.backout_lambda * x_mid
        logits = self.lm_head(self.ops.rms_norm(x))
        if targets is not None:
            return self.ops.softcap_cross_entropy(
                logits.view(-1, logits.size(-1)), targets.reshape(-1), self.config.softcap, reduction
            )
        logits = logits.float()
        if self.config.softcap > 0:
            logits = self.config.softcap * torch.tanh(logits / self.config.softcap)
        return logits

    @torch.no_grad()
    def grow_rotary(self, length: int) -> None:
        """Rotary tables for inputs of up to `length` tokens (computed on the CPU as at construction)."""
        if length <= self.cos.size(1):
            return
        cos, sin = rotary_tables(length, self.config.head_dim, self.config.rope_base)
        self.cos = cos.to(self.cos.device)
        self.sin = sin.to(self.sin.device)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Split parameters by optimiser role: Muon takes the block matrices, AdamW the rest."""
        cfg = self.config
        matrices = [p for p in self.blocks.parameters() if p.ndim == 2]
        scalars = [p for p in self.blocks.parameters() if p.ndim < 2]
        if cfg.smear:
            scalars += [self.smear_gate.weight, self.smear_lambda]
        if cfg.backout:
            scalars.append(self.backout_lambda)
        return {
            "matrix": matrices,
            "embedding": [self.wte.weight, *(ve.weight for ve in self.value_embeds.values())],
            "unembedding": [self.lm_head.weight],
            "scalar": scalars,
            # Multiplicative on the residual stream, so compounding over layers: a much smaller rate (optim).
            "resid": [self.resid_lambdas] if cfg.residual_scalars else [],
            "x0": [self.x0_lambdas] if cfg.residual_scalars else [],
        }

    def num_params(self) -> int:
        """Parameters of this model (model.counts, which needs no torch, counts them from the config)."""
        return counts.num_params(self.config)

    def flops_per_token(self) -> float:
        """Training FLOPs per token (see model.counts.flops_per_token)."""
        return counts.flops_per_token(self.config)
