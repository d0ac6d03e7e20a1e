"""Interoperation with other array libraries: DLPack, the CUDA Array Interface,
foreign streams and numba-cuda kernels.

Exporting (``DeviceBuffer.__dlpack__`` / ``HostBuffer.__dlpack__``)
    The capsule is made by NumPy: an ``ndarray`` is built over the buffer's
    memory through ``__array_interface__`` (NumPy never touches the memory to do
    so), its base being a small holder that references the buffer; NumPy's
    ``__dlpack__`` makes the capsule, whose deleter drops the array and with it
    the buffer. For CUDA memory the capsule's device field is then set to
    ``(kDLCUDA, device_id)``. So the buffer lives as long as the consumer's
    tensor, with all capsule lifetime handled in C.

    Stream semantics (CUDA memory, ``stream`` as the DLPack spec defines it:
    ``None`` = the legacy default stream, 1 = legacy, 2 = per-thread, a larger
    int = a ``CUstream``, -1 = no synchronisation, 0 refused): the consumer's
    stream is made to wait, on the device, for everything enqueued so far on the
    buffer's owning stream (a CUDA event recorded there and waited for on the
    consumer's stream). When the consumer releases the tensor, the owning stream
    waits for the consumer's stream before the buffer can go back to the pool, so
    the memory is not reused under work the consumer still has queued.

    Host memory (``HostBuffer``, and ``DeviceBuffer`` of the CPU device) is
    exported as ``(kDLCPU, 0)``. There is no stream to order on: as with
    ``HostBuffer.as_numpy()``, the consumer touches the memory directly, so await
    the operations that write it first (or consume it inside a CPU function
    enqueued after them). Blocking here instead would deadlock a CPU function
    that exports a buffer its own stream owns.

Importing (``from_dlpack``, ``from_cuda_array_interface``, and every
``enqueue_copy`` operand that is another library's array)
    The memory is wrapped, never copied, in a ``DeviceBuffer`` (device memory,
    or host memory on the CPU device) or a ``HostBuffer`` (page-locked host
    memory on a CUDA context) that keeps the foreign owner alive and frees
    nothing. See ``from_dlpack`` for the stream rules.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import re
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._buffer import DeviceBuffer, HostBuffer, _BufferBase, _Span
from ._event import DeviceEvent
from ._types import check_int

if TYPE_CHECKING:
    from ._context import DeviceContext, _ContextState
    from ._function import DeviceFunction
    from ._stream import _StreamImpl

__all__ = ["NumbaKernel", "from_cuda_array_interface", "from_dlpack", "load_numba_kernel"]

# DLPack device types (dlpack.h)
kDLCPU = 1
kDLCUDA = 2
kDLCUDAHost = 3
kDLCUDAManaged = 13

# CUDA stream handles with a special meaning (CU_STREAM_LEGACY, CU_STREAM_PER_THREAD)
_LEGACY_STREAM = 1
_PER_THREAD_STREAM = 2

_READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY


# -- the DLPack structures (dlpack.h, ABI stable since 0.5 / 1.0) -------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", _DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _DLTensor),
    ]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

# Capsule names: module-level bytes, so the pointers a renamed capsule keeps stay valid.
_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"
_USED = b"used_dltensor"
_USED_VERSIONED = b"used_dltensor_versioned"

_api = ctypes.pythonapi
_capsule_name = _api.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]
_capsule_pointer = _api.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_set_name = _api.PyCapsule_SetName
_capsule_set_name.restype = ctypes.c_int
_capsule_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_valid = _api.PyCapsule_IsValid
_capsule_valid.restype = ctypes.c_int
_capsule_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _tensor_of(capsule: Any) -> tuple[_DLTensor, Any, bool]:
    """The DLTensor of an unconsumed capsule, its managed struct, and whether it
    is a versioned (DLPack 1.x) capsule."""
    if _capsule_valid(capsule, _NAME_VERSIONED):
        m: Any = _DLManagedTensorVersioned.from_address(_capsule_pointer(capsule, _NAME_VERSIONED))
        if m.version.major != 1:
            raise BufferError(f"DLPack {m.version.major}.{m.version.minor} is not supported")
        return m.dl_tensor, m, True
    if _capsule_valid(capsule, _NAME):
        m = _DLManagedTensor.from_address(_capsule_pointer(capsule, _NAME))
        return m.dl_tensor, m, False
    raise BufferError("__dlpack__ did not return an unconsumed DLPack capsule")


# -- dtypes -----------------------------------------------------------------------------

_DL_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


def _dtype_from_dl(code: int, bits: int, lanes: int) -> np.dtype[Any]:
    if lanes != 1:
        raise BufferError(f"DLPack vector dtypes (lanes={lanes}) are not supported")
    kind = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}.get(code)
    if kind == "b" and bits == 8:
        return np.dtype(np.bool_)
    if code == 4 and bits == 16:  # kDLBfloat
        try:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            raise BufferError("bfloat16 tensors need the ml_dtypes package") from None
    if kind is None or kind == "b" or bits % 8:
        raise BufferError(f"DLPack dtype code {code} with {bits} bits is not supported")
    try:
        return np.dtype(f"{kind}{bits // 8}")
    except TypeError:
        raise BufferError(f"DLPack dtype code {code} with {bits} bits is not supported") from None


def _flat_size(shape: Sequence[int], strides: Sequence[int] | None, itemsize: int) -> int:
    """The element count of a C-contiguous layout; ``ValueError`` for any other.
    ``strides`` are in elements (DLPack) or None (C-contiguous)."""
    n = math.prod(shape)
    if strides is not None and n > 1:
        expect = 1
        for dim, st in zip(reversed(shape), reversed(strides), strict=True):
            if dim != 1 and st != expect:
                raise ValueError(
                    f"only C-contiguous arrays can be wrapped (shape {tuple(shape)}, "
                    f"strides {tuple(strides)} elements)"
                )
            expect *= dim
    return n


# -- the wrapped memory ------------------------------------------------------------------


class _ForeignAlloc:
    """Memory another library owns, seen through asyncgpu's allocation protocol
    (``ptr``, ``host``, ``release``, ``detach``, ``set_owner``): it keeps the owner
    alive while a buffer uses it and frees nothing."""

    __slots__ = ("host", "owner", "ptr", "readonly")

    def __init__(
        self, ptr: int, owner: Any, host: np.ndarray | None = None, readonly: bool = False
    ) -> None:
        self.ptr = ptr
        self.owner = owner
        self.host = host
        self.readonly = readonly

    def release(self, stream: _StreamImpl) -> None:
        # Every asyncgpu operation that used the memory has finished (operations keep
        # their buffers alive), so the owner can go.
        self.owner = None

    def detach(self) -> None:
        raise ValueError(
            "take_ptr() on memory another library owns: asyncgpu cannot hand over "
            "memory it did not allocate"
        )

    def set_owner(self, stream: _StreamImpl) -> None:
        pass


class _ConsumedCapsule:
    """Owns a consumed DLPack capsule's tensor: calls the producer's deleter when
    the last buffer over it is gone."""

    __slots__ = ("address", "capsule", "deleter")

    def __init__(self, capsule: Any, managed: Any, versioned: bool) -> None:
        self.capsule = capsule  # the renamed capsule (its destructor no longer deletes)
        self.address = ctypes.addressof(managed)
        self.deleter = managed.deleter
        _capsule_set_name(capsule, _USED_VERSIONED if versioned else _USED)

    def __del__(self) -> None:
        if self.deleter:
            _DELETER(self.deleter)(self.address)
            self.deleter = None


def _consume_capsule(capsule: Any) -> tuple[int, np.dtype[Any], int, tuple[int, int], Any, bool]:
    """Parse and take ownership of a DLPack capsule: (address of the first element,
    dtype, element count, (device_type, device_id), owner, read-only). The owner
    calls the producer's deleter once dropped."""
    t, managed, versioned = _tensor_of(capsule)
    dtype = _dtype_from_dl(t.dtype.code, t.dtype.bits, t.dtype.lanes)
    ndim = int(t.ndim)
    shape = [int(t.shape[i]) for i in range(ndim)]
    strides = [int(t.strides[i]) for i in range(ndim)] if t.strides else None
    n = _flat_size(shape, strides, dtype.itemsize)
    ptr = int(t.data or 0) + int(t.byte_offset)
    device = (int(t.device.device_type), int(t.device.device_id))
    readonly = bool(versioned and managed.flags & _READ_ONLY)
    owner = _ConsumedCapsule(capsule, managed, versioned)
    return ptr, dtype, n, device, owner, readonly


