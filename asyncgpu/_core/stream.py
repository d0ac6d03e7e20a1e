"""Streams: ordered queues of device work.

``_StreamImpl`` is the seam between the device-independent core and a device.
A backend subclasses it and implements the submission methods; the core
(``DeviceContext``, buffers, functions) calls only what is declared here.
Two completion styles exist:

* push (the CPU device): the thread that finishes an operation calls
  ``DeviceEvent._finish``; waiting means registering a waiter;
* poll (``_PolledStream``, CUDA): the device writes a completion counter after
  each operation; events complete in order when the counter passes their
  sequence number, and ``_retire`` finishes them.

The public face of one stream, ``DeviceStream``, lives in ``asyncgpu._api``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn

from .._accel import native
from .._errors import ContextClosedError, DeviceError, DeviceFaultError, UnsupportedError
from . import engine as _engine
from . import pool as _pool
from .event import DeviceEvent, _loop_waiter, _trio_wait_pushed, _UserEvent

if TYPE_CHECKING:
    import numpy as np

    from .._types import ConstantMemoryMapping
    from .protocols import LaunchedFunction

__all__ = ["_HostResult", "_PolledStream", "_StreamImpl"]


class _HostResult:
    """The value or error of host work on a polled stream, kept in the event's
    ``_value`` until the event is retired in order (a fault that fails the event
    first must not be overwritten by the host work finishing later).

    It also starts the host work enqueued right behind it on the same stream
    (``follow``): that work needs only this work's end, which the host sees
    first, not a marker's trip through the device and the engine's notice of it
    (each CPU function would wait up to a polling interval for that)."""

    __slots__ = ("ended", "error", "next", "value")

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.ended = False
        self.next: Callable[[], None] | None = None

    def end(self, value: Any, error: BaseException | None) -> Callable[[], None] | None:
        """Record the result; returns the host work to start next, if any."""
        self.value = value
        self.error = error
        with _follow_lock:
            self.ended = True
            nxt, self.next = self.next, None
        return nxt

    def follow(self, begin: Callable[[], None]) -> bool:
        """Have ``begin`` called when this work ends (False: it has ended)."""
        with _follow_lock:
            if self.ended:
                return False
            assert self.next is None  # only the op right behind follows
            self.next = begin
            return True


_follow_lock = threading.Lock()
_waiter_order = itertools.count()  # ties between issue waiters: first come, first called


# An event that is done: a wait for it orders nothing (what ``fence`` enqueues).
_DONE = DeviceEvent(None)
_DONE._done = True


class _Gate:
    """A point in a held stream's queue that later calls wait behind."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = False


