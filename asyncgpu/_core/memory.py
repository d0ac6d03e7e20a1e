"""DeviceBuffer and HostBuffer: typed, stream-owned memory.

A buffer remembers the stream that owns it (the stream it was created on, or
the one given to ``reassign_ownership_to``). Its memory goes back to the pool
on that stream, in stream order, once the buffer and every operation that used
it are gone: operations keep the buffers they use alive until they finish.

Every memory operand of a copy (buffers, NumPy arrays given as host spans,
raw pointers) is seen by the backends through the same four attributes:
``_ptr`` (address), ``_nbytes``, ``_hostbytes`` (a ``uint8`` NumPy view when
the host can touch the memory, else ``None``) and ``_kind``.
"""

from __future__ import annotations

import atexit
import contextlib
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._accel import native
from .._errors import ContextClosedError
from .._types import check_int
from .dlpack import array_interface, dlpack_device, export_dlpack, host_array
from .pool import host_work

if TYPE_CHECKING:
    from collections.abc import Generator

    from .._types import DeviceAttribute
    from .event import DeviceEvent
    from .protocols import ContextState
    from .stream import _StreamImpl

__all__ = [
    "ContextView",
    "DeviceBuffer",
    "HostBuffer",
    "as_dtype",
    "pin_allocations",
    "unpin_allocations",
]


class ContextView(Protocol):
    """A ``DeviceContext`` (the public face's, a layer above): a view of one
    context's shared state bound to a current stream, as the buffers and
    functions it made keep it and the operand checks read it."""

    @property
    def _state(self) -> ContextState: ...

    @property
    def _impl(self) -> _StreamImpl: ...

    def _check_open(self) -> None: ...

    def _view(self, impl: _StreamImpl) -> ContextView: ...

    def synchronize(self) -> None: ...

    def get_attribute(self, attr: DeviceAttribute) -> int: ...

    def enqueue_copy(
        self, dst: Any, src: Any, size: int | None = None, *, dtype: Any = None
    ) -> DeviceEvent: ...

    def enqueue_memset(self, dst: DeviceBuffer | HostBuffer, val: Any) -> DeviceEvent: ...

    def enqueue_create_host_buffer(self, dtype: Any, size: int) -> HostBuffer: ...

    def __await__(self) -> Generator[Any, None, None]: ...


_DTYPES: dict[Any, np.dtype[Any]] = {}  # dtype specifications seen, and what they are
_DTYPES_MAX = 256


def as_dtype(dtype: Any) -> np.dtype[Any]:
    """``numpy.dtype(dtype)``, with a ``TypeError`` naming the bad value. A valid
    specification by type or by name (``np.float32``, ``"f4"``) is remembered, up
    to 256 of them, so the next lookup of it is one dictionary probe (types and
    strings compare exactly; a ``np.dtype`` may carry metadata, so it is not a key)."""
    kind = type(dtype)
    if kind is type or kind is str:
        dt = _DTYPES.get(dtype)
        if dt is None:
            dt = _new_dtype(dtype)
            if len(_DTYPES) < _DTYPES_MAX:
                _DTYPES[dtype] = dt
        return dt
    return _new_dtype(dtype)


def _new_dtype(dtype: Any) -> np.dtype[Any]:
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"{dtype!r} is not a dtype NumPy knows: {e}") from None
    if dt.hasobject or dt.itemsize == 0:
        raise TypeError(f"{dt} cannot live in device memory (object or zero-size dtype)")
    if dt.subdtype is not None:
        raise TypeError(
            f"{dt} is a subarray dtype; use its element type {dt.subdtype[0]} and "
            f"{int(np.prod(dt.subdtype[1]))} times the size"
        )
    return dt


def check_size(size: Any) -> int:
    size = check_int(size, "size (a number of elements)")
    if size < 0:
        raise ValueError(f"size must not be negative, got {size}")
    return size


# The most bytes one allocation may ask for: what a signed 64-bit size (and so
# any device's address space) can count.
MAX_ALLOC_BYTES = 2**63 - 1


