"""The completion engine's wake-up order, on any machine.

An asyncio loop's reactor owns the awaits of GPU work on that loop and completes
their futures itself, in each stream's completion order. The work may be
finished on the loop's thread (the reactor's retire) or on another thread (the
watcher, a blocking wait, a fault); either way the awaiting tasks wake in the
order the work finished. A wake-up from another thread that bypassed the
reactor's queue once woke a task early
(``test_awaits_resolve_in_submission_order[cuda]`` on a GPU caught it).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest
from _recording_stream import RecordingStream

from asyncgpu import DeviceFaultError
from asyncgpu._core import engine as _engine
from asyncgpu._core.engine import reactor_for


def _count_threadsafe_calls(monkeypatch, loop: asyncio.AbstractEventLoop) -> list[object]:
    """The callbacks that other threads schedule on ``loop`` from now on."""
    scheduled: list[object] = []
    real = loop.call_soon_threadsafe

    def counting(cb, *args, **kwargs):  # type: ignore[no-untyped-def]
        scheduled.append(cb)
        return real(cb, *args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    return scheduled


@pytest.mark.asyncio
async def test_awaits_wake_in_completion_order_whichever_thread_finishes_the_work(
    monkeypatch,
) -> None:
    """Six operations awaited out of order by six tasks; another thread retires
    the first three, the reactor the last three. The tasks wake in completion
    order, and the other thread schedules nothing on the loop: the reactor alone
    completes its futures (a task once woke early when another thread's
    wake-up bypassed the reactor's queue)."""
    loop = asyncio.get_running_loop()
    scheduled = _count_threadsafe_calls(monkeypatch, loop)
    s = RecordingStream()
    evs = [s.submit() for _ in range(6)]
    woke: list[int] = []

    async def wait(i: int) -> None:
        await evs[i]
        woke.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in (5, 3, 0, 4, 1, 2)]
    await asyncio.sleep(0)  # each task has run its first step: all six are awaiting
    assert [seq for seq, _, _ in reactor_for(loop).pending[s]] == [1, 2, 3, 4, 5, 6]

    s.done = 3  # the device passes the third operation
    other = threading.Thread(target=s._retire)  # and another thread notices
    other.start()
    other.join()
    assert all(ev._done for ev in evs[:3]) and not woke
    s.done = 6  # the rest is the reactor's to notice
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert woke == [0, 1, 2, 3, 4, 5]
    assert scheduled == []


def test_the_watcher_runs_callbacks_of_polled_work_once_it_finishes() -> None:
    """``add_done_callback`` on a polled stream's event: the watcher thread notices
    the completion counter pass the event and calls back (CPU work behind GPU work
    starts this way)."""
    from test_held_submission import ModelStream

    class SlowDevice(ModelStream):
        """Markers reach the device, which writes them only when told to."""

        written = 0

        def _write_counter(self, seq: int) -> None:
            self.written = seq
            self._issued_mark = seq

    s = SlowDevice("s", [])
    ev = s.op("kernel")
    called = threading.Event()
    ev.add_done_callback(lambda _e: called.set())  # asks for a marker and a watch
    assert s.written == ev._seq and not called.is_set()
    s.counter = s.written  # the device finishes the kernel
    assert called.wait(10)


@pytest.mark.asyncio
async def test_an_await_wakes_only_once_its_event_is_done_not_when_the_counter_passes_it() -> None:
    """Another thread's retire may have taken the event off the stream and not
    yet finished it: the counter has passed it, its value is not there yet. The
    reactor wakes the awaiter only once the event is done."""

    class RetiredElsewhere(RecordingStream):
        taken = True  # another thread's retire holds the event

        def _retire(self) -> bool:
            return False if self.taken else super()._retire()

    loop = asyncio.get_running_loop()
    reactor = _engine._Reactor(loop)
    s = RetiredElsewhere()
    ev = s.submit()
    fut = reactor.add(s, ev)
    s.done = 1
    assert not reactor._poll_once() and not reactor.deferred
    s.taken = False  # the other thread finishes it
    assert reactor._poll_once() and list(reactor.deferred) == [fut] and ev._done
    await asyncio.wait_for(fut, 10)
    assert not reactor.pending


@pytest.mark.asyncio
async def test_an_event_failed_short_of_the_counter_wakes_its_awaiter_with_the_error() -> None:
    """A fault fails every pending event of its context though the device never
    wrote their markers: the await raises the error, it does not wait for a
    counter that will not move."""
    s = RecordingStream()
    ev = s.submit()
    waiting = asyncio.ensure_future(_await(ev))
    await asyncio.sleep(0)  # the task is awaiting the event through the reactor
    assert not waiting.done()
    s._fail(RuntimeError("the device faulted"))  # what a sticky fault does
    with pytest.raises(DeviceFaultError, match="the device faulted"):
        await asyncio.wait_for(waiting, 10)
    assert s.done == 0


