"""``asyncgpu._native.DirectFuture``: the future of one asyncio await of a
polled stream. It behaves as an ``asyncio.Future`` toward everything that uses
one (a task awaiting it, ``asyncio.wait``, ``gather``, ``shield``,
``wait_for``, cancellation), and adds ``wake()``: the reactor finishes it and
the awaiting task's step runs at once, in the task's context, instead of
through one ``loop.call_soon`` per await. ``wake`` runs only from a plain loop
callback (the reactor's ``_wake_batch``); everything else schedules the
callbacks as asyncio does."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import weakref
from typing import Any

import pytest

from asyncgpu import _native
from asyncgpu._core import engine as _engine

where = contextvars.ContextVar("where", default="outside")


def new(loop: asyncio.AbstractEventLoop) -> Any:
    return _native.DirectFuture(loop=loop)


async def in_callback(fn: Any) -> Any:
    """Run fn() as a plain callback of the running loop (not inside a task's
    step, as the reactor's wake-ups run) and return what it returned."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def call() -> None:
        try:
            done.set_result(fn())
        except BaseException as e:  # (handed to the test)
            done.set_exception(e)

    loop.call_soon(call)
    return await done


@pytest.mark.asyncio
async def test_wake_runs_the_awaiting_tasks_step_before_it_returns_in_the_tasks_context() -> None:
    loop = asyncio.get_running_loop()
    fut = new(loop)
    seen: list[str] = []

    async def waiter() -> None:
        where.set("task")
        await fut
        seen.append(where.get())

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # the task runs up to its await
    assert not fut.done() and seen == []

    def wake() -> list[str]:
        where.set("callback")
        fut.wake()
        return list(seen)  # what the task had done when wake() returned

    assert await in_callback(wake) == ["task"]
    assert fut.done() and fut.result() is None and task.done()


@pytest.mark.asyncio
async def test_awaits_woken_in_one_batch_run_in_batch_order() -> None:
    loop = asyncio.get_running_loop()
    futs = [new(loop) for _ in range(5)]
    order: list[int] = []

    async def waiter(i: int) -> None:
        await futs[i]
        order.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in (3, 0, 4, 1, 2)]
    await asyncio.sleep(0)
    await in_callback(lambda: _engine._wake_batch([futs[i] for i in (2, 4, 0, 1, 3)]))
    assert order == [2, 4, 0, 1, 3]
    await asyncio.gather(*tasks)


@pytest.mark.asyncio
async def test_cancelling_the_awaiting_task_cancels_the_future_and_a_later_wake_does_nothing() -> (
    None
):
    loop = asyncio.get_running_loop()
    fut = new(loop)
    task = asyncio.create_task(asyncio.wait_for(fut, None))
    await asyncio.sleep(0)
    task.cancel("enough")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.cancelled() and fut.done()
    with pytest.raises(asyncio.CancelledError, match="enough"):
        fut.result()
    with pytest.raises(asyncio.CancelledError):
        fut.exception()
    await in_callback(fut.wake)  # the reactor finds it finished: nothing happens
    assert fut.cancelled() and not fut.cancel()


@pytest.mark.asyncio
async def test_set_result_and_cancel_schedule_the_callbacks_with_call_soon() -> None:
    loop = asyncio.get_running_loop()
    calls: list[tuple[str, Any]] = []
    a, b = new(loop), new(loop)
    a.add_done_callback(lambda f: calls.append(("a", f)))
    b.add_done_callback(lambda f: calls.append(("b", f)))
    a.set_result(7)
    assert b.cancel() and calls == []  # not yet run: scheduled
    await asyncio.sleep(0)
    assert calls == [("a", a), ("b", b)]
    assert a.result() == 7 and await a == 7
    with pytest.raises(asyncio.InvalidStateError):
        a.set_result(8)


@pytest.mark.asyncio
async def test_a_callback_added_to_a_finished_future_is_scheduled_in_its_context() -> None:
    loop = asyncio.get_running_loop()
    fut = new(loop)
    fut.set_result(None)
    ctx = contextvars.copy_context()
    ctx.run(where.set, "given")
    seen: list[str] = []
    fut.add_done_callback(lambda f: seen.append(where.get()), context=ctx)
    assert seen == []
    await asyncio.sleep(0)
    assert seen == ["given"]


