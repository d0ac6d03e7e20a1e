"""numba-cuda kernels launched through asyncgpu: ``load_numba_kernel`` compiles a
``@cuda.jit`` kernel for one signature with numba and loads its PTX into a
context; ``NumbaKernel.args`` flattens arrays the way numba passes them."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._core.event import DeviceEvent
from .._core.foreign import _cai_of
from .._core.function import DeviceFunction
from .._core.memory import _BufferBase
from .context import DeviceContext

__all__ = ["NumbaKernel", "load_numba_kernel"]


_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$.]*)\s*\(")


class NumbaKernel:
    """A numba-cuda ``@cuda.jit`` kernel compiled for one signature and loaded into
    an asyncgpu context.

    numba passes each array as its array structure flattened into several kernel
    parameters (meminfo, parent, item count, item size, data pointer, shape,
    strides); ``args(*values)`` builds them, so the kernel launches through
    ``enqueue_function``::

        k = asyncgpu.load_numba_kernel(ctx, axpy, "void(float32, float32[::1], float32[::1])")
        ctx.enqueue_function(k.function, *k.args(np.float32(2), x, y),
                             grid_dim=blocks, block_dim=256)

    or ``k.enqueue(ctx, np.float32(2), x, y, grid_dim=..., block_dim=...)``.

    Array arguments: ``DeviceBuffer`` / ``HostBuffer`` (1-D), ``(buffer, shape)``
    for a C-contiguous N-D view of a buffer, or objects with
    ``__cuda_array_interface__`` (any strides). Scalars are converted to the
    signature's types.
    """

    def __init__(self, function: DeviceFunction, argtypes: Sequence[Any], name: str) -> None:
        self.function = function
        self.argtypes = tuple(argtypes)
        self.name = name

    def args(self, *values: Any) -> tuple[Any, ...]:
        if len(values) != len(self.argtypes):
            raise TypeError(
                f"kernel {self.name} takes {len(self.argtypes)} arguments, {len(values)} given"
            )
        out: list[Any] = []
        for i, (ty, v) in enumerate(zip(self.argtypes, values, strict=True)):
            try:
                _numba_arg(ty, v, out)
            except (TypeError, ValueError) as e:
                raise type(e)(f"argument {i} of {self.name} ({ty}): {e}") from None
        return tuple(out)

    def enqueue(self, where: Any, *values: Any, **launch: Any) -> DeviceEvent:
        """Launch on ``where`` (a DeviceContext or DeviceStream)."""
        return where.enqueue_function(self.function, *self.args(*values), **launch)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"<NumbaKernel {self.name}{self.argtypes}>"


def _array_layout(value: Any) -> tuple[Any, np.dtype[Any], tuple[int, ...], tuple[int, ...]]:
    """(data argument, dtype, shape, byte strides) of an array argument."""
    shape: tuple[int, ...] | None = None
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], _BufferBase):
        value, shape = value[0], tuple(int(d) for d in value[1])
    if isinstance(value, _BufferBase):
        value._check()
        dt = value._dtype
        if shape is None:
            shape = (value._size,)
        if math.prod(shape) != value._size:
            raise ValueError(f"shape {shape} does not hold the buffer's {value._size} elements")
        strides = []
        acc = dt.itemsize
        for d in reversed(shape):
            strides.append(acc)
            acc *= d
        return value, dt, shape, tuple(reversed(strides))
    cai = _cai_of(value)
    if cai is None:
        raise TypeError(
            f"an array argument must be a buffer, (buffer, shape) or have "
            f"__cuda_array_interface__, not {type(value).__name__}"
        )
    dt = np.dtype(cai["typestr"])
    shape = tuple(int(d) for d in cai["shape"])
    st = cai.get("strides")
    if st is None:
        acc = dt.itemsize
        rev = []
        for d in reversed(shape):
            rev.append(acc)
            acc *= d
        strides_t = tuple(reversed(rev))
    else:
        strides_t = tuple(int(s) for s in st)
    return value, dt, shape, strides_t


def _numba_arg(ty: Any, value: Any, out: list[Any]) -> None:
    from numba.core import types
    from numba.np.numpy_support import as_dtype

    if isinstance(ty, types.Array):
        data, dt, shape, strides = _array_layout(value)
        want = np.dtype(as_dtype(ty.dtype))
        if dt != want:
            raise TypeError(f"dtype {dt} does not match {want}")
        if len(shape) != ty.ndim:
            raise ValueError(f"{len(shape)}-D array for a {ty.ndim}-D parameter")
        if ty.layout == "C":
            expect = dt.itemsize
            for d, s in zip(reversed(shape), reversed(strides), strict=True):
                if d != 1 and s != expect:
                    raise ValueError("the parameter is C-contiguous; the array is not")
                expect *= d
        out += [np.uint64(0), np.uint64(0), np.int64(math.prod(shape)), np.int64(dt.itemsize)]
        out.append(data)
        out += [np.int64(d) for d in shape]
        out += [np.int64(s) for s in strides]
    elif isinstance(ty, types.CPointer):
        out.append(value if isinstance(value, _BufferBase) else np.uint64(int(value)))
    elif isinstance(ty, types.BaseTuple):
        if len(value) != len(ty):
            raise ValueError(f"a tuple of {len(ty)} values is needed, not {len(value)}")
        for t, v in zip(ty, value, strict=True):
            _numba_arg(t, v, out)
    elif isinstance(ty, types.Boolean):
        out.append(np.uint8(bool(value)))
    elif isinstance(ty, types.Complex):
        c = complex(value)
        f = np.float32 if ty.bitwidth == 64 else np.float64
        out += [f(c.real), f(c.imag)]
    elif isinstance(ty, (types.Integer, types.Float)):
        out.append(np.dtype(as_dtype(ty)).type(value))
    else:
        raise TypeError(f"numba parameter type {ty} is not supported")


def load_numba_kernel(ctx: DeviceContext, kernel: Any, signature: Any) -> NumbaKernel:
    """Compile a numba-cuda ``@cuda.jit`` kernel for ``signature`` (a numba signature
    string such as ``"void(float32, float32[::1])"``, or a tuple of numba types) and
    load it into ``ctx`` (through ``load_function``).

    numba compiles for the device's compute capability and links the kernel (with
    any ``link=`` files) into a cubin, which is loaded; the PTX is the fallback.
    Parameters: arrays (see ``NumbaKernel``), integers, floats, booleans, complex
    numbers, pointers and tuples of them. Needs ``numba-cuda``."""
    if ctx._state.api != "cuda":
        raise ValueError("numba kernels run on the CUDA device")
    try:
        from numba.core import sigutils
    except ImportError as e:
        raise ImportError(f"load_numba_kernel needs numba-cuda: {e}") from None
    import numba.cuda as nbcuda

    args, _ret = sigutils.normalize_signature(signature)
    cc = ctx.default_device_info.compute_capability
    with nbcuda.gpus[ctx.id()]:
        compiled = kernel.compile(tuple(args)) if hasattr(kernel, "compile") else kernel
        ptx = compiled.inspect_asm(cc)
        code: Any = None
        lib = getattr(compiled, "_codelibrary", None)
        if lib is not None:
            # The linked cubin also holds what numba links in (its helpers, libraries).
            try:
                code = lib.get_cubin(cc=cc)
                code = getattr(code, "code", code)
            except Exception:
                code = None
    names = _ENTRY.findall(ptx)
    entry = getattr(compiled, "entry_name", None)
    if entry is None and not names:
        raise ValueError("numba's PTX has no kernel entry point")
    name = str(entry) if entry is not None else names[0]
    fn = ctx.load_function(function_name=name, asm=code if code is not None else ptx)
    py_name = getattr(getattr(kernel, "py_func", None), "__name__", name)
    return NumbaKernel(fn, args, py_name)
