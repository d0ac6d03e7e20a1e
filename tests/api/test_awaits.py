"""How awaits resolve: order, already-finished work, cancellation, trio, threads."""

from __future__ import annotations

import asyncio
import random
import threading

import anyio
import numpy as np
import pytest
import trio
from _kernels import ADD_ONE, TIMEOUT_S, Gate, poison, random_array

from asyncgpu import DeviceContext, DeviceEvent

N = 512


@pytest.mark.asyncio
async def test_awaits_resolve_in_submission_order(ctx: DeviceContext, gate) -> None:
    n = 40
    ran: list[int] = []  # the order the stream ran the functions in
    resumed: list[int] = []  # the order the awaiting tasks woke up in
    g = gate()
    ctx.enqueue_cpu_function(g)
    events = [ctx.enqueue_cpu_function(ran.append, i) for i in range(n)]
    all_waiting = asyncio.Event()
    started = 0

    async def waiter(i: int) -> None:
        nonlocal started
        started += 1
        if started == n:
            all_waiting.set()
        await events[i]
        resumed.append(i)

    order = list(range(n))
    random.shuffle(order)  # the tasks start awaiting in a random order ...
    tasks = [asyncio.create_task(waiter(i)) for i in order]
    await all_waiting.wait()  # every task is now suspended on its event
    g.open()
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
    assert ran == list(range(n))
    assert resumed == list(range(n))  # ... and wake up in submission order


@pytest.mark.asyncio
async def test_every_enqueue_returns_an_awaitable_event(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    data = random_array(rng, np.int32, N) // 2
    buf = ctx.enqueue_create_buffer(np.int32, N)
    out = poison(np.int32, N)
    s1 = ctx.select_stream(1)
    s1.enqueue_cpu_function(lambda: None)
    ops = {
        "copy": lambda: ctx.enqueue_copy(buf, data),
        "memset": lambda: ctx.enqueue_memset(buf, 1),
        "copy back": lambda: ctx.enqueue_copy(buf, data),
        "function": lambda: ctx.enqueue_function(
            ADD_ONE, buf, np.int32(N), grid_dim=2, block_dim=256
        ),
        "no cross-stream sync": lambda: ctx.enqueue_copy_no_cross_stream_sync(out, buf),
        "cpu range": lambda: ctx.enqueue_cpu_range(lambda i: None, 3),
        "wait": lambda: ctx.enqueue_wait_for(s1),
        "cpu function": lambda: ctx.enqueue_cpu_function(lambda: "cpu"),
    }
    for name, op in ops.items():
        ev = op()
        assert isinstance(ev, DeviceEvent), name
        assert await ev == ("cpu" if name == "cpu function" else None), name
        assert ev.query(), name
    np.testing.assert_array_equal(out, data + 1)


@pytest.mark.asyncio
async def test_await_of_a_finished_operation_returns_at_once(ctx: DeviceContext) -> None:
    ev = ctx.enqueue_cpu_function(lambda: "value")
    ev.synchronize()

    async def get() -> str:
        return await ev

    coro = get()
    # One step of the coroutine completes it: the await did not suspend.
    with pytest.raises(StopIteration) as stop:
        coro.send(None)
    assert stop.value.value == "value"
    assert await ev == "value"  # and as often as you like


@pytest.mark.asyncio
async def test_cancelling_an_awaiting_task_does_not_cancel_the_work(
    ctx: DeviceContext, rng: np.random.Generator, gate
) -> None:
    data = random_array(rng, np.int32, N) // 2
    buf = ctx.enqueue_create_buffer(np.int32, N)
    ctx.enqueue_copy(buf, data)
    g = gate()
    ctx.enqueue_cpu_function(g)
    launched = ctx.enqueue_function(ADD_ONE, buf, np.int32(N), grid_dim=2, block_dim=256)
    result = ctx.enqueue_cpu_function(lambda: "result")

    async def wait() -> str:
        return await result

    task = asyncio.create_task(wait())
    await asyncio.sleep(0)  # the task runs up to its await and suspends there
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not result.query()  # the work is still pending, not cancelled
    g.open()
    assert await result == "result"  # a later await of the same event works
    assert launched.query()
    out = poison(np.int32, N)
    await ctx.enqueue_copy(out, buf)
    np.testing.assert_array_equal(out, data + 1)


@pytest.mark.asyncio
async def test_many_tasks_await_one_event(ctx: DeviceContext, gate) -> None:
    g = gate()
    ev = ctx.enqueue_cpu_function(g)

    async def wait() -> str:
        return await ev

    tasks = [asyncio.create_task(wait()) for _ in range(20)]
    await asyncio.sleep(0)
    g.open()
    assert await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S) == ["opened"] * 20


@pytest.mark.asyncio
async def test_the_loop_stays_responsive_while_work_is_pending(ctx: DeviceContext, gate) -> None:
    g = gate()
    ev = ctx.enqueue_cpu_function(g)
    waiting = asyncio.create_task(asyncio.wait_for(ev, TIMEOUT_S))
    ticks = 0
    for _ in range(100):  # the loop keeps running other tasks
        await asyncio.sleep(0)
        ticks += 1
    assert ticks == 100 and not waiting.done()
    g.open()
    assert await waiting == "opened"