def alloc_bytes(dtype: np.dtype[Any], size: int) -> int:
    """The bytes of ``size`` elements of ``dtype``: ``ValueError`` for a size no
    device could allocate (more bytes than a 64-bit address space holds). A size
    that could exist but does not fit the device's memory is the backend's
    ``DeviceError`` (``CUDA_ERROR_OUT_OF_MEMORY``) at the allocation."""
    nbytes = size * dtype.itemsize
    if nbytes > MAX_ALLOC_BYTES:
        raise ValueError(
            f"{size} elements of {dtype} are {nbytes} bytes, more than any allocation can "
            f"hold ({MAX_ALLOC_BYTES} bytes)"
        )
    return nbytes


class _Span:
    """A NumPy array used as a host span (pageable memory, kept alive by the op)."""

    __slots__ = ("_array", "_dtype", "_hostbytes", "_kind", "_nbytes", "_owner", "_ptr", "_size")

    def __init__(self, array: np.ndarray, writable: bool) -> None:
        if not array.flags.c_contiguous:
            raise ValueError("a NumPy array used as a span must be C-contiguous")
        if writable and not array.flags.writeable:
            raise ValueError("the destination NumPy array is read-only")
        self._array = array
        self._dtype = array.dtype
        self._size = array.size
        self._nbytes = array.nbytes
        self._ptr = array.ctypes.data if array.nbytes else 0
        self._hostbytes = array.reshape(-1).view(np.uint8)
        self._kind = "pageable"
        self._owner: _StreamImpl | None = None


class _Pointer:
    """A raw address with a size (the pointer overloads of ``enqueue_copy``)."""

    __slots__ = ("_dtype", "_hostbytes", "_kind", "_nbytes", "_owner", "_ptr", "_size")

    def __init__(self, ptr: int, dtype: np.dtype[Any], size: int, host: Any = None) -> None:
        self._ptr = int(ptr)
        self._dtype = dtype
        self._size = size
        self._nbytes = size * dtype.itemsize
        self._hostbytes = host
        self._kind = "pointer"
        self._owner = None


# Allocations that a device graph uses, by id, with how many live graphs use each
# (the graphs hold the allocations, so an id here is never reused): their memory
# cannot be taken out of asyncgpu's hands (``take_ptr``) while a graph may
# still replay on it.
_graph_pins: dict[int, int] = {}


def pin_allocations(allocs: list[Any]) -> None:
    """Count one more graph using each of ``allocs``."""
    for a in allocs:
        _graph_pins[id(a)] = _graph_pins.get(id(a), 0) + 1


def unpin_allocations(allocs: list[Any]) -> None:
    """A graph using ``allocs`` is gone."""
    for a in allocs:
        left = _graph_pins.get(id(a), 0) - 1
        if left > 0:
            _graph_pins[id(a)] = left
        else:
            _graph_pins.pop(id(a), None)


