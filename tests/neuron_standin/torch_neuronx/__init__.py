"""torch-neuronx stand-in on the CPU: TorchNeuron's device, process-group and NEFF-cache rules as its source has them.

Every rule below cites the line of TorchNeuron's own source it mirrors: [T] is the public snapshot of
torch-neuronx in github.com/parmoham-aws/test-repo-parmoham at 98154b867aa2 (April 2026; it predates Neuron
2.33, so a rule 2.33 changed would differ: docs/neuron.md lists what is still unproven). Tensors stay on the
CPU; what the stand-in adds is the bookkeeping that decides whether the real one would accept a call.

- ``torch.device("neuron", i)`` parses: the PrivateUse1 backend is renamed ``neuron`` and ``torch.neuron`` is its
  device module ([T] torch_neuronx/__init__.py:119, :122). A mode maps every neuron device argument to the CPU
  after :func:`vnc_id` has checked the index, as the caching allocator does on every allocation ([T]
  csrc/core/allocator/NeuronCachingAllocator.cpp:50, csrc/core/NeuronDevice.cpp:188-210).
- The runtime starts (``nrt_init``) on the first device use ([T] __init__.py:137-160, ``_lazy_init``); it then
  reserves the process's cores (Neuron Runtime configuration guide, "NeuronCore allocation"): lock files under
  ``$TORCH_NEURONX_STANDIN_LOCKS``, one per core, held while the process lives, where that variable is set.
- ``dist.init_process_group("neuron")`` runs ``_neuron_runtime_setup`` ([T] distributed/backend.py:292-318): the
  runtime must not have started yet; ``NEURON_RT_VISIBLE_CORES`` becomes ``LOCAL_RANK`` where it is unset
  (:205-222); world size, local world size and the local device start index (= the local rank) are set; the
  runtime starts; the process must see exactly one core. Collectives then run on gloo.
- ``torch.neuron.device_count()`` is the local world size once that is set, else the visible cores
  (NeuronDevice.cpp:224-231); ``current_device()`` the start index once set, else 0 (:97-109);
  ``set_device`` refuses an index outside this process's range (:126-135).
- ``torch.compile(backend="neuron")`` keeps each graph in the persistent NEFF cache, ``TORCH_NEURONX_NEFF_CACHE_DIR``
  (default ``/tmp/neff_cache``), at ``ab/cd/<key>.neff`` for a 32-hex-digit key over the graph, written through a
  temporary file and a rename; a later process finds it there ([T] csrc/core/cache/PersistentCacheBackend.cpp:22-28,
  :61-65, :108-140; cache/CacheUtils.cpp:11-35). ``TORCH_NEURONX_NEFF_DISABLE_CACHE=1`` (exactly "1") turns the
  persistent cache off (PersistentCacheBackend.cpp:17-18, :55-59; CompilationCache.cpp:61); the Python-side
  ``TORCH_NEURONX_DISABLE_NEFF_CACHE`` (1/true/yes) turns off the in-process cache only ([T] utils.py:191-198,
  python_ops/compilation/cache.py:38). The key's hash function differs (XXH3-128 there, BLAKE2b-128 here).

``FAKE_NEURON`` (comma-separated, tests/neuron_standins.py) breaks it the ways the preflight guards against:
``unavailable``, ``few-cores``, ``share-core`` (every rank given core 0), ``cache-elsewhere``, ``no-hit``,
``model-compile-error`` (a graph of more than :data:`SMALL_GRAPH_NODES` nodes fails as neuronx-cc's failures
reach a compile, [T] ``csrc/core/KernelExecution.cpp``'s "compilation failed for op", while small graphs compile).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import tempfile
import types
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

CORES_VAR = "NEURON_RT_VISIBLE_CORES"
LOCKS_VAR = "TORCH_NEURONX_STANDIN_LOCKS"
NEFF_CACHE_VAR = "TORCH_NEURONX_NEFF_CACHE_DIR"
DEFAULT_NEFF_CACHE = "/tmp/neff_cache"  # PersistentCacheBackend.cpp:27
PERSISTENT_DISABLE_VAR = "TORCH_NEURONX_NEFF_DISABLE_CACHE"  # PersistentCacheBackend.cpp:57, exactly "1" (:18)
MEMORY_DISABLE_VAR = "TORCH_NEURONX_DISABLE_NEFF_CACHE"  # utils.py:197, 1/true/yes (:198)

MODES = set(filter(None, os.environ.get("FAKE_NEURON", "").split(",")))


def _parse(text: str) -> list[int]:
    cores: list[int] = []
    for item in text.split(","):
        lo, _, hi = item.strip().partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


class _Runtime:
    """The C++ side's process state (NeuronDevice.cpp:29-37): -1 means not set."""

    world_size = -1
    rank = -1
    local_world_size = -1
    local_device_start_index = -1
    initialized = False
    held: list[Any] = []


