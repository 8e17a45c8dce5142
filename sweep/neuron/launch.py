"""Trainium plumbing of a trial: launch shape, the shared compile cache, graph-shape keys, utilisation.

Everything here is plain Python over the documented interfaces of the Neuron tools and runtime, so the
CPU tests drive it with stand-in executables; nothing imports torch or ``model.*``.

**Launch shape.** ``lnc`` (``NEURON_LOGICAL_NC_CONFIG``: 2 gives 4 logical cores per Trainium2 chip,
1 gives 8), ``ranks`` (torchrun processes, one logical core each) and ``neuron_cc_flags``
(``NEURON_CC_FLAGS``) are study parameters like any other (fixed, searched or derived) but the trainer
does not know them: :class:`TrialLaunch` strips them from its config and turns them into environment
and torchrun arguments. Ray reserves ``neuron_cores`` counted in the node's logical-core config (what
``ray start`` saw in ``NEURON_LOGICAL_NC_CONFIG``, 2 unless the cluster says otherwise) and sets
``NEURON_RT_VISIBLE_CORES`` ("0-3", "4,5,6,7", "0-1,4-5"). Those cores are translated into the
trial's own LNC (a LNC-2 core is the physical pair 2c, 2c+1), split evenly over the ranks (rank r
drives the first core of its share) and the trainer sees exactly the ranks' cores, so
``neuron:LOCAL_RANK`` is the mapped core. A plan that does not fit (3 ranks on 4 cores, a LNC-2 trial
on cores that split physical pairs, cores neuron-ls does not show) is refused with one line. A
multi-chip trial (``trial.chips = K``, :func:`chip_cores`) is the same plan over K chips' cores: one rank
per logical core, ``NEURON_RT_VISIBLE_CORES`` over all of them.

**Compile cache.** Every Neuron trial points the caches at one place: the node directory
(``$NEURON_CACHE_DIR``, as ``infra/cluster.py`` writes it into ``cluster.env``; ``infra/ray/node_sync.sh``
syncs it with S3), a shared file system (``trial.compile_cache = "/fsx/neuron-cache"``) or S3
(``"s3://bucket/prefix"``). The layout is the one ``cluster.env`` uses: ``neff/`` for the native
backend's NEFF cache (``TORCH_NEURONX_NEFF_CACHE_DIR``, a file system path: with S3 it stays on the
node and node_sync carries it) and ``xla/`` for the XLA path's cache (``NEURON_COMPILE_CACHE_URL``,
which takes ``s3://`` itself). ``--cache_dir`` in the compiler flags is refused: it would move the
cache away from where the sweep looks. Hits are read off the cache directory: NEFF files present after
the run that were not there before were compiled by it (a miss); none new means every graph came from
the cache. On a node running several trials at once a neighbour's new entries count against this
trial too, so a miss can be over-reported, a hit never.

**Graph key.** :func:`graph_key` hashes exactly the settings that decide which graphs get compiled,
so the driver can prefer enqueued trials whose graphs are compiled already and ``sweep precompile``
can list the shapes a study asks for. See :data:`GRAPH_DEFAULTS` for what is in and why, and
:data:`NOT_IN_GRAPH_KEY` for what is left out.

**Utilisation.** Where ``neuron-monitor`` is on PATH, :class:`MonitorSampler` reads its JSON reports
during the trial and keeps, for the trial's own runtimes (found by pid: the processes carrying the
trial token), the mean NeuronCore utilisation and the peak device memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("sweep.neuron")

# -- names ------------------------------------------------------------------------------------------

LAUNCH_KEYS = ("lnc", "ranks", "neuron_cc_flags")  # study parameters the worker takes out of the trainer config
LNC_VAR = "NEURON_LOGICAL_NC_CONFIG"
CORES_VAR = "NEURON_RT_VISIBLE_CORES"  # set by Ray for a task holding neuron_cores
CC_FLAGS_VAR = "NEURON_CC_FLAGS"
NEFF_CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_DIR"  # the native backend's persistent NEFF cache (a path)
XLA_CACHE_VAR = "NEURON_COMPILE_CACHE_URL"  # the XLA path's persistent cache (a path or s3://)
NEFF_DISABLE_VAR = "TORCH_NEURONX_NEFF_DISABLE_CACHE"
NODE_CACHE_VAR = "NEURON_CACHE_DIR"  # the node's cache root, from infra's cluster.env
DEFAULT_NODE_CACHE = "/var/tmp/trnsweep-neuron-cache"
DEFAULT_NODE_LNC = 2  # Trainium2's default, and render-cluster's
LNC_VALUES = (1, 2)
CORES_PER_CHIP = 8  # physical NeuronCores of a Trainium2 chip
MAX_CHIPS = 16  # a trn2.48xlarge: a trial runs on one node
MIN_CACHE_FREE_BYTES = 4 * 1024**3  # below this a compile could fill the disk, which corrupts the cache

ATTR_GRAPH_KEY = "graph_key"
ATTR_GRAPH_CACHE = "graph_cache"  # "hit" | "miss" | "none" (never got as far as compiling)
ATTR_PRECOMPILED = "precompiled_graph_keys"  # study attribute written by `sweep precompile`


class LaunchError(ValueError):
    """A launch plan that cannot run here; the message is one line, ``key`` the launch key at fault."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