async def _await(ev: object) -> object:
    return await ev  # type: ignore[misc]


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def wake_some(reactor: _engine._Reactor) -> None:
    """One reactor step's wake-ups, and the loop iteration that runs them (with
    the extension they run in a callback of their own, ``_wake_batch``)."""
    reactor._wake_some()
    await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_each_loop_iteration_wakes_as_many_tasks_as_fit_its_time_budget(
    monkeypatch,
) -> None:
    """One reactor step per loop iteration: the batch follows the time the tasks
    woken in the iteration before took, 100 us each gives the minimum, 0.5 us
    each the maximum."""
    clock = _Clock()
    monkeypatch.setattr(_engine, "_monotonic", clock)
    loop = asyncio.get_running_loop()
    reactor = _engine._Reactor(loop)
    futs = [_engine._Future(loop=loop) for _ in range(2000)]
    reactor.deferred.extend(futs)

    def woken() -> int:
        return sum(f.done() for f in futs)

    await wake_some(reactor)
    assert woken() == _engine.WAKE_MIN
    clock.now += _engine.WAKE_MIN * 100e-6  # the woken tasks took 100 us each
    await wake_some(reactor)
    assert woken() == 2 * _engine.WAKE_MIN
    clock.now += _engine.WAKE_MIN * 0.5e-6  # 0.5 us each
    await wake_some(reactor)
    assert woken() == 2 * _engine.WAKE_MIN + _engine.WAKE_MAX
    clock.now += _engine.WAKE_MAX * 10e-6  # 10 us each: as many as fit the budget
    await wake_some(reactor)
    fits = round(_engine.ITERATION_S / 10e-6)
    assert _engine.WAKE_MIN < fits < _engine.WAKE_MAX
    assert woken() == 2 * _engine.WAKE_MIN + _engine.WAKE_MAX + fits


def test_the_wake_budget_of_the_environment_is_the_reactors_at_import() -> None:
    """(Its parsing: ``test_config``.)"""
    env = {**os.environ, "ASYNCGPU_WAKE_BUDGET_MS": "0.05"}
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from asyncgpu._core import engine as _engine; print(_engine.ITERATION_S)",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert float(out) == pytest.approx(0.00005)


@pytest.mark.asyncio
async def test_a_cancelled_await_in_a_wake_batch_leaves_the_rest_of_the_batch_woken() -> None:
    """A task cancelled while its await waits in the reactor's queue of finished
    work: its future is cancelled, and the batch it is in still wakes the others."""
    loop = asyncio.get_running_loop()
    reactor = _engine._Reactor(loop)
    futs = [_engine._Future(loop=loop) for _ in range(3)]
    futs[1].cancel()  # what cancelling its task does
    reactor.deferred.extend(futs)
    await wake_some(reactor)
    assert futs[0].result() is None and futs[2].result() is None
    assert futs[1].cancelled() and not reactor.deferred


@pytest.mark.asyncio
async def test_cancelled_awaits_among_many_leave_the_other_awaits_and_every_event_whole() -> None:
    """Two hundred tasks await operations on four streams, and every fifth task
    is cancelled while its await is pending. The device then finishes three
    operations per stream per loop iteration. Every other task wakes, in its
    stream's order; the cancelled tasks' events still complete and await again
    at once; and the reactor ends with nothing pending."""
    streams = [RecordingStream() for _ in range(4)]
    events = [streams[i % 4].submit() for i in range(200)]
    woke: list[int] = []

    async def wait(i: int) -> None:
        await events[i]
        woke.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in range(200)]
    await asyncio.sleep(0)  # each task has run its first step: all 200 are awaiting
    reactor = reactor_for(asyncio.get_running_loop())
    assert sum(len(awaits) for awaits in reactor.pending.values()) == 200
    for t in tasks[::5]:
        t.cancel()
    while any(s.done < s._seq for s in streams):  # the device, a few operations at a time
        for s in streams:
            s.done = min(s._seq, s.done + 3)
        await asyncio.sleep(0)
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
    cancelled = [i for i, r in enumerate(results) if isinstance(r, asyncio.CancelledError)]
    assert cancelled == list(range(0, 200, 5))
    assert sorted(woke) == [i for i in range(200) if i % 5]
    for k in range(4):
        on_stream = [i for i in woke if i % 4 == k]
        assert on_stream == sorted(on_stream)
    await asyncio.wait_for(asyncio.gather(*events), 10)  # the cancelled tasks' events too
    for _ in range(100):  # the reactor's last steps skip the cancelled futures, then it ends
        if reactor.task is None:
            break
        await asyncio.sleep(0)
    assert reactor.task is None and not reactor.pending and not reactor.deferred


