"""The completion engine: who notices that polled (GPU) work has finished.

Push-completed streams (the CPU device) finish their events from the pool
threads that run the work, so they need nothing from here but the pool.
Poll-completed streams (CUDA) expose a monotonically increasing completion
counter that the GPU writes into host-mapped memory at each marker (markers are
placed where a completion can be waited for; see ``stream._PolledStream``), and
events on one stream complete in submission order, so noticing completions
costs one plain memory read per stream, whatever the number of pending events.

Two pollers read those counters:

* ``_Reactor``: one per asyncio event loop, a task on that loop. It polls every
  stream with pending awaits once per loop iteration while completions keep
  coming (``SPIN_S``), then parks on a timer (``PARK_S`` backing off to
  ``PARK_MAX_S``), so a long kernel costs almost no CPU. Wake-ups it causes happen
  on its own loop, as many per iteration as fit in ``ITERATION_S`` (measured
  from the iterations before): no thread hop, no self-pipe write, and no loop
  iteration long enough to starve other tasks. With the extension each
  iteration's batch runs in one loop callback (``_wake_batch``) that finishes
  each ``DirectFuture`` and runs its task's step at once; without it, plain
  ``set_result`` calls.
* ``_Watcher``: one thread per process, for everything that is not an asyncio
  await (``add_done_callback``, trio awaits, CPU functions enqueued behind GPU
  work, sweeping finished work so that what it kept alive is released). It
  spins briefly, then sleeps with backoff, and stops when it has nothing to do.

Both ask the stream for sticky device faults whenever they have been idle for
``FAULT_CHECK_S`` and fail every pending event of the faulted context, so no
await hangs after a fault.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import contextvars
import heapq
import operator
import threading
import time
import weakref
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any

from .. import _config
from .._accel import native
from .event import _set_future

if TYPE_CHECKING:
    from .event import DeviceEvent
    from .protocols import PolledStream as _PolledStream

__all__ = ["polled_future", "reactor_for", "watcher"]

SPIN_S = 0.0005  # keep polling every loop iteration this long after the last progress
PARK_S = 0.001  # then poll on a timer this often, backing off up to PARK_MAX_S
PARK_MAX_S = 0.008  # (a timer wake-up costs the OS and asyncio more CPU than a poll)
FAULT_CHECK_S = 0.005  # ask the driver for sticky faults when idle this long
WAKE_MIN = 8
WAKE_MAX = 256
INLINE_SPIN_S = 0.00003  # a lone awaiter spins inline this long before using the reactor


# Futures a reactor completes per loop iteration: as many woken tasks as fit in
# ITERATION_S, judged by the last iteration's time per woken task, within
# WAKE_MIN..WAKE_MAX. Another task on the loop then waits about 2.5 budgets (the
# rest of the iteration in which its timer fires, that iteration, and the next
# one's earlier callbacks), so the budget trades that task's latency against the
# awaits moved per iteration; the benchmark suite's engine_iteration_budget_sweep
# measures settings side by side (see the performance page).
ITERATION_S = _config.SETTINGS.wake_budget_s  # $ASYNCGPU_WAKE_BUDGET_MS, read at import
InvalidStateError = asyncio.InvalidStateError
_monotonic = time.perf_counter
# The future of a reactor's await: the extension's DirectFuture, which the
# reactor completes by running the awaiting task's step at once (``_wake_batch``);
# configure_futures hands it what it needs of contextvars and asyncio.
_Future: Any = native.DirectFuture
native.configure_futures(contextvars.copy_context, asyncio.CancelledError, InvalidStateError)
_first = operator.itemgetter(0)


# -- asyncio reactor --------------------------------------------------------------


class _Reactor:
    """Polls the streams awaited from one asyncio loop.

    The reactor owns its awaits: ``pending`` maps each stream to its awaits, a
    deque of ``(seq, event, future)`` in sequence order, and the reactor alone
    completes those futures, once the event is done. No waiter is registered on
    the event, so whichever thread finishes the work (this reactor's retire, the
    watcher's sweep, another thread's ``synchronize``, a fault), the tasks wake
    in the order the reactor pops them: the stream's completion order."""

    __slots__ = (
        "__weakref__",
        "batch",
        "deferred",
        "held_waits",
        "kicked",
        "loop",
        "park",
        "pending",
        "task",
        "woke_at",
        "woken",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.pending: dict[_PolledStream, deque[tuple[int, DeviceEvent, asyncio.Future[Any]]]] = {}
        self.park: asyncio.Future[Any] | None = None  # set while parked on a timer
        # Futures of finished events, completed ``batch`` per iteration so that a
        # burst of completions never makes one loop iteration long (loop lag).
        self.deferred: deque[asyncio.Future[Any]] = deque()
        self.batch = WAKE_MIN
        self.woken = 0  # futures completed at ``woke_at``
        self.woke_at = 0.0
        self.task: asyncio.Task[None] | None = None
        self.kicked = False  # a new await ended the park: spin for SPIN_S again
        # (stream, seq) whose marker's hand-over to the driver will wake this
        # reactor (_behind_host_work)
        self.held_waits: set[tuple[_PolledStream, int]] = set()

    def add(
        self, stream: _PolledStream, ev: DeviceEvent, fut: asyncio.Future[Any] | None = None
    ) -> asyncio.Future[Any]:
        """A future (``fut``, else a new one) that this reactor completes once ``ev``
        is done (on the loop's thread, the only one that calls it). The usual case,
        an await behind the pending ones of a stream while the reactor runs, is
        inline in ``polled_future``."""
        if fut is None:
            fut = _Future(loop=self.loop)
        self._insert(stream, ev._seq, ev, fut)
        if self.task is None:
            self.task = self.loop.create_task(self._run(), name="asyncgpu-reactor")
        elif self.park is not None:
            # Parked on a timer: poll now instead, and keep polling every
            # iteration for SPIN_S, as after progress (else the reactor would
            # park again at once, and work that takes longer than the await's
            # inline spin would be seen only when the 1-8 ms timer fires).
            self.kicked = True
            _set_future(self.park)
        return fut

    def _insert(
        self, stream: _PolledStream, seq: int, ev: DeviceEvent, fut: asyncio.Future[Any]
    ) -> None:
        awaits = self.pending.get(stream)
        if awaits is None:
            self.pending[stream] = deque(((seq, ev, fut),))
        elif awaits[-1][0] <= seq:
            awaits.append((seq, ev, fut))
        else:  # an earlier operation awaited after a later one: keep the order
            awaits.insert(bisect.bisect_right(awaits, seq, key=_first), (seq, ev, fut))

    def _poll_once(self) -> bool:
        """Retire every stream whose counter passed its first await, and queue the
        futures of the awaits whose events are done, in order. An event can be
        done with the counter short of it (a fault failed it, its stream
        closed), or past it and not yet done (another thread's retire took it
        and is finishing it): only ``_done`` says the outcome is there."""
        moved = False
        pending = self.pending
        deferred = self.deferred
        for stream, awaits in list(pending.items()):
            seq, ev, fut = awaits[0]
            if not ev._done:
                if stream._completed() < seq:
                    continue
                stream._retire()
                if not ev._done:
                    if ev._stream is not stream or ev._seq != seq:
                        # A user event recorded again since the await began: wait
                        # for its new point, where it now is.
                        awaits.popleft()
                        if not awaits:
                            del pending[stream]
                        self._insert(ev._stream, ev._seq, ev, fut)  # type: ignore[arg-type]
                        moved = True
                    continue
            while True:
                deferred.append(fut)
                awaits.popleft()
                if not awaits:
                    del pending[stream]
                    break
                seq, ev, fut = awaits[0]
                if not ev._done:
                    break
            moved = True
        return moved

    def _behind_host_work(self) -> bool:
        """True when the first await of every pending stream waits for host work
        (a CPU function, a staged copy) that has not yet let its marker reach the
        driver; each such stream then wakes this reactor, from the thread that
        hands that marker over, through ``call_soon_threadsafe``.

        Polling every iteration cannot see that work finish sooner, and it keeps
        the GIL from the pool threads doing the work: a spinning loop takes the
        GIL back as soon as it drops it, so a pool thread waits for the switch
        interval (``sys.getswitchinterval()``, far longer than a small copy)."""
        if not self.pending:
            return False
        for stream, awaits in self.pending.items():
            seq = awaits[0][0]
            if stream._pending is None or stream._issued_mark >= seq:
                return False  # the device may finish it at any moment
        for stream, awaits in self.pending.items():
            key = (stream, awaits[0][0])
            if key in self.held_waits:
                continue
            if not stream._when_issued(key[1], partial(self._wake_from, key)):
                return False  # handed over meanwhile
            self.held_waits.add(key)
        return True

    def _wake_from(self, key: tuple[_PolledStream, int]) -> None:
        """From the thread that handed the driver the marker of ``key``."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to wake
            self.loop.call_soon_threadsafe(self._woken_by, key)

    def _woken_by(self, key: tuple[_PolledStream, int]) -> None:
        self.held_waits.discard(key)
        self.kicked = True
        if self.park is not None:
            _set_future(self.park)

    def _check_faults(self) -> None:
        """Ask the driver whether a stream with pending awaits has faulted. A
        faulted stream's events have been failed; the next ``_poll_once`` wakes
        their awaiters (work that finished meanwhile is retired there too: a
        stream dropped without retiring it leaves its awaits hanging, as
        ``test_every_enqueue_returns_an_awaitable_event[cuda]`` checks)."""
        for stream in list(self.pending):
            stream._check_fault()

    def _wake_some(self) -> None:
        """Complete the next batch of queued futures. Called once per reactor
        step, so once per loop iteration while there is work: the tasks woken
        by the previous call have run since, and the time per woken task sizes
        this batch."""
        now = _monotonic()
        if self.woken:
            per_task = max((now - self.woke_at) / self.woken, 1e-7)
            self.batch = max(WAKE_MIN, min(WAKE_MAX, round(ITERATION_S / per_task)))
        d = self.deferred
        n = min(self.batch, len(d))
        popleft = d.popleft
        self.loop.call_soon(_wake_batch, [popleft() for _ in range(n)])
        self.woken = n
        self.woke_at = now

    async def _run(self) -> None:
        sleep = asyncio.sleep
        loop = self.loop
        last = _monotonic()
        checked = last
        try:
            while self.pending or self.deferred:
                moved = self._poll_once()
                if self.deferred:
                    self._wake_some()
                    moved = True
                if moved:
                    last = checked = _monotonic()
                    await sleep(0)
                    continue
                now = _monotonic()
                behind = self._behind_host_work()
                if now - last < SPIN_S and not behind:
                    await sleep(0)
                    continue
                if now - checked >= FAULT_CHECK_S:
                    checked = now
                    self._check_faults()
                    if self._poll_once():  # failed, or finished while the driver was asked
                        last = _monotonic()
                        await sleep(0)
                        continue
                # Park on a timer, longer the longer nothing has moved (at most a
                # tenth of the time since the last progress, so a 200 ms kernel
                # is noticed within ~8 ms, 4% of its time); a new await
                # (``add``) ends the park at once.
                park = self.park = loop.create_future()
                timer = loop.call_later(
                    min(PARK_MAX_S, max(PARK_S, (now - last) / 10)), _set_future, park
                )
                try:
                    await park
                finally:
                    self.park = None
                    timer.cancel()
                if self.kicked:
                    self.kicked = False
                    last = _monotonic()
        finally:
            self.task = None
            self.park = None
            d = self.deferred
            while d:  # never strand a waiter (cancelled, or its loop is closing)
                _set_future(d.popleft())


def _wake_batch(futs: list[Any]) -> None:
    """Wake the awaits of a batch of ``DirectFuture`` in order: each ``wake``
    runs its awaiting task's step here. A plain loop callback (the reactor's
    ``_wake_some`` schedules it), because asyncio runs a task's step only
    outside any other task's step. A done callback's exception is reported as
    asyncio reports one from a callback; ``KeyboardInterrupt`` and
    ``SystemExit`` (which a task's step lets through) leave the rest of the
    batch to ``loop.call_soon`` and propagate."""
    for i, fut in enumerate(futs):
        try:
            fut.wake()
        except Exception as exc:
            fut._loop.call_exception_handler(
                {
                    "message": "exception in a callback of an asyncgpu await",
                    "exception": exc,
                    "future": fut,
                }
            )
        except BaseException:
            for rest in futs[i + 1 :]:
                _set_future(rest)
            raise


_reactors: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Reactor] = (
    weakref.WeakKeyDictionary()
)
_reactors_lock = threading.Lock()


def reactor_for(loop: asyncio.AbstractEventLoop) -> _Reactor:
    r = _reactors.get(loop)
    if r is None:
        with _reactors_lock:
            r = _reactors.get(loop)
            if r is None:
                # A reactor refers to its loop, so the weak key alone never lets
                # an entry go: the reactors of closed loops are dropped here,
                # with the streams their unfinished awaits held (a program that
                # calls asyncio.run again and again would keep every loop, and
                # every context awaited when one closed, for good).
                for old in [lp for lp in _reactors if lp.is_closed()]:
                    del _reactors[old]
                r = _reactors[loop] = _Reactor(loop)
    return r


def polled_future(
    stream: _PolledStream, ev: DeviceEvent, loop: asyncio.AbstractEventLoop
) -> asyncio.Future[Any] | None:
    """The asyncio await of a polled stream (its ``_future``): a marker covering
    ``ev`` if none does yet, then a future the reactor completes, or None when
    the event finished during a brief inline spin.

    The inline spin happens only for a lone awaiter (the reactor has nothing else
    pending) while the loop has no other callback ready to run (the idle
    reactor's own last step aside), so it delays no runnable task; it lasts at
    most ``INLINE_SPIN_S``, about the time a short kernel takes to come back.
    """
    global _last
    if not stream._eager or ev._seq > stream._marked:
        stream._need(ev)  # (after _poll, an eager stream has marked and counted ev)
    last = _last
    if last[0] is loop:
        reactor = last[1]
    else:
        reactor = reactor_for(loop)
        _last = (loop, reactor)
    # The loop's ready queue may hold the idle reactor's own next step (it runs
    # once more after its last wake-up); anything else ready means no spin.
    ready = getattr(loop, "_ready", None)
    if (
        ready is not None
        and not reactor.pending
        and len(ready) <= (reactor.task is not None and not reactor.deferred)
        and (stream._pending is None or stream._issued_mark >= ev._seq)  # not behind host work
    ):
        completed = stream._completed
        seq = ev._seq
        deadline = _monotonic() + INLINE_SPIN_S
        while completed() < seq:
            if _monotonic() > deadline:
                break
        else:
            stream._retire()
            if ev._done:
                return None
    # (``reactor.add``'s usual case, inline: the await's hot path)
    fut: asyncio.Future[Any] = _Future(loop=loop)
    awaits = reactor.pending.get(stream)
    if (
        awaits is not None
        and awaits[-1][0] <= ev._seq
        and reactor.park is None
        and reactor.task is not None
    ):
        awaits.append((ev._seq, ev, fut))
        return fut
    return reactor.add(stream, ev, fut)


_last: tuple[Any, Any] = (None, None)


# -- the watcher thread -------------------------------------------------------------


class _Watcher:
    """One daemon thread resolving callback waits on polled streams."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._kicked = False  # a new watch: poll often again (as after progress)
        self._pending: dict[_PolledStream, list[int]] = {}
        self._sweep: set[_PolledStream] = set()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def watch(self, stream: _PolledStream, seq: int) -> None:
        with self._cond:
            heap = self._pending.get(stream)
            if heap is None:
                self._pending[stream] = [seq]
            else:
                heapq.heappush(heap, seq)
            self._kicked = True
            self._ensure_running()
            self._cond.notify()

    def sweep_later(self, stream: _PolledStream) -> None:
        """Retire ``stream``'s finished work soon even if nobody waits on it, so the
        objects its operations keep alive are released."""
        if stream in self._sweep:
            return
        with self._cond:
            self._sweep.add(stream)
            self._ensure_running()
            self._cond.notify()

    def forget(self, stream: _PolledStream) -> None:
        with self._cond:
            self._pending.pop(stream, None)
            self._sweep.discard(stream)

    def _ensure_running(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._main, name="asyncgpu-watcher", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        self._thread = None

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def _main(self) -> None:
        last = checked = swept = _monotonic()
        delay = 0.00005
        while True:
            with self._cond:
                while not self._pending and not self._sweep and not self._stopping:
                    if not self._cond.wait(timeout=1.0) and not self._pending and not self._sweep:
                        self._thread = None
                        return
                if self._stopping:
                    return
                items = list(self._pending.items())
                sweep = list(self._sweep) if _monotonic() - swept > 0.01 else ()
                if self._kicked:  # a new watch: spin, then back off, from the start
                    self._kicked = False
                    last = _monotonic()
                    delay = 0.00005
            moved = False
            for stream, heap in items:
                c = stream._completed()
                if heap and heap[0] <= c:
                    stream._retire()
                    moved = True
                    with self._cond:
                        while heap and heap[0] <= c:
                            heapq.heappop(heap)
                        if not heap and self._pending.get(stream) is heap:
                            del self._pending[stream]
            if sweep:
                swept = _monotonic()
                for stream in sweep:
                    if stream._touched:  # busy: its own awaits and enqueues retire it
                        stream._touched = False
                        continue
                    tail = stream.tail()
                    if tail is not None:
                        stream._need(tail, eager=False, waited=False)  # a marker, so work retires
                    if stream._retire():
                        with self._cond:
                            self._sweep.discard(stream)
            now = _monotonic()
            if moved:
                last = checked = now
                delay = 0.00005
                continue
            if now - checked >= FAULT_CHECK_S:
                checked = now
                for stream, _ in items:
                    stream._check_fault()
                    if stream._fault is not None:
                        with self._cond:
                            self._pending.pop(stream, None)
            if now - last < SPIN_S and items:
                time.sleep(0)
            else:
                # Park on the condition, not in time.sleep: a new watch() (a CPU
                # function behind GPU work, a callback) wakes the thread at once.
                with self._cond:
                    if not self._stopping:
                        self._cond.wait(delay if items else 0.01)
                delay = min(delay * 2, PARK_S)


watcher = _Watcher()
