"""Operation checks: what an ``enqueue_*`` call verifies before it reaches a
stream, written once for every device.

``copy_operands`` is on the copy's hot path: for buffers it checks inline (no
call per operand), so that ``enqueue_copy`` reaches the stream's ``copy`` in
two Python calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._errors import ContextClosedError
from .foreign import operand as foreign_operand
from .memory import (
    ContextView,
    DeviceBuffer,
    HostBuffer,
    _BufferBase,
    _Pointer,
    _Span,
    as_dtype,
    check_size,
)

__all__ = ["check_kernel_buffer", "check_writable", "copy_operands"]

_BUFFER_TYPES = (DeviceBuffer, HostBuffer)


def check_writable(buf: _BufferBase) -> None:
    """``ValueError`` for a buffer that wraps another library's read-only memory."""
    if getattr(buf._alloc, "readonly", False):
        raise ValueError(
            f"this {type(buf).__name__} wraps read-only memory (exported read-only by its "
            "owner); it cannot be written"
        )


def check_kernel_buffer(state: Any, buf: _BufferBase, what: str) -> None:
    """A buffer that a kernel or memset of ``state``'s context uses in place
    (``what`` names the use in the error): usable (``ContextClosedError`` for a
    buffer of a closed context, ``ValueError`` for memory taken with
    ``take_ptr()``), and of ``state``'s context or of one whose memory its
    device addresses (``backend.reaches``: another context of the same device,
    whose memory it is; another device of the same API once peer access is
    enabled, as MAX asks too). Any other is a ``ValueError`` naming both
    contexts: the device would read memory it cannot address (a CPU context's
    pageable memory in a CUDA kernel, a CUDA buffer in a CPU kernel's NumPy
    body), where a copy, which does move data between devices, is what works.
    Callers test the common case first (the buffer is of ``state``'s open
    context and owns its memory) and call this only otherwise."""
    buf._check()
    bstate = buf._ctx._state
    if bstate is state:
        return
    if bstate.api == state.api:
        if state.backend.reaches(bstate.backend):
            return
        hint = (
            f"enable peer access first (a {state.describe()} context's "
            "enable_peer_access(peer)), or copy it with enqueue_copy"
        )
    else:
        hint = "copy its data into a buffer of this context with enqueue_copy"
    raise ValueError(
        f"{what}: a {type(buf).__name__} of the {bstate.describe()} context cannot be "
        f"used by the {state.describe()} context, whose device does not address its "
        f"memory; {hint}"
    )


def copy_operands(
    ctx: ContextView, dst: Any, src: Any, size: int | None, dtype: Any
) -> tuple[Any, Any, int]:
    """The operands of ``ctx.enqueue_copy(dst, src, size, dtype=dtype)`` as the
    streams take them (buffers, ``_Span`` for NumPy arrays, ``_Pointer`` for
    addresses) and the bytes to copy. Raises the call's precise error for
    anything else: operands of another device, closed contexts, taken or
    read-only memory, dtype and size mismatches, overlapping ranges."""
    state = ctx._state
    if type(dst) in _BUFFER_TYPES and type(src) in _BUFFER_TYPES:
        # Two buffers (the common case), checked inline.
        d, s = dst, src
        crossing = False
        for b in (dst, src):
            bstate = b._ctx._state
            if bstate.closed:
                raise ContextClosedError(
                    f"{type(b).__name__} of the closed context {bstate.describe()}"
                )
            if b._alloc is None:
                raise ValueError("this buffer's memory was taken with take_ptr()")
            if bstate is not state and bstate.api != state.api:
                crossing = True
        if crossing:
            d, s = _crossing_operands(state, dst, src)
        if getattr(dst._alloc, "readonly", False):
            check_writable(dst)
        if size is not None:
            raise TypeError("size is only given with raw addresses")
        if d._dtype != s._dtype:
            raise TypeError(f"dtype mismatch: copying {s._dtype} into {d._dtype}")
        if dtype is not None and as_dtype(dtype) != d._dtype:
            raise TypeError(f"dtype={as_dtype(dtype)} does not match the operands' {d._dtype}")
        # The destination's size is copied (the reference's rule); a source with
        # fewer elements is refused rather than read past its end.
        if s._size < d._size:
            raise ValueError(
                f"the source buffer has {s._size} elements; the destination buffer needs {d._size}"
            )
        nbytes = d._nbytes
    else:
        d, s, nbytes = _general_operands(ctx, dst, src, size, dtype)
    dp, sp = d._ptr, s._ptr
    if nbytes and dp != sp and dp < sp + nbytes and sp < dp + nbytes:
        # cuMemcpy has no overlap rule (and the CPU device copies large ranges
        # in parallel pieces): refused on every device, never a wrong result.
        raise ValueError(
            f"the copy's source and destination overlap ({nbytes} bytes at "
            f"{sp:#x} and {dp:#x}); copy through a separate buffer"
        )
    return d, s, nbytes