# -- launch shape -----------------------------------------------------------------------------------

_CORE_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cores(text: str) -> list[int]:
    """``NEURON_RT_VISIBLE_CORES`` in any of Ray's and the runtime's forms ("0-3", "4,5,6,7", "0-1,4-5")."""
    cores: list[int] = []
    for item in (s.strip() for s in text.split(",")):
        m = _CORE_ITEM.match(item)
        if not m:
            raise LaunchError(f"{CORES_VAR}={text!r}: {item!r} is not a core or a range a-b")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise LaunchError(f"{CORES_VAR}={text!r}: range {item} runs backwards")
        cores.extend(range(lo, hi + 1))
    if len(set(cores)) != len(cores):
        raise LaunchError(f"{CORES_VAR}={text!r}: a core is listed twice")
    return sorted(cores)


def format_cores(cores: Iterable[int]) -> str:
    """The shortest ranges form ("0-3,6"), which the runtime and Ray both read."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cores)):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def to_trial_lnc(cores: Sequence[int], node_lnc: int, lnc: int) -> list[int]:
    """Cores counted in the node's LNC (what Ray hands out) renumbered in the trial's LNC.

    A LNC-2 core c is the physical pair (2c, 2c+1), so a LNC-1 trial on LNC-2 cores gets both halves,
    and a LNC-2 trial on LNC-1 cores needs whole, aligned pairs.
    """
    if node_lnc == lnc:
        return sorted(cores)
    if node_lnc == 2 and lnc == 1:
        return sorted(p for c in cores for p in (2 * c, 2 * c + 1))
    have = set(cores)
    pairs = sorted({c // 2 for c in have})
    split = [c for c in sorted(have) if c ^ 1 not in have]
    if split:
        raise LaunchError(f"{CORES_VAR}={format_cores(cores)} splits LNC-2 pairs (2k, 2k+1) at core(s) "
                          f"{format_cores(split)}: a LNC-2 trial needs whole pairs of LNC-1 cores")
    return pairs


def chip_cores(chips: int, lnc: int) -> int:
    """Logical NeuronCores of ``chips`` whole chips at ``lnc``: one torchrun rank each for a multi-chip trial."""
    return chips * CORES_PER_CHIP // lnc


def map_ranks(cores: Sequence[int], ranks: int, lnc: int) -> list[int]:
    """The core each rank drives: the cores split evenly, rank r taking the first of its share."""
    n = len(cores)
    if ranks < 1 or ranks > n or n % ranks:
        raise LaunchError(f"{ranks} rank(s) do not fit the {n} LNC-{lnc} NeuronCore(s) assigned "
                          f"({format_cores(cores)}): ranks must divide the core count")
    share = n // ranks
    return [cores[r * share] for r in range(ranks)]


def launch_values(config: Mapping[str, Any], default_ranks: int = 1,
                  env: Mapping[str, str] | None = None) -> tuple[int, int | None, str | None]:
    """(ranks, lnc, compiler flags) of a trial: its config first, then the spec's ``trial.ranks`` and env."""
    env = env or {}
    ranks = config.get("ranks", default_ranks)
    if isinstance(ranks, float) and ranks.is_integer():
        ranks = int(ranks)
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise LaunchError(f"ranks must be a positive integer, got {ranks!r}", "ranks")
    lnc: Any = config.get("lnc", env.get(LNC_VAR))
    if lnc is not None:
        name = "lnc" if "lnc" in config else LNC_VAR
        try:
            lnc = int(lnc)
        except (TypeError, ValueError):
            raise LaunchError(f"{name} must be 1 or 2, got {lnc!r}", "lnc") from None
        if lnc not in LNC_VALUES:
            raise LaunchError(f"{name} must be 1 or 2, got {lnc!r}", "lnc")
    flags = config.get("neuron_cc_flags", env.get(CC_FLAGS_VAR))
    if flags is not None:
        if not isinstance(flags, str):
            raise LaunchError(f"neuron_cc_flags must be a string, got {flags!r}", "neuron_cc_flags")
        if any(t.split("=", 1)[0] in ("--cache_dir", "--cache-dir") for t in _split_flags(flags)):
            raise LaunchError("--cache_dir is set by the sweep (trial.compile_cache); remove it", "neuron_cc_flags")
    return ranks, lnc, flags


