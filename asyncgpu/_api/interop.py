"""The interop entry points: another library's array as an asyncgpu buffer,
without copying (``from_dlpack``, ``from_cuda_array_interface``). The wrapping
itself is the core's (``asyncgpu._core.foreign``); here a context is found for
arrays passed without one.
"""

from __future__ import annotations

import threading
from typing import Any

from .._core.dlpack import kDLCPU, kDLCUDA, kDLCUDAHost, kDLCUDAManaged
from .._core.foreign import _cai_of, _parse_cai, wrap_cai, wrap_dlpack
from .._core.memory import DeviceBuffer, HostBuffer
from .._devices import pointer_device
from .context import DeviceContext

__all__ = ["from_cuda_array_interface", "from_dlpack"]

_default_lock = threading.Lock()
_default_contexts: dict[tuple[str, int], DeviceContext] = {}


def _default_context(api: str, device_id: int) -> DeviceContext:
    """A process-wide context per device, for wraps made without a context."""
    key = (api, device_id)
    with _default_lock:
        ctx = _default_contexts.get(key)
        if ctx is None or ctx._state.closed or not ctx._ref.open:
            ctx = _default_contexts[key] = DeviceContext(device_id, api=api)
        return ctx


def _resolve_ctx(ctx: DeviceContext | None, api: str, device_id: int) -> DeviceContext:
    if ctx is None:
        return _default_context(api, device_id)
    ctx._check_open()
    return ctx


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
        api, device_id = ("cuda" if dev_type == kDLCUDAHost else "cpu"), 0
    elif dev_type in (kDLCUDA, kDLCUDAManaged):
        api, device_id = "cuda", dev_id
    else:
        raise BufferError(f"DLPack device type {dev_type} is not supported")
    return wrap_dlpack(obj, _resolve_ctx(ctx, api, device_id))


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
    ptr = _parse_cai(cai)[0]
    dev = None
    if ptr and (ctx is None or ctx._state.api == "cuda"):
        dev = pointer_device(ptr)
    return wrap_cai(obj, _resolve_ctx(ctx, "cuda", dev or 0), cai, dev)