class _StreamImpl:
    """One stream of one device (backend base class; push completion)."""

    label: str = "stream"
    priority: int = 0
    device_clock = False  # trace_stamp gives device timestamps (CUDA)
    # Set by ``begin_close`` under the lock every submission holds (a polled
    # stream's ``_submit_lock``, the compiled ``StreamCore``'s field there), and
    # read under it by every submission: an enqueue that overlaps ``close()``
    # either got in before the flag, and ``close()`` waits for it, or sees the
    # flag and is refused. Checking it before taking the lock would leave a gap
    # between the check and the submission.
    _closing = False

    def __init__(self, state: Any, index: int, priority: int) -> None:
        self.state = state
        self.index = index
        self.priority = priority
        self.label = f"{state.api}:{state.device_id}/s{index}"

    def trace_stamp(self) -> Any:
        """For tracing, where ``device_clock``: a device timestamp placed in stream
        order after the operation just enqueued (the CPU device has no clock of
        its own: its operations' host times are exact)."""
        raise NotImplementedError

    # -- submission (backends implement) ---------------------------------------------

    def copy(self, dst: Any, src: Any, nbytes: int, keep: Any) -> DeviceEvent:
        """Copy ``nbytes`` between two memory operands (see ``_buffer._Mem``)."""
        raise NotImplementedError

    def memset(self, dst: Any, value: np.generic, count: int, keep: Any) -> DeviceEvent:
        raise NotImplementedError

    def launch(
        self,
        fn: LaunchedFunction,
        args: tuple[Any, ...],
        cfg: Any,
        constant_memory: Sequence[ConstantMemoryMapping],
    ) -> DeviceEvent:
        """Launch ``fn`` with the backend's ``cfg`` (from ``make_launch_config``)."""
        raise NotImplementedError

    def cpu_call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> DeviceEvent:
        raise NotImplementedError

    def cpu_range(self, fn: Callable[[int], Any], count: int) -> DeviceEvent:
        raise NotImplementedError

    def wait_event(self, ev: DeviceEvent) -> DeviceEvent:
        """Make later work on this stream wait, on the device, for ``ev``."""
        raise NotImplementedError

    def tail(self) -> DeviceEvent | None:
        """The event of the last operation submitted (None: nothing yet)."""
        raise NotImplementedError

    def point(self) -> DeviceEvent | None:
        """The event standing for everything submitted to the stream so far (what
        ``await stream`` and ``enqueue_wait_for(stream)`` wait for)."""
        return self.tail()

    def fence(self) -> DeviceEvent:
        """An operation that does nothing: its event stands for everything
        submitted to the stream so far, by asyncgpu or, for a wrapped stream, by
        the library that owns it. Waiting for it orders after all of that. Never
        blocks."""
        return self.wait_event(_DONE)

    def wait_for_event_handle(self, handle: int) -> None:
        """Later work here waits, on the device, for the driver event ``handle``
        (another library's, at its latest record). Only CUDA streams can."""
        raise UnsupportedError(f"{self.label} cannot wait for a CUDA event")

    def record(self, ev: _UserEvent) -> None:
        """Re-point the user event ``ev`` at the current end of this stream."""
        raise NotImplementedError

    def synchronize(self) -> None:
        _pool.refuse_wait_from_own_work(self)
        ev = self.tail()
        if ev is not None:
            ev._wait_blocking()
            ev._raise_fault()

    @property
    def _submission_lock(self) -> Any:
        """The lock every submission of this stream holds (a backend's; ``_closing``
        is set and read under it)."""
        raise NotImplementedError

    def begin_close(self) -> None:
        """Refuse every submission from now on (``ContextClosedError``): the first
        step of the context's close, before it waits for the stream's work. The
        flag is set under the lock the submissions hold, so one in progress ends
        first (and is waited for)."""
        with self._submission_lock:
            self._closing = True

    def alloc_device(self, nbytes: int) -> Any:
        """Device memory owned by this stream, from the backend
        (``backend.alloc_device``: ``cuMemAllocFromPoolAsync`` on this stream, or
        memory the stream kept; never blocks for the device), allocated as a
        submission: under the submission lock, refused with
        ``ContextClosedError`` once ``close()`` has begun. So an allocation
        racing with ``close()`` either ends before the close goes on (which then
        waits for it and, later, destroys the stream it was made on) or is
        refused; it never reaches a stream being destroyed. (The compiled
        ``enqueue_create_buffer`` hands out memory the stream kept without this
        lock, reading ``_closing`` under the GIL in the same step as the take.)"""
        with self._submission_lock:
            if self._closing:
                self._refuse_closed()
            return self.state.backend.alloc_device(nbytes, self)

    def alloc_host(self, nbytes: int) -> Any:
        """Host memory the device can reach, for a host buffer this stream owns
        (``backend.alloc_host``: the pinned pool on CUDA, ``cuMemHostAlloc``
        where it has no block of the size, which can block for long). Taken
        outside the submission lock, since no stream is used (a submission or
        an await there would wait for it), and kept only under the lock: once
        ``close()`` has begun it is given back and ``ContextClosedError``
        raised, so a host buffer is never made after the close went on."""
        alloc = self.state.backend.alloc_host(nbytes, self)
        with self._submission_lock:
            if not self._closing:
                return alloc
        alloc.release(self)
        self._refuse_closed()

    def _refuse_closed(self) -> NoReturn:
        """Raise the closed context's error (a submission that found ``_closing``;
        the compiled submissions call it too)."""
        raise ContextClosedError(f"the DeviceContext {self.state.describe()} is closed")

    def close(self) -> None:
        """Release the stream (after its work is done)."""

    def _settle(self) -> None:
        """Block until everything submitted so far has been handed to the driver
        (only polled streams ever hold work back)."""

    # -- ordering with streams of other libraries (``foreign``; CUDA) ---------------

    def wait_for_handle(self, producer: int) -> None:
        """Later work here waits, on the device, for what the foreign stream
        ``producer`` has been given so far."""
        self.state.backend.stream_waits_for_stream(self.handle(), producer)

    def order_handle_after(self, waiter: int, settle: bool = True) -> None:
        """The foreign stream ``waiter`` waits, on the device, for everything
        enqueued here so far."""
        self.state.backend.stream_waits_for_stream(waiter, self.handle())

    def handle(self) -> int:
        """The native handle (``CUstream`` address on CUDA, 0 on the CPU device)."""
        return 0

    # -- completion (push style; polled streams override) ---------------------------

    def _poll(self, ev: DeviceEvent) -> bool:
        return ev._done

    def _block(self, ev: DeviceEvent) -> None:
        flag = threading.Event()
        if ev._add_waiter(lambda _e: flag.set()):
            flag.wait()

    def _watch(self, ev: DeviceEvent) -> None:
        pass

    def _future(
        self, ev: DeviceEvent, loop: asyncio.AbstractEventLoop
    ) -> asyncio.Future[Any] | None:
        """A future of ``loop`` that completes with ``ev`` (None: ``ev`` is done).
        Host work of this stream awaiting its own operation (through a loop of
        its own) gets ``RuntimeError``, as a blocking wait does."""
        if not ev._done:
            _pool.refuse_wait_from_own_work(self, ev._seq)
        w = _loop_waiter(ev, loop)
        return w.fut if w is not None else None

    def _trio_wait(self, ev: DeviceEvent, outcome: bool = True) -> Generator[Any, None, Any]:
        """Under trio, wait until ``ev`` is done (the stream was asked once); then
        return its outcome (``outcome``), else None."""
        return _trio_wait_pushed(ev, outcome)

    def _elapsed_ms(self, start: DeviceEvent, end: DeviceEvent) -> float:
        t0 = start._timing
        t1 = end._timing
        if not (start._done and end._done):
            raise RuntimeError("elapsed_time needs both events to have completed")
        if isinstance(t0, bool) or isinstance(t1, bool):
            raise ValueError("elapsed_time needs events created with disable_timing=False")
        return (float(t1) - float(t0)) / 1e6