@pytest.mark.asyncio
async def test_the_done_callbacks_run_in_the_order_added_and_can_be_removed() -> None:
    loop = asyncio.get_running_loop()
    fut = new(loop)
    calls: list[int] = []

    def one(f: Any) -> None:
        calls.append(1)

    def two(f: Any) -> None:
        calls.append(2)

    for cb in (one, two, one, two, one):
        fut.add_done_callback(cb)
    assert fut.remove_done_callback(one) == 3 and fut.remove_done_callback(one) == 0
    await in_callback(fut.wake)
    assert calls == [2, 2]


@pytest.mark.asyncio
async def test_a_pending_future_has_neither_result_nor_exception() -> None:
    fut = new(asyncio.get_running_loop())
    with pytest.raises(asyncio.InvalidStateError):
        fut.result()
    with pytest.raises(asyncio.InvalidStateError):
        fut.exception()
    assert not fut.done() and not fut.cancelled()
    assert "pending" in repr(fut)


@pytest.mark.asyncio
async def test_asyncio_takes_it_for_a_future_of_its_loop() -> None:
    loop = asyncio.get_running_loop()
    futs = [new(loop) for _ in range(3)]
    assert all(asyncio.isfuture(f) for f in futs) and futs[0]._loop is loop
    assert asyncio.ensure_future(futs[0]) is futs[0]
    gathered = asyncio.gather(*futs[:2])
    waited = asyncio.ensure_future(asyncio.wait([futs[2]]))
    shielded = asyncio.ensure_future(asyncio.shield(futs[2]))
    await asyncio.sleep(0)
    await in_callback(lambda: _engine._wake_batch(futs))
    assert await gathered == [None, None]
    done, pending = await waited
    assert done == {futs[2]} and not pending
    assert await shielded is None


@pytest.mark.asyncio
async def test_a_task_of_another_loop_cannot_await_it() -> None:
    fut = new(asyncio.new_event_loop())
    try:
        with pytest.raises(RuntimeError, match="attached to a different loop"):
            await asyncio.create_task(_await(fut))
    finally:
        fut._loop.close()


async def _await(fut: Any) -> None:
    await fut


@pytest.mark.asyncio
async def test_iterating_it_again_before_it_finishes_is_refused() -> None:
    fut = new(asyncio.get_running_loop())
    it = fut.__await__()
    assert next(it) is fut and fut._asyncio_future_blocking
    with pytest.raises(RuntimeError, match="await wasn't used with future"):
        next(it)


@pytest.mark.asyncio
async def test_a_raising_callback_is_reported_and_the_rest_of_the_batch_still_wakes() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda lp, c: reported.append(c))
    try:
        futs = [new(loop) for _ in range(3)]
        calls: list[str] = []

        def bad(f: Any) -> None:
            raise ValueError("callback failed")

        futs[0].add_done_callback(bad)
        futs[0].add_done_callback(lambda f: calls.append("after bad"))
        futs[1].add_done_callback(lambda f: calls.append("next future"))

        def wake() -> list[str]:
            _engine._wake_batch(futs)
            return list(calls)

        assert await in_callback(wake) == ["next future"]  # the one after bad: scheduled
        assert all(f.done() for f in futs)
        assert [type(c["exception"]) for c in reported] == [ValueError]
        assert reported[0]["future"] is futs[0]
        assert calls == ["next future", "after bad"]  # (it ran since)
    finally:
        loop.set_exception_handler(None)


@pytest.mark.asyncio
async def test_a_keyboard_interrupt_in_a_batch_propagates_and_leaves_the_rest_scheduled() -> None:
    loop = asyncio.get_running_loop()
    futs = [new(loop) for _ in range(3)]
    woken: list[int] = []

    def interrupt(f: Any) -> None:
        raise KeyboardInterrupt

    futs[0].add_done_callback(interrupt)
    futs[1].add_done_callback(lambda f: woken.append(1))
    futs[2].add_done_callback(lambda f: woken.append(2))
    with pytest.raises(KeyboardInterrupt):
        _engine._wake_batch(futs)
    assert woken == [] and all(f.done() for f in futs)  # the rest: through call_soon
    await asyncio.sleep(0)
    assert woken == [1, 2]