class _BufferBase(native.BufferCore):
    """Shared behaviour of device and host buffers.

    The fields are the compiled ``BufferCore``'s: its allocation (None once it
    no longer owns memory), context, dtype, host view, owning stream, parent
    (of a sub-buffer), address, length, size in bytes and whether it owns its
    memory. The CUDA launch packs a buffer argument by reading them directly,
    ``DeviceContext.enqueue_create_buffer`` makes a buffer on memory its stream
    kept without Python, and a dropped device buffer gives its memory back to
    its stream's kept buffers without Python (everything else through
    ``_release_memory``, which ``BufferCore`` calls when it is dropped)."""

    __slots__ = ("__weakref__",)
    _alloc: Any
    _ctx: ContextView
    _dtype: np.dtype[Any]
    _hostbytes: np.ndarray | None
    _nbytes: int
    _owner: _StreamImpl
    _owns: bool
    _parent: _BufferBase | None
    _ptr: int
    _size: int
    _kind = "device"

    def __init__(
        self,
        ctx: ContextView,
        alloc: Any,
        dtype: np.dtype[Any],
        size: int,
        owner: _StreamImpl,
        *,
        offset: int = 0,
        parent: _BufferBase | None = None,
    ) -> None:
        self._ctx = ctx
        self._alloc = alloc
        self._dtype = dtype
        self._size = size
        self._nbytes = size * dtype.itemsize
        self._ptr = alloc.ptr + offset
        host = alloc.host
        self._hostbytes = host[offset : offset + self._nbytes] if host is not None else None
        self._owner = owner
        self._owns = parent is None
        self._parent = parent

    # -- facts -----------------------------------------------------------------------

    def __len__(self) -> int:
        return self._size

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def context(self) -> ContextView:
        """The context (bound to the owning stream) this buffer belongs to."""
        return self._ctx._view(self._owner)

    def unsafe_ptr(self) -> int:
        """The address of the first element (device address for device buffers)."""
        self._check()
        return self._ptr

    def __reduce__(self) -> Any:
        # Pickling is how process pools and Ray's object store carry values; a
        # buffer is memory of this process's context, meaningless in another, so
        # the refusal says what to send instead.
        if self._kind == "host":
            hint = "send its contents: h.as_numpy() (a view; pickling it copies the values)"
        else:
            hint = "copy it to the host first (ctx.enqueue_copy(array, buf), awaited)"
        raise TypeError(
            f"a {type(self).__name__} cannot be pickled (it is memory of this process's "
            f"DeviceContext): {hint}"
        )

    def _check(self) -> None:
        if self._ctx._state.closed:
            raise ContextClosedError(
                f"{type(self).__name__} of the closed context {self._ctx._state.describe()}"
            )
        if self._alloc is None:
            raise ValueError("this buffer's memory was taken with take_ptr()")

    # -- ownership -------------------------------------------------------------------

    def take_ptr(self) -> int:
        """Give up ownership: return the address; the caller must free it. The
        buffer can no longer be used. Its sub-buffers stay views of that memory,
        which is the caller's now: they are valid until the caller frees it, like
        any raw address."""
        self._check()
        if not self._owns:
            raise ValueError("take_ptr() on a sub-buffer: take the parent's pointer instead")
        if _graph_pins.get(id(self._alloc)):
            raise ValueError(
                "take_ptr(): a DeviceGraph uses this buffer's memory and may replay on it; "
                "drop the graph (and await its last replay) first"
            )
        ptr = self._ptr
        self._alloc.detach()
        self._alloc = None
        self._owns = False
        return ptr

    def reassign_ownership_to(self, ctx: ContextView) -> None:
        """Make ``ctx``'s current stream the owner: later frees and cross-stream
        copies are ordered on it. Its stream first waits for the old owner."""
        self._check()

        if not isinstance(ctx, native.ContextCore):  # (a DeviceContext)
            raise TypeError(
                "reassign_ownership_to takes a DeviceContext (for a stream: "
                f"stream.context()), not {type(ctx).__name__}"
            )
        ctx._check_open()
        new = ctx._impl
        if new.state is not self._owner.state:
            raise ValueError("a buffer can only move to a stream of the same device context")
        old = self._owner
        if new is not old:
            tail = old.tail()
            if tail is not None and not tail._done:
                new.wait_event(tail)
            self._owner = new
            self._ctx = ctx
            if self._owns:
                self._alloc.set_owner(new)

    def create_sub_buffer(self, dtype: Any, offset: int, size: int) -> Any:
        """A view of ``size`` elements of ``dtype`` starting at element ``offset``
        (counted in ``dtype`` elements). Raises ``IndexError`` outside the parent."""
        self._check()
        dt = as_dtype(dtype)
        size = check_size(size)
        offset = check_int(offset, "offset")
        start = offset * dt.itemsize
        end = start + size * dt.itemsize
        if offset < 0 or end > self._nbytes:
            raise IndexError(
                f"sub-buffer [{start}, {end}) bytes is outside the parent's {self._nbytes} bytes"
            )
        base_offset = self._ptr - self._alloc.ptr + start
        return type(self)(
            self._ctx, self._alloc, dt, size, self._owner, offset=base_offset, parent=self
        )

    # -- work on the owning stream -----------------------------------------------------

    def enqueue_copy_to(self, dst: Any) -> DeviceEvent:
        """Copy this buffer into ``dst`` on the owning stream."""
        return self.context().enqueue_copy(dst, self)

    def enqueue_copy_from(self, src: Any) -> DeviceEvent:
        """Copy ``src`` into this buffer on the owning stream."""
        return self.context().enqueue_copy(self, src)

    def enqueue_fill(self, value: Any) -> DeviceEvent:
        """Set every element to ``value`` on the owning stream."""
        return self.context().enqueue_memset(self, value)  # type: ignore[arg-type]

    # Set at interpreter exit (atexit). A class attribute, read through the
    # instance: it survives the clearing of this module's globals in the teardown.
    _exiting = False

    def _release_memory(self) -> None:
        """The buffer is being dropped: give its memory back, if it owns any."""
        alloc = self._alloc
        if not self._owns or alloc is None or self._exiting:
            # (At interpreter exit nothing is given back: the end of the process
            # frees the memory, and the streams and pools a release would go
            # through may be gone. The allocation, dropped with the buffer, decides
            # what its own teardown may safely do.)
            return
        with contextlib.suppress(Exception):  # a finalizer has nobody to raise to
            alloc.release(self._owner)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self._dtype}[{self._size}] on {self._owner.label}"
            f" at 0x{self._ptr:x}>"
        )

    def __str__(self) -> str:
        """MAX's form, the values: ``HostBuffer([0, 1, 2])``; a buffer longer than
        NumPy's print threshold shows its first and last ``edgeitems`` values with
        ``...`` between (``np.set_printoptions``)."""
        return f"{type(self).__name__}({_format_values(self._values_to_print())})"

    def _values_to_print(self) -> np.ndarray:
        raise NotImplementedError


