"""What all views of one device context share (``_ContextState``), the
reference a view holds (``_Ref``); the fields of a view are the compiled
``ContextCore``'s, which ``DeviceContext`` extends.

The backend is handed in by the public face, which chose it (``_devices``): the
core never names a device.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

from .._accel import native
from .._errors import ContextClosedError
from .._types import DeviceAttribute
from .function import DeviceFunction
from .protocols import Backend
from .stream import _StreamImpl
from .trace import Trace
from .trace_json import TraceFile

__all__ = ["_ContextState", "_Ref"]

# The streams a context makes when it is made (the most hardware queues a CUDA
# device hands out); the rest of its pool is made on first use.
_EAGER_STREAMS = 32
# How many wrapped streams of other libraries a context keeps alive for reuse,
# the most recently wrapped ones (see _ContextState.external_stream).
EXTERNAL_STREAMS_KEPT = 64


class _ContextState(native.StateCore):
    """What all views (and copies) of one device context share. ``closed`` and
    ``trace`` are fields of the compiled ``StateCore``, which the C hot paths
    read directly."""

    def __init__(self, api: str, device_id: int, num_streams: int, backend: Backend) -> None:
        self.api = api
        self.device_id = device_id
        self.backend = backend
        self.closed = False
        self.closing = False  # close() has begun: no stream is made any more
        self.refs = 1
        self.lock = threading.RLock()
        self.trace: Trace | None = None
        self.trace_file: TraceFile | None = None  # ASYNCGPU_TRACE's (see DeviceContext)
        self.num_streams = num_streams
        self.streams: dict[int, _StreamImpl] = {}  # (made at once or on first use)
        self.extra_streams: list[_StreamImpl] = []  # (create_stream's)
        self.next_index = num_streams  # (the index of the next stream outside the pool)
        # Wrapped streams of other libraries by native handle: every one alive
        # (one per handle while it lives), and the most recently wrapped ones,
        # which the context keeps alive (external_stream).
        self.external_streams: weakref.WeakValueDictionary[int, _StreamImpl] = (
            weakref.WeakValueDictionary()
        )
        self.kept_external: OrderedDict[int, _StreamImpl] = OrderedDict()
        self.compiled: dict[Any, DeviceFunction] = {}
        self.limits: dict[DeviceAttribute, int] = {}
        _open_states.add(self)
        # The backend's driver resources go back at close, or once a context
        # dropped without close is collected: only after its work has finished,
        # since work in flight keeps its streams, and so this state, reachable
        # (from the CPU pool's queue, or the watcher's sweep of polled streams).
        # Not at interpreter exit, which may still wait for that work.
        self.release_backend = weakref.finalize(self, backend.close)
        self.release_backend.atexit = False
        # The pool's streams are made together, one after another: the CUDA driver
        # hands its hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default) to
        # new streams in turn, so streams made together get queues of their own,
        # and work on one never waits behind another's in a shared queue. (A pool
        # larger than the driver has queues for makes the rest on first use.)
        for i in range(min(num_streams, _EAGER_STREAMS)):
            self.streams[i] = self.backend.new_stream(self, i, 0)

    def describe(self) -> str:
        return f"{self.api}:{self.device_id}"

    def stream(self, i: int) -> _StreamImpl:
        s = self.streams.get(i)
        if s is None:
            with self.lock:
                s = self.streams.get(i)
                if s is None:
                    self.refuse_if_closing()
                    s = self.streams[i] = self.backend.new_stream(self, i, 0)
        return s

    def take_index(self) -> int:
        """Under ``lock``: the index of a new stream outside the pool."""
        index = self.next_index
        self.next_index += 1
        return index

    def external_stream(self, handle: int, stream: Any) -> _StreamImpl:
        """The wrapper of another library's stream ``stream`` (native handle
        ``handle``): the one alive for that handle, else a new one
        (``backend.external_stream``).

        The context keeps the ``EXTERNAL_STREAMS_KEPT`` most recently wrapped
        handles' wrappers alive, so wrapping the same stream again (per
        request) is a dictionary look-up. Past that bound, the least recently
        wrapped ones that are idle (their last operation seen finished) are let
        go: each is released (its counter slots, marker events and kept memory,
        by its finalizer; never the other library's stream, which is not ours)
        once nothing else holds it: a ``DeviceStream`` or a buffer of it, or
        work in flight. One with work pending is kept past the bound until its
        work is seen finished.

        A handle whose stream its owner destroyed may be handed out again by
        the driver for a new stream: a wrapper still kept for it is harmless,
        since it holds only the handle's value and resources of its own (no
        state of the old stream's), so the new stream's work goes where the
        handle now points."""
        impl = self.kept_external.get(handle)
        if impl is not None:
            with contextlib.suppress(KeyError):  # (let go meanwhile by another thread)
                self.kept_external.move_to_end(handle)
            return impl
        with self.lock:
            self.refuse_if_closing()
            impl = self.external_streams.get(handle)
            if impl is None:
                impl = self.backend.external_stream(self, stream, self.take_index())
                self.external_streams[handle] = impl
            self.kept_external[handle] = impl
            self.kept_external.move_to_end(handle)
            excess = len(self.kept_external) - EXTERNAL_STREAMS_KEPT
            if excess > 0:
                # Least recently wrapped first; never the one just wrapped.
                for h, s in list(self.kept_external.items())[:-1]:
                    ev = s.tail()
                    if ev is None or ev._done:
                        del self.kept_external[h]
                        excess -= 1
                        if excess == 0:
                            break
        return impl

    def refuse_if_closing(self) -> None:
        """Under ``lock``: ``ContextClosedError`` once ``close()`` has begun (a
        stream made then would miss ``close()``'s refusal and wait)."""
        if self.closing:
            raise ContextClosedError(f"the DeviceContext {self.describe()} is closed")

    def all_streams(self) -> list[_StreamImpl]:
        return [
            *self.streams.values(),
            *self.extra_streams,
            *self.external_streams.values(),
        ]

    def limit(self, attr: DeviceAttribute) -> int:
        v = self.limits.get(attr)
        if v is None:
            v = self.limits[attr] = self.backend.attribute(attr)
        return v

    def fail_all(self, err: BaseException) -> None:
        for s in self.all_streams():
            fail = getattr(s, "_fail", None)
            if fail is not None:
                fail(err)

    def close(self) -> None:
        """Refuse new work, wait for the work already in, then release streams,
        caches and the backend.

        Each stream refuses submissions first (``begin_close``, under the lock
        its submissions hold), so an enqueue racing with this close either got
        in before, and is waited for below, or raises ``ContextClosedError``:
        none runs after ``close()`` returns."""
        with self.lock:
            if self.closed:
                return
            self.closing = True
            streams = self.all_streams()
        for s in streams:
            s.begin_close()
        errors: list[BaseException] = []
        for s in streams:
            try:
                s.synchronize()
            except Exception as e:  # a faulted device still gets released
                errors.append(e)
        with self.lock:
            self.closed = True
            _open_states.discard(self)
            for s in streams:
                with contextlib.suppress(Exception):
                    s.close()
            self.compiled.clear()
            with contextlib.suppress(Exception):
                self.release_backend()


_open_states: weakref.WeakSet[_ContextState] = weakref.WeakSet()
# How long the interpreter's exit waits for work still pending on open contexts.
EXIT_WAIT_S = 10.0


def _setter(flag: threading.Event) -> Any:
    return lambda _e: flag.set()


@atexit.register
def _wait_at_exit() -> None:
    """At interpreter exit, wait (up to ``EXIT_WAIT_S`` in all) for the work still
    pending on contexts nobody closed, as closing them would; what has not
    finished by then is dropped with one warning on the ``asyncgpu`` logger.
    (Runs after the interpreter has joined the program's non-daemon threads and
    after ``atexit`` hooks registered later, such as a ``ctx.close``.)"""
    pending = []
    for state in list(_open_states):
        if state.closed:
            continue
        for s in state.all_streams():
            try:
                ev = s.point()
            except ContextClosedError:  # (closing on another thread: nothing new goes in)
                ev = s.tail()
            if ev is not None and not ev._done:
                pending.append((s.label, ev))
    if not pending:
        return
    deadline = time.monotonic() + EXIT_WAIT_S
    left = []
    for label, ev in pending:
        done = threading.Event()
        try:
            ev.add_done_callback(_setter(done))
        except Exception:  # a stream that cannot be asked any more
            continue
        if not done.wait(max(0.0, deadline - time.monotonic())):
            left.append(label)
    if left:
        logging.getLogger("asyncgpu").warning(
            "at exit, work on %s had not finished after %g s; it is dropped",
            ", ".join(left),
            EXIT_WAIT_S,
        )


class _Ref(native.RefCore):
    """One reference to a context state (a handle and the views made from it).
    ``open`` (a field of the compiled ``RefCore``) says whether it is open;
    ``owner`` is a weak reference to the handle whose ``close`` releases it (a
    view's ``close`` does not, while that handle lives)."""

    __slots__ = ("owner",)
    open: bool
    owner: weakref.ref[Any] | None

    def __init__(self) -> None:
        self.open = True
        self.owner = None
