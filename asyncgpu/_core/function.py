"""Kernels and compiled functions.

A ``Kernel`` may carry a CUDA C++ source (for the CUDA device) and a NumPy body
(for the CPU device), so one program runs unchanged on either device.
``compile_function`` turns it into a ``DeviceFunction`` for one context.

The NumPy body is called once per thread block, with a ``ThreadBlock`` that
holds the launch geometry and the block's thread indices as NumPy arrays,
followed by the launch arguments (device and host buffers arrive as NumPy views
of their memory)::

    def axpy_cpu(b: ThreadBlock, a, x, y, n):
        i = b.global_idx.x
        i = i[i < n]
        y[i] += a * x[i]
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import FunctionType
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .._accel import native
from .._types import DeviceAttribute, Dim, check_int

if TYPE_CHECKING:
    from .memory import ContextView

__all__ = [
    "DeviceExternalFunction",
    "DeviceFunction",
    "Kernel",
    "ThreadBlock",
    "check_scalar_sizes",
    "kernel",
    "kernel_arg_kind",
    "refuse_coroutine_function",
]


def reject_python_scalar(n: int, a: Any) -> None:
    """Kernel arguments need an explicit C type: a Python int, float, bool or
    complex raises ``TypeError`` (on every device alike)."""
    if type(a) in (int, float, bool, complex):
        raise TypeError(
            f"kernel argument {n} ({a!r}) is a Python {type(a).__name__}; give it a NumPy "
            "type (e.g. np.int32(n), np.float32(x)) so its C type is explicit"
        )


def reject_unpassable_scalar(n: int, a: Any) -> None:
    """A NumPy scalar with no C parameter type (a string, bytes, datetime, timedelta
    or object scalar, a structure holding objects, a subarray) raises
    ``TypeError`` (on every device alike). A structured scalar (``np.void``) is a
    C struct, passed by value."""
    if isinstance(a, np.generic):
        dt = a.dtype
        if dt.kind in "OSUMm" or dt.hasobject or dt.subdtype is not None or dt.itemsize == 0:
            raise TypeError(
                f"kernel argument {n} ({type(a).__name__}, dtype {dt}) has no C parameter "
                "type: give a number, a structured scalar (np.void) or a buffer"
            )


# The NumPy scalars a kernel parameter can take, by kind: the sizes CUDA passes
# (a structured scalar, kind "V", is a C struct of any size).
PASSABLE_SCALARS = {"i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8), "b": (1,), "c": (8, 16)}
# What ``kernel_arg_kind`` tells a device about an argument.
ARG_BUFFER, ARG_SCALAR, ARG_FOREIGN, ARG_CUDA_CORE = range(4)


def kernel_arg_kind(n: int, a: Any) -> int:
    """Check kernel argument ``n`` by the rule every device applies, and say what
    it is: a buffer (``ARG_BUFFER``), a NumPy scalar with a C parameter type
    (``ARG_SCALAR``), another library's device array with
    ``__cuda_array_interface__`` (``ARG_FOREIGN``) or a cuda.core object
    (``ARG_CUDA_CORE``). Anything else raises ``TypeError`` naming the argument's
    index and type: a Python scalar, a NumPy scalar CUDA cannot pass, a NumPy
    array in pageable memory, ``str``, ``None``, a list, a dict, any other
    object. A program checked on one device is so checked on the other."""
    if isinstance(a, native.BufferCore):  # (a DeviceBuffer or HostBuffer)
        return ARG_BUFFER
    if isinstance(a, np.generic):
        reject_unpassable_scalar(n, a)
        kind = a.dtype.kind
        if kind != "V" and a.dtype.itemsize not in PASSABLE_SCALARS.get(kind, ()):
            raise TypeError(
                f"kernel argument {n} ({type(a).__name__}) has no CUDA parameter type: give "
                "an integer, float16/32/64, bool, complex64/128 or structured scalar"
            )
        return ARG_SCALAR
    reject_python_scalar(n, a)
    if isinstance(a, np.ndarray):
        raise TypeError(
            f"kernel argument {n} is a NumPy array in pageable host memory; copy it "
            "into a DeviceBuffer or HostBuffer first"
        )
    if getattr(a, "__cuda_array_interface__", None) is not None:
        return ARG_FOREIGN
    t = type(a)
    if hasattr(a, "handle") and t.__module__.startswith("cuda.core"):
        return ARG_CUDA_CORE
    raise TypeError(
        f"kernel argument {n} of type {t.__name__} is not supported: give a DeviceBuffer, "
        "a HostBuffer, a NumPy scalar or a device array (__cuda_array_interface__)"
    )


def check_scalar_sizes(name: str, args: tuple[Any, ...], want: tuple[int, ...]) -> None:
    """``TypeError`` unless ``args`` match a kernel's declared parameter sizes in
    bytes (``want``): their count, and each NumPy scalar's size (a buffer or a
    device array is an 8-byte address)."""
    if len(args) != len(want):
        raise TypeError(f"kernel {name} takes {len(want)} arguments, {len(args)} given")
    for n, (a, w) in enumerate(zip(args, want, strict=True)):
        got = a.dtype.itemsize if isinstance(a, np.generic) else 8
        if got != w:
            raise TypeError(
                f"kernel {name} argument {n} is {w} bytes, but {type(a).__name__} is {got} bytes"
            )


class Kernel:
    """A kernel with a CUDA C++ source, a NumPy body, or both.

    ``name`` is the ``extern "C"`` entry point in ``cuda``; ``cpu`` is called per
    thread block on the CPU device (see ``ThreadBlock``).
    """

    __slots__ = ("compile_options", "cpu", "cuda", "name")

    def __init__(
        self,
        name: str,
        *,
        cuda: str | None = None,
        cpu: Callable[..., Any] | None = None,
        compile_options: str | tuple[str, ...] = (),
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError("a Kernel needs a non-empty name")
        if cuda is None and cpu is None:
            raise ValueError("a Kernel needs a CUDA source, a CPU body, or both")
        if cpu is not None and not callable(cpu):
            raise TypeError("the CPU body of a Kernel must be callable")
        if cpu is not None:
            refuse_coroutine_function(cpu, "a Kernel's CPU body")
        self.name = name
        self.cuda = cuda
        self.cpu = cpu
        self.compile_options = compile_options

    def __repr__(self) -> str:
        parts = [p for p, v in (("cuda", self.cuda), ("cpu", self.cpu)) if v is not None]
        return f"<Kernel {self.name} ({', '.join(parts)})>"


def kernel(
    *, cuda: str | None = None, name: str | None = None, compile_options: str = ""
) -> Callable[[Callable[..., Any]], Kernel]:
    """Decorator: the decorated function is the NumPy body, ``cuda`` the CUDA C++
    source whose entry point is ``name`` (default: the function's name)."""

    def wrap(fn: Callable[..., Any]) -> Kernel:
        return Kernel(name or fn.__name__, cuda=cuda, cpu=fn, compile_options=compile_options)

    return wrap


class Idx3(NamedTuple):
    """Per-thread indices of a block: three arrays of one entry per thread."""

    x: np.ndarray
    y: np.ndarray
    z: np.ndarray


class ThreadBlock:
    """The launch geometry seen by one thread block of a CPU kernel.

    ``thread_idx`` and ``global_idx`` hold one entry per thread of the block, with
    ``x`` varying fastest (CUDA's linear thread order). ``shared`` is the block's
    dynamic shared memory (``shared_mem_bytes`` bytes, zeroed per block).
    """

    __slots__ = ("block_dim", "block_idx", "global_idx", "grid_dim", "shared", "thread_idx")

    def __init__(
        self, grid_dim: Dim, block_dim: Dim, block_idx: Dim, thread_idx: Idx3, shmem: int
    ) -> None:
        self.grid_dim = grid_dim
        self.block_dim = block_dim
        self.block_idx = block_idx
        self.thread_idx = thread_idx
        self.global_idx = Idx3(
            block_idx.x * block_dim.x + thread_idx.x,
            block_idx.y * block_dim.y + thread_idx.y,
            block_idx.z * block_dim.z + thread_idx.z,
        )
        self.shared = np.zeros(shmem, np.uint8)

    @staticmethod
    def thread_indices(block: Dim) -> Idx3:
        n = np.arange(block.size(), dtype=np.int64)
        return Idx3(n % block.x, (n // block.x) % block.y, n // (block.x * block.y))


class DeviceFunction(native.FunctionCore):
    """A function compiled for one device context.

    Its context, its backend's function and its validated launch configurations
    (``_ctx``, ``_impl``, ``_cfgs``) are fields of the compiled ``FunctionCore``,
    which the C ``enqueue_function`` reads directly.

    ``asm`` holds the PTX when compiled with ``dump_asm`` (CUDA), ``sass`` the
    disassembly when the tools for it exist, ``log`` the compiler's log.
    """

    __slots__ = ("__weakref__", "asm", "log", "name", "sass")

    def __init__(
        self,
        ctx: ContextView,
        name: str,
        impl: Any,
        *,
        asm: str | None = None,
        sass: str | None = None,
        log: str = "",
    ) -> None:
        self._ctx = ctx
        self.name = name
        self._impl = impl
        self._cfgs: dict[Any, Any] = {}  # launch geometry, validated once per shape
        self.asm = asm
        self.sass = sass
        self.log = log

    def context(self) -> ContextView:
        return self._ctx

    def get_attribute(self, attr: int) -> int:
        """A ``CUfunction_attribute`` of the function (``cuFuncGetAttribute``): for
        example 0 max threads per block, 1 static shared bytes, 4 registers."""
        self._ctx._check_open()
        return self._ctx._state.backend.function_attribute(self, int(attr))

    def occupancy(self, block_size: int, shared_mem_bytes: int = 0) -> int:
        """Most blocks of ``block_size`` threads that can be resident on one
        multiprocessor (``cuOccupancyMaxActiveBlocksPerMultiprocessor``).
        ``block_size`` is from 1 to the device's most threads per block;
        ``shared_mem_bytes`` is not negative (``ValueError``)."""
        self._ctx._check_open()
        block_size = check_int(block_size, "block_size")
        shared_mem_bytes = check_int(shared_mem_bytes, "shared_mem_bytes")
        limit = self._ctx.get_attribute(DeviceAttribute.MAX_THREADS_PER_BLOCK)
        if not 1 <= block_size <= limit:
            raise ValueError(f"block_size {block_size} is outside 1..{limit}")
        if shared_mem_bytes < 0:
            raise ValueError(f"shared_mem_bytes must not be negative, got {shared_mem_bytes}")
        return self._ctx._state.backend.function_occupancy(self, block_size, shared_mem_bytes)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self._ctx._state.describe()}>"


class DeviceExternalFunction(DeviceFunction):
    """A function loaded from PTX or a cubin (``load_function``)."""

    __slots__ = ()


def refuse_coroutine_function(func: Any, what: str) -> None:
    """CPU work runs on pool threads, with no event loop: an ``async def``
    function would only make a coroutine that nobody runs. (A plain function's
    own ``__call__`` is never async: asking about it, as about other callable
    objects', would cost every ``enqueue_cpu_function`` a second
    ``inspect.iscoroutinefunction``.)"""
    if inspect.iscoroutinefunction(func) or (
        type(func) is not FunctionType
        and inspect.iscoroutinefunction(
            getattr(func, "__call__", None)  # noqa: B004 (an object whose __call__ is async)
        )
    ):
        raise TypeError(
            f"{what} runs plain functions on the CPU pool; {func!r} is an async function "
            "(await it in a task instead)"
        )