def _format_values(a: np.ndarray) -> str:
    """``[v0, v1, ...]`` with each value as NumPy prints the scalar (``1.0``, ``7``),
    summarized in the middle as NumPy summarizes a long array."""
    opts = np.get_printoptions()
    if a.size > opts["threshold"]:
        e = opts["edgeitems"]
        items = [*map(str, a[:e]), "...", *map(str, a[a.size - e :])]
    else:
        items = [str(v) for v in a]
    return "[" + ", ".join(items) + "]"


@atexit.register
def _at_exit() -> None:
    _BufferBase._exiting = True
    native.set_exiting(True)


class DeviceBuffer(_BufferBase):
    """Memory in the device's global memory (host memory on the CPU device).

    ``str(buf)`` shows the values, as MAX prints a buffer: it waits for the owning
    stream's work so far (blocking, as ``synchronize()`` does), then copies the
    contents to the host to print them. Called from a CPU function running on the
    owning stream, it does not wait (that stream's earlier work has finished, and
    a wait would be for the CPU function itself): it reads the memory as it is.
    ``repr(buf)`` describes the buffer without touching its memory."""

    __slots__ = ()
    _kind = "device"

    def _values_to_print(self) -> np.ndarray:
        self._check()
        if host_work.stream is not self._owner:
            self.context().synchronize()
        if self._hostbytes is not None:
            return self._hostbytes.view(self._dtype)
        return self._ctx._state.backend.read_device(self._ptr, self._nbytes).view(self._dtype)

    def map_to_host(self) -> _HostMapping:
        """Map the buffer's contents to the host: ``with buf.map_to_host() as h``
        (blocking) or ``async with`` (awaits instead). On entry the contents are
        copied to host memory once the owning stream reaches this point; on exit
        the host's changes are copied back."""
        self._check()
        return _HostMapping(self)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Refused, as CuPy refuses it: device memory is not a NumPy array, and
        without this NumPy would make a 0-d object array of the buffer."""
        raise TypeError(
            "a DeviceBuffer is not a NumPy array: copy it to the host first "
            "(ctx.enqueue_copy(array_or_host_buffer, buf)), or read it through "
            "buf.map_to_host()"
        )

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3 (CUDA device only). ``stream`` is the owning
        stream, so consumers order their work after ours. If that stream holds
        work behind CPU work, this blocks until that work has been handed to the
        driver, so that what the consumer orders after ``stream`` includes it."""
        self._check()
        state = self._ctx._state
        if state.api != "cuda":
            raise AttributeError("__cuda_array_interface__ exists only on CUDA device buffers")
        self._owner._settle()
        return {
            "shape": (self._size,),
            "typestr": self._dtype.str,
            "data": (self._ptr, False),
            "version": 3,
            "strides": None,
            "stream": self._owner.handle() or None,
        }

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """DLPack export, no copy: ``torch.from_dlpack(buf)``, ``cupy.from_dlpack(buf)``
        (CUDA), ``np.from_dlpack(buf)`` (CPU device). On CUDA the consumer's
        ``stream`` waits on the device for the owning stream's work so far; on the
        CPU device the memory is host memory: await the writes first. The capsule
        keeps the buffer alive."""
        return export_dlpack(self, stream, max_version, dl_device, copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(2, device_id)`` (kDLCUDA) on CUDA, ``(1, 0)`` (kDLCPU) on the CPU device."""
        return dlpack_device(self)


class HostBuffer(_BufferBase):
    """Page-locked host memory the device can reach (plain memory on the CPU
    device). Indexing, ``as_numpy()`` and ``str(h)`` (MAX's form, the values:
    ``HostBuffer([0, 1, 2])``) touch the memory directly: await the operations
    that write it first."""

    __slots__ = ()
    _kind = "host"

    def _values_to_print(self) -> np.ndarray:
        self._check()
        return host_array(self)

    def as_numpy(self) -> np.ndarray:
        """A NumPy view of the buffer (no copy) that keeps the buffer, and so its
        memory, alive for as long as the view exists."""
        self._check()
        return host_array(self)

    def __getitem__(self, index: Any) -> Any:
        return self.as_numpy()[index]

    def __setitem__(self, index: Any, value: Any) -> None:
        self.as_numpy()[index] = value

    def __buffer__(self, flags: int) -> memoryview:
        """The buffer protocol (Python 3.12+: ``memoryview(h)``, ``bytes(h)``); the
        view keeps the buffer alive."""
        self._check()
        return memoryview(host_array(self))  # type: ignore[arg-type]

    @property
    def __array_interface__(self) -> dict[str, Any]:
        """NumPy's array interface: ``np.asarray(h)`` is a view (no copy) whose base
        is the buffer, so the buffer lives as long as the view."""
        self._check()
        return array_interface(self)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self._check()
        a = host_array(self)
        if dtype is not None and np.dtype(dtype) != a.dtype:
            if copy is False:
                raise ValueError(f"viewing {a.dtype} as {np.dtype(dtype)} needs a copy")
            return a.astype(dtype)
        return a.copy() if copy else a

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """DLPack export as host memory (kDLCPU), no copy: ``np.from_dlpack(h)``,
        ``torch.from_dlpack(h)``. Like ``as_numpy()``, it does not wait: await the
        operations that write the buffer first. The capsule keeps the buffer alive."""
        return export_dlpack(self, stream, max_version, dl_device, copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(1, 0)``: kDLCPU (page-locked host memory on CUDA)."""
        return (1, 0)

    def map_to_host(self) -> _HostMapping:
        """Host buffers are host memory already: yields the buffer itself once the
        owning stream has reached this point."""
        self._check()
        return _HostMapping(self)


class _HostMapping:
    """``with`` / ``async with`` face of ``map_to_host``."""

    def __init__(self, buf: _BufferBase) -> None:
        self._buf = buf
        self._host: HostBuffer | None = None

    def _direct(self) -> bool:
        return isinstance(self._buf, HostBuffer) or self._buf._hostbytes is not None

    def _view(self) -> HostBuffer:
        buf = self._buf
        if isinstance(buf, HostBuffer):
            return buf
        # Device memory the host can address (the CPU device): a host view of it.
        return HostBuffer(
            buf._ctx,
            buf._alloc,
            buf._dtype,
            buf._size,
            buf._owner,
            offset=buf._ptr - buf._alloc.ptr,
            parent=buf,
        )

    def __enter__(self) -> HostBuffer:
        buf = self._buf
        buf._check()
        ctx = buf.context()
        if self._direct():
            ctx.synchronize()
            return self._view()
        self._host = ctx.enqueue_create_host_buffer(buf._dtype, buf._size)
        ctx.enqueue_copy(self._host, buf).synchronize()
        return self._host

    def __exit__(self, *exc: Any) -> None:
        if self._host is not None:
            self._buf.context().enqueue_copy(self._buf, self._host).synchronize()
            self._host = None

    async def __aenter__(self) -> HostBuffer:
        buf = self._buf
        buf._check()
        ctx = buf.context()
        if self._direct():
            await ctx
            return self._view()
        self._host = ctx.enqueue_create_host_buffer(buf._dtype, buf._size)
        await ctx.enqueue_copy(self._host, buf)
        return self._host

    async def __aexit__(self, *exc: Any) -> None:
        if self._host is not None:
            await self._buf.context().enqueue_copy(self._buf, self._host)
            self._host = None