def _split_flags(flags: str) -> list[str]:
    try:
        return shlex.split(flags)
    except ValueError:
        return flags.split()


_SPEC_KEY = {"ranks": "trial.ranks", "lnc": f"trial.env.{LNC_VAR}", "neuron_cc_flags": f"trial.env.{CC_FLAGS_VAR}"}


def spec_fit(neuron_cores: int, ranks: int, lnc: int | None) -> str | None:
    """Why a (ranks, lnc) plan cannot fit ``neuron_cores`` as the spec reserves them; None when it fits.

    ``neuron_cores`` counts cores at the cluster's LNC, assumed :data:`DEFAULT_NODE_LNC` here; the
    worker checks again against the cores Ray actually assigns.
    """
    if neuron_cores <= 0:
        return None
    lnc = lnc or DEFAULT_NODE_LNC
    logical = neuron_cores * DEFAULT_NODE_LNC // lnc
    if ranks > logical or logical % ranks:
        return (f"{ranks} rank(s) do not fit {logical} LNC-{lnc} NeuronCore(s) (trial.resources.neuron_cores = "
                f"{neuron_cores} at the cluster's LNC {DEFAULT_NODE_LNC}): ranks must divide the core count")
    return None


def check_spec(space: Any, neuron_cores: int, trial_ranks: int, trial_ranks_given: bool, env: Mapping[str, str],
               compile_cache: str) -> tuple[str, str] | None:
    """Launch settings a spec gets wrong, as (key, one-line message); None when all is well.

    Launch values are collected from the fixed values and from sampled points (conditional and
    derived ones included) and each (ranks, lnc) pair is checked against the reserved cores.
    """
    names = set(space.fixed) | {p.name for p in space.params} | {n for n, _ in space.derived}
    where = {**{k: "fixed" for k in space.fixed}, **{p.name: "params" for p in space.params},
             **{n: "derived" for n, _ in space.derived}}
    if "ranks" in names and trial_ranks_given:
        return "trial.ranks", f"ranks is also [{where['ranks']}] ranks; keep one"
    for key, var in (("lnc", LNC_VAR), ("neuron_cc_flags", CC_FLAGS_VAR)):
        if key in names and var in env:
            return f"trial.env.{var}", f"the study sets [{where[key]}] {key}; keep one"
    if CORES_VAR in env:
        return f"trial.env.{CORES_VAR}", "Ray assigns the cores of a trial; use trial.resources.neuron_cores"
    if compile_cache and not (compile_cache.startswith("s3://") or os.path.isabs(compile_cache)):
        return "trial.compile_cache", f"must be an absolute path or s3://bucket/prefix, got {compile_cache!r}"
    if not names & set(LAUNCH_KEYS) and not neuron_cores:
        return None
    rng = random.Random(0)
    seen: set[tuple[Any, Any, Any]] = set()
    for _ in range(200):
        try:
            env_point, broken = space.complete(space.sample(rng))
        except Exception:  # the spec's own checks report broken expressions
            return None
        if broken is not None:
            continue
        combo = tuple(env_point.get(k) for k in LAUNCH_KEYS)
        if combo in seen:
            continue
        seen.add(combo)
        try:
            ranks, lnc, _ = launch_values(env_point, trial_ranks, env)
        except LaunchError as e:
            key = e.key or "ranks"
            return (f"{where[key]}.{key}" if key in where else _SPEC_KEY[key]), str(e)
        why = spec_fit(neuron_cores, ranks, lnc)
        if why:
            return (f"{where['ranks']}.ranks" if "ranks" in where else "trial.ranks"), why
    return None


# -- graph-shape key --------------------------------------------------------------------------------