_rt = _Runtime()
VISIBLE_CORES: list[int] = []  # the cores the runtime reserved, once it started


def _visible() -> list[int]:
    text = os.environ.get(CORES_VAR)
    return _parse(text) if text else list(range(8 // int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "2") or 2)))


def vnc_count() -> int:
    """nrt_get_visible_vnc_count (NeuronDevice.cpp:212-222): the cores this process sees."""
    return 1 if "few-cores" in MODES else len(_visible())


def is_neuron_runtime_initialized() -> bool:
    return _rt.initialized


def _lazy_init() -> None:
    """nrt_init on first use (__init__.py:137-160); the runtime reserves the visible cores until exit."""
    if _rt.initialized:
        return
    cores = _visible()
    locks = os.environ.get(LOCKS_VAR)
    if locks:
        for core in cores:
            handle = open(os.path.join(locks, f"nc{core}.lock"), "a")  # noqa: SIM115 - held until exit
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError(f"torch_neuronx stand-in: NeuronCore {core} is already reserved by another "
                                   "process") from None
            _rt.held.append(handle)
    VISIBLE_CORES[:] = cores
    _rt.initialized = True


def device_count() -> int:
    """NeuronDevice.cpp:224-231: the local world size once distributed setup set it, else the visible cores."""
    return _rt.local_world_size if _rt.local_world_size != -1 else vnc_count()


def _start_index() -> int:
    return 0 if _rt.local_device_start_index == -1 else _rt.local_device_start_index  # NeuronDevice.cpp:111-113


_current: list[int] = []  # set_device's choice (NeuronDevice.cpp:29, thread-local there)


def current_device() -> int:
    """NeuronDevice.cpp:97-109: the device set, else the distributed default (the local rank), else 0."""
    return _current[-1] if _current else _start_index()


def set_device(device: Any) -> None:
    """__init__.py:196-206 and NeuronDevice.cpp:126-135: only this process's own indices."""
    index = getattr(device, "index", device)
    index = current_device() if index is None else int(index)
    start, count = _start_index(), vnc_count()
    if index < start or index >= start + count:
        raise ValueError(f"Device index {index} is out of range. Valid range is {start} to {start + count - 1} "
                         "for this process")
    _current.append(index)


def vnc_id(device_index: int | None) -> int:
    """get_vnc_id (NeuronDevice.cpp:188-210): the PyTorch index of a tensor's device, as a runtime core."""
    index = current_device() if device_index is None else device_index
    if _rt.local_world_size == -1:
        return index
    if index >= _rt.local_world_size:
        raise RuntimeError(f"Device index {index} is out of range. Valid range is 0 to {_rt.local_world_size - 1}")
    if index < _rt.local_device_start_index:
        raise RuntimeError("Attempted to access device that doesn't attach to this process, received "
                           f"{index} expected to be equal or greater than {_rt.local_device_start_index}")
    return index - _rt.local_device_start_index


# -- the neuron device, on the CPU ----------------------------------------------------------------

def _neuron_device(value: Any) -> torch.device | None:
    if isinstance(value, torch.device):
        return value if value.type == "neuron" else None
    if isinstance(value, str) and value.split(":")[0] == "neuron":
        return torch.device(value)
    return None


class _OnTheCpu(TorchFunctionMode):
    """Every neuron device argument is checked as an allocation there would be, then becomes the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.device or torch.compiler.is_compiling():  # a device object, or a graph being traced
            return func(*args, **kwargs)
        if any(_neuron_device(a) is not None for a in args) or any(
                _neuron_device(v) is not None for v in kwargs.values()):
            args = tuple(self._place(a) for a in args)
            kwargs = {k: self._place(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)

    @staticmethod
    def _place(value: Any) -> Any:
        device = _neuron_device(value)
        if device is None:
            return value
        vnc_id(device.index)  # NeuronCachingAllocator.cpp:50: every allocation asks get_vnc_id
        _lazy_init()
        return torch.device("cpu")


torch.utils.rename_privateuse1_backend("neuron")  # __init__.py:119


def synchronize(device: Any = None) -> None:
    _lazy_init()


neuron = types.ModuleType("torch.neuron")
neuron.is_available = lambda: "unavailable" not in MODES and device_count() > 0  # neuron.py: device_count() > 0
neuron.device_count = device_count
neuron.current_device = current_device
neuron.set_device = set_device
neuron.synchronize = synchronize
neuron.is_initialized = is_neuron_runtime_initialized
neuron.get_amp_supported_dtype = lambda: [torch.float32, torch.float16, torch.bfloat16]  # neuron.py:80-84
neuron.is_autocast_enabled = lambda: False
neuron.get_autocast_dtype = lambda: torch.bfloat16
torch._register_device_module("neuron", neuron)  # __init__.py:122
# What the stand-in cannot be: TorchNeuron's C++ device guard and streams. torch.accelerator, which dynamo asks
# for the current stream when it traces, is told that no accelerator is here, so graphs trace as CPU graphs.
torch.accelerator.is_available = lambda: False
_MODE = _OnTheCpu()
_MODE.__enter__()


# -- the process group ---------------------------------------------------------------------------

def _set_rt_visible_cores(rank: int, world_size: int) -> tuple[int, int]:
    """distributed/backend.py:205-222 (torchrun sets LOCAL_RANK and LOCAL_WORLD_SIZE; one host here otherwise)."""
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if "share-core" in MODES:
        os.environ[CORES_VAR] = "0"
    if not os.environ.get(CORES_VAR):
        os.environ[CORES_VAR] = str(local_rank)
    return local_rank, local_world_size


def _neuron_runtime_setup(rank: int, size: int) -> None:
    """distributed/backend.py:292-318, asserts included."""
    assert not is_neuron_runtime_initialized(), \
        "Neuron runtime should not be initialized before the init_process_group."
    local_rank, local_world_size = _set_rt_visible_cores(rank, size)
    _rt.world_size, _rt.rank, _rt.local_world_size = size, rank, local_world_size  # :300-302
    if local_rank >= local_world_size:  # NeuronDevice.cpp:174-178
        raise ValueError(f"local device start index {local_rank} is out of range. Valid range is 0 to "
                         f"{local_world_size - 1}")
    _rt.local_device_start_index = local_rank  # :303
    _lazy_init()  # :307
    assert vnc_count() == 1, "Attempted to have more than one device per process in distributed setup"  # :310-312


def _create_neuron_process_group(store: Any, rank: int, size: int, timeout: Any) -> Any:
    """backend.py:53-58 and ProcessGroupNeuron.__init__ (:418-440): runtime set-up on the first group."""
    if _rt.world_size == -1:
        _neuron_runtime_setup(rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


dist.Backend.register_backend("neuron", _create_neuron_process_group, devices=["neuron", "cpu"])


# -- the compile backend and its NEFF cache --------------------------------------------------------

def _persistent_cache_disabled() -> bool:
    return os.environ.get(PERSISTENT_DISABLE_VAR) == "1"  # PersistentCacheBackend.cpp:17-18, :55-59


def _cache_key(graph: str) -> str:
    """MakePersistentCacheKey (CacheUtils.cpp:11-35): a 128-bit hash of base key + IR, 32 hex digits."""
    salt = os.environ.get("NEURON_CC_FLAGS", "")  # **guess**: the compiler's flags are part of the base key
    if "no-hit" in MODES:
        salt += str(os.getpid())
    return hashlib.blake2b((salt + "\0" + graph).encode(), digest_size=16).hexdigest()


def _sharded_path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, key[:2], key[2:4], key + ".neff")  # PersistentCacheBackend.cpp:61-65


def _atomic_write(path: str, data: bytes) -> None:
    """PersistentCacheBackend.cpp:108-140: a temporary ``.tmp.XXXXXX`` beside the target, then a rename."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp.", dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


COMPILED: list[str] = []  # keys compiled by this process (misses)
SMALL_GRAPH_NODES = 40


def _backend(gm: Any, example_inputs: Any) -> Any:
    cache_dir = os.environ.get(NEFF_CACHE_VAR) or DEFAULT_NEFF_CACHE  # PersistentCacheBackend.cpp:22-28
    if "cache-elsewhere" in MODES:
        cache_dir = os.environ["FAKE_NEURON_ELSEWHERE"]
    if "model-compile-error" in MODES and len(gm.graph.nodes) > SMALL_GRAPH_NODES:
        raise RuntimeError("HLO to NEFF compilation failed for op 'torch_compile': neuronx-cc exited 70")
    key = _cache_key(gm.code)
    path = _sharded_path(cache_dir, key)
    if _persistent_cache_disabled() or not os.path.exists(path):
        COMPILED.append(key)
        if not _persistent_cache_disabled():
            _atomic_write(path, gm.code.encode())
    return gm.forward


from torch._dynamo import register_backend  # noqa: E402

register_backend(_backend, name="neuron")
sys.modules.setdefault("torch.neuron", neuron)
