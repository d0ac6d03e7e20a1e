"""Other libraries' arrays as asyncgpu operands: memory reached through
``__cuda_array_interface__`` or DLPack is wrapped, never copied, in a buffer
that keeps the foreign owner alive and frees nothing, and is ordered after the
producer's stream where that stream is known.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .dlpack import (
    _LEGACY_STREAM,
    _call_dlpack,
    _consume_capsule,
    _flat_size,
    _ForeignAlloc,
    kDLCPU,
    kDLCUDA,
    kDLCUDAHost,
    kDLCUDAManaged,
)
from .event import DeviceEvent
from .memory import ContextView, DeviceBuffer, HostBuffer, _BufferBase, _Span
from .stream import _StreamImpl

__all__ = ["launch_done", "launch_streams", "operand", "wrap_cai", "wrap_dlpack"]


def _fence(impl: _StreamImpl) -> DeviceEvent:
    """An operation that does nothing on ``impl`` (``_StreamImpl.fence``)."""
    return impl.fence()


def _normalize_stream(handle: Any) -> int | None:
    if handle is None:
        return None
    h = int(handle)
    return _LEGACY_STREAM if h == 0 else h


def producer_stream(obj: Any, cai: dict[str, Any] | None = None) -> int | None:
    """The ``CUstream`` on which the library that made ``obj`` orders its work, when
    it can be known: a PyTorch CUDA tensor's device's current stream, else the
    ``stream`` of its CUDA Array Interface (v3). None: unknown."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            return _normalize_stream(torch.cuda.current_stream(obj.device).cuda_stream)
        return None
    if cai is not None:
        return _normalize_stream(cai.get("stream"))
    return None


def _after_producer(impl: _StreamImpl, producer: int | None) -> bool:
    """Make ``impl`` wait, on the device, for what the producer's stream has
    submitted so far. False when there is nothing to order (unknown producer, or
    ``impl`` itself)."""
    if producer is None or producer == impl.handle():
        return False
    impl.wait_for_handle(producer)
    return True


class _ForeignOwner:
    """The owning "stream" of a copy operand over another library's memory whose
    stream is known. ``ContextView._copy`` orders a copy with the owners of its
    operands: it waits for their ``tail()`` (None here: ``operand`` has already made
    the copy's stream wait for the producer's) and then calls ``wait_event(copy)``,
    which makes the producer's stream wait for the copy, so the producer's later
    work sees it. Only driver calls: no asyncgpu state is kept for foreign streams,
    so one destroyed later leaves nothing behind."""

    __slots__ = ("_handle", "label", "state")

    def __init__(self, state: Any, handle: int) -> None:
        self.state = state
        self._handle = handle
        self.label = f"foreign stream 0x{handle:x}"

    def tail(self) -> None:
        return None

    def handle(self) -> int:
        return self._handle

    def wait_event(self, ev: DeviceEvent) -> DeviceEvent:
        stream = ev._stream
        if stream is not None and not ev._done:
            stream.order_handle_after(self._handle)
        return ev

    def _settle(self) -> None:
        pass  # another library's stream: asyncgpu holds nothing back on it

    def order_handle_after(self, waiter: int, settle: bool = True) -> None:
        self.state.backend.stream_waits_for_stream(waiter, self._handle)


# -- importing ---------------------------------------------------------------------------


def _cai_of(obj: Any) -> dict[str, Any] | None:
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        return None
    if not isinstance(cai, dict):
        raise TypeError(f"{type(obj).__name__}.__cuda_array_interface__ is not a dict")
    return cai


