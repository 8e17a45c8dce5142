"""What a GPTConfig costs, without building it: its exact parameter count and training FLOPs per token.

model.gpt builds these parameters (the norms have no weights):
- embedding `wte` and untied head `lm_head`: vocab_size x model_dim each;
- per block: query and output projections model_dim x (n_head * head_dim) each, key and value projections
  model_dim x (n_kv_head * head_dim) each, MLP model_dim x mlp_dim twice;
- with value_embeds, on every odd layer: a value embedding vocab_size x (n_kv_head * head_dim) and a gate of
  n_kv_head;
- with residual_scalars: two scalars per layer.

`num_params(cfg)` equals `sum(p.numel() for p in GPT(cfg).parameters())` (a test builds the models to check).
This module imports no torch, so the sweep's `gpt_params` expression counts with it too.
"""

from __future__ import annotations

from model.config import GPTConfig


def value_embed_layers(cfg: GPTConfig) -> int:
    """Layers carrying a value embedding: the odd ones (1, 3, ...) when value_embeds is on."""
    return cfg.depth // 2 if cfg.value_embeds else 0


def lookup_params(cfg: GPTConfig) -> int:
    """Embedding tables, which a token reads a row of (no matmul): wte and the value embeddings."""
    kv_dim = cfg.n_kv_head * cfg.head_dim
    return cfg.vocab_size * cfg.model_dim + value_embed_layers(cfg) * cfg.vocab_size * kv_dim


def matmul_params(cfg: GPTConfig) -> int:
    """Weights every token multiplies through: the blocks' projections and MLPs, and the head."""
    d, q_dim, kv_dim = cfg.model_dim, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    attention = 2 * d * q_dim + 2 * d * kv_dim  # c_q and c_proj; c_k and c_v
    mlp = 2 * d * cfg.mlp_dim  # c_fc and c_proj
    return cfg.depth * (attention + mlp) + d * cfg.vocab_size


def scalar_params(cfg: GPTConfig) -> int:
    """Learned scalars: the value-embedding gates and the residual scalars."""
    gates = value_embed_layers(cfg) * cfg.n_kv_head
    return gates + (2 * cfg.depth if cfg.residual_scalars else 0)


def num_params(cfg: GPTConfig) -> int:
    """Every parameter of `model.gpt.GPT(cfg)`."""
    return lookup_params(cfg) + matmul_params(cfg) + scalar_params(cfg)


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token: 6 per matmul weight plus causal attention's score and value products."""
    attention = 12 * cfg.depth * cfg.n_head * cfg.head_dim * cfg.seq_len
    return 6.0 * matmul_params(cfg) + attention