@pytest.mark.asyncio
async def test_work_that_finishes_while_the_reactor_checks_for_faults_still_wakes_its_awaiter() -> (
    None
):
    """The reactor asks the driver for sticky faults when nothing has moved for a
    while. Work that finishes during that question must still be retired and its
    awaiter woken (an await once hung this way on a GPU: the reactor dropped the
    stream from its pending set without retiring it)."""
    from test_markers import RecordingStream

    class FinishesDuringFaultCheck(RecordingStream):
        asked = 0

        def _query_fault(self) -> BaseException | None:
            self.asked += 1
            self.done = self._seq  # the device finishes while the driver is asked
            return None

    s = FinishesDuringFaultCheck()
    ev = s.submit()
    await asyncio.wait_for(ev, 10)  # the device finishes it only in the fault check
    assert ev._done and s.asked >= 1 and not s._inflight


class _TickingClock(_Clock):
    """A clock that moves 10 us each time it is read."""

    def __call__(self) -> float:
        self.now += 10e-6
        return self.now


@pytest.mark.asyncio
async def test_a_new_await_makes_a_parked_reactor_poll_every_iteration_again(
    monkeypatch,
) -> None:
    """A reactor with nothing moving parks on a timer (1-4 ms). A new await ends
    the park and, as progress does, makes it poll once per loop iteration for
    ``SPIN_S`` again: work that takes longer than the await's own brief spin is
    then seen when it ends, not when the timer fires (otherwise an awaited small
    pageable copy takes as long as the timer)."""
    clock = _TickingClock()
    monkeypatch.setattr(_engine, "_monotonic", clock)
    s = RecordingStream()
    first = asyncio.ensure_future(_await(s.submit()))
    reactor = reactor_for(asyncio.get_running_loop())
    await asyncio.sleep(0)
    clock.now += 1.0  # nothing has moved for a second: the reactor parks
    for _ in range(100):
        if reactor.park is not None:
            break
        await asyncio.sleep(0)
    assert reactor.park is not None
    second = asyncio.ensure_future(_await(s.submit()))
    for _ in range(5):
        await asyncio.sleep(0)
        parked = reactor.park is not None and not reactor.park.done()
        assert not parked, "the reactor parked again right after a new await"
    s.done = s._seq
    await asyncio.wait_for(asyncio.gather(first, second), 10)


@pytest.mark.asyncio
async def test_an_await_behind_host_work_parks_until_that_work_hands_its_marker_over() -> None:
    """Work behind host work (a CPU function, a staged copy) cannot finish before
    that host work does, and a loop that polls every iteration meanwhile keeps
    the GIL from the pool thread doing it. So the reactor parks, and the thread
    that ends the host work wakes it once the marker is with the driver."""
    from test_held_submission import ModelStream

    s = ModelStream("s", [])
    ev, gate = s.host_work()
    waiting = asyncio.ensure_future(_await(ev))
    reactor = reactor_for(asyncio.get_running_loop())
    for _ in range(5):
        await asyncio.sleep(0)
    assert reactor.park is not None and not reactor.park.done(), "it polls instead of parking"
    assert reactor.held_waits == {(s, ev._seq)}
    ended = threading.Thread(target=s._open, args=(gate,))  # the pool thread's finish
    ended.start()
    ended.join()
    await asyncio.sleep(0)  # the wake-up it sent through call_soon_threadsafe runs
    assert not reactor.held_waits and (reactor.park is None or reactor.park.done())
    await asyncio.wait_for(waiting, 10)
    assert ev._done


@pytest.mark.asyncio
async def test_the_reactor_polls_on_while_any_stream_it_waits_on_is_not_behind_host_work() -> None:
    """Parking is for awaits that nothing but host work can finish: one await on
    a stream that the device may finish at any moment keeps the reactor polling,
    and a held stream's wake-up is asked for once, however often it parks."""
    from test_held_submission import ModelStream

    reactor = _engine._Reactor(asyncio.get_running_loop())
    held = ModelStream("held", [])
    ev, gate = held.host_work()
    held._need(ev)  # its marker waits behind the gate
    first = reactor.add(held, ev)
    assert reactor._behind_host_work() and reactor._behind_host_work()
    assert len(held._issue_waiters) == 1  # asked once
    free = RecordingStream()
    second = reactor.add(free, free.submit())
    assert not reactor._behind_host_work()
    held._open(gate)  # the hand-over wakes the reactor through its loop
    await asyncio.sleep(0)
    assert not reactor.held_waits and not held._issue_waiters
    free.finish_all()
    await asyncio.wait_for(asyncio.gather(first, second), 10)