def _parse_cai(cai: dict[str, Any]) -> tuple[int, np.dtype[Any], int, bool]:
    """(address, dtype, element count, read-only) of a C-contiguous CUDA Array
    Interface (versions 0-3)."""
    if cai.get("mask") is not None:
        raise ValueError("arrays with a __cuda_array_interface__ mask cannot be wrapped")
    try:
        dtype = np.dtype(cai["typestr"])
        shape = tuple(int(d) for d in cai["shape"])
        ptr, readonly = cai["data"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed __cuda_array_interface__: {e}") from None
    strides = cai.get("strides")
    elems = None
    if strides is not None:
        if any(int(s) % dtype.itemsize for s in strides):
            raise ValueError("strides that are not whole elements cannot be wrapped")
        elems = [int(s) // dtype.itemsize for s in strides]
    n = _flat_size(shape, elems, dtype.itemsize)
    return int(ptr or 0), dtype, n, bool(readonly)


def _check_cuda_ctx(ctx: ContextView, device_id: int | None, what: str) -> None:
    if ctx._state.api != "cuda":
        raise ValueError(
            f"{what} is CUDA device memory; the {ctx._state.describe()} context cannot use it"
        )
    if device_id is not None and device_id != ctx._state.device_id:
        raise ValueError(
            f"{what} is memory of CUDA device {device_id}; the context is device "
            f"{ctx._state.device_id}"
        )


def _wrap(
    ctx: ContextView,
    cls: type[_BufferBase],
    alloc: _ForeignAlloc,
    dtype: np.dtype[Any],
    n: int,
    owner: _StreamImpl,
) -> Any:
    return cls(ctx, alloc, dtype, n, owner)


def _host_alloc(array: np.ndarray, owner: Any = None) -> tuple[_ForeignAlloc, np.dtype[Any], int]:
    if not array.flags.c_contiguous:
        raise ValueError("only C-contiguous arrays can be wrapped")
    flat = array.reshape(-1)
    ptr = flat.ctypes.data if flat.nbytes else 0
    alloc = _ForeignAlloc(
        ptr, array if owner is None else owner, flat.view(np.uint8), not array.flags.writeable
    )
    return alloc, array.dtype, flat.size


def _wrap_host_array(ctx: ContextView, array: np.ndarray, owner: Any = None) -> Any:
    """Host memory as a buffer: a DeviceBuffer on the CPU device (whose device
    memory is host memory), a HostBuffer on a CUDA context (pinned memory only)."""
    alloc, dtype, n = _host_alloc(array, owner)
    if ctx._state.api == "cpu":
        return _wrap(ctx, DeviceBuffer, alloc, dtype, n, ctx._impl)
    ctx._state.backend.make_current()
    if n and not ctx._state.backend.is_pinned(alloc.ptr):
        raise ValueError(
            "pageable host memory cannot be a buffer of a CUDA context; pass it to "
            "enqueue_copy as a NumPy array (np.from_dlpack(obj)), or pin it"
        )
    return _wrap(ctx, HostBuffer, alloc, dtype, n, ctx._impl)


def wrap_dlpack(obj: Any, ctx: ContextView) -> DeviceBuffer | HostBuffer:
    """``from_dlpack(obj, ctx)`` for an open ``ctx`` (see its docstring)."""
    dev_type, dev_id = (int(v) for v in obj.__dlpack_device__())
    if dev_type in (kDLCPU, kDLCUDAHost):
        # Host memory: NumPy consumes the capsule (and keeps it alive as the array's
        # base); the array is then wrapped.
        return _wrap_host_array(ctx, np.from_dlpack(obj))
    if dev_type not in (kDLCUDA, kDLCUDAManaged):
        raise BufferError(f"DLPack device type {dev_type} is not supported")
    _check_cuda_ctx(ctx, dev_id if dev_type == kDLCUDA else None, type(obj).__name__)
    impl = ctx._impl
    capsule = _call_dlpack(obj, impl.handle())
    ptr, dtype, n, device, owner, readonly = _consume_capsule(capsule)
    if device[0] != dev_type:
        raise BufferError(
            f"__dlpack__ returned a tensor on device type {device[0]}, "
            f"__dlpack_device__ said {dev_type}"
        )
    # The producer made the stream wait for its work; a fence makes that wait part
    # of the stream's asyncgpu order, so copies on other streams see it too.
    _fence(impl)
    alloc = _ForeignAlloc(ptr, owner, None, readonly)
    return _wrap(ctx, DeviceBuffer, alloc, dtype, n, impl)


def wrap_cai(
    obj: Any, ctx: ContextView, cai: dict[str, Any], device_id: int | None
) -> DeviceBuffer:
    """``from_cuda_array_interface(obj, ctx)`` for an open ``ctx``, given ``obj``'s
    interface ``cai`` and the device its memory is on (None: unknown)."""
    ptr, dtype, n, readonly = _parse_cai(cai)
    _check_cuda_ctx(ctx, device_id, type(obj).__name__)
    impl = ctx._impl
    if _after_producer(impl, producer_stream(obj, cai)):
        _fence(impl)  # so that copies on other streams order after the wait too
    return _wrap(ctx, DeviceBuffer, _ForeignAlloc(ptr, obj, None, readonly), dtype, n, impl)


def operand(ctx: ContextView, obj: Any, writable: bool) -> Any:
    """A foreign array as an ``enqueue_copy`` operand.

    CUDA memory (``__cuda_array_interface__``, or ``__dlpack__`` on a CUDA device)
    becomes a buffer over the same memory. When the producer's stream is known (a
    PyTorch tensor: its device's current stream; otherwise the interface's
    ``stream``, e.g. a CuPy array's), the copy waits for the producer's work so far
    and the producer's stream waits for the copy before its later work, as for a
    buffer owned by another stream (``_ForeignOwner``). Otherwise a DLPack
    producer is asked to order the copy's stream after its work
    (``__dlpack__(stream=...)``).

    Host memory through DLPack becomes a NumPy array (``np.from_dlpack``) used as
    a host span.
    """
    cai = _cai_of(obj) if hasattr(type(obj), "__cuda_array_interface__") else None
    if cai is not None:
        if ctx._state.api != "cuda":
            raise ValueError(
                f"{type(obj).__name__} is CUDA memory; the {ctx._state.describe()} context "
                "cannot use it"
            )
        ptr, dtype, n, readonly = _parse_cai(cai)
        if writable and readonly:
            raise ValueError(f"the destination {type(obj).__name__} is read-only")
        impl = ctx._impl
        producer = producer_stream(obj, cai)
        owner: Any = impl
        if _after_producer(impl, producer):
            assert producer is not None
            owner = _ForeignOwner(ctx._state, producer)
            # An operation after the wait, so that a copy run by host work (a
            # pageable one, staged on the pool once the stream's last operation
            # is seen to finish) starts after the producer's work too.
            _fence(impl)
        return _wrap(ctx, DeviceBuffer, _ForeignAlloc(ptr, obj, None, readonly), dtype, n, owner)
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(f"{type(obj).__name__} is not an array asyncgpu can copy")
    dev_type, _dev_id = (int(v) for v in obj.__dlpack_device__())
    if dev_type == kDLCPU:
        return _Span(np.from_dlpack(obj), writable)
    buf = wrap_dlpack(obj, ctx)
    if writable and buf._alloc.readonly:
        raise ValueError(f"the destination {type(obj).__name__} is read-only")
    return buf


# -- foreign kernel arguments (used by the CUDA backend's launch) --------------------------


def launch_streams(impl: _StreamImpl, args: Sequence[Any]) -> list[int]:
    """Before a launch on ``impl``: for the foreign arrays among ``args`` (objects
    with ``__cuda_array_interface__``, PyTorch tensors) whose producer stream is
    known and is not ``impl``, make ``impl`` wait, on the device, for that
    stream's work so far. Returns those streams' handles, for ``launch_done``.
    Driver calls only (safe under ``impl``'s submit lock)."""
    out: list[int] = []
    for a in args:
        if isinstance(a, (_BufferBase, np.generic)):
            continue
        cai = _cai_of(a) if hasattr(type(a), "__cuda_array_interface__") else None
        producer = producer_stream(a, cai)
        if producer is None or producer in out:
            continue
        if _after_producer(impl, producer):
            out.append(producer)
    return out


def launch_done(impl: _StreamImpl, streams: Sequence[int]) -> None:
    """Right after a launch on ``impl``: the producer streams returned by
    ``launch_streams`` wait, on the device, for the kernel (and everything else
    submitted to ``impl`` so far)."""
    for h in streams:
        impl.order_handle_after(h, settle=False)  # under impl's submit lock