def _call_dlpack(obj: Any, stream: int | None) -> Any:
    """``obj.__dlpack__`` asking for DLPack 1.x, falling back to the legacy call."""
    try:
        return obj.__dlpack__(stream=stream, max_version=(1, 0))
    except TypeError:
        return obj.__dlpack__(stream=stream)


# -- contexts and streams ----------------------------------------------------------------

_default_lock = threading.Lock()
_default_contexts: dict[tuple[str, int], DeviceContext] = {}


def _default_context(api: str, device_id: int) -> DeviceContext:
    """A process-wide context per device, for wraps made without a context."""
    from ._context import DeviceContext

    key = (api, device_id)
    with _default_lock:
        ctx = _default_contexts.get(key)
        if ctx is None or ctx._state.closed or not ctx._ref.open:
            ctx = _default_contexts[key] = DeviceContext(device_id, api=api)
        return ctx


_DONE = DeviceEvent(None)
_DONE._done = True


def _fence(impl: _StreamImpl) -> DeviceEvent:
    """An operation that does nothing on ``impl``: its event stands for everything
    submitted to the stream so far, by asyncgpu or, for a wrapped stream, by the
    library that owns it. Waiting for it orders after all of that."""
    ev = impl.wait_event(_DONE)
    prune = getattr(impl, "_prune", None)
    if prune is not None:
        prune()
    return ev


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
    stream is known. ``DeviceContext._copy`` orders a copy with the owners of its
    operands: it waits for their ``tail()`` (None here: ``operand`` has already made
    the copy's stream wait for the producer's) and then calls ``wait_event(copy)``,
    which makes the producer's stream wait for the copy, so the producer's later
    work sees it. Only driver calls: no asyncgpu state is kept for foreign streams,
    so one destroyed later leaves nothing behind."""

    __slots__ = ("_handle", "label", "state")

    def __init__(self, state: _ContextState, handle: int) -> None:
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
        _stream_waits_for_stream(self.state, waiter, self._handle)


def _cuda_driver() -> Any:
    from cuda.bindings import driver

    return driver


def _check_cu(result: Any, what: str) -> Any:
    from ._cuda import _check

    return _check(result, what)


def _stream_waits_for_stream(state: _ContextState, waiter: int, producer: int) -> None:
    """``waiter`` waits on the device for all work submitted to ``producer`` so far
    (a CUDA event recorded on one and waited for on the other)."""
    cu = _cuda_driver()
    state.backend.make_current()
    e = _check_cu(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    try:
        _check_cu(cu.cuEventRecord(e, cu.CUstream(producer)), "cuEventRecord")
        _check_cu(cu.cuStreamWaitEvent(cu.CUstream(waiter), e, 0), "cuStreamWaitEvent")
    finally:
        cu.cuEventDestroy(e)


def _pointer_device(ptr: int) -> int | None:
    """The device ordinal of a CUDA address (None when the driver cannot say)."""
    cu = _cuda_driver()
    err, dev = cu.cuPointerGetAttribute(
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, cu.CUdeviceptr(ptr)
    )
    return int(dev) if err == cu.CUresult.CUDA_SUCCESS else None


def _pinned(ptr: int) -> bool:
    """True if a host address is page-locked memory CUDA knows (pinned or registered)."""
    cu = _cuda_driver()
    err, kind = cu.cuPointerGetAttribute(
        cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, cu.CUdeviceptr(ptr)
    )
    return bool(
        err == cu.CUresult.CUDA_SUCCESS and int(kind) == int(cu.CUmemorytype.CU_MEMORYTYPE_HOST)
    )


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


def _resolve_ctx(ctx: DeviceContext | None, api: str, device_id: int) -> DeviceContext:
    if ctx is None:
        return _default_context(api, device_id)
    ctx._check_open()
    return ctx


def _check_cuda_ctx(ctx: DeviceContext, device_id: int | None, what: str) -> None:
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
    ctx: DeviceContext,
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


def _wrap_host_array(ctx: DeviceContext, array: np.ndarray, owner: Any = None) -> Any:
    """Host memory as a buffer: a DeviceBuffer on the CPU device (whose device
    memory is host memory), a HostBuffer on a CUDA context (pinned memory only)."""
    alloc, dtype, n = _host_alloc(array, owner)
    if ctx._state.api == "cpu":
        return _wrap(ctx, DeviceBuffer, alloc, dtype, n, ctx._impl)
    ctx._state.backend.make_current()
    if n and not _pinned(alloc.ptr):
        raise ValueError(
            "pageable host memory cannot be a buffer of a CUDA context; pass it to "
            "enqueue_copy as a NumPy array (np.from_dlpack(obj)), or pin it"
        )
    return _wrap(ctx, HostBuffer, alloc, dtype, n, ctx._impl)


def from_dlpack(obj: Any, ctx: DeviceContext | None = None) -> DeviceBuffer | HostBuffer:
    """Wrap another library's array as an asyncgpu buffer, without copying, through
    DLPack (``obj.__dlpack__`` / ``__dlpack_device__``).

    * CUDA device memory (``kDLCUDA``, ``kDLCUDAManaged``) becomes a
      ``DeviceBuffer`` of ``ctx`` (a CUDA context of the same device);
    * host memory (``kDLCPU``, ``kDLCUDAHost``) becomes a ``DeviceBuffer`` on the
      CPU device, and a ``HostBuffer`` on a CUDA context (page-locked memory only:
      pageable memory is refused; pass it to ``enqueue_copy`` as a NumPy array).

    The result is flat: ``len()`` is the array's element count, its dtype the
    array's. Only C-contiguous arrays are wrapped (``ValueError`` otherwise). The
    buffer keeps the producer's memory alive (the capsule's deleter runs when the
    buffer and every operation that used it are gone) and frees nothing;
    ``take_ptr()`` on it raises.

    Streams: the buffer is owned by ``ctx``'s current stream. That stream is passed
    to ``obj.__dlpack__(stream=...)``, so the producer orders it after its own
    pending work on the array, as DLPack requires. Work either library enqueues
    later is not ordered by the wrap: pass the array itself to ``enqueue_copy``
    (which orders on the producer's stream where it is known), or order the streams
    explicitly. Without ``ctx``, a process-wide context of the array's device is
    used.
    """
    if not hasattr(obj, "__dlpack__"):
        raise TypeError(f"{type(obj).__name__} does not implement __dlpack__")
    dev_type, dev_id = (int(v) for v in obj.__dlpack_device__())
    if dev_type in (kDLCPU, kDLCUDAHost):
        # Host memory: NumPy consumes the capsule (and keeps it alive as the array's
        # base); the array is then wrapped.
        ctx = _resolve_ctx(ctx, "cuda" if dev_type == kDLCUDAHost else "cpu", 0)
        return _wrap_host_array(ctx, np.from_dlpack(obj))  # type: ignore[no-any-return]
    if dev_type not in (kDLCUDA, kDLCUDAManaged):
        raise BufferError(f"DLPack device type {dev_type} is not supported")
    ctx = _resolve_ctx(ctx, "cuda", dev_id)
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
    return _wrap(ctx, DeviceBuffer, alloc, dtype, n, impl)  # type: ignore[no-any-return]


def from_cuda_array_interface(obj: Any, ctx: DeviceContext | None = None) -> DeviceBuffer:
    """Wrap an object with ``__cuda_array_interface__`` (a CuPy array, a PyTorch
    CUDA tensor, a numba device array) as a ``DeviceBuffer``, without copying.

    Flat and C-contiguous only, as for ``from_dlpack``. The buffer keeps ``obj``
    alive and frees nothing. It is owned by ``ctx``'s current stream, which is
    made to wait, on the device, for the producer's stream: the interface's
    ``stream`` (v3), or for a PyTorch tensor its device's current stream. Work
    either library enqueues later is not ordered by the wrap.
    """
    cai = _cai_of(obj)
    if cai is None:
        raise TypeError(f"{type(obj).__name__} has no __cuda_array_interface__")
    ptr, dtype, n, readonly = _parse_cai(cai)
    dev = _pointer_device(ptr) if ptr and (ctx is None or ctx._state.api == "cuda") else None
    ctx = _resolve_ctx(ctx, "cuda", dev or 0)
    _check_cuda_ctx(ctx, dev, type(obj).__name__)
    impl = ctx._impl
    if _after_producer(impl, producer_stream(obj, cai)):
        _fence(impl)  # so that copies on other streams order after the wait too
    return _wrap(ctx, DeviceBuffer, _ForeignAlloc(ptr, obj, None, readonly), dtype, n, impl)  # type: ignore[no-any-return]


def operand(ctx: DeviceContext, obj: Any, writable: bool) -> Any:
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
    buf = from_dlpack(obj, ctx)
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


# -- exporting ---------------------------------------------------------------------------


def dlpack_device(buf: _BufferBase) -> tuple[int, int]:
    """``__dlpack_device__``: ``(kDLCUDA, id)`` for CUDA device memory, ``(kDLCPU, 0)``
    for host memory (host buffers; device buffers of the CPU device)."""
    state = buf._ctx._state
    if state.api == "cuda" and isinstance(buf, DeviceBuffer):
        return (kDLCUDA, state.device_id)
    return (kDLCPU, 0)


class _Export:
    """The base of the NumPy array a capsule is made from: exposes the buffer's
    memory through ``__array_interface__`` and keeps the buffer alive. For CUDA
    memory it remembers the consumer's stream, so that the buffer's owning stream
    waits for it before the buffer can be released."""

    def __init__(self, buf: _BufferBase, consumer: int | None) -> None:
        self.__array_interface__ = {
            "data": (buf._ptr, False),
            "typestr": buf._dtype.str,
            "shape": (buf._size,),
            "version": 3,
        }
        self.buf: _BufferBase | None = buf
        self.consumer = consumer

    def __del__(self) -> None:
        buf, self.buf = self.buf, None
        consumer = self.consumer
        if buf is None or consumer is None:
            return
        state = buf._ctx._state
        owner = buf._owner.handle()
        if state.closed or consumer == owner:
            return
        # Driver calls only: no asyncgpu lock is taken in a finalizer.
        with contextlib.suppress(Exception):
            _stream_waits_for_stream(state, owner, consumer)


def host_array(buf: _BufferBase) -> np.ndarray:
    """A NumPy view of host memory whose base keeps ``buf`` alive."""
    arr = np.asarray(_Export(buf, None))
    return arr if arr.dtype == buf._dtype else arr.view(buf._dtype)


def array_interface(buf: _BufferBase) -> dict[str, Any]:
    return {
        "data": (buf._ptr, False),
        "typestr": buf._dtype.str,
        "shape": (buf._size,),
        "version": 3,
    }


def export_dlpack(
    buf: _BufferBase,
    stream: Any = None,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
) -> Any:
    """``__dlpack__`` of a buffer (see the module docstring for the semantics)."""
    buf._check()
    device = dlpack_device(buf)
    if dl_device is not None and tuple(int(v) for v in dl_device) != device:
        raise BufferError(f"the buffer is on DLPack device {device}, not {tuple(dl_device)}")
    if copy:
        raise BufferError("asyncgpu buffers export without copying; use enqueue_copy to copy")
    if buf._dtype.kind not in _DL_CODES or not buf._dtype.isnative:
        raise BufferError(f"dtype {buf._dtype} has no DLPack equivalent")
    s = None if stream is None else check_int(stream, "stream (or None)")
    consumer: int | None = None
    if device[0] == kDLCUDA:
        if s == 0:
            raise BufferError(
                "stream=0 is ambiguous in DLPack; use 1 for the legacy default stream"
            )
        if s != -1:
            consumer = _LEGACY_STREAM if s is None else s
            if consumer != buf._owner.handle():
                buf._owner.order_handle_after(consumer)
    elif s is not None and s != -1:
        raise BufferError("host memory is exported without a stream: pass stream=None")
    arr = np.asarray(_Export(buf, consumer))
    versioned = max_version is not None and int(max_version[0]) >= 1
    if versioned:
        try:
            capsule = arr.__dlpack__(max_version=(1, 0))
        except TypeError:  # NumPy 1.x makes legacy capsules only
            capsule = arr.__dlpack__()
    else:
        capsule = arr.__dlpack__()
    if device[0] != kDLCPU:
        t = _tensor_of(capsule)[0]
        t.device.device_type = device[0]
        t.device.device_id = device[1]
        t.data = buf._ptr or None
        t.byte_offset = 0
    return capsule


# -- numba-cuda kernels ------------------------------------------------------------------

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