class _HardwareQueues:
    """Whether the streams of one device each have a hardware queue of their own
    (``solo``); see ``_PolledStream._need``. A backend whose streams share the
    device's queues (CUDA) keeps one per device up to date."""

    __slots__ = ("limit", "solo", "streams")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.solo = True
        self.streams: Any = ()


_OWN_QUEUES = _HardwareQueues(0)  # for streams that share no queue


class _PolledStream(native.StreamCore, _StreamImpl):
    """A stream whose completions are learned by polling markers.

    Every operation gets a sequence number. A *marker* placed after operation
    ``n`` lets the host learn, once the device passes it, that everything up to
    ``n`` has finished: ``_completed()`` returns the highest such number, and
    events finish in order as it grows. Markers are lazy: one is placed only
    when a completion must be known (an await, a query, a callback, a
    cross-stream wait, a synchronize) or when the user still holds the event of
    the stream's last operation as the next one is enqueued, and at least every
    ``MARK_EVERY`` operations so that what finished work kept alive is released.
    Fire-and-forget work therefore costs no marker.

    Subclasses implement ``_place_marker`` (under ``_submit_lock``: a marker for
    everything submitted so far) and ``_completed``.

    The bookkeeping fields (``_seq``, ``_marked``, ``_awaited``, ``_eager``,
    ``_inflight``, the locks, ...) are the compiled ``StreamCore``'s (the first
    base, so that its methods come before the push-style ones of ``_StreamImpl``), which the
    CUDA launch reads and writes directly, and so are ``_poll`` (whether an
    event is done: a marker covering it through ``_need``, counted as awaited,
    then ``_retire`` if the markers have passed it), ``_retire`` (finish, in
    order, every event the markers have passed, a kernel, copy or memset in C
    and host work through ``_finish_retired``; True when nothing is left in
    flight) and ``_before_submit``. That one is called under ``_submit_lock``
    before a new operation is submitted: it marks the stream's last operation
    now if the user still holds its event (it may be awaited later, and a
    marker placed later would also wait for the new operation), or if
    ``MARK_EVERY`` operations went unmarked; and it leaves eager mode when the
    last operation was neither awaited nor is still held.

    Held submission: work enqueued behind host work (a CPU function, a staged
    copy) is not handed to the driver until that host work has finished. While
    a stream is held, ``_pending`` is a deque of driver calls ``(seq, call)``
    and ``_Gate`` objects; a gate blocks the calls behind it until it opens,
    and the thread that opens it hands them to the driver (``_drain``). So no
    stream ever waits on the device for memory that only the host writes: the
    driver does not see that ordering and may block in other calls (module
    loads) until such a wait ends, which deadlocks when the host work waits for
    the blocked thread. ``_issued_mark`` is the highest marker handed to the
    driver; ``_when_issued`` lets another stream's gate open once a marker
    covering a given operation has been.
    """

    MARK_EVERY = 32
    _queues: _HardwareQueues = _OWN_QUEUES  # the device's hardware queues

    def __init__(self, state: Any, index: int, priority: int) -> None:
        super().__init__(state, index, priority)
        self._seq = 0  # last sequence number handed out
        self._marked = 0  # sequence number covered by the last marker placed
        self._awaited = 0  # highest sequence number awaited or called back
        self._eager = False  # place a marker after every operation
        self._touched = False  # submitted to since the watcher's last sweep
        # (the extension's ring of events, oldest first, with the deque operations
        # the streams use, which its launch and retire reach without a method call)
        self._inflight = native.EventQueue()
        # Re-entrant: interop helpers submit under a caller's hold of it. (The
        # extension's RLock: its C code takes them without a Python call.)
        self._submit_lock = native.RLock()
        self._retire_lock = native.RLock()
        self._fault: BaseException | None = None
        self._pending: deque[Any] | None = None  # not None: held (see the class doc)
        self._issued_mark = 0
        # A heap of (seq, order, callback): the drain that issues a marker takes the
        # waiters it covers from the top (a list scanned whole on every drain makes
        # draining many held operations quadratic).
        self._issue_waiters: list[tuple[int, int, Callable[[], None]]] = []

    @property
    def _submission_lock(self) -> Any:
        # (the compiled ``before_submit``, which every submission calls under
        # ``_submit_lock``, refuses once ``_closing`` is set)
        return self._submit_lock

    def alloc_device(self, nbytes: int) -> Any:
        """``_StreamImpl.alloc_device``'s steps, compiled (``_alloc_device_c``),
        which the compiled ``enqueue_create_buffer`` takes for its new
        allocations too: under ``_submit_lock``, refused once ``_closing`` is
        set, ``backend.alloc_device(nbytes, self)``."""
        return self._alloc_device_c(nbytes)

    def _completed(self) -> int:
        """The highest sequence number known to have finished (never blocks)."""
        raise NotImplementedError

    def _place_marker(self, counter: bool = False) -> None:
        raise NotImplementedError

    def _need(self, ev: DeviceEvent, eager: bool = True, waited: bool = True) -> None:
        """Make sure a marker covers ``ev`` (placing one now if none does).

        A stream whose completions are being awaited or called back
        (``eager=True``) switches to eager markers: one right after each
        operation, so the device writes it as soon as the work ends. It switches
        back once an operation goes unawaited and unheld (``_before_submit``).
        Blocking waits (``eager=False``) place their marker when they block and
        do not switch a lazy stream to eager, but they count as waits
        (``waited``): an eager stream whose every operation is awaited or
        synchronized stays eager (otherwise a ``synchronize()`` between two
        awaits makes the second await place its marker late, from Python, which
        slows its round trip). The watcher's sweep
        (``waited=False``) only marks. And no stream is eager while its
        device's hardware queues are shared (``_queues.solo`` false): a marker
        right after a long kernel holds up the next work of every stream that
        shares the kernel's queue, so those streams would run their kernels one
        after another instead of overlapping."""
        if waited and ev._seq > self._awaited:
            self._awaited = ev._seq
        if eager and self._queues.solo:
            self._eager = True
        if ev._seq > self._marked:
            with self._submit_lock:
                if ev._seq > self._marked and not ev._done:
                    self._place_marker()

    def tail(self) -> DeviceEvent | None:
        inflight = self._inflight
        try:
            return inflight[-1]
        except IndexError:
            return None

    def _finish_retired(self, ev: DeviceEvent) -> None:
        """Finish a retired event that ``_retire`` hands back (host work, whose
        value is its staged result, or an event with a lock)."""
        v = ev._value
        if type(v) is _HostResult:  # host work (CUDA): its staged result
            ev._finish(v.value, v.error)
        else:
            ev._finish(v, ev._error)

    def _watch(self, ev: DeviceEvent) -> None:
        self._need(ev)
        _engine.watcher.watch(self, ev._seq)

    # The asyncio await (marker, brief inline spin, else the loop's reactor): the
    # engine's function itself, so the await's hot path has one call fewer.
    _future = _engine.polled_future
    # The trio await (brief polling at checkpoints, else the run's reactor).
    _trio_wait = _engine.trio_wait

    def _block(self, ev: DeviceEvent) -> None:
        self._need(ev, eager=False)
        completed = self._completed
        seq = ev._seq
        t0 = last_check = time.perf_counter()
        delay = 0.00002
        while completed() < seq and not ev._done:
            now = time.perf_counter()
            if now - t0 > 0.00005:
                time.sleep(delay)
                delay = min(delay * 2, 0.0002)  # noticed at most ~0.2 ms late
                if now - last_check > 0.005:
                    last_check = now
                    self._check_fault()
        self._retire()

    # -- held submission (see the class docstring) ------------------------------------

    def _hold(self, gate: _Gate | None = None) -> _Gate:
        """Under ``_submit_lock``: hold everything submitted from now on until the
        gate (a new one, or ``gate``) opens (``_open``)."""
        if gate is None:
            gate = _Gate()
        if self._pending is None:
            self._pending = deque((gate,))
        else:
            self._pending.append(gate)
        return gate

    def _issue(self, seq: int, call: Callable[..., Any], *args: Any) -> None:
        """Under ``_submit_lock``: ``call(*args)`` (a driver call of operation
        ``seq``; 0: not an operation of its own) now, or once the gates before it
        have opened while the stream is held."""
        if self._pending is None:
            call(*args)
        else:
            self._pending.append((seq, partial(call, *args)))

    def _open(self, gate: _Gate) -> None:
        """Open ``gate`` and hand what it held back to the driver (any thread)."""
        gate.open = True
        self._drain()

    def _drain_prepare(self) -> None:
        """Called before a drain makes driver calls (CUDA: make the context current)."""

    def _drain(self) -> None:
        """Hand held calls to the driver, in order, up to the first closed gate."""
        if self._pending is None:
            return
        self._drain_prepare()
        failed: list[tuple[int, BaseException]] = []
        with self._submit_lock:
            p = self._pending
            while p:
                item = p[0]
                if type(item) is _Gate:
                    if not item.open:
                        break
                    p.popleft()
                    continue
                p.popleft()
                try:
                    item[1]()
                except Exception as exc:
                    failed.append((item[0], exc))
            if p is not None and not p:
                self._pending = None
            fire = self._take_issue_waiters()
        for seq, err in failed:
            self._submit_failed(seq, err)
        for cb in fire:
            cb()

    def _take_issue_waiters(self) -> list[Callable[[], None]]:
        """Under ``_submit_lock``: the callbacks of the waiters that the markers
        handed to the driver so far cover, in the order they must run."""
        ws = self._issue_waiters
        if not ws or ws[0][0] > self._issued_mark:
            return []
        mark = self._issued_mark
        ready = []
        while ws and ws[0][0] <= mark:
            ready.append(heapq.heappop(ws)[2])
        return ready

    def _when_issued(self, seq: int, cb: Callable[[], None]) -> bool:
        """Call ``cb`` once a marker covering operation ``seq`` has been handed to
        the driver. False (and no call) if that has already happened."""
        with self._submit_lock:
            if self._issued_mark >= seq:
                return False
            heapq.heappush(self._issue_waiters, (seq, next(_waiter_order), cb))
            return True

    def _submit_failed(self, seq: int, err: BaseException) -> None:
        """A held call failed when the driver got it: the operation's awaiters get
        the error (a failed marker fails everything in flight, which would
        otherwise never be seen to finish)."""
        if not isinstance(err, DeviceError):
            err = DeviceError(f"submitting held operation #{seq} on {self.label}: {err}")
        if seq <= 0:
            self._fail(err)
            return
        for ev in list(self._inflight):
            if ev._seq == seq:
                if ev._error is None:
                    ev._error = err
                return

    def _settle(self) -> None:
        """Block until everything submitted so far has been handed to the driver."""
        if self._pending is None:
            return
        handed = threading.Event()
        with self._submit_lock:
            p = self._pending
            if p is None:
                return
            p.append((0, handed.set))
        # (Held work here is held behind host work: a CPU function of this
        # stream would wait for itself.)
        with _pool.waiting_for(self):
            while not handed.wait(0.005):
                self._check_fault()

    # -- faults ----------------------------------------------------------------------

    def _query_fault(self) -> BaseException | None:
        """Ask the driver whether the stream's context has a sticky fault."""
        return None

    def _check_fault(self) -> None:
        if not self._inflight:
            return
        err = self._fault or self._query_fault()
        if err is not None:
            self.state.fail_all(err)

    def _fail(self, err: BaseException) -> None:
        """Fail every event still in flight (the device will never finish them)."""
        self._fault = err
        with self._retire_lock:
            pending = list(self._inflight)
            self._inflight.clear()
        for ev in pending:
            e = DeviceFaultError(
                f"{err} (operation #{ev._seq} on {self.label} did not complete)",
                code=getattr(err, "code", None),
                name=getattr(err, "name", None),
            )
            ev._finish(None, e)
