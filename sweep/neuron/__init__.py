"""Trainium plumbing of a trial: launch shape, the shared compile cache, graph-shape keys, utilisation.

Everything here is plain Python over the documented interfaces of the Neuron tools and runtime, so the
CPU tests drive it with stand-in executables; nothing imports torch or ``model.*`` beyond ``model.config``
(the trainer's defaults and widths, never restated here).

- :mod:`sweep.neuron.launch`: ``lnc``, ``ranks`` and ``neuron_cc_flags`` (study parameters the trainer
  does not know), Ray's ``NEURON_RT_VISIBLE_CORES`` renumbered at the trial's LNC and split over the
  ranks, and the spec-time check that a plan fits the reserved cores.
- :mod:`sweep.neuron.cache`: where the compile caches point (node directory, shared path or S3) and a
  trial's hit or miss, read off the cache directory.
- :mod:`sweep.neuron.graph`: :func:`graph_key`, a hash of exactly the settings that decide which
  graphs get compiled.
- :mod:`sweep.neuron.monitor`: ``neuron-ls`` (the node's devices) and the ``neuron-monitor`` sampler.
- :mod:`sweep.neuron.trial`: :class:`TrialLaunch`, all of the above for one trial.
- :mod:`sweep.neuron.rank`: what torchrun runs in each rank: its own NeuronCore, then the trainer.
- :mod:`sweep.neuron.versions`: the pinned Neuron package set, DLAMI and venv, and the check of what is
  installed (docs/neuron.md gives every source).

This facade re-exports the public names, so ``from sweep import neuron`` and ``neuron.X`` work.
"""

from sweep.neuron.cache import (
    ATTR_GRAPH_CACHE,
    DEFAULT_NODE_CACHE,
    MIN_CACHE_FREE_BYTES,
    NEFF_CACHE_VAR,
    NEFF_DISABLE_VAR,
    NEFF_DISABLE_VAR_DOCS,
    NEFF_DISABLE_VARS,
    NODE_CACHE_VAR,
    PUSH_MIN_AGE_S,
    XLA_CACHE_VAR,
    CacheLocation,
    cache_disabled_by,
    cache_entries,
    cache_location,
    cache_outcome,
    compile_seconds,
    run_sync,
    sync_command,
)
from sweep.neuron.graph import (
    ATTR_GRAPH_KEY,
    ATTR_PRECOMPILED,
    GRAPH_DEFAULTS,
    GRAPH_INPUTS,
    NOT_IN_GRAPH_KEY,
    TRAINER_DEFAULTS,
    WIDTH_KEYS,
    graph_key,
    graph_shape,
    resolved_model,
    trainer_defaults,
)
from sweep.neuron.launch import (
    CC_FLAGS_VAR,
    CORES_PER_CHIP,
    CORES_VAR,
    DEFAULT_NODE_LNC,
    LAUNCH_KEYS,
    LNC_VALUES,
    LNC_VAR,
    MAX_CHIPS,
    OPT_LEVEL_VAR,
    OPT_LEVELS,
    RANK_CORES_VAR,
    RANK_MODULE,
    LaunchError,
    check_spec,
    chip_cores,
    format_cores,
    launch_values,
    map_ranks,
    opt_level_value,
    parse_cores,
    rank_env,
    spec_fit,
    split_flags,
    to_trial_lnc,
)
from sweep.neuron.monitor import (
    ATTR_TOOLS_MISSING,
    MONITOR_CONFIG,
    TOOL_DIRS,
    Device,
    MonitorSampler,
    check_node,
    find_tool,
    missing_tool,
    monitor_sample,
    neuron_ls,
    parse_neuron_ls,
)
from sweep.neuron.trial import TrialLaunch

__all__ = [
    "ATTR_GRAPH_CACHE", "ATTR_GRAPH_KEY", "ATTR_PRECOMPILED", "ATTR_TOOLS_MISSING", "TOOL_DIRS", "find_tool",
    "missing_tool", "CC_FLAGS_VAR", "CORES_PER_CHIP", "CORES_VAR", "DEFAULT_NODE_CACHE", "DEFAULT_NODE_LNC",
    "GRAPH_DEFAULTS", "GRAPH_INPUTS", "LAUNCH_KEYS", "LNC_VALUES", "LNC_VAR", "MAX_CHIPS", "MIN_CACHE_FREE_BYTES",
    "OPT_LEVEL_VAR", "OPT_LEVELS", "opt_level_value",
    "MONITOR_CONFIG", "NEFF_CACHE_VAR", "NEFF_DISABLE_VAR", "NEFF_DISABLE_VAR_DOCS",
    "NEFF_DISABLE_VARS", "NODE_CACHE_VAR", "NOT_IN_GRAPH_KEY", "PUSH_MIN_AGE_S",
    "RANK_CORES_VAR", "RANK_MODULE", "TRAINER_DEFAULTS", "WIDTH_KEYS", "XLA_CACHE_VAR", "CacheLocation", "Device",
    "LaunchError", "MonitorSampler", "TrialLaunch", "cache_disabled_by", "cache_entries", "cache_location",
    "cache_outcome", "check_node",
    "check_spec", "chip_cores", "compile_seconds", "format_cores", "graph_key", "graph_shape", "launch_values",
    "map_ranks", "monitor_sample", "neuron_ls", "parse_cores", "parse_neuron_ls", "rank_env", "run_sync",
    "sync_command", "resolved_model", "spec_fit", "split_flags", "to_trial_lnc", "trainer_defaults",
]
