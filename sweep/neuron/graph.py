"""Graph-shape keys: which compiled graphs a trial needs, as a stable hash of the settings that decide them.

The driver prefers enqueued trials whose graphs are compiled already (``sweep.run.warm``) and ``sweep
precompile`` lists the shapes a study asks for. See :data:`GRAPH_DEFAULTS` for what is in and why, and
:data:`NOT_IN_GRAPH_KEY` for what is left out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

from model.config import DEFAULTS, GPTConfig, OptimConfig, RunConfig
from sweep.neuron.launch import LAUNCH_KEYS, launch_values, opt_level_value, split_flags

ATTR_GRAPH_KEY = "graph_key"  # trial attribute: the key of the trial's graphs
ATTR_PRECOMPILED = "precompiled_graph_keys"  # study attribute written by `sweep precompile`


def trainer_defaults() -> dict[str, Any]:
    """Every trainer key with the value a config that leaves it out trains with: the model, optimiser and
    run dataclasses' defaults overlaid with ``model.config.DEFAULTS`` (the demo-sized model)."""
    out: dict[str, Any] = {}
    for cls in (GPTConfig, OptimConfig, RunConfig):
        for f in fields(cls):
            out[f.name] = f.default_factory() if f.default is MISSING else f.default
    return {**out, **DEFAULTS}


TRAINER_DEFAULTS = trainer_defaults()

# What decides the graphs a trial compiles, with the trainer's default for each. In the key:
# - vocab_size, depth, model_dim, head_dim, n_kv_head, mlp_ratio (as mlp_dim), seq_len, batch_size
#   (per rank): tensor shapes. model_dim and n_kv_head enter resolved the way GPTConfig resolves them
#   (0 means depth x aspect_ratio rounded up to head_dim, and one KV head per query head), so
#   equal models written differently share a key; aspect_ratio matters only through model_dim.
# - kernels, compile, device: which ops and which compiler (reference or NKI kernels; eager or
#   compiled; CPU graphs are not Neuron graphs).
# - qk_norm, value_embeds, residual_scalars, smear, backout, normuon, cautious_wd: boolean toggles that add
#   or drop ops; ve_gate_channels (a gate's shape), window_pattern and short_window (masks traced as constants).
# - softcap, qk_scale, ve_gate_scale, adam_beta1, adam_beta2, x0_beta1: Python floats traced into the graphs as
#   constants (softcap 0 and qk_scale 1 also drop an op), so another value is another NEFF even at equal shapes.
# - tokenizer: a tokenizer file fixes the vocabulary in place of vocab_size.
# - ranks, lnc, neuron_cc_flags, neuron_opt_level (launch keys, below): world size, the compile target's logical
#   core size and the compiler's options all change the compiled artefact (TorchNeuron's own NEFF cache key holds
#   the opt level and the flags too, docs/neuron.md).
GRAPH_DEFAULTS: dict[str, Any] = {k: TRAINER_DEFAULTS[k] for k in (
    "vocab_size", "depth", "aspect_ratio", "model_dim", "head_dim", "n_kv_head", "mlp_ratio", "seq_len", "batch_size",
    "kernels", "compile", "device", "qk_norm", "value_embeds", "residual_scalars", "cautious_wd", "softcap",
    "adam_beta1", "adam_beta2", "tokenizer", "qk_scale", "ve_gate_channels", "ve_gate_scale", "window_pattern",
    "short_window", "smear", "backout", "normuon", "x0_beta1")}
# Left out, and why: every learning rate, weight decay, momentum and schedule ratio is a 0-dim device
# tensor filled in place (model/optim.py), so it never changes a graph; grad_accum (and
# total_batch_tokens, which only sets it) repeats the same micro-step graph; rope_base, head_init_std,
# embed_init_std, fc_init_scale and x0_init only fill buffers and weights (graph inputs), muon_beta2 a 0-dim
# tensor; seed, data, val_shard, eval, CORE and budget settings,
# logging and checkpointing are run-time; compile_optimizer and compile_loss change nothing on Neuron, where
# both follow `compile` (model/train.py).
NOT_IN_GRAPH_KEY = ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "weight_decay", "adam_weight_decay",
                    "muon_momentum", "muon_momentum_start", "muon_momentum_warmup_ratio", "warmup_ratio",
                    "warmdown_ratio", "final_lr_frac", "grad_accum", "rope_base", "head_init_std", "embed_init_std",
                    "fc_init_scale", "x0_init", "muon_beta2", "seed", "data",
                    "val_shard", "cache_dir", "eval_tokens", "final_eval_tokens", "eval_fractions", "eval_at_start",
                    "budget_s", "startup_allowance_s", "excluded_steps", "max_steps", "max_loss", "log_every",
                    "save_checkpoint", "num_threads",
                    # CORE runs after training on the final weights; the global batch only sets grad_accum.
                    "core_bundle", "core_max_seconds", "core_max_examples", "core_buckets", "total_batch_tokens",
                    # The final evaluation runs the eager model after the deadline, at whatever length it asks.
                    "eval_seq_len", "final_eval_rows", "compile_optimizer", "compile_loss")