# What decides the graphs a trial compiles, with the trainer's default for each (tests hold these
# equal to model.config's). In the key:
# - vocab_size, depth, model_dim, head_dim, n_kv_head, mlp_ratio (as mlp_dim), seq_len, batch_size
#   (per rank): tensor shapes. model_dim and n_kv_head enter resolved the way GPTConfig resolves them
#   (0 means depth x aspect_ratio rounded up to head_dim, and one KV head per query head), so
#   equal models written differently share a key; aspect_ratio matters only through model_dim.
# - kernels, compile, device: which ops and which compiler (reference or NKI kernels; eager or
#   compiled; CPU graphs are not Neuron graphs).
# - qk_norm, value_embeds, residual_scalars, cautious_wd: boolean toggles that add or drop ops.
# - softcap, adam_beta1, adam_beta2: Python floats traced into the graphs as constants (softcap 0
#   also drops the op), so another value is another NEFF even at equal shapes.
# - tokenizer: a tokenizer file fixes the vocabulary in place of vocab_size.
# - ranks, lnc, neuron_cc_flags (launch keys, below): world size, the compile target's logical core
#   size and the compiler's options all change the compiled artefact.
GRAPH_DEFAULTS: dict[str, Any] = {
    "vocab_size": 2048, "depth": 4, "aspect_ratio": 32, "model_dim": 0, "head_dim": 32, "n_kv_head": 0,
    "mlp_ratio": 4.0, "seq_len": 128, "batch_size": 16, "kernels": "auto", "compile": False, "device": "auto",
    "qk_norm": True, "value_embeds": False, "residual_scalars": False, "cautious_wd": True, "softcap": 15.0,
    "adam_beta1": 0.8, "adam_beta2": 0.95, "tokenizer": "",
}
# Left out, and why: every learning rate, weight decay, momentum and schedule ratio is a 0-dim device
# tensor filled in place (model/optim.py), so it never changes a graph; grad_accum (and
# total_batch_tokens, which only sets it) repeats the same micro-step graph; rope_base and head_init_std
# only fill buffers and weights (graph inputs); seed, data, val_shard, eval, CORE and budget settings,
# logging, checkpointing and fault injection are run-time.
NOT_IN_GRAPH_KEY = ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "weight_decay", "adam_weight_decay",
                    "muon_momentum", "muon_momentum_start", "muon_momentum_warmup_ratio", "warmup_ratio",
                    "warmdown_ratio", "final_lr_frac", "grad_accum", "rope_base", "head_init_std", "seed", "data",
                    "val_shard", "cache_dir", "eval_tokens", "final_eval_tokens", "eval_fractions", "eval_at_start",
                    "budget_s", "startup_allowance_s", "excluded_steps", "max_steps", "max_loss", "log_every",
                    "save_checkpoint", "num_threads", "fault", "fault_step",
                    # CORE runs after training on the final weights; the global batch only sets grad_accum.
                    "core_bundle", "core_max_seconds", "core_max_examples", "core_buckets", "total_batch_tokens")
GRAPH_INPUTS = frozenset(GRAPH_DEFAULTS) | frozenset(LAUNCH_KEYS)


