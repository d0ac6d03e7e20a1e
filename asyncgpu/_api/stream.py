"""``DeviceStream``: the public face of one stream of a context."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, Protocol

from .._core.event import DeviceEvent, _UserEvent
from .._core.memory import ContextView
from .._core.pool import refuse_wait_from_own_work
from .._core.stream import _StreamImpl
from .._errors import DeviceFaultError

__all__ = ["DeviceStream", "await_stream"]


class _StreamContext(ContextView, Protocol):
    """A ``DeviceContext`` as its streams use it (``context``, the module that
    defines it, imports this one)."""

    def _view(self, impl: _StreamImpl) -> _StreamContext: ...

    # (``other``: what the context's own method checks, a DeviceContext,
    # DeviceStream or DeviceEvent; DeviceContext cannot be named here.)
    def enqueue_wait_for(self, other: Any) -> DeviceEvent: ...

    # (``DeviceContext.enqueue_function``, whose arguments the stream passes on as
    # they come.)
    @property
    def enqueue_function(self) -> Callable[..., DeviceEvent]: ...


def await_stream(ctx: _StreamContext, impl: _StreamImpl) -> Generator[Any, None, None]:
    """``await stream`` and ``await ctx`` (the context's current stream), one
    implementation: wait, without blocking the loop, for everything enqueued on
    ``impl`` so far (its ``point()``), through that event's compiled await
    (``DeviceEvent.__await__``: a marker, a brief inline spin, then the loop's
    reactor on CUDA; a waiter of the event on the CPU device). A device fault
    raises; the error of the stream's last operation itself (a CPU function's)
    is that operation's, not the stream's. ``ContextClosedError`` once
    ``ctx`` is closed; ``RuntimeError`` from a CPU function of the stream,
    which would wait for itself."""
    ctx._check_open()
    ev = impl.point()
    if ev is None or (ev._done and ev._error is None):
        return
    if not ev._done:
        refuse_wait_from_own_work(impl, ev._seq)
    try:
        yield from ev.__await__()  # (the event's compiled await)
    except DeviceFaultError:
        raise
    except Exception as e:
        # The error of the stream's last operation itself (a CPU function's) is
        # that operation's, not the stream's: the stream's work is done.
        if e is not ev._error:
            raise


class DeviceStream:
    """A stream of a device context: work enqueued on it runs in order.

    ``await stream`` waits (without blocking the loop) for everything enqueued on
    it so far; ``synchronize()`` blocks for the same.
    """

    __slots__ = ("_ctx", "_impl")

    def __init__(self, ctx: _StreamContext, impl: _StreamImpl) -> None:
        self._ctx = ctx
        self._impl = impl

    def context(self) -> _StreamContext:
        """A view of the owning context bound to this stream."""
        return self._ctx._view(self._impl)

    def synchronize(self) -> None:
        """Block until all work enqueued on this stream has completed
        (``cuStreamSynchronize`` on CUDA; returns, never reaching the destroyed
        stream, if a close on another thread overtakes it)."""
        self._ctx._check_open()
        self._impl.synchronize()

    def record_event(self, event: DeviceEvent) -> None:
        """Record ``event`` (from ``create_event`` on this device) at the current
        end of this stream (``cuEventRecord``); it then stands for that point only,
        whatever it stood for before. Never blocks."""
        self._ctx._check_open()
        if not isinstance(event, _UserEvent):
            raise TypeError(
                "record_event takes an event made by create_event(), not "
                + (
                    "the event of an enqueued operation"
                    if isinstance(event, DeviceEvent)
                    else type(event).__name__
                )
            )
        state = self._ctx._state
        if event._device != (state.api, state.device_id):
            api, device_id = event._device
            raise ValueError(
                f"record_event: the event was made for {api}:{device_id}, this stream is "
                f"on {state.api}:{state.device_id}"
            )
        self._impl.record(event)

    def enqueue_wait_for(self, other: Any) -> DeviceEvent:
        """Make later work on this stream wait, on the device, for ``other`` (a
        DeviceContext, DeviceStream or DeviceEvent). The host never blocks."""
        return self.context().enqueue_wait_for(other)

    def enqueue_function(self, f: Any, *args: Any, **launch: Any) -> DeviceEvent:
        """Launch ``f`` on this stream (see ``DeviceContext.enqueue_function``)."""
        return self.context().enqueue_function(f, *args, **launch)

    def priority(self) -> int:
        """The stream's priority (lower numbers are higher priority on CUDA)."""
        return self._impl.priority

    @property
    def index(self) -> int:
        return self._impl.index

    @property
    def handle(self) -> int:
        """The native stream handle as an int (``CUstream``; 0 on the CPU device).

        Work you submit to it yourself runs after everything enqueued here so far:
        if the stream holds work behind CPU work, this blocks until that work has
        been handed to the driver."""
        self._impl._settle()
        return self._impl.handle()

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol: ``(0, handle)`` (blocks as ``handle`` does)."""
        if self._impl.state.api != "cuda":
            raise TypeError("__cuda_stream__ is only defined for CUDA streams")
        self._impl._settle()
        return (0, self._impl.handle())

    def __await__(self) -> Generator[Any, None, None]:
        return await_stream(self._ctx, self._impl)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceStream) and other._impl is self._impl

    def __hash__(self) -> int:
        return id(self._impl)

    def __repr__(self) -> str:
        return f"<DeviceStream {self._impl.label} priority={self._impl.priority}>"
