"""The completion engine's polled path on every event loop (asyncio, uvloop, trio),
without a device: ``RecordingStream``'s counter is what the tests set.

The reactor of each loop (``_Reactor`` on asyncio and uvloop, ``_TrioReactor``
on trio) wakes its awaits once the counter passes them, and a lone awaiter's
brief spin sees short work finish without it, using nothing of the loop beyond
its public API.
"""

from __future__ import annotations

import threading

import anyio
import pytest
from _kernels import TIMEOUT_S
from _loops import BACKENDS, checkpoint, is_trio
from _recording_stream import RecordingStream

from asyncgpu import DeviceEvent


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    return request.param


pytestmark = pytest.mark.anyio


async def test_many_awaits_wake_once_the_counter_passes_them(anyio_backend: object) -> None:
    """Thirty tasks await six operations; the device passes the first three, then
    the rest, from another thread. Each task wakes with its operation done, once
    the counter has passed it."""
    s = RecordingStream()
    evs = [s.submit() for _ in range(6)]
    woke: list[tuple[int, bool]] = []
    waiting = 0

    async def wait(i: int) -> None:
        nonlocal waiting
        waiting += 1
        await evs[i]
        woke.append((i, s.done >= evs[i]._seq))

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            for k in range(30):
                tg.start_soon(wait, k % 6)
            while waiting < 30:
                await checkpoint(anyio_backend)
            assert woke == []
            device = threading.Thread(target=lambda: setattr(s, "done", 3))
            device.start()
            device.join()
            while len(woke) < 15:
                await checkpoint(anyio_backend)
            assert sorted(i for i, _ in woke) == sorted(k % 6 for k in range(30) if k % 6 < 3)
            s.done = 6
    assert sorted(i for i, _ in woke) == sorted(k % 6 for k in range(30))
    assert all(passed for _, passed in woke)


class _ShortWork(RecordingStream):
    """A device that finishes each marked operation a moment after the marker:
    the counter passes it on the third read after the marker was placed (the
    await's first look at the stream reads it at most twice, its spin after)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def _place_marker(self) -> None:
        super()._place_marker()
        self.reads = 0

    def _completed(self) -> int:
        self.reads += 1
        if self.reads >= 3:
            self.done = self._marked
        return self.done


async def test_a_lone_awaiter_of_short_work_needs_no_reactor(
    anyio_backend: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short work awaited alone is seen by the await's own brief spin: the loop's
    reactor is never started. (The spins' budget per streak is lifted here, so
    that a slow moment of the machine cannot end one.)"""
    from asyncgpu._core import engine

    monkeypatch.setattr(engine, "ITERATION_S", 60.0)
    s = _ShortWork()
    for _ in range(10):
        ev = s.submit()
        assert not ev._done
        await ev
        assert ev._done
    if is_trio(anyio_backend):
        import trio

        assert not engine._trio_reactor(trio).running
    else:
        import asyncio

        assert engine.reactor_for(asyncio.get_running_loop()).task is None


async def test_awaiting_short_work_again_and_again_lets_other_tasks_run(
    anyio_backend: object,
) -> None:
    """A task awaiting work that its spin sees finish, thousands of times, would
    never yield to the loop if every such await ended in the spin: the spins
    of a streak share one iteration's budget, then an await yields, so another
    task keeps running meanwhile."""
    s = _ShortWork()
    other_ran = 0
    done = False

    async def other() -> None:
        nonlocal other_ran
        while not done:
            other_ran += 1
            await checkpoint(anyio_backend)

    async def busy() -> int:
        nonlocal done
        seen = other_ran
        for _ in range(3000):
            await s.submit()
        done = True
        return other_ran - seen

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            await checkpoint(anyio_backend)
            assert await busy() > 0


async def test_given_up_awaits_leave_the_others_to_wake(anyio_backend: object) -> None:
    """Ten of twenty awaits of one operation are given up (a cancel scope on
    every loop); the counter then passes the operation: the other ten wake, and
    the operation is done."""
    s = RecordingStream()
    ev = s.submit()
    woke = 0
    waiting = 0

    async def wait(give_up: bool) -> None:
        nonlocal woke, waiting
        with anyio.CancelScope() as scope:
            waiting += 1
            if give_up:
                scope.cancel()
            await ev
            woke += 1

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            for k in range(20):
                tg.start_soon(wait, k % 2 == 0)
            while waiting < 20:
                await checkpoint(anyio_backend)
            await checkpoint(anyio_backend)
            s.done = 1
    assert woke == 10
    assert ev._done