def test_the_constructor_takes_the_loop_alone() -> None:
    loop = asyncio.new_event_loop()
    try:
        assert _native.DirectFuture(loop)._loop is loop
        for args, kw in (
            ((), {}),
            ((loop, loop), {}),
            ((), {"lop": loop}),
            ((loop,), {"loop": loop}),
        ):
            with pytest.raises(TypeError, match="takes the loop alone"):
                _native.DirectFuture(*args, **kw)
        fut = _native.DirectFuture(loop)
        with pytest.raises(TypeError, match="unexpected keyword argument 'ctx'"):
            fut.add_done_callback(print, ctx=None)
        with pytest.raises(TypeError):
            fut.cancel("a", msg="b")
    finally:
        loop.close()


def test_the_collector_sees_through_its_callbacks() -> None:
    """A future whose callback refers back to it is a cycle the collector frees."""
    loop = asyncio.new_event_loop()
    try:
        fut = _native.DirectFuture(loop)

        class Holder:
            pass

        h = Holder()
        h.fut = fut  # type: ignore[attr-defined]
        fut.add_done_callback(lambda f, h=h: None)
        ref = weakref.ref(h)
        del h, fut
        gc.collect()
        assert ref() is None
    finally:
        loop.close()


# -- the await of a DeviceEvent in C (EventCore's am_await) ----------------------------


class _Stream:
    """A stream that answers the event's await as the test says: _poll's answer
    and the future _future hands out."""

    def __init__(self, reached: bool = False, fut: Any = None) -> None:
        self.reached = reached
        self.fut = fut
        self.polls = 0

    def _poll(self, ev: Any) -> bool:
        self.polls += 1
        return self.reached

    def _future(self, ev: Any, loop: asyncio.AbstractEventLoop) -> Any:
        return self.fut


def _event(stream: Any = None) -> Any:
    from asyncgpu._core.event import DeviceEvent

    return DeviceEvent(stream, 1)


@pytest.mark.asyncio
async def test_awaiting_a_finished_event_returns_its_value_without_asking_the_stream() -> None:
    stream = _Stream()
    ev = _event(stream)
    ev._finish((1, 2))
    assert await ev == (1, 2)  # (a tuple stays one value)
    failed = _event(stream)
    failed._finish(None, ValueError("the operation's error"))
    with pytest.raises(ValueError, match="the operation's error"):
        await failed
    assert stream.polls == 0


@pytest.mark.asyncio
async def test_an_event_the_stream_reports_finished_ends_the_await_at_once() -> None:
    ev = _event(_Stream(reached=True))
    ev._finish("value")
    ev._done = False  # (as a stream whose _poll retires it: the outcome is stored)
    assert await ev == "value"


@pytest.mark.asyncio
async def test_a_pending_event_hands_the_task_the_reactors_future_and_ends_with_its_outcome() -> (
    None
):
    loop = asyncio.get_running_loop()
    fut = new(loop)
    ev = _event(_Stream(fut=fut))
    task = asyncio.ensure_future(_await(ev))
    await asyncio.sleep(0)
    assert task.get_coro().cr_await is fut  # no generator between the task and it
    ev._finish("the event's value")
    await in_callback(lambda: _engine._wake_batch([fut]))
    assert task.result() is None and fut.result() is None

    async def value_of(e: Any) -> Any:
        return await e

    fut2 = new(loop)
    ev2 = _event(_Stream(fut=fut2))
    task2 = asyncio.ensure_future(value_of(ev2))
    await asyncio.sleep(0)
    ev2._finish(None, KeyError("device error"))
    await in_callback(lambda: _engine._wake_batch([fut2]))
    with pytest.raises(KeyError, match="device error"):
        await task2


@pytest.mark.asyncio
async def test_an_asyncio_future_from_the_stream_is_awaited_then_the_event_ends_the_await() -> None:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    ev = _event(_Stream(fut=fut))

    async def value_of(e: Any) -> Any:
        return await e

    task = asyncio.ensure_future(value_of(ev))
    await asyncio.sleep(0)
    assert not task.done()
    ev._finish([3])
    fut.set_result("the future's own result is not the await's")
    assert await task == [3]


@pytest.mark.asyncio
async def test_awaiting_an_event_never_recorded_raises_at_the_await() -> None:
    from asyncgpu import AsyncGPUError

    with pytest.raises(AsyncGPUError, match="never recorded"):
        await _event()