def test_the_reactors_of_closed_loops_are_let_go() -> None:
    """Each loop that awaits polled work gets a reactor, which refers to its
    loop: once the loop is closed, the next new reactor drops it, so a program
    that runs loop after loop (``asyncio.run`` in a loop) keeps neither the loops
    nor the streams their unfinished awaits held."""
    import gc
    import weakref
    from collections import deque

    gone = []
    for _ in range(20):
        loop = asyncio.new_event_loop()
        stream = RecordingStream()
        reactor_for(loop).pending[stream] = deque()  # (an await the loop never saw end)
        gone += [weakref.ref(loop), weakref.ref(stream)]
        loop.close()
        del loop, stream
    reactor_for(asyncio.new_event_loop()).loop.close()
    gc.collect()
    assert [r for r in gone if r() is not None] == []
    assert sum(lp.is_closed() for lp in list(_engine._reactors)) <= 1  # (the last one's)


@pytest.mark.asyncio
async def test_a_burst_of_cpu_completions_wakes_its_loop_once_in_completion_order(
    monkeypatch,
) -> None:
    """Work finished on other threads (the CPU device's pool) wakes an asyncio
    loop through its inbox: the first wake-up of a burst schedules one callback
    on the loop (``call_soon_threadsafe``, a self-pipe write), the others join
    it, and the tasks wake in the order their work finished."""
    from asyncgpu import DeviceContext

    loop = asyncio.get_running_loop()
    scheduled = _count_threadsafe_calls(monkeypatch, loop)
    gate = threading.Event()
    with DeviceContext(api="cpu") as ctx:
        first = ctx.enqueue_cpu_function(gate.wait)  # holds the stream's work back
        evs = [ctx.enqueue_cpu_function(lambda i=i: i) for i in range(20)]
        woke: list[int] = []

        async def wait(i: int) -> None:
            await evs[i]
            woke.append(i)

        tasks = [asyncio.create_task(wait(i)) for i in reversed(range(20))]
        await asyncio.sleep(0)  # every task awaits its event
        gate.set()
        evs[-1].synchronize()  # the loop's thread is held while the pool finishes all
        assert woke == [] and len(scheduled) == 1  # one wake-up for the whole burst
        await asyncio.gather(*tasks)
        assert woke == list(range(20))
        assert first.query()


def test_a_burst_of_cpu_completions_wakes_a_trio_run_once_in_completion_order() -> None:
    """The same under trio: the run's inbox hands its first wake-up of a burst to
    ``TrioToken.run_sync_soon``, the others join it, and every task wakes (in
    the order trio picks for one batch of rescheduled tasks: it reverses some
    batches on purpose)."""
    trio = pytest.importorskip("trio")
    trio_testing = pytest.importorskip("trio.testing")
    from asyncgpu import DeviceContext
    from asyncgpu._core.event import _trio_inbox

    async def main() -> tuple[list[int], int]:
        inbox = _trio_inbox(trio)
        sent: list[object] = []
        real = inbox.send

        def counting(fn):  # type: ignore[no-untyped-def]
            sent.append(fn)
            return real(fn)

        inbox.send = counting
        gate = threading.Event()
        woke: list[int] = []
        with DeviceContext(api="cpu") as ctx:
            ctx.enqueue_cpu_function(gate.wait)  # holds the stream's work back
            evs = [ctx.enqueue_cpu_function(lambda i=i: i) for i in range(20)]

            async def wait(i: int) -> None:
                assert await evs[i] == i
                woke.append(i)

            async with trio.open_nursery() as nursery:
                for i in reversed(range(20)):
                    nursery.start_soon(wait, i)
                await trio_testing.wait_all_tasks_blocked()  # every task awaits its event
                gate.set()
                evs[-1].synchronize()  # the run's thread is held while the pool finishes all
                assert woke == []
                bursts = len(sent)
        return woke, bursts

    woke, bursts = trio.run(main)
    assert bursts == 1  # one wake-up for the whole burst
    assert sorted(woke) == list(range(20))
