"""The trainer's configuration: one flat dict of parameters, split into model, optimiser and run parts.

This module is the one home of the trainer's settings and defaults, and it imports no torch: the sweep
(study specs, graph keys, exports) reads the same dataclasses without loading the trainer.

The same flat names are used by the study specs, the dashboard and ad-hoc trials, so a sweep point is a
config as it stands. Unknown keys and values of the wrong type are refused with a ConfigError that names
the key: a typo in a sweep must never train silently with a default.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import InitVar, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kernels import IMPLS


class ConfigError(ValueError):
    """A configuration the trainer refuses; the message is one line naming the key."""


@dataclass
class GPTConfig:
    """The model's shape and options (model.gpt builds it; model.counts counts it)."""

    vocab_size: int = 8192
    depth: int = 4
    model_dim: int = 0  # 0: derived as depth * aspect_ratio, rounded up to a multiple of head_dim
    aspect_ratio: int = 64
    head_dim: int = 64
    n_kv_head: int = 0  # 0: as many KV heads as query heads (no GQA)
    mlp_ratio: float = 4.0
    seq_len: int = 256
    rope_base: float = 10000.0
    softcap: float = 15.0  # 0 disables the logit softcap
    qk_norm: bool = True
    qk_scale: float = 1.0  # q and k times this after QK-norm (nanochat: 1.2, sharper attention)
    # The public recipe's features (docs/recipe.md says where each comes from and what it gained there).
    # Value embeddings: a vocab x kv_dim table on alternating layers ending with the last, added to V through a
    # per-head gate ve_gate_scale * sigmoid(W x[:ve_gate_channels]) (at most model_dim; 0: added ungated).
    value_embeds: bool = True
    ve_gate_channels: int = 32
    ve_gate_scale: float = 2.0
    # Residual scalars: x = resid_lambdas[i] * x + x0_lambdas[i] * x0 before block i (x0: the normed embedding).
    residual_scalars: bool = True
    x0_init: float = 0.1  # x0_lambdas' initial value (resid_lambdas start at 1)
    # Attention windows, a pattern of S (short: short_window tokens, 0: seq_len // 2) and L (full) tiled over
    # the layers, the last always L. On CPU and Neuron a window is a mask on full attention: no FLOPs saved,
    # yet SSSL (autoresearch's default) beat L per second on the recipe bench (docs/recipe.md).
    window_pattern: str = "SSSL"
    short_window: int = 0
    smear: bool = False  # nanochat: a gated share of the previous token's embedding added to each token's
    backout: bool = False  # nanochat: a learned share of the mid-depth residual subtracted before the head
    embed_init_std: float = 1.0  # wte's init (nanochat: 0.8)
    fc_init_scale: float = 1.0  # the MLP input projection's init relative to the others (nanochat: 0.4)
    head_init_std: float = 0.001
    kernels: str = "auto"  # torch (plain), reference (autograd Functions), nki (Trainium); auto: nki or torch
    # False: derive model_dim and n_kv_head but do not validate. Only for counting (model.counts) whatever
    # shape a sweep draws, before its constraints reject those the trainer refuses; not a field.
    check: InitVar[bool] = True

    def __post_init__(self, check: bool) -> None:
        if self.model_dim == 0 and self.depth > 0 and self.head_dim > 0:
            width = self.depth * self.aspect_ratio
            self.model_dim = max(self.head_dim, -(-width // self.head_dim) * self.head_dim)
        if self.n_kv_head == 0 and self.head_dim > 0:
            self.n_kv_head = self.model_dim // self.head_dim
        if check:
            self.validate()

    @property
    def n_head(self) -> int:
        return self.model_dim // self.head_dim

    @property
    def ve_gate_width(self) -> int:
        """Channels a value-embedding gate reads: ve_gate_channels, at most the model's width."""
        return min(self.ve_gate_channels, self.model_dim)

    @property
    def mlp_dim(self) -> int:
        return int(round(self.mlp_ratio * self.model_dim))

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field: a sweep must learn why a point is invalid."""
        for name in ("vocab_size", "depth", "model_dim", "head_dim", "n_kv_head", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.model_dim % self.head_dim:
            raise ValueError(f"model_dim {self.model_dim} is not divisible by head_dim {self.head_dim}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head {self.n_kv_head} does not divide the {self.n_head} query heads")
        if self.kernels not in IMPLS:
            raise ValueError(f"kernels must be one of {', '.join(IMPLS)}, got {self.kernels!r}")
        if self.mlp_ratio <= 0 or self.rope_base <= 0 or self.softcap < 0 or self.head_init_std < 0:
            raise ValueError("mlp_ratio and rope_base must be positive, softcap and head_init_std >= 0")
        for name in ("qk_scale", "ve_gate_scale", "embed_init_std", "fc_init_scale"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.ve_gate_channels < 0:
            raise ValueError(f"ve_gate_channels must not be negative, got {self.ve_gate_channels}")
        if self.short_window < 0:
            raise ValueError(f"short_window must not be negative, got {self.short_window}")
        if not self.window_pattern or set(self.window_pattern.upper()) - set("SL"):
            raise ValueError(f"window_pattern must be a non-empty string of S and L, got {self.window_pattern!r}")

    def window_sizes(self) -> list[int]:
        """Each layer's attention window in tokens (seq_len: full causal attention); the last layer is full."""
        short = min(self.short_window or self.seq_len // 2, self.seq_len) or 1
        pattern = self.window_pattern.upper() or "L"
        sizes = [short if pattern[i % len(pattern)] == "S" else self.seq_len for i in range(self.depth)]
        return sizes[:-1] + [self.seq_len] if sizes else sizes

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class OptimConfig:
    """Learning rates, Muon/AdamW settings and schedule ratios (model.optim; model.schedule's shapes)."""

    matrix_lr: float = 0.04
    embedding_lr: float = 0.6
    unembedding_lr: float = 0.004
    scalar_lr: float = 0.5
    weight_decay: float = 0.2  # Muon's, decaying linearly to 0 over the run
    adam_weight_decay: float = 0.0
    adam_beta1: float = 0.8
    adam_beta2: float = 0.95
    muon_momentum: float = 0.95
    muon_momentum_start: float = 0.85
    muon_momentum_warmup_ratio: float = 0.1
    # NorMuon: the orthogonalised update rescaled per row (or column) by an EMA of its squares (beta2).
    normuon: bool = True
    muon_beta2: float = 0.95
    x0_beta1: float = 0.96  # Adam's beta1 for the x0 scalars (resid scalars take scalar_lr / 100)
    cautious_wd: bool = True
    warmup_ratio: float = 0.0
    warmdown_ratio: float = 0.5
    final_lr_frac: float = 0.0


@dataclass
class RunConfig:
    """How a run trains, evaluates and reports: batch, budget, data, device, evaluations, CORE."""

    batch_size: int = 16  # sequences per rank per micro-step
    grad_accum: int = 1
    total_batch_tokens: int = 0  # > 0: the global batch in tokens, from which grad_accum is derived per world size
    seed: int = 0
    budget_s: float = 30.0  # charged training seconds
    startup_allowance_s: float = 900.0  # start-up time not charged, as in the competition kit
    excluded_steps: int = 3  # first steps not charged (compilation, warm caches)
    max_steps: int = 0  # > 0: stop there too, and key schedules to steps (repeatable runs, benchmarks)
    eval_fractions: list[float] = field(default_factory=lambda: [0.25, 0.5, 0.75])
    eval_at_start: bool = False
    eval_tokens: int = 16384  # intermediate evaluations: a fixed slice of the validation set
    # The final evaluation scores what the competition's evaluate_bpb scores (model.data.scoring_set): on the
    # kit's data, its rows (its MAX_SEQ_LEN and EVAL_TOKENS decide); else the first final_eval_tokens //
    # eval_seq_len rows of the validation stream, at eval_seq_len (0: seq_len; a study that searches seq_len
    # sets it, e.g. 2048 as the kit, so that every trial is scored on the same rows at the same length).
    final_eval_tokens: int = 65536
    eval_seq_len: int = 0  # on the kit's data 0 or its MAX_SEQ_LEN
    final_eval_rows: int = 0  # 0: every one of those rows (exact); n: a fixed uniform sample of n, with val_bpb_stderr
    data: str = ""  # "" or "demo": the demo corpus; else a directory, glob or file of parquet or text
    tokenizer: str = ""  # "": train one of vocab_size on the training text
    val_shard: str = ""
    cache_dir: str = "runs/cache"
    device: str = "auto"
    num_threads: int = 0  # torch CPU threads; 0 keeps torch's default
    compile: bool = False  # the model's forward and backward through torch.compile (and the optimiser with it)
    # The optimiser's update compiled per parameter shape before the clock starts (CPU and CUDA; on Neuron it goes
    # with `compile`, docs/neuron.md); off: eager, the same numbers to rounding.
    compile_optimizer: bool = True
    # Training's softcapped cross-entropy compiled, warmed up before the clock (CPU and CUDA, PyTorch ops; on
    # Neuron it goes with `compile`): one fused pass where the eager chain makes six over [tokens, vocab].
    compile_loss: bool = True
    max_loss: float = 0.0  # a training loss above this, or not finite, is divergence; 0: 2 ln(vocab)
    log_every: int = 10
    save_checkpoint: bool = True
    core_bundle: str = ""  # CORE after the final eval: "" none, "demo" the demo bundle, else a bundle directory
    core_max_seconds: float = 3600.0  # CORE's time limit; past it the result is marked incomplete
    core_max_examples: int = 0  # per task; 0: all
    core_buckets: int = 4  # CORE row lengths seq_len, /2, /4, ... (>= 64); 1: every row padded to seq_len


# The demo-sized default model: trains visibly in seconds on a laptop CPU.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 2048,
    "depth": 4,
    "aspect_ratio": 32,
    "head_dim": 32,
    "seq_len": 128,
}

@dataclass
class TrainConfig:
    model: GPTConfig
    optim: OptimConfig
    run: RunConfig

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved flat config, as recorded in results."""
        out: dict[str, Any] = {}
        for part in (self.model, self.optim, self.run):
            out.update({f.name: getattr(part, f.name) for f in fields(part)})
        return out


def _coerce(key: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(default, str):
        if value is None:
            return ""
        if isinstance(value, str):
            return value
    elif isinstance(default, list) and isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        return [float(v) for v in value]
    raise ConfigError(f"config key {key!r} expects {type(default).__name__}, got {value!r}")


def _fill(cls, values: dict[str, Any]):
    defaults = cls() if cls is not GPTConfig else None
    kwargs = {}
    for f in fields(cls):
        if f.name in values:
            default = getattr(defaults, f.name) if defaults is not None else f.default
            kwargs[f.name] = _coerce(f.name, values[f.name], default)
    return cls(**kwargs)


def parse_config(values: dict[str, Any], budget_s: float | None = None) -> TrainConfig:
    """Validate a flat parameter dict (over the demo defaults) into a TrainConfig."""
    if not isinstance(values, dict):
        raise ConfigError(f"config must be a JSON object, got {type(values).__name__}")
    known = GPTConfig.field_names() | {f.name for part in (OptimConfig, RunConfig) for f in fields(part)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown config key {unknown[0]!r}" + (f" (and {len(unknown) - 1} more)"
                                                                  if len(unknown) > 1 else ""))
    merged = {**DEFAULTS, **values}
    if budget_s is not None:
        merged["budget_s"] = budget_s
    run = _fill(RunConfig, merged)
    optim = _fill(OptimConfig, merged)
    try:
        model = _fill(GPTConfig, merged)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"model config: {e}") from None
    _check_run(run)
    _check_optim(optim)
    return TrainConfig(model, optim, run)


def _check_run(run: RunConfig) -> None:
    if run.budget_s <= 0:
        raise ConfigError(f"budget_s must be positive, got {run.budget_s}")
    for key in ("batch_size", "grad_accum", "eval_tokens", "final_eval_tokens", "log_every"):
        if getattr(run, key) <= 0:
            raise ConfigError(f"{key} must be positive, got {getattr(run, key)}")
    for key in ("startup_allowance_s", "excluded_steps", "max_steps", "num_threads", "core_max_examples",
                "total_batch_tokens", "eval_seq_len", "final_eval_rows"):
        if getattr(run, key) < 0:
            raise ConfigError(f"{key} must not be negative, got {getattr(run, key)}")
    if any(not 0 < f <= 1 for f in run.eval_fractions):
        raise ConfigError(f"eval_fractions must lie in (0, 1], got {run.eval_fractions}")
    if run.device not in ("auto", "cpu", "cuda", "neuron"):
        raise ConfigError(f"device must be auto, cpu, cuda or neuron, got {run.device!r}")
    if run.max_loss < 0:
        raise ConfigError(f"max_loss must not be negative, got {run.max_loss}")
    if run.core_max_seconds <= 0:
        raise ConfigError(f"core_max_seconds must be positive, got {run.core_max_seconds}")
    if run.core_buckets < 1:
        raise ConfigError(f"core_buckets must be at least 1, got {run.core_buckets}")


def resolve_batch(cfg: TrainConfig, world_size: int) -> None:
    """Derive grad_accum from total_batch_tokens once the world size is known (a no-op when it is 0).

    grad_accum = total_batch_tokens / (batch_size * seq_len * world_size) must be a whole number >= 1;
    an explicit grad_accum other than 1 must agree with it.
    """
    run, total = cfg.run, cfg.run.total_batch_tokens
    if not total:
        return
    per_micro = run.batch_size * cfg.model.seq_len * world_size
    if total % per_micro:
        raise ConfigError(f"total_batch_tokens {total} is not a multiple of batch_size * seq_len * world_size"
                          f" = {run.batch_size} * {cfg.model.seq_len} * {world_size} = {per_micro}")
    derived = total // per_micro
    if run.grad_accum not in (1, derived):
        raise ConfigError(f"grad_accum {run.grad_accum} contradicts total_batch_tokens {total}, which gives"
                          f" {derived} at world size {world_size}")
    run.grad_accum = derived


def _check_optim(optim: OptimConfig) -> None:
    for f in fields(optim):
        value = getattr(optim, f.name)
        if isinstance(value, float) and value < 0:
            raise ConfigError(f"{f.name} must not be negative, got {value}")
    for key in ("warmup_ratio", "warmdown_ratio", "final_lr_frac", "muon_momentum", "muon_momentum_start",
                "adam_beta1", "adam_beta2", "muon_beta2", "x0_beta1"):
        if not 0 <= getattr(optim, key) <= 1:
            raise ConfigError(f"{key} must lie in [0, 1], got {getattr(optim, key)}")
    if optim.warmup_ratio + optim.warmdown_ratio > 1:
        raise ConfigError("warmup_ratio + warmdown_ratio must not exceed 1")


def load_config_arg(arg: str) -> dict[str, Any]:
    """--config takes inline JSON or a path to a .json or .toml file."""
    text = arg.strip()
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config is not valid JSON: {e}") from None
    path = Path(arg)
    if not path.is_file():
        raise ConfigError(f"--config: no such file {arg}")
    try:
        if path.suffix == ".toml":
            return tomllib.loads(path.read_text())
        return json.loads(path.read_text())
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {arg}: {str(e).splitlines()[0]}") from None
