"""A NumPy stand-in for the part of the NKI API that `kernels.nki_kernels` uses, for tests on machines
without the Neuron SDK. Long file: one module is the whole stand-in (language, ISA, jit, simulate), so that
the kernels swap in exactly one object per namespace.

It executes the kernels eagerly, like `nki.simulate` (docs: nki/guides/nki_simulator), and is strict where
the trn2 hardware is strict, so that a kernel passing here has a chance on the chip:

- on-chip memory: every SBUF/PSUM tensor is counted while it is alive (Python's reference counting stands
  in for the compiler's liveness), against 224 KiB of SBUF per partition (NeuronCore-v3: 28 MiB = 128 x
  224 KiB, Trainium2 architecture guide) and 8 PSUM banks of 2 KiB per partition (16 KiB, the
  Trainium/Inferentia2 guide); the real simulator does not check capacity at all;
- dtypes: bfloat16 is held as bfloat16 (`ml_dtypes`, as the real simulator's precise mode), engines compute
  in float32 (the Vector Engine computes in FP32, trn2 guide), DMA casts through float32 (nki.isa.dma_copy),
  matmul writes float32 PSUM (TensorE accumulates in FP32), and NKI has no float64;
- control flow: tile values are unknown while NKI specializes a kernel (NKI 0.7 traces it with Python), so
  branching on a tile's value fails; `nl.program_id` is an integer only inside a launch grid, axis 0 only;
- layout: at most 128 partitions, matmul and Tensor Engine transpose from SBUF into PSUM, 128 stationary and
  512 moving columns, no DMA out of PSUM, outputs in shared HBM, per-partition operands of shape [rows, 1].

Fresh tensors are filled with NaN (4 for integers) so a read of memory never written shows up, and LNC=2
launches run the kernel once per core against shared output tensors. Passing here shows the tiling, index
arithmetic, dtypes and memory plan are right; it says nothing about speed or about every rule neuronx-cc
enforces. Never used outside tests.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np

PMAX = 128
MOVING_MAX = 512
STATIONARY_MAX = 128
SBUF_PARTITION_BYTES = 224 * 1024  # NeuronCore-v3 (trn2): 28 MiB SBUF = 128 partitions x 224 KiB
PSUM_BANK_BYTES = 2 * 1024  # one bank holds 512 float32 per partition: one matmul's output
PSUM_BANKS = 8  # 16 KiB of PSUM per partition
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)


class NkiConstraintError(AssertionError):
    """A rule of the hardware or of NKI that the kernel broke; the message names it."""


class FakeTensor(np.ndarray):
    """A NumPy array that remembers which memory (hbm, shared_hbm, sbuf, psum) it lives in; views keep it."""

    buffer: str = "hbm"

    def __array_finalize__(self, obj: Any) -> None:
        self.buffer = getattr(obj, "buffer", "hbm")

    def __bool__(self) -> bool:
        raise NkiConstraintError(
            "Python control flow on a tile's value: NKI specializes kernels by tracing them before any value "
            "exists; use nl.fori_loop/nl.while_loop or a mask")

    __float__ = __int__ = __index__ = __bool__  # type: ignore[assignment]

    def item(self, *args: Any) -> Any:
        return self.__bool__()


def _tensor(arr: np.ndarray, buffer: str) -> FakeTensor:
    t = np.asarray(arr).view(FakeTensor)
    t.buffer = buffer
    return t


def _buf(t: Any) -> str:
    return getattr(t, "buffer", "const")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise NkiConstraintError(message)


class _Ledger:
    """Live on-chip bytes per partition of one core's run."""

    def __init__(self) -> None:
        self.sbuf = 0
        self.psum_banks = 0
        self.peak_sbuf = 0

    def release(self, sbuf: int, banks: int) -> None:
        self.sbuf -= sbuf
        self.psum_banks -= banks


class _State(threading.local):
    programs: int = 0  # 0: not inside a launch
    program: int = 0
    shared: list[FakeTensor] | None = None  # shared_hbm tensors of this launch, replayed for later cores
    shared_at: int = 0
    ledger: _Ledger | None = None


_state = _State()
LAST_LAUNCH = {"peak_sbuf": 0, "lnc": 0}  # the last simulate() call's peak SBUF bytes per partition, any core