@pytest.mark.asyncio
async def test_errors_of_awaited_work_propagate_through_gather(ctx: DeviceContext) -> None:
    def fail() -> None:
        raise OSError("disk")

    ok = ctx.select_stream(1).enqueue_cpu_function(lambda: 1)
    bad = ctx.select_stream(2).enqueue_cpu_function(fail)
    results = await asyncio.gather(ok, bad, return_exceptions=True)
    assert results[0] == 1
    assert isinstance(results[1], OSError)


# -- trio ---------------------------------------------------------------------------------


def test_await_under_trio(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.float32, N)
    out = poison(np.float32, N)
    g = Gate()

    async def main() -> str:
        buf = ctx.enqueue_create_buffer(np.float32, N)
        ctx.enqueue_copy(buf, data)
        held = ctx.enqueue_cpu_function(g)
        copied = ctx.enqueue_copy(out, buf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, lambda: g.entered.wait(TIMEOUT_S))
        assert not copied.query()
        g.open()
        with trio.fail_after(TIMEOUT_S):
            value = await held
            await copied
            await ctx.stream()
            await ctx
        return value

    try:
        assert trio.run(main) == "opened"
    finally:
        g.open()
    np.testing.assert_array_equal(out, data)


def test_trio_cancellation_does_not_cancel_the_work(ctx: DeviceContext) -> None:
    g = Gate()
    ev = ctx.enqueue_cpu_function(g)

    async def main() -> str:
        with trio.move_on_after(0) as scope:
            await ev
        assert scope.cancelled_caught
        assert not ev.query()
        g.open()
        with trio.fail_after(TIMEOUT_S):
            return await ev

    try:
        assert trio.run(main) == "opened"
    finally:
        g.open()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.anyio
async def test_await_under_anyio(ctx: DeviceContext, anyio_backend: str) -> None:
    g = Gate()
    results: list[int] = []
    try:
        held = ctx.enqueue_cpu_function(g)
        events = [ctx.enqueue_cpu_function(lambda i=i: i * i) for i in range(10)]

        async def one(i: int) -> None:
            results.append(await events[i])

        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                for i in range(10):
                    tg.start_soon(one, i)
                g.open()
            await held
    finally:
        g.open()
    assert sorted(results) == [i * i for i in range(10)]


# -- threads, each with its own loop --------------------------------------------------------


@pytest.mark.parametrize("same_stream", [False, True], ids=["own streams", "one stream"])
def test_awaits_from_several_threads_each_with_its_own_loop(
    ctx: DeviceContext, rng: np.random.Generator, same_stream: bool
) -> None:
    threads = 4
    datas = [random_array(rng, np.int32, N) // 2 for _ in range(threads)]
    start = threading.Barrier(threads, timeout=TIMEOUT_S)
    results: dict[int, object] = {}

    async def work(t: int) -> np.ndarray:
        c = ctx if same_stream else ctx.select_stream(t + 1)
        buf = c.enqueue_create_buffer(np.int32, N)
        await c.enqueue_copy(buf, datas[t])
        for _ in range(5):
            c.enqueue_function(ADD_ONE, buf, np.int32(N), grid_dim=2, block_dim=256)
        assert await c.enqueue_cpu_function(lambda: t) == t
        out = poison(np.int32, N)
        await c.enqueue_copy(out, buf)
        await c
        return out

    def run(t: int) -> None:
        try:
            start.wait()
            results[t] = asyncio.run(asyncio.wait_for(work(t), TIMEOUT_S))
        except BaseException as e:
            results[t] = e

    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    for t in range(threads):
        r = results[t]
        assert not isinstance(r, BaseException), r
        np.testing.assert_array_equal(r, datas[t] + 5)


def test_an_event_awaited_from_two_loops_at_once(ctx: DeviceContext) -> None:
    g = Gate()
    ev = ctx.enqueue_cpu_function(g)
    both_waiting = threading.Barrier(3, timeout=TIMEOUT_S)
    results: list[object] = []

    async def wait() -> None:
        both_waiting.wait()
        results.append(await asyncio.wait_for(ev, TIMEOUT_S))

    def run() -> None:
        try:
            asyncio.run(wait())
        except BaseException as e:
            results.append(e)

    pool = [threading.Thread(target=run) for _ in range(2)]
    for th in pool:
        th.start()
    try:
        both_waiting.wait()
    finally:
        g.open()
    for th in pool:
        th.join()
    assert results == ["opened", "opened"]


def test_an_event_is_awaitable_after_its_loop_closed(ctx: DeviceContext) -> None:
    ev = ctx.enqueue_cpu_function(lambda: 3)

    async def get() -> int:
        return await ev

    assert asyncio.run(get()) == 3
    assert asyncio.run(get()) == 3  # a second, fresh loop
    assert isinstance(ev, DeviceEvent) and ev.query()
