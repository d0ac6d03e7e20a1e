"""Awaiting PyTorch's CUDA work from an event loop, without blocking it.

``import asyncgpu.torch`` (never imported by ``import asyncgpu``, and PyTorch
itself is imported only at the first call)::

    import asyncgpu.torch

    with torch.cuda.stream(s):
        out.copy_(model(x.to("cuda", non_blocking=True)), non_blocking=True)
        done = asyncgpu.torch.wait()   # covers everything queued on s so far
    await done                          # the loop keeps running meanwhile; out is ready

    ev = torch.cuda.Event()
    ev.record(s)
    await asyncgpu.torch.wait_event(ev)

What an await covers: ``wait(stream)`` stands for everything queued on
``stream`` before the *call* (by PyTorch, by asyncgpu or by anyone else), and
for nothing queued after it: it enqueues an empty operation of asyncgpu's on
the stream, and the await ends once the GPU has passed it. ``wait_event(ev)``
stands for the work ``ev`` captured at its latest ``record`` before the call.
The result is a ``DeviceEvent``: await it (asyncio, uvloop, trio, anyio), ask
``query()``, or ``synchronize()``. Cancelling the await never cancels the GPU
work. Errors of the GPU (a fault) are raised by the await.

Each PyTorch stream is wrapped once per context (``create_external_stream``)
and the wrapper is kept (the context keeps the most recently wrapped streams'
wrappers; see its bound there): a call costs one empty operation, no driver call
until the await (one ``cuEventRecord`` of a pooled driver event), and the
reactor's ``cuEventQuery`` polls while it waits.

Without PyTorch, or with a PyTorch that has no CUDA device, the calls raise
``NoDeviceError`` (importing this module never fails).
"""

from __future__ import annotations

import importlib
import sys
import threading
import weakref
from typing import Any

from ._api.context import DeviceContext
from ._api.interop import _default_context
from ._core.event import DeviceEvent
from ._core.stream import _StreamImpl
from ._errors import NoDeviceError

__all__ = ["wait", "wait_event"]

# context state -> the stream of ours that waits for PyTorch's events (wait_event)
_event_waiters: weakref.WeakKeyDictionary[Any, _StreamImpl] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _torch() -> Any:
    """PyTorch with CUDA, or ``NoDeviceError`` saying what is missing."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            torch = importlib.import_module("torch")
        except ImportError as e:
            raise NoDeviceError(
                f"asyncgpu.torch needs PyTorch with CUDA, and PyTorch is not installed ({e})"
            ) from None
    return torch


def _no_cuda(torch: Any, e: BaseException | None = None) -> NoDeviceError:
    why = f" ({type(e).__name__}: {e})" if e is not None else ""
    return NoDeviceError(
        "asyncgpu.torch awaits PyTorch's CUDA work, and this PyTorch has no CUDA device "
        f"(torch.cuda.is_available() is {torch.cuda.is_available()}){why}; on the CPU, "
        "PyTorch's operations are done when they return: there is nothing to await"
    )


def _current_stream(torch: Any) -> Any:
    try:
        return torch.cuda.current_stream()
    except (AssertionError, RuntimeError) as e:  # (torch's answers without CUDA)
        raise _no_cuda(torch, e) from None


def _stream_device(s: Any, torch: Any) -> int:
    index = getattr(s, "device_index", None)
    if index is None:
        device = getattr(s, "device", None)
        index = getattr(device, "index", None)
    if index is None:
        if not torch.cuda.is_available():
            raise _no_cuda(torch)
        index = torch.cuda.current_device()
    return int(index)


def _impl_of(s: Any, ctx: DeviceContext | None, torch: Any) -> _StreamImpl:
    """The wrapped stream of PyTorch's stream ``s``: the context's (``ctx``, or
    the process-wide context of ``s``'s device), whose ``create_external_stream``
    wraps each ``CUstream`` once and bounds the wrappers it keeps."""
    # Checked here for both paths, so that the error names this module's call
    # rather than the create_external_stream it would otherwise reach.
    handle = getattr(s, "cuda_stream", None)
    if handle is None:
        raise TypeError(f"asyncgpu.torch.wait takes a torch.cuda.Stream, not {type(s).__name__}")
    if ctx is None:
        ctx = _default_context("cuda", _stream_device(s, torch))
    return ctx.create_external_stream(s)._impl


def wait(stream: Any = None, *, ctx: DeviceContext | None = None) -> DeviceEvent:
    """An event that finishes once everything queued on PyTorch's ``stream``
    before this call has finished on the GPU: ``await asyncgpu.torch.wait()``.

    ``stream`` is a ``torch.cuda.Stream`` (or ``ExternalStream``); None: the
    current stream of the current device (``torch.cuda.current_stream()``), the
    one PyTorch's operations are queued on. ``ctx`` is the asyncgpu context that
    wraps it (a CUDA context of the stream's device); None: a process-wide one
    per device.

    The call enqueues an empty operation of asyncgpu's on the stream (no driver
    call of its own, never blocks) and returns its event; the driver is asked at
    the await (``cuEventRecord`` of a pooled event, then ``cuEventQuery`` by the
    loop's reactor). Work queued on the stream after the call is not covered.
    ``NoDeviceError`` without PyTorch's CUDA; ``TypeError`` if ``stream`` is not
    a CUDA stream (with or without ``ctx``); ``ContextClosedError`` if ``ctx``
    is closed."""
    torch = _torch()
    if stream is None:
        stream = _current_stream(torch)
    return _impl_of(stream, ctx, torch).fence()


def _waiter(ctx: DeviceContext | None, device: int) -> _StreamImpl:
    if ctx is None:
        ctx = _default_context("cuda", device)
    else:
        ctx._check_open()
    impl = _event_waiters.get(ctx._state)
    if impl is None:
        with _lock:
            impl = _event_waiters.get(ctx._state)
            if impl is None:
                impl = _event_waiters[ctx._state] = ctx.create_stream()._impl
    return impl


_NOTHING = DeviceEvent(None)  # (done: what waiting for an event never recorded waits for)
_NOTHING._done = True


def wait_event(event: Any, *, ctx: DeviceContext | None = None) -> DeviceEvent:
    """An event that finishes once PyTorch's ``event`` (a ``torch.cuda.Event``)
    has been reached, at its latest ``record`` before this call:
    ``await asyncgpu.torch.wait_event(ev)``. An event never recorded is done.

    A stream of asyncgpu's per context (made at the first call, one more
    stream of the device) waits for it on the device (``cuStreamWaitEvent``)
    and an empty operation after that wait stands for it, so the awaits of
    ``wait_event`` on one context finish in the order of their calls: an event
    recorded after slow work holds back the awaits of events called after it.
    For independent requests on several PyTorch streams, ``wait(stream)`` per
    stream has no such order. Never blocks.
    ``NoDeviceError`` without PyTorch's CUDA; ``TypeError`` if ``event`` is not
    a CUDA event."""
    torch = _torch()
    handle = getattr(event, "cuda_event", None)
    if handle is None:
        raise TypeError(
            f"asyncgpu.torch.wait_event takes a torch.cuda.Event, not {type(event).__name__}"
        )
    if not torch.cuda.is_available():
        raise _no_cuda(torch)
    if not handle:
        return _NOTHING  # (PyTorch makes the driver event at the first record)
    device = getattr(getattr(event, "device", None), "index", None)
    impl = _waiter(ctx, torch.cuda.current_device() if device is None else int(device))
    impl.wait_for_event_handle(int(handle))
    return impl.fence()