GRAPH_INPUTS = frozenset(GRAPH_DEFAULTS) | frozenset(LAUNCH_KEYS)
WIDTH_KEYS = ("depth", "aspect_ratio", "model_dim", "head_dim", "n_kv_head", "mlp_ratio")  # what the widths come from


class _UncheckedGPTConfig(GPTConfig):
    """GPTConfig's own derivation of the widths without its validation, for configs the trainer refuses:
    they still get a key (recorded on the failed trial, listed by precompile) as they always did."""

    def validate(self) -> None:
        pass


def resolved_model(config: Mapping[str, Any]) -> GPTConfig:
    """The trainer's model config over ``config``'s width keys: model_dim, n_kv_head and mlp_dim resolved
    the way the trainer resolves them (0 model_dim from depth x aspect_ratio, 0 n_kv_head one per head)."""
    c = {k: config.get(k, GRAPH_DEFAULTS[k]) for k in WIDTH_KEYS}
    widths = {**{k: int(c[k]) for k in WIDTH_KEYS if k != "mlp_ratio"}, "mlp_ratio": float(c["mlp_ratio"])}
    try:
        return GPTConfig(**widths)
    except ValueError:
        return _UncheckedGPTConfig(**widths)


def graph_shape(config: Mapping[str, Any], default_ranks: int = 1, env: Mapping[str, str] | None = None
                ) -> dict[str, Any]:
    """The normalised settings :func:`graph_key` hashes (see :data:`GRAPH_DEFAULTS`)."""
    c = {**GRAPH_DEFAULTS, **{k: v for k, v in config.items() if k in GRAPH_DEFAULTS}}
    ranks, lnc, flags = launch_values(config, default_ranks, env)
    opt_level = opt_level_value(config, env)
    model = resolved_model(c)
    return {
        "vocab_size": int(c["vocab_size"]), "depth": model.depth, "model_dim": model.model_dim,
        "head_dim": model.head_dim, "n_kv_head": model.n_kv_head, "mlp_dim": model.mlp_dim,
        "seq_len": int(c["seq_len"]),
        "batch_size": int(c["batch_size"]), "kernels": c["kernels"], "compile": bool(c["compile"]),
        "device": c["device"], "qk_norm": bool(c["qk_norm"]), "value_embeds": bool(c["value_embeds"]),
        "residual_scalars": bool(c["residual_scalars"]), "cautious_wd": bool(c["cautious_wd"]),
        "softcap": float(c["softcap"]), "adam_beta1": float(c["adam_beta1"]), "adam_beta2": float(c["adam_beta2"]),
        "tokenizer": c["tokenizer"] or "", "ranks": ranks, "lnc": lnc,
        "neuron_cc_flags": " ".join(split_flags(flags)) if flags else "",
        **({"neuron_opt_level": opt_level} if opt_level else {}),  # absent when unset: older keys stay as they were
        **recipe_shape(c),
    }


# The recipe's graph settings (docs/recipe.md) at the values that compile what the trainer compiled before they
# existed: at these they stay out of the hash, so a config written with them keeps the key it was stored with.
LEGACY_RECIPE = {"qk_scale": 1.0, "ve_gate_channels": 0, "ve_gate_scale": 2.0, "window_pattern": "L", "short_window": 0,
                 "smear": False, "backout": False, "normuon": False, "x0_beta1": None}


def recipe_shape(c: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's settings of ``c`` that differ from :data:`LEGACY_RECIPE` (the gate and x0 settings only
    where value embeddings and residual scalars are on)."""
    out = {"qk_scale": float(c["qk_scale"]), "window_pattern": str(c["window_pattern"]).upper(),
           "short_window": int(c["short_window"]), "smear": bool(c["smear"]), "backout": bool(c["backout"]),
           "normuon": bool(c["normuon"])}
    if c["value_embeds"]:
        out.update(ve_gate_channels=int(c["ve_gate_channels"]), ve_gate_scale=float(c["ve_gate_scale"]))
    if c["residual_scalars"]:
        out["x0_beta1"] = float(c["x0_beta1"])
    return {k: v for k, v in out.items() if v != LEGACY_RECIPE[k]}


def graph_key(config: Mapping[str, Any], default_ranks: int = 1, env: Mapping[str, str] | None = None) -> str:
    """A stable 16-hex-digit hash of :func:`graph_shape`: equal keys compile equal graphs."""
    blob = json.dumps(graph_shape(config, default_ranks, env), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]

