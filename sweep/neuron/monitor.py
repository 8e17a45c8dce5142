"""The node's Neuron devices (``neuron-ls``) and a trial's utilisation (``neuron-monitor``).

``neuron-ls --json-output`` (where installed) must show every core assigned to a trial; other processes
on the trial's devices are recorded. Where ``neuron-monitor`` is installed, :class:`MonitorSampler` reads
its JSON reports during the trial and keeps, for the trial's own runtimes (found by pid: the processes
carrying the trial token), the mean NeuronCore utilisation and the peak device memory.

The tools come with the ``aws-neuronx-tools`` package in ``/opt/aws/neuron/bin``, which the Neuron setup
guides add to PATH; they are looked for on PATH and then there. A missing tool is said once per process
in one line (log warning) and recorded with the trial (``neuron_tools_missing``), never skipped silently.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sweep.neuron.launch import CORES_VAR, LaunchError, format_cores
from sweep.neuron.versions import NEURON_TOOLS_BIN

log = logging.getLogger("sweep.neuron")
TOOL_DIRS = (NEURON_TOOLS_BIN,)  # where aws-neuronx-tools installs neuron-ls and neuron-monitor
ATTR_TOOLS_MISSING = "neuron_tools_missing"
_SKIPPED = {"neuron-ls": "the trial's cores are not checked against the node's devices",
            "neuron-monitor": "no NeuronCore utilisation or device memory is recorded"}
_said: set[str] = set()


def find_tool(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """A Neuron tool's path: on PATH, else in /opt/aws/neuron/bin; None when it is in neither."""
    found = shutil.which(name, path=(os.environ if env is None else env).get("PATH", ""))
    return found or shutil.which(name, path=os.pathsep.join(TOOL_DIRS))


def missing_tool(name: str) -> str:
    """The one line that says a tool is missing and what goes without it (logged once per process)."""
    line = (f"{name} not found on PATH or in {os.pathsep.join(TOOL_DIRS)} (package aws-neuronx-tools): "
            f"{_SKIPPED.get(name, 'skipped')}")
    if name not in _said:
        _said.add(name)
        log.warning("%s", line)
    return line


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
    """The node's devices from ``neuron-ls --json-output``; None when the tool is absent (said in one line)
    or fails."""
    exe = find_tool("neuron-ls", env)
    if exe is None:
        missing_tool("neuron-ls")
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


def monitor_once(env: Mapping[str, str] | None = None, timeout: float = 30.0,
                 config_dir: str | None = None) -> dict[str, Any]:
    """The first report ``neuron-monitor`` prints with :data:`MONITOR_CONFIG`; raises RuntimeError saying why not.

    Used by the preflight: a tool that is missing, exits, prints no JSON object or stays silent past
    ``timeout`` seconds is a node whose trials would record no utilisation.
    """
    env = dict(os.environ if env is None else env)
    exe = find_tool("neuron-monitor", env)
    if exe is None:
        raise RuntimeError(f"neuron-monitor is not on PATH or in {os.pathsep.join(TOOL_DIRS)}")
    fd, config = tempfile.mkstemp(prefix="neuron-monitor-", suffix=".json", dir=config_dir)
    with os.fdopen(fd, "w") as f:
        json.dump(MONITOR_CONFIG, f)
    proc = subprocess.Popen([exe, "-c", config], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, env=env)
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()) if proc.stdout else None,
                              daemon=True)
    reader.start()
    reader.join(timeout)
    try:
        if reader.is_alive() or not lines or not lines[0]:
            code = proc.poll()
            why = f"exited with {code}" if code is not None else f"printed nothing in {timeout:g} s"
            raise RuntimeError(f"neuron-monitor {why}")
        try:
            report = json.loads(lines[0])
        except ValueError:
            raise RuntimeError(f"neuron-monitor printed no JSON: {lines[0][:120]!r}") from None
        if not isinstance(report, dict):
            raise RuntimeError("neuron-monitor printed JSON that is not a report object")
        return report
    finally:
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            os.unlink(config)


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
        self.missing: str | None = None  # the line saying neuron-monitor is missing, when it is

    def start(self) -> bool:
        """Start sampling; False (and nothing started, said in one line) where neuron-monitor is missing."""
        exe = find_tool("neuron-monitor")
        if exe is None:
            self.missing = missing_tool("neuron-monitor")
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