def _general_operands(
    ctx: ContextView, dst: Any, src: Any, size: int | None, dtype: Any
) -> tuple[Any, Any, int]:
    """``copy_operands`` for everything but two buffers: NumPy arrays, other
    libraries' arrays, raw addresses."""
    d_ptr = isinstance(dst, (int, np.integer)) and not isinstance(dst, bool)
    s_ptr = isinstance(src, (int, np.integer)) and not isinstance(src, bool)
    if d_ptr or s_ptr:
        d, s, nbytes = _pointer_operands(ctx, dst, src, d_ptr, s_ptr, size, dtype)
    else:
        if size is not None:
            raise TypeError("size is only given with raw addresses")
        d = _operand(ctx, dst, True)
        s = _operand(ctx, src, False)
        if d._dtype != s._dtype:
            raise TypeError(f"dtype mismatch: copying {s._dtype} into {d._dtype}")
        if dtype is not None and as_dtype(dtype) != d._dtype:
            raise TypeError(f"dtype={as_dtype(dtype)} does not match the operands' {d._dtype}")
        d_buf = isinstance(d, _BufferBase)
        s_buf = isinstance(s, _BufferBase)
        if d_buf and s_buf:
            # The destination's size is copied (the reference's rule); a source
            # with fewer elements is refused rather than read past its end.
            if s._size < d._size:
                raise ValueError(
                    f"the source buffer has {s._size} elements; the destination buffer "
                    f"needs {d._size}"
                )
            nbytes = d._nbytes
        elif d_buf:
            if s._size < d._size:
                raise ValueError(
                    f"the source array has {s._size} elements; the destination buffer "
                    f"needs {d._size}"
                )
            nbytes = d._nbytes
        elif s_buf:
            if d._size < s._size:
                raise ValueError(
                    f"the destination array has {d._size} elements; the source buffer "
                    f"holds {s._size}"
                )
            nbytes = s._nbytes
        else:
            raise TypeError("enqueue_copy needs a buffer on at least one side")
    return d, s, nbytes


def _operand(ctx: ContextView, obj: Any, writable: bool) -> Any:
    if isinstance(obj, _BufferBase):
        obj._check()
        if writable:
            check_writable(obj)
        ostate = obj._ctx._state
        if ostate is not ctx._state and ostate.api != ctx._state.api:
            return _host_operand(ctx._state, obj)
        return obj
    if isinstance(obj, np.ndarray):
        return _Span(obj, writable)
    t = type(obj)
    if hasattr(t, "__cuda_array_interface__") or hasattr(t, "__dlpack__"):
        # Another library's array (CuPy, PyTorch, numba, JAX...): wrapped in place.
        return foreign_operand(ctx, obj, writable)
    raise TypeError(
        "a copy operand must be a DeviceBuffer, a HostBuffer, a NumPy array, an array "
        "with __cuda_array_interface__ or __dlpack__, or (with a size) an int address, "
        f"not {type(obj).__name__}"
    )


def _crossing_operands(state: Any, dst: _BufferBase, src: _BufferBase) -> tuple[Any, Any]:
    """Two buffers of which one or both belong to another device's context
    (``_host_operand``): at most one may, since a copy between two host
    buffers belongs on their own context."""

    def foreign(b: _BufferBase) -> bool:
        bstate = b._ctx._state
        return bstate is not state and bstate.api != state.api

    if foreign(dst) and foreign(src):
        raise ValueError(
            f"both buffers belong to the {dst._ctx._state.describe()} context: copy "
            "them there, not on another device's context"
        )
    if foreign(dst):
        return _host_operand(state, dst), src
    return dst, _host_operand(state, src)


def _host_operand(state: Any, buf: _BufferBase) -> _Span:
    """A buffer of another device's context used by ``state``'s context: allowed
    where that device's buffers are all host memory (the CPU device's, device and
    host buffers alike, as in MAX), which the copy then takes as pageable host
    memory, ordered with the buffer's owning stream as a buffer of the context's
    own is (the copy waits for the owner's earlier work on it; the owner's later
    work waits for the copy). The copy's event keeps the buffer alive. Any other
    mix of devices is a ``ValueError``."""
    bstate = buf._ctx._state
    if not bstate.backend.memory_is_host or buf._hostbytes is None:
        raise ValueError(
            f"a buffer of the {bstate.describe()} context cannot be used by the "
            f"{state.describe()} context (only buffers of a context whose memory is "
            "host memory, such as the CPU device's, can)"
        )
    span = _Span(buf._hostbytes.view(buf._dtype), False)
    span._owner = buf._owner
    return span


def _pointer_operands(
    ctx: ContextView, dst: Any, src: Any, d_ptr: bool, s_ptr: bool, size: int | None, dtype: Any
) -> tuple[Any, Any, int]:
    backend = ctx._state.backend
    if d_ptr and s_ptr:
        if size is None or dtype is None:
            raise TypeError("copying between two addresses needs size= and dtype=")
        dt = as_dtype(dtype)
        n = check_size(size)
    else:
        if size is not None:
            raise TypeError("with a buffer operand the buffer's length is copied; omit size")
        buf = _operand(ctx, src if d_ptr else dst, not d_ptr)
        if not isinstance(buf, _BufferBase):
            raise TypeError("an address is copied to or from a buffer, not a NumPy array")
        dt = buf._dtype
        n = buf._size
        if dtype is not None and as_dtype(dtype) != dt:
            raise TypeError(f"dtype {as_dtype(dtype)} does not match the buffer's {dt}")
    nbytes = n * dt.itemsize

    def ptr(p: Any) -> _Pointer:
        p = int(p)
        if p == 0 and nbytes:
            raise ValueError("null address")
        if not 0 <= p < 1 << 64:
            raise ValueError(f"{p} is not an address (outside 0..2**64-1)")
        return _Pointer(p, dt, n, backend.pointer_host_view(p, nbytes))

    d = ptr(dst) if d_ptr else buf
    s = ptr(src) if s_ptr else buf
    return d, s, nbytes
