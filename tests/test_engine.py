"""The completion engine's wake-up order, on any machine.

An asyncio loop's reactor completes the futures of finished GPU work from one
queue. Completions may be noticed on the loop's thread (the reactor) or on
another thread (the watcher, a pool thread finishing CPU work); either way the
awaiting tasks must wake in the order the work finished. The H200 run of
2026-12-02 showed a task woken early when another thread's wake-up bypassed the
queue (``test_awaits_resolve_in_submission_order[cuda]``).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from asyncgpu._engine import reactor_for
from asyncgpu._event import _LoopWaiter, _wake


@pytest.mark.asyncio
async def test_wakeups_from_other_threads_keep_completion_order() -> None:
    loop = asyncio.get_running_loop()
    reactor = reactor_for(loop)
    waiters = [_LoopWaiter(loop, reactor) for _ in range(6)]
    woke: list[int] = []
    for i, w in enumerate(waiters):
        w.fut.add_done_callback(lambda _f, i=i: woke.append(i))

    _wake(waiters[0], None)  # noticed by the reactor, on the loop's thread
    _wake(waiters[1], None)
    other = threading.Thread(target=lambda: [_wake(w, None) for w in waiters[2:5]])
    other.start()  # noticed by another thread
    other.join()
    _wake(waiters[5], None)  # and by the reactor again

    await asyncio.wait_for(asyncio.gather(*(w.fut for w in waiters)), 10)
    assert woke == list(range(6))


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
async def test_a_burst_from_another_thread_schedules_one_wake_up_call() -> None:
    loop = asyncio.get_running_loop()
    reactor = reactor_for(loop)
    waiters = [_LoopWaiter(loop, reactor) for _ in range(50)]
    scheduled = []
    real = loop.call_soon_threadsafe

    def counting(cb, *args):
        scheduled.append(cb)
        return real(cb, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        other = threading.Thread(target=lambda: [_wake(w, None) for w in waiters])
        other.start()
        other.join()
    finally:
        del loop.call_soon_threadsafe
    assert len(scheduled) == 1
    await asyncio.wait_for(asyncio.gather(*(w.fut for w in waiters)), 10)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.asyncio
async def test_each_loop_iteration_wakes_as_many_tasks_as_fit_its_time_budget(
    monkeypatch,
) -> None:
    """One reactor step per loop iteration: the batch follows the time the tasks
    woken in the iteration before took, 100 us each gives the minimum, 1 us each
    the maximum."""
    from asyncgpu import _engine

    clock = _Clock()
    monkeypatch.setattr(_engine, "_monotonic", clock)
    loop = asyncio.get_running_loop()
    reactor = _engine._Reactor(loop)
    futs = [loop.create_future() for _ in range(2000)]
    reactor.deferred.extend(futs)

    def woken() -> int:
        return sum(f.done() for f in futs)

    reactor._wake_some()
    assert woken() == _engine.WAKE_MIN
    clock.now += _engine.WAKE_MIN * 100e-6  # the woken tasks took 100 us each
    reactor._wake_some()
    assert woken() == 2 * _engine.WAKE_MIN
    clock.now += _engine.WAKE_MIN * 1e-6  # 1 us each
    reactor._wake_some()
    assert woken() == 2 * _engine.WAKE_MIN + _engine.WAKE_MAX
    clock.now += _engine.WAKE_MAX * 10e-6  # 10 us each: 0.3 ms fits 30
    reactor._wake_some()
    assert woken() == 2 * _engine.WAKE_MIN + _engine.WAKE_MAX + 30


@pytest.mark.asyncio
async def test_work_that_finishes_while_the_reactor_checks_for_faults_still_wakes_its_awaiter() -> (
    None
):
    """The reactor asks the driver for sticky faults when nothing has moved for a
    while. Work that finishes during that question must still be retired and its
    awaiter woken (the H200 run of 2026-12-04 hung an await this way: the reactor
    dropped the stream from its pending set without retiring it)."""
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