# ------------------------------------------------------------------------------------------------ nki.language
class _Op:
    def __init__(self, name: str, fn: Callable[..., np.ndarray]) -> None:
        self.name, self.fn = name, fn

    def __call__(self, *args: Any) -> np.ndarray:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"nl.{self.name}"


def _f32(x: Any) -> Any:
    """The engines' working precision (float32) for a tile, or a Python float for a scalar."""
    return np.asarray(x).astype(F32) if isinstance(x, np.ndarray) else float(x)


class _TileSize:
    pmax = PMAX
    gemm_stationary_fmax = STATIONARY_MAX
    gemm_moving_fmax = MOVING_MAX
    psum_fmax = MOVING_MAX
    psum_num_banks = PSUM_BANKS
    # NKI's usable SBUF per partition (nl.tile_size.sbuf_fmax_bytes, NKI 0.4+). The docs give no trn2
    # figure for it, only the capacity (224 KiB) and "total minus reserved bytes": the stand-in reports the
    # capacity, no reserve (a guess), and its SBUF ledger refuses anything past this same figure.
    sbuf_fmax_bytes = SBUF_PARTITION_BYTES
    sbuf_fmax = SBUF_PARTITION_BYTES // 4  # in float32 elements
    sbuf_size_bytes = SBUF_PARTITION_BYTES * PMAX  # all partitions: 28 MiB
    total_available_sbuf_size = SBUF_PARTITION_BYTES  # the deprecated name of sbuf_fmax_bytes, same value


