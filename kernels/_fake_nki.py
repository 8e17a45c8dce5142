"""A NumPy stand-in for the part of the NKI API that `kernels.nki_kernels` uses, for tests on machines
without the Neuron SDK.

It executes the kernels eagerly, like `nki.simulate`: fresh tensors are filled with NaN (so a read of
memory never written shows up in the result), LNC=2 launches run the kernel once per core against shared
output tensors, and the documented layout rules the kernels depend on are checked (at most 128 partitions,
matmul and Tensor Engine transpose from SBUF into PSUM, 128 stationary and 512 moving columns, equal
transpose dtypes, no DMA out of PSUM, outputs in shared HBM, per-partition operands of shape [rows, 1]).
Passing here shows the tiling, index arithmetic and math are right; it says nothing about whether
neuronx-cc accepts the kernels or how fast they run. Never used outside tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

PMAX = 128
MOVING_MAX = 512
STATIONARY_MAX = 128
PSUM_BYTES = 16 * 1024  # per partition: 8 banks of 2 KiB


class FakeTensor(np.ndarray):
    """A NumPy array that remembers which memory (hbm, shared_hbm, sbuf, psum) it lives in; views keep it."""

    buffer: str = "hbm"

    def __array_finalize__(self, obj: Any) -> None:
        self.buffer = getattr(obj, "buffer", "hbm")


def _tensor(arr: np.ndarray, buffer: str) -> FakeTensor:
    t = np.asarray(arr).view(FakeTensor)
    t.buffer = buffer
    return t


def _buf(t: Any) -> str:
    return getattr(t, "buffer", "const")


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


class _State(threading.local):
    programs: int = 1
    program: int = 0
    shared: list[FakeTensor] | None = None  # shared_hbm tensors of this launch, replayed for later cores
    shared_at: int = 0


_state = _State()


# ------------------------------------------------------------------------------------------------ nki.language
class _Op:
    def __init__(self, name: str, fn: Callable[..., np.ndarray]) -> None:
        self.name, self.fn = name, fn

    def __call__(self, *args: Any) -> np.ndarray:
        return self.fn(*args)

    def __repr__(self) -> str:
        return f"nl.{self.name}"


def _f64(x: Any) -> Any:
    return np.asarray(x, dtype=np.float64) if isinstance(x, np.ndarray) else float(x)


class _TileSize:
    pmax = PMAX
    gemm_stationary_fmax = STATIONARY_MAX
    gemm_moving_fmax = MOVING_MAX
    psum_fmax = 2048


def _ndarray(shape: tuple[int, ...], dtype: Any, buffer: str = "sbuf", name: str = "") -> FakeTensor:
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    if buffer in ("sbuf", "psum"):
        _check(shape[0] <= PMAX, f"{buffer} tensor {shape}: partition dimension exceeds {PMAX}")
    if buffer == "psum":
        free = int(np.prod(shape[1:])) * dtype.itemsize
        _check(free <= PSUM_BYTES, f"psum tensor {shape} {dtype}: {free} bytes per partition exceed {PSUM_BYTES}")
    if buffer == "shared_hbm" and _state.shared is not None:
        if _state.program > 0:  # a later core of an LNC=2 launch sees the tensors the first one created
            t = _state.shared[_state.shared_at]
            _state.shared_at += 1
            _check(t.shape == shape and t.dtype == dtype, "cores allocated different shared outputs")
            return t
        fill = np.nan if dtype.kind == "f" else 4
        t = _tensor(np.full(shape, fill, dtype=dtype), buffer)
        _state.shared.append(t)
        return t
    fill = np.nan if dtype.kind == "f" else 4
    return _tensor(np.full(shape, fill, dtype=dtype), buffer)


def _num_programs(axes: int = 0) -> int:
    return _state.programs


def _program_id(axis: int = 0) -> int:
    return _state.program


def _make_language() -> ModuleType:
    nl = ModuleType("nki.language")
    nl.float32, nl.bfloat16, nl.float16, nl.int32, nl.uint32 = (
        np.float32, np.float32, np.float16, np.int32, np.uint32)  # bfloat16 modelled as float32
    nl.sbuf, nl.psum, nl.hbm, nl.private_hbm, nl.shared_hbm = "sbuf", "psum", "hbm", "hbm", "shared_hbm"
    nl.tile_size = _TileSize
    nl.ndarray = _ndarray
    nl.affine_range = nl.static_range = nl.sequential_range = range
    nl.program_ndim = lambda: 1 if _state.programs > 1 else 0
    nl.num_programs = _num_programs
    nl.program_id = _program_id
    binary = {
        "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum,
        "minimum": np.minimum,
        "equal": lambda a, b: (a == b).astype(np.float64),
        "greater_equal": lambda a, b: (a >= b).astype(np.float64),
    }
    unary = {
        "exp": np.exp, "log": np.log, "tanh": np.tanh, "square": np.square, "sqrt": np.sqrt,
        "relu": lambda a: np.maximum(a, 0.0), "rsqrt": lambda a: 1.0 / np.sqrt(a), "copy": lambda a: a,
        "reciprocal": lambda a: 1.0 / a,
    }
    for name, fn in {**binary, **unary}.items():
        setattr(nl, name, _Op(name, fn))
    nl.BINARY = frozenset(binary)
    return nl


nl = _make_language()


# ------------------------------------------------------------------------------------------------ nki.isa
def _store(dst: FakeTensor, value: Any) -> None:
    value = np.asarray(value)
    _check(value.shape == dst.shape, f"result shape {value.shape} does not fit dst {dst.shape}")
    np.copyto(dst, value.astype(dst.dtype), casting="unsafe")


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
        return _f64(value)
    return float(value)


def _binary(op: _Op) -> _Op:
    _check(op.name in nl.BINARY, f"{op!r} is not a binary arithmetic operator")
    return op


def dma_copy(dst: FakeTensor, src: FakeTensor, **_: Any) -> None:
    _check(_buf(src) != "psum", "dma_copy cannot read PSUM: copy to SBUF first")
    _check(_buf(dst) != "psum", "dma_copy writes HBM or SBUF")
    _check(src.shape == dst.shape, f"dma_copy shapes differ: src {src.shape}, dst {dst.shape}")
    _store(dst, src)


def nc_matmul(dst: FakeTensor, stationary: FakeTensor, moving: FakeTensor, accumulate: bool | None = None,
              **_: Any) -> None:
    _check(_buf(stationary) == "sbuf" and _buf(moving) == "sbuf", "nc_matmul reads SBUF operands")
    _check(_buf(dst) == "psum", "nc_matmul writes PSUM")
    k, m = stationary.shape
    k2, n = moving.shape
    _check(k == k2 and k <= PMAX, f"contraction sizes {k} and {k2} must match and be <= {PMAX}")
    _check(m <= STATIONARY_MAX and n <= MOVING_MAX, f"stationary free {m} > 128 or moving free {n} > 512")
    _check(dst.shape == (m, n), f"matmul result {(m, n)} does not fit dst {dst.shape}")
    _check(accumulate is not None, "the fake needs accumulate=True/False spelled out")
    result = _f64(stationary).T @ _f64(moving)
    _store(dst, _f64(dst) + result if accumulate else result)


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
    pre = _f64(data) * _operand(scale, data)
    if bias is not None:
        pre = pre + _operand(bias, data)
    out = op(pre)
    _store(dst, out)
    if reduce_res is not None:
        _check(reduce_op is not None and reduce_op.name == "add", "the Scalar Engine reduction only adds")
        _check(reduce_res.shape == (data.shape[0], 1), f"reduce_res {reduce_res.shape} for data {data.shape}")
        _store(reduce_res, out.sum(axis=1, keepdims=True))


def activation_reduce(dst: FakeTensor, op: _Op, data: FakeTensor, reduce_op: _Op, reduce_res: FakeTensor,
                      bias: Any = None, scale: Any = 1.0, **_: Any) -> None:
    activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res)


def tensor_tensor(dst: FakeTensor, data1: FakeTensor, data2: FakeTensor, op: _Op, **_: Any) -> None:
    _on_chip(data1, data2)
    _same_shape(dst, data1, data2)
    _check(not (_buf(data1) == "psum" and _buf(data2) == "psum"), "the Vector Engine reads at most one PSUM input")
    _store(dst, _binary(op)(_f64(data1), _f64(data2)))


def tensor_scalar(dst: FakeTensor, data: FakeTensor, op0: _Op, operand0: Any, reverse0: bool = False,
                  op1: _Op | None = None, operand1: Any = None, reverse1: bool = False, **_: Any) -> None:
    _on_chip(data)
    _same_shape(dst, data)
    a, b = _f64(data), _operand(operand0, data)
    out = _binary(op0)(b, a) if reverse0 else _binary(op0)(a, b)
    if op1 is not None:
        c = _operand(operand1, data)
        out = _binary(op1)(c, out) if reverse1 else _binary(op1)(out, c)
    _store(dst, out)


def scalar_tensor_tensor(dst: FakeTensor, data: FakeTensor, op0: _Op, operand0: Any, op1: _Op,
                         operand1: FakeTensor, reverse0: bool = False, reverse1: bool = False, **_: Any) -> None:
    _on_chip(data, operand1)
    _same_shape(dst, data, operand1)
    a, b = _f64(data), _operand(operand0, data)
    out = _binary(op0)(b, a) if reverse0 else _binary(op0)(a, b)
    c = _f64(operand1)
    _store(dst, _binary(op1)(c, out) if reverse1 else _binary(op1)(out, c))


def tensor_reduce(dst: FakeTensor, op: _Op, data: FakeTensor, axis: Any, negate: bool = False,
                  keepdims: bool = False, **_: Any) -> None:
    _on_chip(data)
    axes = tuple(axis) if isinstance(axis, tuple | list) else (axis,)
    _check(0 not in axes, "tensor_reduce reduces free axes only; the partition axis is 0")
    reducer = {"add": np.sum, "maximum": np.max, "minimum": np.min, "multiply": np.prod}[_binary(op).name]
    out = reducer(_f64(data), axis=axes, keepdims=True)
    if negate:
        out = -out
    _store(dst, out.reshape(dst.shape))


def tensor_copy(dst: FakeTensor, src: FakeTensor, **_: Any) -> None:
    _on_chip(src)
    _same_shape(dst, src)
    _store(dst, src)


def memset(dst: FakeTensor, value: Any, **_: Any) -> None:
    _check(dst.dtype.kind == "f" or isinstance(value, int), "memset value must match an integer dst's type")
    dst[...] = value


def iota(dst: FakeTensor, pattern: list[list[int]], offset: int = 0, channel_multiplier: int = 0, **_: Any) -> None:
    _check(len(pattern) == 1 and dst.ndim == 2 and pattern[0][1] == dst.shape[1], "fake iota: 2-D [[step, n]] only")
    step = pattern[0][0]
    p = np.arange(dst.shape[0])[:, None]
    f = np.arange(dst.shape[1])[None, :]
    _store(dst, offset + f * step + p * channel_multiplier)


def reciprocal(dst: FakeTensor, data: FakeTensor, **_: Any) -> None:
    _on_chip(data)
    _same_shape(dst, data)
    _store(dst, 1.0 / _f64(data))


nisa = ModuleType("nki.isa")
for _fn in (dma_copy, nc_matmul, nc_transpose, activation, activation_reduce, tensor_tensor, tensor_scalar,
            scalar_tensor_tensor, tensor_reduce, tensor_copy, memset, iota, reciprocal):
    setattr(nisa, _fn.__name__, _fn)


# ------------------------------------------------------------------------------------------------ nki
class Kernel:
    """What `nki.jit` returns: `kernel[lnc]` picks the logical-core degree; it runs only under `simulate`."""

    def __init__(self, fn: Callable[..., Any], lnc: int = 1) -> None:
        self.fn, self.lnc = fn, lnc

    def __getitem__(self, lnc: int) -> Kernel:
        return Kernel(self.fn, int(lnc))

    def __call__(self, *args: Any) -> Any:
        raise RuntimeError("the fake nki runs kernels only through nki.simulate")


def jit(fn: Callable[..., Any] | None = None, **_: Any) -> Any:
    if fn is None:
        return lambda f: Kernel(f)
    return Kernel(fn)


def simulate(kernel: Kernel) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        hbm = [_tensor(np.array(a), "hbm") if isinstance(a, np.ndarray) else a for a in args]
        _state.programs, _state.shared = kernel.lnc, []
        try:
            result = None
            for program in range(kernel.lnc):
                _state.program, _state.shared_at = program, 0
                result = kernel.fn(*hbm)
        finally:
            _state.programs, _state.program, _state.shared = 1, 0, None
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
