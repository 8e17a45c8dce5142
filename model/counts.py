"""What a GPTConfig costs, without building it: its exact parameter count and training FLOPs per token.

model.gpt builds these parameters (the norms have no weights):
- embedding `wte` and untied head `lm_head`: vocab_size x model_dim each;
- per block: query and output projections model_dim x (n_head * head_dim) each, key and value projections
  model_dim x (n_kv_head * head_dim) each, MLP model_dim x mlp_dim twice;
- with value_embeds, on alternating layers ending with the last: a value embedding vocab_size x
  (n_kv_head * head_dim) and, with ve_gate_channels > 0, a gate n_kv_head x min(ve_gate_channels, model_dim)
  (a matmul);
- with residual_scalars: two scalars per layer; with smear a gate of min(24, model_dim) and a scalar; with
  backout a scalar.

`num_params(cfg)` equals `sum(p.numel() for p in GPT(cfg).parameters())` (a test builds the models to check).
This module imports no torch, so the sweep's `gpt_params` expression counts with it too.
"""

from __future__ import annotations

from model.config import GPTConfig


def value_embed_layers(cfg: GPTConfig) -> int:
    """Layers carrying a value embedding: every other one counted back from the last (model.gpt.has_value_embed)."""
    return (cfg.depth + 1) // 2 if cfg.value_embeds and cfg.depth > 0 else 0


def lookup_params(cfg: GPTConfig) -> int:
    """Embedding tables, which a token reads a row of (no matmul): wte and the value embeddings."""
    kv_dim = cfg.n_kv_head * cfg.head_dim
    return cfg.vocab_size * cfg.model_dim + value_embed_layers(cfg) * cfg.vocab_size * kv_dim


def matmul_params(cfg: GPTConfig) -> int:
    """Weights every token multiplies through: the blocks' projections, MLPs and value-embedding gates, and the
    head."""
    d, q_dim, kv_dim = cfg.model_dim, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    attention = 2 * d * q_dim + 2 * d * kv_dim  # c_q and c_proj; c_k and c_v
    mlp = 2 * d * cfg.mlp_dim  # c_fc and c_proj
    gates = value_embed_layers(cfg) * cfg.n_kv_head * min(cfg.ve_gate_channels, cfg.model_dim)
    return cfg.depth * (attention + mlp) + gates + d * cfg.vocab_size


def scalar_params(cfg: GPTConfig) -> int:
    """Learned scalars (and the smear gate's few weights, optimised alongside them)."""
    smear = min(24, cfg.model_dim) + 1 if cfg.smear else 0  # model.gpt.SMEAR_CHANNELS and smear_lambda
    return (2 * cfg.depth if cfg.residual_scalars else 0) + smear + (1 if cfg.backout else 0)


def num_params(cfg: GPTConfig) -> int:
    """Every parameter of `model.gpt.GPT(cfg)`."""
    return lookup_params(cfg) + matmul_params(cfg) + scalar_params(cfg)


def flops_per_token(cfg: GPTConfig) -> float:
    """Training FLOPs per token: 6 per matmul weight plus causal attention's score and value products, each
    layer over its window (GPTConfig.window_sizes; a window is a mask, so this is the model's FLOPs, not
    necessarily the work a backend does)."""
    attention = sum(12 * cfg.n_head * cfg.head_dim * min(w, cfg.seq_len) for w in cfg.window_sizes())
    return 6.0 * matmul_params(cfg) + attention