def graph_shape(config: Mapping[str, Any], default_ranks: int = 1, env: Mapping[str, str] | None = None
                ) -> dict[str, Any]:
    """The normalised settings :func:`graph_key` hashes (see :data:`GRAPH_DEFAULTS`)."""
    c = {**GRAPH_DEFAULTS, **{k: v for k, v in config.items() if k in GRAPH_DEFAULTS}}
    ranks, lnc, flags = launch_values(config, default_ranks, env)
    head_dim = int(c["head_dim"])
    model_dim = int(c["model_dim"])
    if model_dim == 0 and head_dim > 0:
        model_dim = max(head_dim, -(-int(c["depth"]) * int(c["aspect_ratio"]) // head_dim) * head_dim)
    n_kv_head = int(c["n_kv_head"]) or (model_dim // head_dim if head_dim > 0 else 0)
    return {
        "vocab_size": int(c["vocab_size"]), "depth": int(c["depth"]), "model_dim": model_dim, "head_dim": head_dim,
        "n_kv_head": n_kv_head, "mlp_dim": int(round(float(c["mlp_ratio"]) * model_dim)), "seq_len": int(c["seq_len"]),
        "batch_size": int(c["batch_size"]), "kernels": c["kernels"], "compile": bool(c["compile"]),
        "device": c["device"], "qk_norm": bool(c["qk_norm"]), "value_embeds": bool(c["value_embeds"]),
        "residual_scalars": bool(c["residual_scalars"]), "cautious_wd": bool(c["cautious_wd"]),
        "softcap": float(c["softcap"]), "adam_beta1": float(c["adam_beta1"]), "adam_beta2": float(c["adam_beta2"]),
        "tokenizer": c["tokenizer"] or "", "ranks": ranks, "lnc": lnc,
        "neuron_cc_flags": " ".join(_split_flags(flags)) if flags else "",
    }


def graph_key(config: Mapping[str, Any], default_ranks: int = 1, env: Mapping[str, str] | None = None) -> str:
    """A stable 16-hex-digit hash of :func:`graph_shape`: equal keys compile equal graphs."""
    blob = json.dumps(graph_shape(config, default_ranks, env), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def pick_warm(keys: Sequence[str | None], warm: set[str]) -> int | None:
    """Index of the first queued trial whose graphs are compiled already; None when none is."""
    return next((i for i, k in enumerate(keys) if k is not None and k in warm), None)


class WarmPicker:
    """The driver's preference for warm trials: when several enqueued trials wait (retries, enqueued
    points, ad-hoc trials), start the first whose graph key is known compiled before the queue's head.

    Warm keys: those of finished trials that compiled or loaded their graphs (``graph_cache`` hit or
    miss) and those ``sweep precompile`` filled, re-read at most every ``refresh_s``. New points the
    sampler proposes are left alone: the preference never changes what is sampled, only the order of
    what already waits.
    """

    def __init__(self, spec: Any, refresh_s: float = 30.0) -> None:
        self.spec = spec
        self.refresh_s = refresh_s
        self._warm: set[str] = set()
        self._read_at = -math.inf

    def key_of(self, params: Mapping[str, Any] | None) -> str | None:
        if not params:
            return None
        try:
            return graph_key(self.spec.space.trainer_config(params), self.spec.ranks, self.spec.env)
        except Exception:  # partial enqueued points: no key, so never preferred
            return None

    def warm_keys(self, study: Any) -> set[str]:
        from optuna.trial import TrialState

        if time.monotonic() - self._read_at < self.refresh_s:
            return self._warm
        done = study._storage.get_all_trials(study._study_id, deepcopy=False,
                                             states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL))
        warm = {t.user_attrs[ATTR_GRAPH_KEY] for t in done
                if t.user_attrs.get(ATTR_GRAPH_CACHE) in ("hit", "miss") and ATTR_GRAPH_KEY in t.user_attrs}
        with contextlib.suppress(Exception):
            warm |= set(study._storage.get_study_user_attrs(study._study_id).get(ATTR_PRECOMPILED, []))
        self._warm, self._read_at = warm, time.monotonic()
        return warm

    def claim(self, study: Any) -> Any | None:
        """A warm waiting trial moved to RUNNING, as ``study.ask`` would; None leaves the choice to ``ask``."""
        import optuna
        from optuna.trial import TrialState

        storage = study._storage
        waiting = storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.WAITING,))
        if len(waiting) < 2:
            return None
        keys = [self.key_of(t.system_attrs.get("fixed_params")) for t in waiting]
        i = pick_warm(keys, self.warm_keys(study))
        if not i:  # none warm, or the head of the queue is: ask() takes it anyway
            return None
        try:
            if not storage.set_trial_state_values(waiting[i]._trial_id, state=TrialState.RUNNING):
                return None
        except optuna.exceptions.UpdateFinishedTrialError:
            return None
        study._thread_local.cached_all_trials = None
        log.info("trial %d: graphs compiled already (key %s); started before trial %d", waiting[i].number, keys[i],
                 waiting[0].number)
        return optuna.trial.Trial(study, waiting[i]._trial_id)


# -- compile cache ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheLocation:
    """Where a trial's compiled graphs go: ``kind`` node, shared (a file system path) or s3."""

    kind: str
    root: str
    neff_dir: str  # always a local or mounted path: the native backend's cache takes no URL
    xla_url: str  # a path, or s3:// for the XLA path

    def env(self) -> dict[str, str]:
        return {NEFF_CACHE_VAR: self.neff_dir, XLA_CACHE_VAR: self.xla_url}

    def local_dirs(self) -> list[str]:
        return [self.neff_dir] + ([] if self.xla_url.startswith("s3://") else [self.xla_url])


def cache_location(compile_cache: str, node_env: Mapping[str, str]) -> CacheLocation:
    """``trial.compile_cache`` resolved on this node ("" means the node directory)."""
    node_root = node_env.get(NODE_CACHE_VAR) or DEFAULT_NODE_CACHE
    node_neff = node_env.get(NEFF_CACHE_VAR) or os.path.join(node_root, "neff")
    if not compile_cache:
        xla = node_env.get(XLA_CACHE_VAR) or os.path.join(node_root, "xla")
        return CacheLocation("node", node_root, node_neff, xla)
    if compile_cache.startswith("s3://"):
        return CacheLocation("s3", compile_cache.rstrip("/"), node_neff, compile_cache.rstrip("/") + "/xla")
    root = compile_cache.rstrip("/") or "/"
    return CacheLocation("shared", root, os.path.join(root, "neff"), os.path.join(root, "xla"))


def cache_entries(dirs: Iterable[str]) -> set[str]:
    """Every compiled graph (``*.neff``) under the cache directories, as paths."""
    found: set[str] = set()
    for d in dirs:
        for base, _, files in os.walk(d):
            found.update(os.path.join(base, f) for f in files if f.endswith(".neff"))
    return found


def cache_outcome(before: set[str], after: set[str], compiled: bool) -> dict[str, Any]:
    """Hit or miss from the cache's contents before and after a run that got as far as ``compiled``."""
    new = len(after - before)
    verdict = "none" if not compiled else "miss" if new else "hit"
    return {ATTR_GRAPH_CACHE: verdict, "graph_cache_new_entries": new, "graph_cache_entries": len(after)}


def compile_seconds(record: Mapping[str, Any]) -> float | None:
    """Compilation inside the trainer's uncharged first steps: their time less that many ordinary steps."""
    try:
        excluded = float(record["excluded_seconds"])
        typical = float(record.get("step_seconds_median") or 0.0) * int(record.get("excluded_steps") or 0)
    except (KeyError, TypeError, ValueError):
        return None
    return round(max(0.0, excluded - typical), 3)


# -- neuron-ls --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    index: int
    cores: tuple[int, ...]  # logical core ids on this device, node-wide numbering
    memory_bytes: int
    pids: tuple[int, ...]


def parse_neuron_ls(obj: Any) -> list[Device]:
    """``neuron-ls --json-output``: a list of devices (or ``{"neuron_devices": [...]}`` in newer tools).

    Each device has ``neuron_device``, ``nc_count``, ``memory_size`` (bytes), ``neuron_processes``
    and, in recent tools, ``neuroncore_ids``; without those the ids follow device order.
    """
    if isinstance(obj, Mapping):
        obj = obj.get("neuron_devices", [])
    if not isinstance(obj, list):
        raise ValueError("neuron-ls: expected a JSON list of devices")
    devices, next_core = [], 0
    for d in sorted(obj, key=lambda d: int(d.get("neuron_device", 0))):
        n = int(d.get("nc_count", 0))
        ids = d.get("neuroncore_ids")
        cores = tuple(int(c) for c in ids) if isinstance(ids, list) and ids else tuple(range(next_core, next_core + n))
        next_core = max(cores, default=next_core - 1) + 1
        pids = tuple(int(p["pid"]) for p in d.get("neuron_processes") or [] if isinstance(p, Mapping) and "pid" in p)
        devices.append(Device(int(d.get("neuron_device", 0)), cores, int(d.get("memory_size") or 0), pids))
    return devices


def neuron_ls(env: Mapping[str, str] | None = None, timeout: float = 20.0) -> list[Device] | None:
    """The node's devices from ``neuron-ls --json-output``; None when the tool is absent or fails."""
    exe = shutil.which("neuron-ls", path=(env or os.environ).get("PATH"))
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--json-output"], capture_output=True, timeout=timeout, check=True,
                             env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL).stdout
        return parse_neuron_ls(json.loads(out))
    except (OSError, subprocess.SubprocessError, ValueError, TypeError, KeyError) as e:
        log.warning("neuron-ls failed: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return None


def check_node(devices: Sequence[Device], cores: Sequence[int], own_pids: Iterable[int] = ()) -> dict[str, Any]:
    """Attributes for the node's devices; raises LaunchError when an assigned core is not on this node."""
    node = {c: d for d in devices for c in d.cores}
    missing = [c for c in cores if c not in node]
    if missing:
        shown = format_cores(node) or "none"
        raise LaunchError(f"{CORES_VAR} core(s) {format_cores(missing)} are not on this node (neuron-ls shows "
                          f"{len(devices)} device(s), cores {shown})")
    mine = {node[c].index: node[c] for c in cores}
    own = set(own_pids)
    foreign = sorted({p for d in mine.values() for p in d.pids if p not in own})
    attrs: dict[str, Any] = {"neuron_node_devices": len(devices), "neuron_node_cores": len(node),
                             "neuron_trial_devices": sorted(mine)}
    if mine:
        attrs["neuron_device_memory_bytes"] = next(iter(mine.values())).memory_bytes
    if foreign:  # e.g. an orphaned trainer still holding the cores: the runtime will refuse to load
        attrs["neuron_foreign_pids"] = foreign
    return attrs


# -- neuron-monitor ---------------------------------------------------------------------------------

MONITOR_CONFIG = {"period": "1s", "neuron_runtimes": [{"tag_filter": ".*", "metrics": [
    {"type": "neuroncore_counters"}, {"type": "memory_used"}]}], "system_metrics": []}


def monitor_sample(report: Mapping[str, Any], pids: set[int] | None = None) -> tuple[list[float], int, int] | None:
    """One neuron-monitor report reduced to the trial's runtimes: per-core utilisation (%), device
    bytes and host bytes; None when no runtime of the trial is in it.

    Layout: ``neuron_runtime_data[] = {pid, report: {neuroncore_counters: {neuroncores_in_use:
    {"<core>": {neuroncore_utilization}}}, memory_used: {neuron_runtime_used_bytes: {neuron_device,
    host}}}}``. ``pids`` None keeps every runtime.
    """
    utils: list[float] = []
    device = host = 0
    found = False
    for rt in report.get("neuron_runtime_data") or []:
        if not isinstance(rt, Mapping) or (pids is not None and rt.get("pid") not in pids):
            continue
        rep = rt.get("report") or {}
        in_use = (rep.get("neuroncore_counters") or {}).get("neuroncores_in_use") or {}
        for counters in in_use.values():
            u = (counters or {}).get("neuroncore_utilization")
            if isinstance(u, (int, float)) and math.isfinite(u):
                utils.append(float(u))
        used = (rep.get("memory_used") or {}).get("neuron_runtime_used_bytes") or {}
        if isinstance(used, Mapping):
            device += int(used.get("neuron_device") or 0)
            host += int(used.get("host") or 0)
        found = True
    return (utils, device, host) if found else None


class MonitorSampler:
    """Runs ``neuron-monitor`` beside a trial and summarises the trial's share of its reports."""

    def __init__(self, pids: Callable[[], Iterable[int]] | None = None, config_dir: Path | None = None,
                 refresh_s: float = 2.0) -> None:
        self._pids_fn = pids
        self._pids: set[int] = set()
        self._pids_at = -math.inf
        self._refresh_s = refresh_s
        self._config_dir = config_dir
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.samples = 0
        self.reports = 0
        self._util_sum = 0.0
        self._util_n = 0
        self.device_peak = 0
        self.host_peak = 0

    def start(self) -> bool:
        """Start sampling; False (and nothing started) where neuron-monitor is not on PATH."""
        exe = shutil.which("neuron-monitor")
        if exe is None:
            return False
        fd, path = tempfile.mkstemp(prefix="neuron-monitor-", suffix=".json", dir=self._config_dir)
        with os.fdopen(fd, "w") as f:
            json.dump(MONITOR_CONFIG, f)
        self._config = path
        try:
            self._proc = subprocess.Popen([exe, "-c", path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                          stdin=subprocess.DEVNULL)
        except OSError as e:
            log.warning("neuron-monitor did not start: %s", e)
            return False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return True

    def _trial_pids(self, seen: Iterable[Any]) -> set[int] | None:
        if self._pids_fn is None:
            return None
        now = time.monotonic()
        if now - self._pids_at > self._refresh_s or (any(p not in self._pids for p in seen)
                                                     and now - self._pids_at > 0.5):
            with contextlib.suppress(Exception):
                self._pids = set(self._pids_fn())
            self._pids_at = now
        return self._pids

    def feed(self, line: bytes | str) -> None:
        """Account one line of neuron-monitor output."""
        try:
            report = json.loads(line)
        except ValueError:
            return
        if not isinstance(report, Mapping):
            return
        self.reports += 1
        pids = self._trial_pids(rt.get("pid") for rt in report.get("neuron_runtime_data") or []
                                if isinstance(rt, Mapping))
        sample = monitor_sample(report, pids)
        if sample is None:
            return
        utils, device, host = sample
        with self._lock:
            self.samples += 1
            if utils:
                self._util_sum += sum(utils) / len(utils)
                self._util_n += 1
            self.device_peak = max(self.device_peak, device)
            self.host_peak = max(self.host_peak, host)

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in iter(self._proc.stdout.readline, b""):
            self.feed(line)

    def stop(self) -> dict[str, Any]:
        """Stop our neuron-monitor and return the summary attributes (empty when nothing was seen)."""
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
            if self._thread is not None:
                self._thread.join(timeout=5)
            with contextlib.suppress(OSError):
                os.unlink(self._config)
            self._proc = None
        with self._lock:
            if not self.samples:
                return {"neuron_monitor_reports": self.reports} if self.reports else {}
            out: dict[str, Any] = {"neuron_monitor_samples": self.samples,
                                   "neuron_device_memory_peak_bytes": self.device_peak,
                                   "neuron_host_memory_peak_bytes": self.host_peak}
            if self._util_n:
                out["neuron_util_mean"] = round(self._util_sum / self._util_n, 3)
            return out


# -- one trial --------------------------------------------------------------------------------------


@dataclass
class TrialLaunch:
    """What the supervisor needs to start one trial on Neuron, and what it records afterwards.

    Built by :meth:`prepare` before anything starts (a plan that does not fit raises LaunchError);
    :meth:`started` once the trainer runs, :meth:`finished` once it is reaped, :meth:`close` always.
    """

    config: dict[str, Any]  # the trainer's config, launch keys removed
    ranks: int
    env: dict[str, str] = field(default_factory=dict)  # added to the trainer's environment
    attrs: dict[str, Any] = field(default_factory=dict)  # recorded with the outcome
    cache: CacheLocation | None = None
    cache_before: set[str] = field(default_factory=set)
    sampler: MonitorSampler | None = None

    @classmethod
    def prepare(cls, config: Mapping[str, Any], default_ranks: int, task_env: Mapping[str, str],
                compile_cache: str = "", node_env: Mapping[str, str] | None = None,
                pids: Callable[[], Iterable[int]] | None = None, workdir: Path | None = None) -> TrialLaunch:
        node_env = dict(os.environ if node_env is None else node_env)
        env = {**node_env, **task_env}
        ranks, lnc, flags = launch_values(config, default_ranks, task_env)
        attrs: dict[str, Any] = {"launch_ranks": ranks}
        with contextlib.suppress(ValueError, TypeError):  # a mistyped config is the trainer's to refuse
            attrs[ATTR_GRAPH_KEY] = graph_key(config, default_ranks, task_env)
        launch = cls({k: v for k, v in config.items() if k not in LAUNCH_KEYS}, ranks, attrs=attrs)
        if lnc is not None:
            launch.env[LNC_VAR] = str(lnc)
            attrs["launch_lnc"] = lnc
        if flags is not None:
            launch.env[CC_FLAGS_VAR] = flags
            attrs["neuron_cc_flags"] = flags
        visible = env.get(CORES_VAR)
        if visible:
            node_lnc = int(node_env.get(LNC_VAR) or DEFAULT_NODE_LNC)
            assigned = parse_cores(visible)
            devices = neuron_ls(node_env)
            if devices is not None:
                attrs.update(check_node(devices, assigned))
            trial_lnc = lnc or node_lnc
            rank_cores = map_ranks(to_trial_lnc(assigned, node_lnc, trial_lnc), ranks, trial_lnc)
            launch.env[CORES_VAR] = format_cores(rank_cores)
            attrs.update(neuron_cores_assigned=format_cores(assigned), neuron_rank_cores=format_cores(rank_cores))
        neuron = bool(visible) or config.get("device") == "neuron" or bool(compile_cache)
        if neuron:
            launch._configure_cache(cache_location(compile_cache, node_env), task_env)
            launch.sampler = MonitorSampler(pids, workdir)
        return launch

    def _configure_cache(self, loc: CacheLocation, task_env: Mapping[str, str]) -> None:
        """Point the caches at ``loc`` (explicit trial.env settings win) and remember what is in them."""
        self.cache = loc
        self.env.update({k: v for k, v in loc.env().items() if k not in task_env})
        self.attrs["compile_cache"] = loc.kind if loc.kind == "node" else loc.root
        dirs = [d for d in loc.local_dirs() if d]
        try:
            for d in dirs:
                os.makedirs(d, exist_ok=True)
            free = shutil.disk_usage(dirs[0]).free
        except OSError as e:
            self.attrs["compile_cache_error"] = f"{type(e).__name__}: {e}"[:300]
            return
        if free < MIN_CACHE_FREE_BYTES:  # a compile that fills the disk corrupts the shared cache
            self.env[NEFF_DISABLE_VAR] = "1"
            self.attrs["compile_cache_error"] = f"cache disabled: {free / 1024**3:.1f} GiB free under {dirs[0]}"
        self.cache_before = cache_entries(dirs)

    def started(self) -> None:
        if self.sampler is not None and not self.sampler.start():
            self.sampler = None

    def finished(self, record: Mapping[str, Any] | None, launch_unix: float | None,
                 first_step_unix: float | None) -> dict[str, Any]:
        """Everything to record: launch attributes, cache verdict, compile and start-up seconds, utilisation."""
        self.close()
        rec = record or {}
        if self.cache is not None and rec.get("device", "neuron") == "neuron":
            compiled = first_step_unix is not None or bool(rec.get("steps"))
            self.attrs.update(cache_outcome(self.cache_before, cache_entries(self.cache.local_dirs()), compiled))
        secs = compile_seconds(rec)
        if secs is not None:
            self.attrs["compile_seconds"] = secs
        if launch_unix is not None and first_step_unix is not None:
            self.attrs["startup_wall_seconds"] = round(first_step_unix - launch_unix, 3)
        return self.attrs

    def close(self) -> None:
        if self.sampler is not None:
            self.attrs.update(self.sampler.stop())
            self.sampler = None