def _account(t: FakeTensor, buffer: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Charge an SBUF/PSUM tensor to the running core's ledger until it is garbage (its last reference dies)."""
    ledger = _state.ledger
    if ledger is None:
        return
    per_partition = int(np.prod(shape[1:])) * dtype.itemsize
    if buffer == "sbuf":
        ledger.sbuf += per_partition
        ledger.peak_sbuf = max(ledger.peak_sbuf, ledger.sbuf)
        usable = _TileSize.sbuf_fmax_bytes
        _check(ledger.sbuf <= usable,
               f"SBUF overflow: {ledger.sbuf} bytes per partition live after allocating {shape} {dtype} "
               f"(trn2 has {usable})")
        weakref.finalize(t, ledger.release, per_partition, 0)
    else:
        banks = -(-per_partition // PSUM_BANK_BYTES)
        ledger.psum_banks += banks
        _check(ledger.psum_banks <= PSUM_BANKS,
               f"PSUM overflow: {ledger.psum_banks} banks of {PSUM_BANK_BYTES} bytes live after allocating "
               f"{shape} {dtype} (trn2 has {PSUM_BANKS} per partition)")
        weakref.finalize(t, ledger.release, 0, banks)


def _ndarray(shape: tuple[int, ...], dtype: Any, buffer: str = "sbuf", name: str = "") -> FakeTensor:
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    _check(dtype != np.float64, "NKI has no float64: use nl.float32")
    fill = np.nan if dtype.kind == "f" or dtype == BF16 else 4
    if buffer in ("sbuf", "psum"):
        _check(shape[0] <= PMAX, f"{buffer} tensor {shape}: partition dimension exceeds {PMAX}")
        t = _tensor(np.full(shape, fill, dtype=dtype), buffer)
        _account(t, buffer, shape, dtype)
        return t
    if buffer == "shared_hbm" and _state.shared is not None:
        if _state.program > 0:  # a later core of an LNC=2 launch sees the tensors the first one created
            t = _state.shared[_state.shared_at]
            _state.shared_at += 1
            _check(t.shape == shape and t.dtype == dtype, "cores allocated different shared outputs")
            return t
        t = _tensor(np.full(shape, fill, dtype=dtype), buffer)
        _state.shared.append(t)
        return t
    return _tensor(np.full(shape, fill, dtype=dtype), buffer)


def _program_ndim() -> int:
    _check(_state.programs > 0, "nl.program_ndim outside a kernel launch")
    return 1 if _state.programs > 1 else 0


def _num_programs(axes: int = 0) -> int:
    _check(_state.programs > 0, "nl.num_programs outside a kernel launch")
    _check(axes == 0, f"the LNC launch grid has one axis; num_programs({axes})")
    return _state.programs


def _program_id(axis: int = 0) -> int:
    _check(_state.programs > 1, "nl.program_id needs a launch grid (kernel[2] at LNC=2); check nl.program_ndim()")
    _check(axis == 0, f"the LNC launch grid has one axis; program_id({axis})")
    return _state.program


def _make_language() -> ModuleType:
    nl = ModuleType("nki.language")
    nl.float32, nl.bfloat16, nl.float16, nl.int32, nl.uint32 = F32, BF16, np.float16, np.int32, np.uint32
    nl.sbuf, nl.psum, nl.hbm, nl.private_hbm, nl.shared_hbm = "sbuf", "psum", "hbm", "hbm", "shared_hbm"
    nl.tile_size = _TileSize
    nl.ndarray = _ndarray
    nl.affine_range = nl.static_range = nl.sequential_range = range  # NKI 0.7: deprecated aliases of range
    nl.program_ndim = _program_ndim
    nl.num_programs = _num_programs
    nl.program_id = _program_id
    binary = {
        "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
        "minimum": np.minimum,
        "equal": lambda a, b: (a == b).astype(F32),
        "greater_equal": lambda a, b: (a >= b).astype(F32),
    }
    unary = {
        "exp": np.exp, "log": np.log, "tanh": np.tanh, "square": np.square, "sqrt": np.sqrt,
        "relu": lambda a: np.maximum(a, np.float32(0.0)), "rsqrt": lambda a: 1.0 / np.sqrt(a),
        "copy": lambda a: a, "reciprocal": lambda a: 1.0 / a,
    }
    for name, fn in {**binary, **unary}.items():
        setattr(nl, name, _Op(name, fn))
    nl.BINARY = frozenset(binary)
    return nl


nl = _make_language()


# ------------------------------------------------------------------------------------------------ nki.isa
def _store(dst: FakeTensor, value: Any) -> None:
    """Write a result into dst, rounding to dst's dtype (bfloat16 rounds to nearest even, as ml_dtypes does)."""
    value = np.asarray(value)
    _check(value.shape == dst.shape, f"result shape {value.shape} does not fit dst {dst.shape}")
    if value.dtype != dst.dtype and dst.dtype.kind != "i" and dst.dtype.kind != "u":
        value = value.astype(F32)
    np.copyto(np.asarray(dst), value.astype(dst.dtype), casting="unsafe")


def _same_shape(*tiles: Any) -> None:
    shapes = [t.shape for t in tiles]
    _check(all(s == shapes[0] for s in shapes), f"tile shapes differ: {shapes}")


def _on_chip(*tiles: Any) -> None:
    for t in tiles:
        _check(_buf(t) in ("sbuf", "psum"), f"compute engines read SBUF or PSUM, got {_buf(t)}")


def _operand(value: Any, data: Any) -> Any:
    """A scalar, or a [rows, 1] per-partition column matching data's rows (broadcast along the free axis)."""
    if isinstance(value, np.ndarray):
        _on_chip(value)
        _check(value.shape == (data.shape[0], 1), f"per-partition operand {value.shape} for data {data.shape}")
        return _f32(value)
    return np.float32(value)


def _binary(op: _Op) -> _Op:
    _check(op.name in nl.BINARY, f"{op!r} is not a binary arithmetic operator")
    return op


def dma_copy(dst: FakeTensor, src: FakeTensor, **_: Any) -> None:
    _check(_buf(src) != "psum", "dma_copy cannot read PSUM: copy to SBUF first")
    _check(_buf(dst) != "psum", "dma_copy writes HBM or SBUF")
    _check(src.shape == dst.shape, f"dma_copy shapes differ: src {src.shape}, dst {dst.shape}")
    _store(dst, np.asarray(src))  # DMA converts dtypes through float32 (nki.isa.dma_copy)


def nc_matmul(dst: FakeTensor, stationary: FakeTensor, moving: FakeTensor, accumulate: bool | None = None,
              **_: Any) -> None:
    _check(_buf(stationary) == "sbuf" and _buf(moving) == "sbuf", "nc_matmul reads SBUF operands")
    _check(_buf(dst) == "psum", "nc_matmul writes PSUM")
    _check(dst.dtype == F32, f"nc_matmul accumulates in float32: its PSUM dst must be float32, got {dst.dtype}")
    k, m = stationary.shape
    k2, n = moving.shape
    _check(k == k2 and k <= PMAX, f"contraction sizes {k} and {k2} must match and be <= {PMAX}")
    _check(m <= STATIONARY_MAX and n <= MOVING_MAX, f"stationary free {m} > 128 or moving free {n} > 512")
    _check(dst.shape == (m, n), f"matmul result {(m, n)} does not fit dst {dst.shape}")
    _check(accumulate is not None, "the fake needs accumulate=True/False spelled out")
    # float32 products and sums, as TensorE accumulates (einsum: no BLAS thread pool for these small tiles)
    result = np.einsum("km,kn->mn", _f32(stationary), _f32(moving))
    _store(dst, _f32(dst) + result if accumulate else result)


def nc_transpose(dst: FakeTensor, data: FakeTensor, **_: Any) -> None:
    _check(_buf(data) == "sbuf" and _buf(dst) == "psum", "Tensor Engine transpose goes from SBUF to PSUM")
    _check(dst.dtype == data.dtype, f"transpose keeps the dtype: {data.dtype} -> {dst.dtype}")
    _check(data.shape[0] <= PMAX and data.shape[1] <= PMAX, f"transpose tile {data.shape} exceeds 128x128")
    _check(dst.shape == data.shape[::-1], f"transpose of {data.shape} does not fit {dst.shape}")
    _store(dst, np.asarray(data).T)


def activation(dst: FakeTensor, op: _Op, data: FakeTensor, bias: Any = None, scale: Any = 1.0,
               reduce_op: _Op | None = None, reduce_res: FakeTensor | None = None, **_: Any) -> None:
    _on_chip(data)
    _same_shape(dst, data)
    _check(op.name not in nl.BINARY, f"{op!r} is not an activation function")
    pre = _f32(data) * _operand(scale, data)
    if bias is not None:
        pre = pre + _operand(bias, data)
    out = op(pre)
    _store(dst, out)
    if reduce_res is not None:
        _check(reduce_op is not None and reduce_op.name == "add", "the Scalar Engine reduction only adds")
        _check(reduce_res.shape == (data.shape[0], 1), f"reduce_res {reduce_res.shape} for data {data.shape}")
        _store(reduce_res, out.sum(axis=1, keepdims=True, dtype=F32))


def activation_reduce(dst: FakeTensor, op: _Op, data: FakeTensor, reduce_op: _Op, reduce_res: FakeTensor,
                      bias: Any = None, scale: Any = 1.0, **_: Any) -> None:
    activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res)


def tensor_tensor(dst: FakeTensor, data1: FakeTensor, data2: FakeTensor, op: _Op, **_: Any) -> None:
    _on_chip(data1, data2)
    _same_shape(dst, data1, data2)
    _check(not (_buf(data1) == "psum" and _buf(data2) == "psum"), "the Vector Engine reads at most one PSUM input")
    _store(dst, _binary(op)(_f32(data1), _f32(data2)))


def tensor_scalar(dst: FakeTensor, data: FakeTensor, op0: _Op, operand0: Any, reverse0: bool = False,
                  op1: _Op | None = None, operand1: Any = None, reverse1: bool = False, **_: Any) -> None:
    _on_chip(data)
    _same_shape(dst, data)
    a, b = _f32(data), _operand(operand0, data)
    out = _binary(op0)(b, a) if reverse0 else _binary(op0)(a, b)
    if op1 is not None:
        c = _operand(operand1, data)
        out = _binary(op1)(c, out) if reverse1 else _binary(op1)(out, c)
    _store(dst, out)


def scalar_tensor_tensor(dst: FakeTensor, data: FakeTensor, op0: _Op, operand0: Any, op1: _Op,
                         operand1: FakeTensor, reverse0: bool = False, reverse1: bool = False, **_: Any) -> None:
    _on_chip(data, operand1)
    _same_shape(dst, data, operand1)
    a, b = _f32(data), _operand(operand0, data)
    out = _binary(op0)(b, a) if reverse0 else _binary(op0)(a, b)
    c = _f32(operand1)
    _store(dst, _binary(op1)(c, out) if reverse1 else _binary(op1)(out, c))


def tensor_reduce(dst: FakeTensor, op: _Op, data: FakeTensor, axis: Any, negate: bool = False,
                  keepdims: bool = False, **_: Any) -> None:
    _on_chip(data)
    axes = tuple(axis) if isinstance(axis, tuple | list) else (axis,)
    _check(0 not in axes, "tensor_reduce reduces free axes only; the partition axis is 0")
    reducer = {"add": np.sum, "maximum": np.max, "minimum": np.min, "multiply": np.prod}[_binary(op).name]
    out = reducer(_f32(data), axis=axes, keepdims=True)
    if negate:
        out = -out
    _store(dst, out.reshape(dst.shape))


def tensor_copy(dst: FakeTensor, src: FakeTensor, **_: Any) -> None:
    _on_chip(src)
    _same_shape(dst, src)
    _store(dst, np.asarray(src))


def memset(dst: FakeTensor, value: Any, **_: Any) -> None:
    _check(dst.dtype.kind != "i" or isinstance(value, int), "memset value must match an integer dst's type")
    _store(dst, np.full(dst.shape, value, dtype=F32 if dst.dtype.kind != "i" else dst.dtype))


def iota(dst: FakeTensor, pattern: list[list[int]], offset: int = 0, channel_multiplier: int = 0, **_: Any) -> None:
    _check(len(pattern) == 1 and dst.ndim == 2 and pattern[0][1] == dst.shape[1], "fake iota: 2-D [[step, n]] only")
    step = pattern[0][0]
    p = np.arange(dst.shape[0])[:, None]
    f = np.arange(dst.shape[1])[None, :]
    _store(dst, (offset + f * step + p * channel_multiplier).astype(F32))


def reciprocal(dst: FakeTensor, data: FakeTensor, **_: Any) -> None:
    _on_chip(data)
    _same_shape(dst, data)
    _store(dst, np.float32(1.0) / _f32(data))


nisa = ModuleType("nki.isa")
for _fn in (dma_copy, nc_matmul, nc_transpose, activation, activation_reduce, tensor_tensor, tensor_scalar,
            scalar_tensor_tensor, tensor_reduce, tensor_copy, memset, iota, reciprocal):
    setattr(nisa, _fn.__name__, _fn)


# ------------------------------------------------------------------------------------------------ nki
def _hbm_input(value: Any) -> Any:
    """A kernel argument as HBM: torch tensors come in with their dtype (bfloat16 stays bfloat16)."""
    if hasattr(value, "detach") and hasattr(value, "dtype"):  # a torch.Tensor, without importing torch here
        t = value.detach().cpu().contiguous()
        bf16 = str(t.dtype) == "torch.bfloat16"
        value = t.view(_torch_int16()).numpy().view(BF16) if bf16 else t.numpy()
    if isinstance(value, np.ndarray):
        _check(value.dtype != np.float64, "NKI has no float64 tensors: pass float32 or bfloat16")
        return _tensor(np.array(value), "hbm")
    return value


def _torch_int16() -> Any:
    import torch  # the caller handed in a torch tensor, so torch is loaded

    return torch.int16


class Kernel:
    """What `nki.jit` returns: `kernel[lnc]` picks the logical-core degree; it runs only under `simulate`."""

    def __init__(self, fn: Callable[..., Any], lnc: int = 1) -> None:
        self.fn, self.lnc = fn, lnc

    def __getitem__(self, lnc: int) -> Kernel:
        _check(int(lnc) in (1, 2), f"the LNC degree is 1 or 2, got kernel[{lnc}]")
        return Kernel(self.fn, int(lnc))

    def __call__(self, *args: Any) -> Any:
        raise RuntimeError("the fake nki runs kernels only through nki.simulate")


def jit(fn: Callable[..., Any] | None = None, **_: Any) -> Any:
    if fn is None:
        return lambda f: Kernel(f)
    return Kernel(fn)


def simulate(kernel: Kernel) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        hbm = [_hbm_input(a) for a in args]
        _state.programs, _state.shared = kernel.lnc, []
        try:
            result = None
            for program in range(kernel.lnc):
                _state.program, _state.shared_at, _state.ledger = program, 0, _Ledger()
                result = kernel.fn(*hbm)
                LAST_LAUNCH["peak_sbuf"] = max(LAST_LAUNCH["peak_sbuf"] if program else 0, _state.ledger.peak_sbuf)
            LAST_LAUNCH["lnc"] = kernel.lnc
        finally:
            _state.programs, _state.program, _state.shared, _state.ledger = 0, 0, None, None
        outputs = result if isinstance(result, tuple) else (result,)
        for out in outputs:
            _check(_buf(out) == "shared_hbm", "kernel outputs must be allocated in nl.shared_hbm")
        plain = tuple(np.asarray(o).copy() for o in outputs)
        return plain if isinstance(result, tuple) else plain[0]

    return run


nki = ModuleType("nki")
nki.jit = jit
nki.simulate = simulate
nki.language = nl
nki.isa = nisa
