"""The shared Neuron compile cache: where a trial's compiled graphs go, and whether it hit.

Every Neuron trial points the caches at one place: the node directory (``$NEURON_CACHE_DIR``, as
``infra/cluster.py`` writes it into ``cluster.env``; ``infra/ray/node_sync.sh`` syncs it with S3), a
shared file system (``trial.compile_cache = "/fsx/neuron-cache"``) or S3 (``"s3://bucket/prefix"``). The
layout is the one ``cluster.env`` uses: ``neff/`` for the native backend's NEFF cache
(``TORCH_NEURONX_NEFF_CACHE_DIR``, a file system path: with S3 it stays on the node and node_sync carries
it) and ``xla/`` for the XLA path's cache (``NEURON_COMPILE_CACHE_URL``, which takes ``s3://`` itself).
Hits are read off the cache directory: NEFF files present after the run that were not there before were
compiled by it (a miss); none new means every graph came from the cache. On a node running several
trials at once a neighbour's new entries count against this trial too, so a miss can be over-reported,
a hit never.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

NEFF_CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_DIR"  # the native backend's persistent NEFF cache (a path)
XLA_CACHE_VAR = "NEURON_COMPILE_CACHE_URL"  # the XLA path's persistent cache (a path or s3://)
NEFF_DISABLE_VAR = "TORCH_NEURONX_NEFF_DISABLE_CACHE"
NODE_CACHE_VAR = "NEURON_CACHE_DIR"  # the node's cache root, from infra's cluster.env
DEFAULT_NODE_CACHE = "/var/tmp/trnsweep-neuron-cache"
MIN_CACHE_FREE_BYTES = 4 * 1024**3  # below this a compile could fill the disk, which corrupts the cache

ATTR_GRAPH_CACHE = "graph_cache"  # trial attribute: "hit" | "miss" | "none" (never got as far as compiling)


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
