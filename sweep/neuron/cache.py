"""The shared Neuron compile cache: where a trial's compiled graphs go, and whether it hit.

TorchNeuron (the ``neuron`` device and ``torch.compile(backend="neuron")``) keeps its compiled graphs
in the persistent NEFF cache, ``TORCH_NEURONX_NEFF_CACHE_DIR``, a directory (TorchNeuron environment
variables; "What are Neuron Compiler artifacts?"). ``NEURON_COMPILE_CACHE_URL`` is the PyTorch/XLA
line's cache: this trainer never reads it; it is still pointed beside the NEFF cache for tools of that
line. Every Neuron trial points the cache at one place (``trial.compile_cache``):

- ``""``: the node directory (``$NEURON_CACHE_DIR``, as ``infra/cluster.py`` writes it into
  ``cluster.env``), which ``infra/ray/node_sync.sh`` shares through the cluster bucket every 5 minutes;
- a shared file system path (``"/fsx/neuron-cache"``): every node reads and writes ``PATH/neff`` directly;
- ``"s3://bucket/prefix"``: TorchNeuron takes no URL, so the NEFFs live in a node-local mirror
  (``$NEURON_CACHE_DIR-s3/bucket/prefix/neff``, outside the directory node_sync shares) that the trial
  pulls from ``s3://bucket/prefix/neff`` before the trainer starts and pushes back once it has
  finished (:attr:`CacheLocation.remote`; the copy is ``python -m infra sync``: new files only, each
  written whole; files younger than a minute wait for the next trial's push).

Hits are read off the cache directory: NEFF files present after the run that were not there before were
compiled by it (a miss); none new means every graph came from the cache. On a node running several
trials at once a neighbour's new entries count against this trial too, so a miss can be over-reported,
a hit never.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NEFF_CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_DIR"  # the native backend's persistent NEFF cache (a path)
XLA_CACHE_VAR = "NEURON_COMPILE_CACHE_URL"  # the XLA path's persistent cache (a path or s3://)
# TorchNeuron reads its cache switch under two names (docs/neuron.md, "Compile cache"): the C++ cache
# backend and the NKI kernel cache read TORCH_NEURONX_NEFF_DISABLE_CACHE, the Python compile cache and the
# environment-variables page the other. The sweep sets only the first, and only on a nearly full cache disk
# (sweep/neuron/trial.py: the on-disk cache off); a trial or preflight that finds one
# set says so.
NEFF_DISABLE_VAR = "TORCH_NEURONX_NEFF_DISABLE_CACHE"  # the C++ backend's name (only "1" disables there)
NEFF_DISABLE_VAR_DOCS = "TORCH_NEURONX_DISABLE_NEFF_CACHE"  # the documented name (1, true, yes)
NEFF_DISABLE_VARS = (NEFF_DISABLE_VAR, NEFF_DISABLE_VAR_DOCS)
_DISABLING = ("1", "true", "yes")  # what either reader takes as "disabled", case aside
NODE_CACHE_VAR = "NEURON_CACHE_DIR"  # the node's cache root, from infra's cluster.env
DEFAULT_NODE_CACHE = "/var/tmp/trnsweep-neuron-cache"
MIN_CACHE_FREE_BYTES = 4 * 1024**3  # below this no NEFF is added: the compiler and the trial need the room

PUSH_MIN_AGE_S = 60.0  # a neighbouring trial's compile may still be writing; a later push takes the rest
SYNC_TIMEOUT_S = 1800.0
REPO_ROOT = Path(__file__).resolve().parents[2]

ATTR_GRAPH_CACHE = "graph_cache"  # trial attribute: "hit" | "miss" | "none" (never got as far as compiling)


@dataclass(frozen=True)
class CacheLocation:
    """Where a trial's compiled graphs go: ``kind`` node, shared (a file system path) or s3."""

    kind: str
    root: str
    neff_dir: str  # always a local or mounted path: the native backend's cache takes no URL
    xla_url: str  # a path, or s3:// for the XLA path
    remote: str = ""  # s3 only: where the NEFF mirror is pulled from and pushed to

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
        url = compile_cache.rstrip("/")
        mirror = os.path.join(node_root.rstrip("/") + "-s3", *url[len("s3://"):].split("/"), "neff")
        return CacheLocation("s3", url, mirror, url + "/xla", remote=url + "/neff")
    root = compile_cache.rstrip("/") or "/"
    return CacheLocation("shared", root, os.path.join(root, "neff"), os.path.join(root, "xla"))


def sync_command(src: str, dst: str, min_age_s: float) -> list[str]:
    """``python -m infra sync``: new files only, each written whole (sweep runs infra's CLI, never imports it)."""
    return [sys.executable, "-m", "infra", "sync", "--quiet", "--min-age-s", f"{min_age_s:g}", src, dst]


def run_sync(src: str, dst: str, min_age_s: float = 0.0) -> str | None:
    """Copy new files from ``src`` to ``dst`` (one of them ``s3://``); the failure in one line, or None."""
    try:
        proc = subprocess.run(sync_command(src, dst, min_age_s), capture_output=True, text=True, cwd=REPO_ROOT,
                              timeout=SYNC_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"[:300]
    if proc.returncode:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        return f"sync {src} -> {dst}: {lines[-1]}"[:300]
    return None


def cache_disabled_by(env: Mapping[str, str]) -> str:
    """The disable settings in ``env`` that turn part of TorchNeuron's NEFF cache off, as one phrase ("" if none)."""
    found = [f"{var}={env[var]}" for var in NEFF_DISABLE_VARS if env.get(var, "").strip().lower() in _DISABLING]
    return ", ".join(found)


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
