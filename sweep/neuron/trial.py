"""One Neuron trial: its launch plan, cache and utilisation, from before the trainer starts to its outcome.

:class:`TrialLaunch` strips the launch keys from the trainer's config and turns them into environment
and torchrun arguments, narrows ``NEURON_RT_VISIBLE_CORES`` to the ranks' cores (one core per process:
a single rank sees its core as ``neuron:0``; several ranks each get their own through
:mod:`sweep.neuron.rank`), points the compile caches at the trial's cache and records
what happened. A script trial gets a private cache over the shared one (:mod:`sweep.neuron.overlay`), whose new
entries are published once it has finished. It lives apart from ``launch`` because it draws on every other
module of the package.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sweep.neuron.cache import (
    MIN_CACHE_FREE_BYTES,
    NEFF_CACHE_VAR,
    NEFF_DISABLE_VAR,
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
)
from sweep.neuron.graph import ATTR_GRAPH_KEY, graph_key
from sweep.neuron.launch import (
    CC_FLAGS_VAR,
    CORES_VAR,
    DEFAULT_NODE_LNC,
    LAUNCH_KEYS,
    LNC_VAR,
    OPT_LEVEL_VAR,
    RANK_CORES_VAR,
    RANK_MODULE,
    format_cores,
    launch_values,
    map_ranks,
    opt_level_value,
    parse_cores,
    to_trial_lnc,
)
from sweep.neuron.monitor import ATTR_TOOLS_MISSING, MonitorSampler, check_node, find_tool, neuron_ls
from sweep.neuron.overlay import Overlay


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
    rank_module: str | None = None  # torchrun runs this in each rank (it narrows the cores, then the trainer)
    sync: Callable[[str, str, float], str | None] = run_sync  # S3 <-> the NEFF mirror (cache.run_sync)
    overlays: list[Overlay] = field(default_factory=list)  # a script trial's private caches over the shared ones

    @classmethod
    def prepare(cls, config: Mapping[str, Any], default_ranks: int, task_env: Mapping[str, str],
                compile_cache: str = "", node_env: Mapping[str, str] | None = None,
                pids: Callable[[], Iterable[int]] | None = None, workdir: Path | None = None,
                sync: Callable[[str, str, float], str | None] | None = None,
                private_cache: Path | None = None, seed: str = "copy") -> TrialLaunch:
        """The plan; with ``private_cache`` (a script trial's) the trainer's caches are private directories there,
        seeded from the shared ones by ``seed`` (``link`` or ``copy``, :mod:`sweep.neuron.overlay`)."""
        node_env = dict(os.environ if node_env is None else node_env)
        env = {**node_env, **task_env}
        ranks, lnc, flags = launch_values(config, default_ranks, task_env)
        attrs: dict[str, Any] = {"launch_ranks": ranks}
        with contextlib.suppress(ValueError, TypeError):  # a mistyped config is the trainer's to refuse
            attrs[ATTR_GRAPH_KEY] = graph_key(config, default_ranks, task_env)
        launch = cls({k: v for k, v in config.items() if k not in LAUNCH_KEYS}, ranks, attrs=attrs)
        if sync is not None:
            launch.sync = sync
        if lnc is not None:
            launch.env[LNC_VAR] = str(lnc)
            attrs["launch_lnc"] = lnc
        if flags is not None:
            launch.env[CC_FLAGS_VAR] = flags
            attrs["neuron_cc_flags"] = flags
        opt_level = opt_level_value(config, task_env)
        if opt_level is not None:
            launch.env[OPT_LEVEL_VAR] = opt_level
            attrs["neuron_opt_level"] = opt_level
        visible = env.get(CORES_VAR)
        if visible:
            node_lnc = int(node_env.get(LNC_VAR) or DEFAULT_NODE_LNC)
            assigned = parse_cores(visible)
            devices = neuron_ls(node_env)
            if devices is not None:
                attrs.update(check_node(devices, assigned))
            elif find_tool("neuron-ls", node_env) is None:
                attrs.setdefault(ATTR_TOOLS_MISSING, []).append("neuron-ls")
            trial_lnc = lnc or node_lnc
            rank_cores = map_ranks(to_trial_lnc(assigned, node_lnc, trial_lnc), ranks, trial_lnc)
            launch.env[CORES_VAR] = format_cores(rank_cores)
            if ranks > 1:  # TorchNeuron wants one core per process: each rank narrows to its own
                launch.env[RANK_CORES_VAR] = ",".join(map(str, rank_cores))
                launch.rank_module = RANK_MODULE
            attrs.update(neuron_cores_assigned=format_cores(assigned), neuron_rank_cores=format_cores(rank_cores))
        neuron = bool(visible) or config.get("device") == "neuron" or bool(compile_cache)
        if neuron:
            launch._configure_cache(cache_location(compile_cache, node_env), task_env, env, private_cache, seed)
            launch.sampler = MonitorSampler(pids, workdir)
        return launch

    def _configure_cache(self, loc: CacheLocation, task_env: Mapping[str, str], env: Mapping[str, str],
                         private: Path | None = None, seed: str = "copy") -> None:
        """Point the caches at ``loc`` (explicit trial.env settings win), or at private directories over it, and
        remember what is in them; ``env`` is the node's environment with trial.env over it, as the trainer will
        see it."""
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
            if private is not None:  # still never the shared directory: an empty private one
                self._overlay(loc, task_env, private, seed)
                self.cache_before = cache_entries(str(o.private) for o in self.overlays)
            return
        if loc.remote:  # what other nodes compiled, before the trainer looks
            error = self.sync(loc.remote, loc.neff_dir, 0.0)
            if error:
                self.attrs["compile_cache_error"] = f"pull: {error}"[:300]
        if private is not None:
            self._overlay(loc, task_env, private, seed)
            dirs = [str(o.private) for o in self.overlays] or dirs
        if free < MIN_CACHE_FREE_BYTES:  # keep the room the compiler and the trial still need (docs/neuron.md)
            # The persistent (on-disk) NEFF cache is the C++ backend's, which reads this name and exactly "1"
            # (docs/neuron.md, "Compile cache"); the other name only switches off the in-process cache.
            self.env[NEFF_DISABLE_VAR] = "1"
            self.attrs["compile_cache_error"] = (f"only {free / 1024**3:.1f} GiB free under {dirs[0]}: "
                                                 f"a compile may fill the disk, so {NEFF_DISABLE_VAR}=1")
        disabled = cache_disabled_by({**env, **self.env})
        if disabled:  # every graph compiles again, and the hit/miss verdict says miss
            self.attrs["compile_cache_disabled"] = f"{disabled} turns TorchNeuron's NEFF cache off for this trial"
        self.cache_before = cache_entries(dirs)

    def _overlay(self, loc: CacheLocation, task_env: Mapping[str, str], private: Path, seed: str) -> None:
        """The trainer's caches as private directories under ``private``, seeded from the shared ones; a cache
        that trial.env points elsewhere is the spec's own choice and stays as it is."""
        self.attrs["compile_cache_private"] = seed
        self.env[NODE_CACHE_VAR] = str(private)
        for var, shared, name in ((NEFF_CACHE_VAR, loc.neff_dir, "neff"), (XLA_CACHE_VAR, loc.xla_url, "xla")):
            if var in task_env or not shared or shared.startswith("s3://"):
                continue
            overlay = Overlay(Path(shared), private / name, seed)
            try:
                overlay.seed()
            except OSError as e:  # the trial compiles what it needs; the shared cache stays as it is
                self.attrs["compile_cache_error"] = f"seeding {overlay.private}: {type(e).__name__}: {e}"[:300]
            self.overlays.append(overlay)
            self.env[var] = str(overlay.private)

    def publish(self) -> None:
        """The private caches' new entries into the shared ones (:meth:`Overlay.publish`), once no process of the
        trial is left; then the private directories go."""
        published = refused = 0
        for overlay in self.overlays:
            try:
                done, bad = overlay.publish()
            except OSError as e:
                self.attrs["compile_cache_error"] = f"publish: {type(e).__name__}: {e}"[:300]
                continue
            published, refused = published + done, refused + bad
            shutil.rmtree(overlay.private, ignore_errors=True)
        if self.overlays:
            self.attrs.update(graph_cache_published=published, graph_cache_refused=refused)
        self.overlays = []

    def started(self) -> None:
        if self.sampler is not None and not self.sampler.start():
            if self.sampler.missing:
                self.attrs.setdefault(ATTR_TOOLS_MISSING, []).append("neuron-monitor")
            self.sampler = None

    def finished(self, record: Mapping[str, Any] | None, launch_unix: float | None,
                 first_step_unix: float | None) -> dict[str, Any]:
        """Everything to record: launch attributes, cache verdict, compile and start-up seconds, utilisation."""
        self.close()
        rec = record or {}
        compiled = False
        if self.cache is not None and rec.get("device", "neuron") == "neuron":
            compiled = first_step_unix is not None or bool(rec.get("steps"))
            dirs = [str(o.private) for o in self.overlays] or self.cache.local_dirs()
            self.attrs.update(cache_outcome(self.cache_before, cache_entries(dirs), compiled))
        self.publish()  # before the push: what the trial compiled reaches the mirror this way only
        if compiled and self.cache is not None and self.cache.remote:
            error = self.sync(self.cache.neff_dir, self.cache.remote, PUSH_MIN_AGE_S)  # share what it compiled
            if error:
                self.attrs["compile_cache_error"] = f"push: {error}"[:300]
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
