"""DeviceEvent: the completion of one enqueued operation, awaitable from any loop.

Every ``enqueue_*`` returns a ``DeviceEvent``. It is done when the operation it
stands for has finished on its stream; its value is what the operation produced
(the return value of a CPU function, else ``None``) and its error is what the
operation raised. A user event from ``create_event`` is the same type: it stands
for the last point of a stream where it was recorded.

How an await resolves (docs/completion.md has the full story):

* an event that is already done returns at once, with no driver call;
* otherwise the stream is asked once whether the point was reached (on CUDA a
  plain read of a counter that the GPU writes into host-mapped memory);
* otherwise the awaiting task hands the event to its loop's reactor
  (``engine``), which polls every stream with pending awaits once per
  loop iteration and parks on a timer when nothing moves. Under trio, or from a
  thread, the engine's watcher thread resolves the wait.

Cancelling a task that awaits an event never cancels the operation: only the
waiter goes away, and a later await of the same event still works.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Generator
from functools import partial
from typing import TYPE_CHECKING, Any

from .._accel import native
from .._errors import AsyncGPUError, DeviceFaultError
from .pool import refuse_wait_from_own_work, waiting_for

__all__ = ["DeviceEvent"]

# The running loop or None, without raising: asyncio exports it (asyncio.events'
# __all__) for event loops and their helpers, and uvloop calls it too. The
# public get_running_loop raises where there is none (under trio), which would
# cost each trio await an exception.
_get_running_loop = asyncio._get_running_loop
_log = logging.getLogger("asyncgpu")
_get_ident = threading.get_ident


def _report_callback_error(fn: Any, e: BaseException) -> None:
    """A done callback raised, on a thread that cannot hand it to anyone: logged
    on the ``asyncgpu`` logger (printed to stderr when logging is not set up)."""
    _log.error("exception in the done callback %r", fn, exc_info=e)


def _await_event(ev: DeviceEvent) -> Generator[Any, None, Any]:
    """What the compiled await (``EventCore.__await__``, ``configure_await``)
    hands back to Python: an event never recorded on a stream (an error), and an
    await with no running asyncio loop (trio: the iterator of the stream's
    ``_trio_wait``, which returns the outcome). Every other await (done at once,
    done after one poll, the reactor's future of the running asyncio loop) stays
    in C."""
    stream = ev._stream
    if stream is None:
        raise AsyncGPUError("this event was never recorded on a stream")
    return _trio_waiting(stream, ev, True)


def _trio_waiting(stream: Any, ev: DeviceEvent, outcome: bool) -> Generator[Any, None, Any]:
    """Await outside asyncio: under trio, the stream's ``_trio_wait`` iterator
    itself (a plain generator: each layer of coroutines around it would cost
    every resumption of the await a frame), which returns the event's outcome
    when ``outcome``, else None."""
    trio = sys.modules.get("trio")
    if trio is None or not trio.lowlevel.in_trio_task():
        raise AsyncGPUError(
            "awaiting a DeviceEvent needs a running asyncio event loop (asyncio, uvloop, "
            "anyio's asyncio backend) or trio in this thread"
        )
    return stream._trio_wait(ev, outcome)  # type: ignore[no-any-return]


def _await_future(ev: DeviceEvent, fut: Any) -> Generator[Any, None, Any]:
    """The rest of an event's await in C whose stream gave a future that is not
    the extension's ``DirectFuture`` (an ``asyncio.Future``)."""
    yield from fut
    return ev._outcome()


class DeviceEvent(native.EventCore):
    """Completion point of an operation on a stream (``await``-able).

    ``await event`` (asyncio or trio) returns the operation's value or raises its
    error and never blocks the event loop; ``synchronize()`` blocks the calling
    thread; ``query()`` never blocks.

    Its fields, its ``__await__`` and its completion (``_finish``, called
    exactly once from any thread; ``_add_waiter``, False if it is already done)
    are the compiled ``EventCore``'s: the GIL alone makes each of them atomic.
    """

    __slots__ = ("__weakref__",)

    _stream: Any  # the stream it was recorded on (None: never recorded)
    _seq: int
    _done: bool
    _value: Any
    _error: BaseException | None
    _waiters: list[Any] | None
    _keep: Any  # what the operation keeps alive until it is done
    _lock: threading.Lock | None
    _node: Any
    _handle: Any  # backend object of a user event (a CUevent on CUDA)
    _timing: Any  # user events: timing on, and the host stamp

    def _wake_waiters(self, waiters: list[Any]) -> None:
        """Wake the waiters of this finished event (``EventCore._finish`` calls
        it): awaiting tasks first, then callbacks (which may start the stream's
        next operation), so tasks wake in completion order."""
        for w in waiters:
            if type(w) is _LoopWaiter:
                _wake(w)
        for w in waiters:
            if type(w) is not _LoopWaiter:
                try:
                    w(self)
                except BaseException as e:  # one broken callback must not strand the rest
                    _report_callback_error(w, e)

    def _trace_end(self) -> None:
        """Stamp the end of this traced operation (``EventCore._finish`` calls it
        before it marks the event done, with the outcome already set, so an
        awaiter never resumes before the trace has the end)."""
        ref = getattr(self._node, "_trace", None)
        trace = ref() if ref is not None else None
        if trace is not None:
            trace._on_done(self)

    def _outcome(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    # -- public face -------------------------------------------------------------

    def query(self) -> bool:
        """True if the operation has finished (successfully or not). Never blocks:
        on CUDA it reads the stream's completion counter (no driver call)."""
        if self._done:
            return True
        stream = self._stream
        return stream is not None and stream._poll(self)

    def synchronize(self) -> Any:
        """Block the calling thread until the operation has finished; return its
        value or raise its error. Works without any event loop."""
        self._wait_blocking()
        return self._outcome()

    def add_done_callback(self, fn: Callable[[DeviceEvent], None]) -> None:
        """Call ``fn(event)`` once the operation has finished, from whichever thread
        notices it (a pool thread, the engine's watcher, or this thread if the event
        is already done). ``fn`` must be quick and must not block; an exception
        it raises is logged on the ``asyncgpu`` logger (the event's other
        waiters are still woken). ``TypeError`` if ``fn`` is not callable."""
        if not callable(fn):
            raise TypeError(f"add_done_callback takes a callable, not {type(fn).__name__}")
        if self._done or self.query() or not self._add_waiter(fn):
            try:
                fn(self)
            except Exception as e:  # as from any other thread: the outcome must not
                _report_callback_error(fn, e)  # depend on whether it was done yet
            return
        stream = self._stream
        if stream is not None:
            stream._watch(self)

    if TYPE_CHECKING:  # (EventCore's: it hands the awaiting task the reactor's future)

        def __await__(self) -> Generator[Any, None, Any]: ...

    def _wait_async(self) -> Generator[Any, None, None]:
        """Wait for completion without returning the outcome."""
        if not self._done:
            waiting = self._wait_on()
            if waiting is not None:
                yield from waiting

    def _wait_on(self) -> Any:
        """What an await of this event must wait on: None if it is done (the stream
        is asked once, then, for a lone awaiter, briefly polled), else an asyncio
        future of the running loop, or, outside asyncio, an awaitable's iterator."""
        stream = self._stream
        if stream is None:
            raise AsyncGPUError("this event was never recorded on a stream")
        if stream._poll(self):
            return None
        refuse_wait_from_own_work(stream, self._seq)
        loop = _get_running_loop()
        if loop is not None:
            return stream._future(self, loop)
        return _trio_waiting(stream, self, False)

    def _wait_blocking(self) -> None:
        if not self._done:
            stream = self._stream
            if stream is None:
                raise AsyncGPUError("this event was never recorded on a stream")
            with waiting_for(stream, self._seq):
                stream._block(self)

    def _raise_fault(self) -> None:
        """Raise the event's error if it is a device fault (a stream-level wait
        reports faults, not the exceptions of individual CPU functions)."""
        if isinstance(self._error, DeviceFaultError):
            raise self._error

    def elapsed_time(self, end: DeviceEvent) -> float:
        """Milliseconds between this event and ``end`` on the device; both must be
        user events created with ``disable_timing=False`` and have completed."""
        stream = self._stream
        if stream is None or end._stream is None:
            raise AsyncGPUError("both events must have been recorded")
        return stream._elapsed_ms(self, end)

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        where = self._stream.label if self._stream is not None else "unrecorded"
        return f"<DeviceEvent {where} #{self._seq} {state}>"


class _UserEvent(DeviceEvent):
    """An event made by ``create_event``: it stands for the point of a stream
    where it was last recorded (``record_event``), and ``_point`` is the
    operation event that point waits behind (None: nothing was pending there),
    what a wait enqueued now waits for. ``_device`` is the (api, device id) it
    was made for: a record on another device's stream is refused."""

    __slots__ = ("_device", "_point")

    _device: tuple[str, int]
    _point: DeviceEvent | None

    @classmethod
    def _new(cls, device: tuple[str, int]) -> _UserEvent:
        ev = cls(None)
        ev._device = device
        ev._point = None
        return ev

    def _repoint(self, stream: Any, seq: int, point: DeviceEvent | None) -> None:
        """Point this event at the end of operation ``seq`` of ``stream`` (a
        record; ``point`` stands for it there), not done. An earlier record that
        is reached later finishes nothing (``_finish_at``): as with
        ``cuEventRecord``, the event stands for its latest record only."""
        with self._lock or _new_lock(self):
            self._stream = stream
            self._seq = seq
            self._point = point
            self._value = None
            self._error = None
            self._done = False

    def _finish_at(self, stream: Any, seq: int, error: BaseException | None) -> None:
        """The record (``stream``, ``seq``) was reached: finish this event, unless
        it was recorded again since. The lock makes the test and the finish one
        step against ``_repoint``; the waiters are woken outside it."""
        with self._lock or _new_lock(self):
            if self._done or self._stream is not stream or self._seq != seq:
                return
            self._error = error
            self._done = True
            self._point = None
            waiters, self._waiters = self._waiters, None
        if waiters:
            self._wake_waiters(waiters)

    def _wait_point(self) -> DeviceEvent | None:
        """What a wait enqueued now waits for (a snapshot: a later record does
        not move it); None when the latest record has been reached."""
        point = self._point
        if self._done or point is None or point._done:
            return None
        return point


_lock_guard = threading.Lock()


def _new_lock(ev: DeviceEvent) -> threading.Lock:
    with _lock_guard:
        if ev._lock is None:
            ev._lock = threading.Lock()
        return ev._lock


class _LoopWaiter:
    """An asyncio future, the thread that runs its loop, and that loop's inbox
    (the await of a push-completed event; polled streams' awaits are the
    reactor's own)."""

    __slots__ = ("fut", "inbox", "thread")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.fut = loop.create_future()
        self.thread = _get_ident()
        last = _last_inbox
        self.inbox = last[1] if last[0] is loop else _inbox_for(loop)


class _Inbox:
    """The wake-ups that other threads hand one event loop (an asyncio loop, a
    trio run): the waiters to finish there, and whether a callback to finish
    them is already on its way.

    Only the first wake-up of a burst schedules that callback (``send``:
    ``call_soon_threadsafe``, or trio's ``TrioToken.run_sync_soon``, each of
    which writes to the loop's wake-up pipe, a system call on the finishing
    thread); those that come before it runs join it, and it finishes them in
    the order they came (``finish`` each). A thread pool finishing many small
    operations otherwise makes one system call, and hands the loop one
    callback, per operation."""

    __slots__ = ("finish", "items", "lock", "send")

    def __init__(self, send: Callable[[Callable[[], None]], Any], finish: Callable[[Any], Any]):
        self.send = send
        self.finish = finish
        self.lock = threading.Lock()
        # Waiters to finish; while not empty, a drain callback is on its way.
        self.items: list[Any] = []

    def put(self, item: Any) -> None:
        """From any thread: finish ``item`` on the loop soon."""
        with self.lock:
            items = self.items
            items.append(item)
            if len(items) > 1:
                return
        try:
            self.send(self.drain)
        except RuntimeError:  # the loop is closed or the run over: nobody to wake
            with self.lock:
                self.items = []

    def drain(self) -> None:
        """On the loop: finish every waiter handed in so far, in order."""
        with self.lock:
            items = self.items
            self.items = []
        finish = self.finish
        for item in items:
            finish(item)


def _send_to_loop(ref: weakref.ReferenceType[asyncio.AbstractEventLoop], fn: Any) -> None:
    loop = ref()
    if loop is None:
        raise RuntimeError("the loop is gone")
    loop.call_soon_threadsafe(fn)


_inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Inbox] = weakref.WeakKeyDictionary()
_last_inbox: tuple[Any, Any] = (None, None)  # (the loop of the latest lookup, its inbox)


def _inbox_for(loop: asyncio.AbstractEventLoop) -> _Inbox:
    """The inbox of an asyncio loop (which it refers to weakly: it is the value
    of a dict weakly keyed by that loop)."""
    global _last_inbox
    with _lock_guard:
        inbox = _inboxes.get(loop)
        if inbox is None:
            inbox = _inboxes[loop] = _Inbox(partial(_send_to_loop, weakref.ref(loop)), _set_future)
    _last_inbox = (loop, inbox)
    return inbox


def _set_future(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(None)


def _wake(waiter: _LoopWaiter) -> None:
    if waiter.thread == _get_ident():
        _set_future(waiter.fut)
    else:
        waiter.inbox.put(waiter.fut)


def _loop_waiter(ev: DeviceEvent, loop: asyncio.AbstractEventLoop) -> _LoopWaiter | None:
    """Register an asyncio waiter on a push-completed event (None: already done)."""
    w = _LoopWaiter(loop)
    return w if ev._add_waiter(w) else None


class _TrioWaker:
    """One trio task waiting in ``trio.lowlevel.wait_task_rescheduled`` for its
    event: whoever sees the event done reschedules ``task``, on the run's
    thread, unless a cancellation has taken the task back first (``abort``),
    which leaves ``task`` None. (A ``trio.Event`` per await would do the same
    through a parking lot, at several times the cost per await.)"""

    __slots__ = ("inbox", "task")

    def __init__(self, task: Any, inbox: _Inbox | None = None) -> None:
        self.task: Any = task
        self.inbox = inbox  # the run's, for wake-ups from other threads

    def abort(self, raise_cancel: Any) -> Any:
        # Whoever holds this waker skips it when its event is done; trio raises
        # the cancellation in the task.
        self.task = None
        return sys.modules["trio"].lowlevel.Abort.SUCCEEDED

    def wake(self) -> None:
        """On the run's thread: reschedule the task unless its wait was given up."""
        task = self.task
        if task is not None:
            self.task = None
            sys.modules["trio"].lowlevel.reschedule(task)

    def done(self, _: DeviceEvent) -> None:
        """The event's done callback, from any thread: wake on the run's thread."""
        self.inbox.put(self)  # type: ignore[union-attr]


# One trio.lowlevel.RunVar per object that each trio run gets its own of (the
# run's inbox here, its reactor in the engine), made on first use.
_trio_run_vars: dict[str, Any] = {}


def _trio_run_local(trio: Any, name: str, make: Callable[[], Any]) -> Any:
    """The current trio run's object called ``name``, ``make()`` on first use."""
    var = _trio_run_vars.get(name)
    if var is None:
        var = _trio_run_vars.setdefault(name, trio.lowlevel.RunVar(name))
    try:
        return var.get()
    except LookupError:
        obj = make()
        var.set(obj)
        return obj


def _trio_inbox(trio: Any) -> _Inbox:
    """The inbox of the current trio run (through its token, from any thread;
    ``trio.RunFinishedError`` once the run is over is a ``RuntimeError``)."""
    return _trio_run_local(  # type: ignore[no-any-return]
        trio,
        "asyncgpu_inbox",
        lambda: _Inbox(trio.lowlevel.current_trio_token().run_sync_soon, _TrioWaker.wake),
    )


def _trio_wait_pushed(ev: DeviceEvent, outcome: bool) -> Generator[Any, None, Any]:
    """The trio await of a push-completed event (the CPU device), as the iterator
    that the event's ``__await__`` hands trio: the task waits in
    ``trio.lowlevel.wait_task_rescheduled``, and the thread that finishes the
    work reschedules it through the run's inbox (``TrioToken.run_sync_soon``,
    trio's public way in from another thread, once per burst). Returns the
    event's outcome (``outcome``), else None."""
    trio = sys.modules["trio"]
    lowlevel = trio.lowlevel
    waker = _TrioWaker(lowlevel.current_task(), _trio_inbox(trio))
    ev.add_done_callback(waker.done)
    yield from lowlevel.wait_task_rescheduled(waker.abort).__await__()
    return ev._outcome() if outcome else None


# What the compiled await calls: asyncio's running loop, and the Python awaits it
# hands back (above).
native.configure_await(_get_running_loop, _await_event, _await_future)
