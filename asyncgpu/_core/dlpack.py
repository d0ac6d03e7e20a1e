"""DLPack: the structures, capsules and dtypes, and buffers exported through it.

How other libraries' arrays are imported lives in ``foreign``; the public entry
points (``from_dlpack``, ``from_cuda_array_interface``) in ``asyncgpu._api``.

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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._types import check_int

if TYPE_CHECKING:
    from .stream import _StreamImpl

__all__ = ["array_interface", "dlpack_device", "export_dlpack", "host_array"]

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


# -- exporting ---------------------------------------------------------------------------


def dlpack_device(buf: Any) -> tuple[int, int]:
    """``__dlpack_device__``: ``(kDLCUDA, id)`` for CUDA device memory, ``(kDLCPU, 0)``
    for host memory (host buffers; device buffers of the CPU device)."""
    state = buf._ctx._state
    if state.api == "cuda" and buf._kind == "device":
        return (kDLCUDA, state.device_id)
    return (kDLCPU, 0)


class _Export:
    """The base of the NumPy array a capsule is made from: exposes the buffer's
    memory through ``__array_interface__`` and keeps the buffer alive. For CUDA
    memory it remembers the consumer's stream, so that the buffer's owning stream
    waits for it before the buffer can be released."""

    def __init__(self, buf: Any, consumer: int | None) -> None:
        self.__array_interface__ = {
            "data": (buf._ptr, False),
            "typestr": buf._dtype.str,
            "shape": (buf._size,),
            "version": 3,
        }
        self.buf: Any | None = buf
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
            state.backend.stream_waits_for_stream(owner, consumer)


def host_array(buf: Any) -> np.ndarray:
    """A NumPy view of host memory whose base keeps ``buf`` alive."""
    arr = np.asarray(_Export(buf, None))
    return arr if arr.dtype == buf._dtype else arr.view(buf._dtype)


def array_interface(buf: Any) -> dict[str, Any]:
    return {
        "data": (buf._ptr, False),
        "typestr": buf._dtype.str,
        "shape": (buf._size,),
        "version": 3,
    }


def export_dlpack(
    buf: Any,
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
