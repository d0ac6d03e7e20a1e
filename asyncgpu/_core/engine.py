"""The completion engine: who notices that polled (GPU) work has finished.

Push-completed streams (the CPU device) finish their events from the pool
threads that run the work, so they need nothing from here but the pool.
Poll-completed streams (CUDA) expose a monotonically increasing completion
counter that the GPU writes into host-mapped memory at each marker (markers are
placed where a completion can be waited for; see ``stream._PolledStream``), and
events on one stream complete in submission order, so noticing completions
costs one plain memory read per stream, whatever the number of pending events.

Three pollers read those counters:

* ``_Reactor``: one per asyncio event loop (any loop with asyncio's public API,
  uvloop included), a task on that loop. It polls every
  stream with pending awaits once per loop iteration while completions keep
  coming (``SPIN_S``), then parks on a timer (``PARK_S`` backing off to
  ``PARK_MAX_S``), so a long kernel costs almost no CPU. Wake-ups it causes happen
  on its own loop, as many per iteration as fit in ``ITERATION_S`` (measured
  from the iterations before): no thread hop, no self-pipe write, and no loop
  iteration long enough to starve other tasks. Each iteration's batch runs in
  one loop callback (``_wake_batch``) that finishes each ``DirectFuture`` (the
  extension's future) and runs its task's step at once.
* ``_TrioReactor``: the same polling for one trio run, a system task of that
  run, rescheduling its awaiting tasks as many per batch of trio's
  runnable tasks as fit in ``ITERATION_S``.
* ``_Watcher``: one thread per process, for everything that is not an await
  (``add_done_callback``, CPU functions enqueued behind GPU
  work, sweeping finished work so that what it kept alive is released). It
  spins briefly, then sleeps with backoff, and stops when it has nothing to do.

All three ask the stream for sticky device faults whenever they have been idle for
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
import sys
import threading
import time
import weakref
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any

from .. import _config
from .._accel import native
from .event import _set_future, _trio_run_local, _trio_run_vars, _TrioWaker

if TYPE_CHECKING:
    from collections.abc import Generator

    from .event import DeviceEvent
    from .protocols import PolledStream as _PolledStream

__all__ = ["polled_future", "reactor_for", "trio_wait", "watcher"]

SPIN_S = 0.0005  # keep polling every loop iteration this long after the last progress
PARK_S = 0.001  # then poll on a timer this often, backing off up to PARK_MAX_S
PARK_MAX_S = 0.008  # (a timer wake-up costs the OS and asyncio more CPU than a poll)
FAULT_CHECK_S = 0.005  # ask the driver for sticky faults when idle this long
WAKE_MIN = 8
WAKE_MAX = 256
# A lone awaiter spins inline at most this long (and within its streak's
# ITERATION_S) before using the reactor: work that ends sooner is seen at once,
# whereas the reactor sees it a loop iteration or two late (its poll, then the
# wake-up's callback), which for a short device graph is a tenth of its time.
INLINE_SPIN_S = 0.0002
# A lone trio awaiter polls at each checkpoint this long before using the reactor:
# longer than INLINE_SPIN_S, as it yields to the run's other tasks at each poll.
TRIO_SPIN_S = 0.0001


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


class _Poller:
    """What a reactor of any event loop does: poll the streams awaited from that
    loop and queue the wake-ups of the awaits whose events are done.

    The reactor owns its awaits: ``pending`` maps each stream to its awaits, a
    deque of ``(seq, event, waker)`` in sequence order, and the reactor alone
    wakes them, once the event is done. No waiter is registered on the event,
    so whichever thread finishes the work (this reactor's retire, the watcher's
    sweep, another thread's ``synchronize``, a fault), the tasks wake in the
    order the reactor pops them: the stream's completion order. A subclass
    says how to yield to its loop (``_yield``), park (``_park``, ended early by
    ``_unpark``), wake a batch of awaits (``_wake``) and be woken from another
    thread (``_wake_from``)."""

    __slots__ = (
        "__weakref__",
        "batch",
        "deferred",
        "held_waits",
        "kicked",
        "pending",
        "polling",
        "streak",
        "woke_at",
        "woken",
    )

    def __init__(self) -> None:
        self.pending: dict[_PolledStream, deque[tuple[int, DeviceEvent, Any]]] = {}
        # Wakers of finished events, woken ``batch`` per iteration so that a
        # burst of completions never makes one loop iteration long (loop lag).
        self.deferred: deque[Any] = deque()
        self.batch = WAKE_MIN
        self.woken = 0  # awaits woken at ``woke_at``
        self.woke_at = 0.0
        self.kicked = False  # a new await ended the park: spin for SPIN_S again
        # (stream, seq) whose marker's hand-over to the driver will wake this
        # reactor (_behind_host_work)
        self.held_waits: set[tuple[_PolledStream, int]] = set()
        self.streak = 0.0  # while inline spins go on without a yield: when they must stop
        self.polling = 0  # awaiters polling at checkpoints, not yet pending here (trio)

    def _arm(self) -> None:
        """Make sure the streak ends once the loop has let its other tasks run
        (asyncio: a callback that ends it, run by the loop's next pass)."""
        raise NotImplementedError

    def _end_streak(self) -> None:
        self.streak = 0.0

    def _insert(self, stream: _PolledStream, seq: int, ev: DeviceEvent, waker: Any) -> None:
        awaits = self.pending.get(stream)
        if awaits is None:
            self.pending[stream] = deque(((seq, ev, waker),))
        elif awaits[-1][0] <= seq:
            awaits.append((seq, ev, waker))
        else:  # an earlier operation awaited after a later one: keep the order
            awaits.insert(bisect.bisect_right(awaits, seq, key=_first), (seq, ev, waker))

    def _poll_once(self) -> bool:
        """Retire every stream whose counter passed its first await, and queue the
        wakers of the awaits whose events are done, in order. An event can be
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
        driver; each such stream then wakes this reactor (``_wake_from``), from
        the thread that hands that marker over.

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
        """From the thread that handed the driver the marker of ``key``: run
        ``_woken_by(key)`` on the reactor's loop."""
        raise NotImplementedError

    def _woken_by(self, key: tuple[_PolledStream, int]) -> None:
        self.held_waits.discard(key)
        self.kicked = True
        self._unpark()

    def _check_faults(self) -> None:
        """Ask the driver whether a stream with pending awaits has faulted. A
        faulted stream's events have been failed; the next ``_poll_once`` wakes
        their awaiters (work that finished meanwhile is retired there too: a
        stream dropped without retiring it leaves its awaits hanging, as
        ``test_every_enqueue_returns_an_awaitable_event[cuda]`` checks)."""
        for stream in list(self.pending):
            stream._check_fault()

    def _wake_some(self) -> None:
        """Wake the next batch of queued awaits. Called once per reactor step,
        so once per loop iteration while there is work: the tasks woken by the
        previous call have run since, and the time per woken task sizes this
        batch."""
        now = _monotonic()
        if self.woken:
            per_task = self._per_task((now - self.woke_at) / self.woken)
            self.batch = max(WAKE_MIN, min(WAKE_MAX, round(ITERATION_S / max(per_task, 1e-7))))
        d = self.deferred
        n = min(self.batch, len(d))
        popleft = d.popleft
        self._wake([popleft() for _ in range(n)])
        self.woken = n
        self.woke_at = now

    def _per_task(self, sample: float) -> float:
        """The time per woken task that sizes the next batch, from ``sample``
        (the time since the last batch was woken, per task woken): on asyncio
        exactly that, as one loop iteration runs the batch's callback and the
        reactor's next step in order."""
        return sample

    def _wake(self, wakers: list[Any]) -> None:
        raise NotImplementedError

    def _wake_now(self, waker: Any) -> None:
        """Wake one await at once (the reactor is stopping)."""
        raise NotImplementedError

    async def _yield(self) -> None:
        raise NotImplementedError

    async def _park(self, seconds: float) -> None:
        raise NotImplementedError

    def _unpark(self) -> None:
        raise NotImplementedError

    async def _poll_loop(self) -> None:
        """Poll every loop iteration while completions keep coming (``SPIN_S``
        after the last), then park, longer the longer nothing has moved (at
        most a tenth of the time since the last progress, so a 200 ms kernel
        is noticed within ~8 ms, 4% of its time); a new await ends the park at
        once. Returns when no await is left; whatever ends it, no waker is
        left queued."""
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
                    await self._yield()
                    continue
                now = _monotonic()
                behind = self._behind_host_work()
                if now - last < SPIN_S and not behind:
                    await self._yield()
                    continue
                if now - checked >= FAULT_CHECK_S:
                    checked = now
                    self._check_faults()
                    if self._poll_once():  # failed, or finished while the driver was asked
                        last = _monotonic()
                        await self._yield()
                        continue
                await self._park(min(PARK_MAX_S, max(PARK_S, (now - last) / 10)))
                if self.kicked:
                    self.kicked = False
                    last = _monotonic()
        finally:
            d = self.deferred
            while d:  # never strand a waiter (cancelled, or its loop is closing)
                self._wake_now(d.popleft())


class _Reactor(_Poller):
    """The poller of one asyncio loop (any ``asyncio.AbstractEventLoop``: it uses
    ``call_soon``, ``call_later``, ``call_soon_threadsafe``, ``create_future``
    and ``create_task`` alone), a task on that loop. Its wakers are the
    awaits' futures (``DirectFuture``), a batch of which one loop callback
    completes (``_wake_batch``)."""

    __slots__ = ("loop", "park", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.loop = loop
        self.park: asyncio.Future[Any] | None = None  # set while parked on a timer
        self.task: asyncio.Task[None] | None = None

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

    def _wake_from(self, key: tuple[_PolledStream, int]) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to wake
            self.loop.call_soon_threadsafe(self._woken_by, key)

    def _arm(self) -> None:
        self.loop.call_soon(self._end_streak)

    def _wake(self, wakers: list[Any]) -> None:
        self.loop.call_soon(_wake_batch, wakers)

    def _wake_now(self, fut: Any) -> None:
        _set_future(fut)

    async def _yield(self) -> None:
        await asyncio.sleep(0)

    async def _park(self, seconds: float) -> None:
        park = self.park = self.loop.create_future()
        timer = self.loop.call_later(seconds, _set_future, park)
        try:
            await park
        finally:
            self.park = None
            timer.cancel()

    def _unpark(self) -> None:
        if self.park is not None:
            _set_future(self.park)

    async def _run(self) -> None:
        try:
            await self._poll_loop()
        finally:
            self.task = None
            self.park = None


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


def _lone(stream: _PolledStream, ev: DeviceEvent, reactor: _Poller) -> bool:
    """Whether ``ev``'s awaiter is alone on its loop's reactor (no other await
    pending or polling, no wake-up queued) and its work is in the driver's
    hands (not held behind host work, whose end no spin can hasten)."""
    return (
        not reactor.pending
        and not reactor.deferred
        and not reactor.polling
        and (stream._pending is None or stream._issued_mark >= ev._seq)
    )


def _spin(stream: _PolledStream, ev: DeviceEvent, reactor: _Poller) -> bool:
    """Read ``stream``'s counter in a tight loop for at most ``INLINE_SPIN_S``:
    True when ``ev`` is done by then.

    An await that ends here never yields to the loop, so a task awaiting short
    work again and again would keep every other task and timer of the loop
    waiting. So the spins of one *streak* (it lasts until the loop has let its
    other tasks run: ``_arm``) share ``ITERATION_S``, as the reactor's wake-ups
    of one iteration do, and no spin runs past it; past it the await goes
    through the reactor, and so yields."""
    now = _monotonic()
    end = reactor.streak
    if not end:
        end = reactor.streak = now + ITERATION_S
        reactor._arm()
    elif now > end:
        return False
    completed = stream._completed
    seq = ev._seq
    deadline = min(now + INLINE_SPIN_S, end)
    while completed() < seq:
        if _monotonic() > deadline:
            return False
    stream._retire()
    return ev._done  # type: ignore[no-any-return]


def polled_future(
    stream: _PolledStream, ev: DeviceEvent, loop: asyncio.AbstractEventLoop
) -> asyncio.Future[Any] | None:
    """The asyncio await of a polled stream (its ``_future``): a marker covering
    ``ev`` if none does yet, then a future the reactor completes, or None when
    the event finished during a brief inline spin.

    The inline spin happens only for a lone awaiter (the reactor has no other
    await pending and no wake-up queued) whose work is in the driver's hands. It
    lasts at most ``INLINE_SPIN_S`` and never past its streak's share of the
    reactor's own budget per loop iteration (``ITERATION_S``), so another task
    ready meanwhile waits no longer than a reactor's batch of wake-ups makes it
    wait. It asks the
    loop nothing: an asyncio loop's ready queue is private (``_ready``, which
    uvloop does not have), and with many awaiters the reactor, not the spin,
    wakes them, so the loop's other tasks keep their turn.
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
    if _lone(stream, ev, reactor) and _spin(stream, ev, reactor):
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


# -- trio reactor ----------------------------------------------------------------------


class _TrioReactor(_Poller):
    """The poller of one trio run, a system task of that run, through trio's
    public low-level API (``spawn_system_task``, ``checkpoint``,
    ``current_trio_token``, ``RunVar``, ``wait_task_rescheduled``,
    ``reschedule``). Its wakers are ``_TrioWaker``: waking one reschedules its
    task into trio's next batch of runnable tasks, so waking ``batch`` of them
    per step bounds how long that batch runs, as ``ITERATION_S`` bounds an
    asyncio loop iteration (trio fires a due timer only between batches)."""

    __slots__ = ("kick", "per_task", "running", "token", "trio")

    def __init__(self, trio: Any) -> None:
        super().__init__()
        self.trio = trio
        self.token = trio.lowlevel.current_trio_token()
        self.kick: Any = None  # a trio.Event while parked
        self.running = False
        self.per_task = 0.0

    def _per_task(self, sample: float) -> float:
        # Trio runs each batch of runnable tasks in random order, so the time
        # between two steps of the reactor (one per batch) holds the tasks it
        # woke last time only on average: one short sample would size a batch
        # far too large, and that batch holds every due timer back (ticker lag).
        # So the estimate rises at once and falls slowly.
        est = self.per_task = max(sample, self.per_task * 0.9)
        return est

    def add(self, stream: _PolledStream, ev: DeviceEvent, waker: _TrioWaker) -> None:
        """Have this reactor wake ``waker`` once ``ev`` is done (from a task of the
        run, the only place that calls it); the task then waits in
        ``wait_task_rescheduled(waker.abort)``."""
        self._insert(stream, ev._seq, ev, waker)
        if not self.running:
            self.running = True
            self.trio.lowlevel.spawn_system_task(self._poll_loop, name="asyncgpu-reactor")
        elif self.kick is not None:
            self.kicked = True  # as the asyncio reactor's add
            self.kick.set()

    def _wake_from(self, key: tuple[_PolledStream, int]) -> None:
        with contextlib.suppress(self.trio.RunFinishedError):  # the run is over
            self.token.run_sync_soon(self._woken_by, key)

    def _arm(self) -> None:
        # Nothing to schedule: ``trio_wait`` ends the streak whenever an awaiter
        # yields (a callback through the run's token would cost the run a
        # wake-up of its own, and its next batch a task step, per streak).
        pass

    def _wake(self, wakers: list[Any]) -> None:
        reschedule = self.trio.lowlevel.reschedule
        for w in wakers:
            task = w.task
            if task is not None:  # (None: its wait was cancelled)
                w.task = None
                reschedule(task)

    def _wake_now(self, w: Any) -> None:
        self._wake([w])

    async def _yield(self) -> None:
        await self.trio.lowlevel.checkpoint()

    async def _park(self, seconds: float) -> None:
        kick = self.kick = self.trio.Event()
        try:
            with self.trio.move_on_after(seconds):
                await kick.wait()
        finally:
            self.kick = None

    def _unpark(self) -> None:
        if self.kick is not None:
            self.kick.set()

    async def _poll_loop(self) -> None:
        try:
            await super()._poll_loop()
        finally:
            self.running = False
            self.kick = None


_REACTOR = "asyncgpu_reactor"  # (the name of the run's reactor among its run-locals)


def _trio_reactor(trio: Any) -> _TrioReactor:
    return _trio_run_local(trio, _REACTOR, partial(_TrioReactor, trio))  # type: ignore[no-any-return]


def trio_wait(
    stream: _PolledStream, ev: DeviceEvent, outcome: bool = True
) -> Generator[Any, None, Any]:
    """The trio await of a polled stream (its ``_trio_wait``; the stream was asked
    once already), as the iterator that the event's ``__await__`` hands trio: it
    returns the event's outcome (``outcome``), else None.

    A lone awaiter whose work is in the driver's hands spins as an asyncio one
    does (``INLINE_SPIN_S``), then polls the stream at each
    ``trio.lowlevel.checkpoint`` for ``TRIO_SPIN_S`` (other tasks run at each
    one), then, as every other awaiter, waits in
    ``trio.lowlevel.wait_task_rescheduled`` until the run's reactor reschedules
    it. Cancellable at every step (a cancel scope, ``trio.move_on_after``); the
    work is never cancelled.

    A plain generator rather than a coroutine, so that trio resumes one frame of
    ours per step instead of the event's await around a coroutine around it; the
    usual case of ``_TrioReactor.add`` (behind the awaits pending on the same
    stream while the reactor runs) is inline, as in ``polled_future``."""
    lowlevel = sys.modules["trio"].lowlevel
    try:
        reactor: _TrioReactor = _trio_run_vars[_REACTOR].get()
    except LookupError:  # (KeyError: no trio run has awaited yet; else not this run)
        reactor = _trio_reactor(sys.modules["trio"])
    if _lone(stream, ev, reactor) and not _spin(stream, ev, reactor):
        checkpoint = lowlevel.checkpoint
        deadline = _monotonic() + TRIO_SPIN_S
        reactor.polling += 1  # (so the run's other awaiters go to the reactor)
        try:
            while True:
                yield from checkpoint().__await__()
                reactor.streak = 0.0  # (the run's other tasks have had their turn)
                if ev.query() or reactor.pending or _monotonic() > deadline:
                    break
        finally:
            reactor.polling -= 1
    if not ev._done:
        waker = _TrioWaker(lowlevel.current_task())
        awaits = reactor.pending.get(stream)
        if (
            awaits is not None
            and awaits[-1][0] <= ev._seq
            and reactor.running
            and reactor.kick is None
        ):
            awaits.append((ev._seq, ev, waker))
        else:
            reactor.add(stream, ev, waker)
        try:
            yield from lowlevel.wait_task_rescheduled(waker.abort).__await__()
        finally:
            reactor.streak = 0.0
    return ev._outcome() if outcome else None


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