async def test_awaits_given_up_while_queued_on_the_reactor_are_skipped_when_it_wakes(
    anyio_backend: object,
) -> None:
    """Twenty tasks wait on the reactor for one operation; ten of them are
    cancelled there (their cancel scopes) before it finishes, and go on to wait
    for something else. The counter then passes it: the reactor wakes the other
    ten and leaves the ten given up alone (under trio, rescheduling a task that
    has left its wait would end its next wait early)."""
    s = RecordingStream()
    ev = s.submit()
    scopes: list[anyio.CancelScope] = []
    later = anyio.Event()
    woke = cancelled = early = 0

    async def wait() -> None:
        nonlocal woke, cancelled, early
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await ev
            woke += 1
        if scope.cancelled_caught:
            cancelled += 1
            await later.wait()
            early += not later.is_set()

    reactor = _reactor(anyio_backend)
    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(wait)
            while len(scopes) < 20:
                await checkpoint(anyio_backend)
            await checkpoint(anyio_backend)
            assert len(reactor.pending.get(s, ())) >= 19  # type: ignore[attr-defined]
            for scope in scopes[::2]:
                scope.cancel()
            while cancelled < 10:
                await checkpoint(anyio_backend)
            s.done = 1
            while woke < 10:
                await checkpoint(anyio_backend)
            for _ in range(3):
                await checkpoint(anyio_backend)
            later.set()
    assert (woke, cancelled, early) == (10, 10, 0)
    assert ev._done


async def test_an_event_failed_short_of_the_counter_wakes_its_awaiters(
    anyio_backend: object,
) -> None:
    """A fault fails an event the counter never reaches: its awaiters on every
    loop raise the error instead of waiting for the counter."""
    s = RecordingStream()
    ev: DeviceEvent = s.submit()
    raised = 0
    waiting = 0

    async def wait() -> None:
        nonlocal waiting, raised
        waiting += 1
        with pytest.raises(RuntimeError, match="failed"):
            await ev
        raised += 1

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(wait)
            while waiting < 5:
                await checkpoint(anyio_backend)
            await checkpoint(anyio_backend)
            ev._finish(None, RuntimeError("failed"))
    assert raised == 5


def _reactor(backend: object) -> object:
    from asyncgpu._core import engine

    if is_trio(backend):
        import trio

        return engine._trio_reactor(trio)
    import asyncio

    return engine.reactor_for(asyncio.get_running_loop())


async def test_many_awaiters_wait_on_the_reactor_not_each_polling_alone(
    anyio_backend: object,
) -> None:
    """Fifty tasks await unfinished work: at most one of them polls on its own
    (a lone awaiter's spin, or under trio its polling at checkpoints); the
    others wait on the reactor, which then wakes them all. (Were each to count
    itself alone, a thousand tasks would each poll, and a trio batch of them
    would keep the run's timers waiting for hundreds of milliseconds.)"""
    s = RecordingStream()
    evs = [s.submit() for _ in range(50)]
    woke = 0
    waiting = 0

    async def wait(i: int) -> None:
        nonlocal woke, waiting
        waiting += 1
        await evs[i]
        woke += 1

    reactor = _reactor(anyio_backend)
    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            for i in range(50):
                tg.start_soon(wait, i)
            while waiting < 50:
                await checkpoint(anyio_backend)
            await checkpoint(anyio_backend)
            assert len(reactor.pending.get(s, ())) >= 49  # type: ignore[attr-defined]
            s.done = 50
    assert woke == 50


def test_the_trio_reactors_batch_estimate_rises_at_once_and_falls_slowly() -> None:
    """Trio runs a batch of tasks in random order, so one reactor step's time per
    woken task is only right on average; a short sample must not size a huge
    batch (which would hold every due timer back), while a long one shrinks the
    batch at once."""
    trio = pytest.importorskip("trio")
    from asyncgpu._core.engine import _TrioReactor

    async def main() -> list[float]:
        r = _TrioReactor(trio)
        return [r._per_task(s) for s in (1e-5, 1e-7, 1e-7, 5e-5)]

    first, short, shorter, long = trio.run(main)
    assert first == 1e-5
    assert short == pytest.approx(0.9e-5) and shorter == pytest.approx(0.81e-5)
    assert long == 5e-5
