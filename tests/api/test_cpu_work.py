"""CPU work as stream work: enqueue_cpu_function and enqueue_cpu_range."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import numpy as np
import pytest
from _kernels import TIMEOUT_S, poison, random_array

from asyncgpu import ContextClosedError, DeviceContext, DeviceEvent

# -- enqueue_cpu_function ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_awaited_value_is_the_functions_return_value(ctx: DeviceContext) -> None:
    ev = ctx.enqueue_cpu_function(divmod, 47, 5)
    assert isinstance(ev, DeviceEvent)
    assert await ev == (9, 2)
    assert await ctx.enqueue_cpu_function(lambda *, k: k * 2, k=21) == 42
    assert ev.synchronize() == (9, 2)  # the value stays with the event


@pytest.mark.asyncio
async def test_an_exception_comes_back_at_the_await_and_the_stream_goes_on(
    ctx: DeviceContext,
) -> None:
    def boom() -> None:
        raise KeyError("boom")

    failed = ctx.enqueue_cpu_function(boom)
    after = ctx.enqueue_cpu_function(lambda: "still running")
    with pytest.raises(KeyError, match="boom"):
        await failed
    with pytest.raises(KeyError):
        failed.synchronize()  # and again, the same error
    assert await after == "still running"
    # Stream-level waits report device faults, not a CPU function's own error.
    await ctx
    ctx.synchronize()
    assert await ctx.enqueue_cpu_function(int, "7") == 7


def test_cpu_functions_run_in_stream_order(ctx: DeviceContext) -> None:
    order: list[int] = []
    events = [ctx.enqueue_cpu_function(order.append, i) for i in range(50)]
    events[-1].synchronize()
    assert order == list(range(50))


def test_a_cpu_function_right_behind_another_starts_when_that_one_returns(
    ctx: DeviceContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Back-to-back CPU functions on one stream hand over on the host: the second
    starts once the first returns, without waiting for anyone to notice the
    first one's event finish. Here nothing would (the engine's watcher is told
    nothing), so a second function that waited for that would never start."""
    from asyncgpu._core import engine as _engine

    monkeypatch.setattr(_engine.watcher, "watch", lambda stream, seq: None)
    go, second_ran = threading.Event(), threading.Event()
    first = ctx.enqueue_cpu_function(go.wait, TIMEOUT_S)
    second = ctx.enqueue_cpu_function(second_ran.set)
    go.set()
    assert second_ran.wait(TIMEOUT_S), "the second function never started"
    monkeypatch.undo()
    assert first.synchronize() is True and second.synchronize() is None


def test_cpu_functions_run_after_earlier_device_work(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    data = random_array(rng, np.float32, 4096)
    buf = ctx.enqueue_create_buffer(np.float32, 4096)
    host = ctx.enqueue_create_host_buffer(np.float32, 4096)
    ctx.enqueue_copy(host, poison(np.float32, 4096))
    ctx.enqueue_copy(buf, data)
    ctx.enqueue_copy(host, buf)
    seen = ctx.enqueue_cpu_function(lambda: host.as_numpy().copy()).synchronize()
    np.testing.assert_array_equal(seen, data)


def test_device_work_after_a_cpu_function_waits_for_it(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    data = random_array(rng, np.int32, 1000)
    host = ctx.enqueue_create_host_buffer(np.int32, 1000)
    buf = ctx.enqueue_create_buffer(np.int32, 1000)
    ctx.enqueue_copy(host, poison(np.int32, 1000))

    def write() -> None:
        host.as_numpy()[:] = data  # the CPU writes ...

    ctx.enqueue_cpu_function(write)
    ctx.enqueue_copy(buf, host)  # ... then the device reads
    out = poison(np.int32, 1000)
    ctx.enqueue_copy(out, buf).synchronize()
    np.testing.assert_array_equal(out, data)


def test_cpu_function_needs_a_callable(ctx: DeviceContext) -> None:
    with pytest.raises(TypeError):
        ctx.enqueue_cpu_function(42)  # type: ignore[arg-type]


def test_an_async_function_is_a_type_error(ctx: DeviceContext) -> None:
    """CPU work runs on pool threads, with no event loop: an ``async def`` function
    only made a coroutine that nobody ran (the event's value)."""

    async def work(i: int = 0) -> int:
        return i

    class AsyncCall:
        async def __call__(self, i: int = 0) -> int:
            return i

    for fn in (work, AsyncCall()):
        with pytest.raises(TypeError, match="async"):
            ctx.enqueue_cpu_function(fn)
        with pytest.raises(TypeError, match="async"):
            ctx.enqueue_cpu_range(fn, 4)
    assert ctx.enqueue_cpu_function(lambda: "next").synchronize() == "next"


_OWN_WAITS = {
    "ctx.synchronize": lambda c: c.synchronize(),
    "stream.synchronize": lambda c: c.stream().synchronize(),
    "event.synchronize": lambda c: c.enqueue_cpu_function(int).synchronize(),
    "ctx.close": lambda c: c.close(),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("wait", list(_OWN_WAITS), ids=list(_OWN_WAITS))
@pytest.mark.parametrize("form", ["function", "range"])
async def test_a_cpu_function_that_waits_for_its_own_stream_gets_a_runtime_error(
    api: str, wait: str, form: str
) -> None:
    """The wait would be for the very function doing it: it hung for ever (as did
    ``close`` of the last reference, which waits for all work)."""
    ctx = DeviceContext(api=api)
    call = _OWN_WAITS[wait]
    if form == "function":
        ev = ctx.enqueue_cpu_function(call, ctx)
    else:
        ev = ctx.enqueue_cpu_range(lambda i: call(ctx), 1)
    awaited = asyncio.ensure_future(ev)
    done, _ = await asyncio.wait({awaited}, timeout=TIMEOUT_S)
    if not done:  # (the context is left open: closing it would hang too)
        pytest.fail(f"a CPU function's {wait} waited for itself")
    with pytest.raises(RuntimeError, match="wait for itself"):
        awaited.result()
    with pytest.raises(RuntimeError, match="wait for itself"):
        ev.synchronize()
    # The context is as it was: open, usable, and it closes normally.
    assert await asyncio.wait_for(ctx.enqueue_cpu_function(lambda: "after"), TIMEOUT_S) == "after"
    ctx.close()
    with pytest.raises(ContextClosedError):
        ctx.enqueue_cpu_function(print)


@pytest.mark.asyncio
@pytest.mark.parametrize("read", ["stream.handle", "__cuda_stream__", "__cuda_array_interface__"])
async def test_a_cpu_function_that_settles_its_own_cuda_stream_gets_a_runtime_error(
    api: str, read: str
) -> None:
    """A CUDA stream holds the work after a CPU function on the host until the
    function ends, and handing out its handle first hands that work to the driver:
    from inside the function, that waited for the function itself, for ever."""
    if api != "cuda":
        pytest.skip("the CPU device holds no work back: its handle never waits")
    ctx = DeviceContext(api=api)
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    reads = {
        "stream.handle": lambda: ctx.stream().handle,
        "__cuda_stream__": lambda: ctx.stream().__cuda_stream__(),
        "__cuda_array_interface__": lambda: buf.__cuda_array_interface__,
    }
    ev = ctx.enqueue_cpu_function(reads[read])
    done, _ = await asyncio.wait({asyncio.ensure_future(ev)}, timeout=TIMEOUT_S)
    if not done:
        pytest.fail(f"a CPU function's {read} waited for itself")
    with pytest.raises(RuntimeError, match="wait for itself"):
        ev.synchronize()
    assert isinstance(ctx.stream().handle, int)  # outside the function it answers
    ctx.close()


@pytest.mark.asyncio
async def test_cpu_functions_that_block_for_other_streams_never_use_up_the_pool(
    ctx: DeviceContext,
) -> None:
    """Every thread of the CPU pool runs a function that blocks until another
    stream's CPU work is done, and that work is queued behind them: the pool
    starts a thread for each blocked wait (without them, it deadlocked)."""
    from asyncgpu._core.pool import cpu_pool, pool_size

    n = pool_size()
    # First a burst of work queued behind busy threads: the pool must then still
    # start threads for the waits below.
    gate = threading.Event()
    burst = [cpu_pool().call(gate.wait, TIMEOUT_S) for _ in range(3 * n)]
    gate.set()
    assert all(f.result(TIMEOUT_S) for f in burst)

    other = ctx.select_stream(3)
    started = threading.Barrier(n + 1, timeout=TIMEOUT_S)
    go = threading.Event()

    def blocks_for_other(i: int) -> None:
        started.wait()  # every pool thread is in here
        assert go.wait(TIMEOUT_S)
        other.synchronize()

    blocked = ctx.select_stream(1).enqueue_cpu_range(blocks_for_other, n)
    started.wait()
    queued = other.enqueue_cpu_function(lambda: "the other stream's work")
    go.set()
    assert await asyncio.wait_for(queued, TIMEOUT_S) == "the other stream's work"
    await asyncio.wait_for(blocked, TIMEOUT_S)


def test_a_cpu_function_may_wait_for_earlier_work_of_its_own_stream(ctx: DeviceContext) -> None:
    """Only a wait for itself is refused: the work before it on the stream has
    finished when it runs, though the stream may not have noticed yet."""
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    filled = buf.enqueue_fill(7)
    first = ctx.enqueue_cpu_function(lambda: 41)
    second = ctx.enqueue_cpu_function(lambda: (filled.synchronize(), first.synchronize() + 1))
    assert second.synchronize() == (None, 42)


def test_cpu_functions_on_different_streams_overlap(ctx: DeviceContext) -> None:
    # Each waits for the other: only concurrent execution gets both through.
    barrier = threading.Barrier(2, timeout=TIMEOUT_S)
    a = ctx.select_stream(1).enqueue_cpu_function(barrier.wait)
    b = ctx.select_stream(2).enqueue_cpu_function(barrier.wait)
    assert sorted([a.synchronize(), b.synchronize()]) == [0, 1]


# -- enqueue_cpu_range ------------------------------------------------------------------------


@pytest.mark.parametrize("count", [1, 2, 7, 100, 1001])
def test_cpu_range_calls_each_index_exactly_once(ctx: DeviceContext, count: int) -> None:
    calls: Counter[int] = Counter()
    lock = threading.Lock()

    def fn(i: int) -> None:
        with lock:
            calls[i] += 1

    assert ctx.enqueue_cpu_range(fn, count).synchronize() is None
    assert calls == Counter(range(count))


def test_cpu_range_of_zero_calls_nothing(ctx: DeviceContext) -> None:
    calls: list[int] = []
    ctx.enqueue_cpu_range(calls.append, 0).synchronize()
    assert calls == []


def test_cpu_range_runs_in_parallel(ctx: DeviceContext) -> None:
    # Two calls that each wait for the other: a serial range would break the barrier.
    barrier = threading.Barrier(2, timeout=TIMEOUT_S)
    got: list[int] = []
    ctx.enqueue_cpu_range(lambda i: got.append(barrier.wait()), 2).synchronize()
    assert sorted(got) == [0, 1]


def test_cpu_range_starts_after_earlier_work_and_ends_before_later_work(
    ctx: DeviceContext, gate
) -> None:
    count = 16
    log: list[str] = []
    lock = threading.Lock()
    g0 = gate()
    ctx.enqueue_cpu_function(g0)  # hold the stream before the range
    ctx.enqueue_cpu_function(log.append, "before")
    last = count - 1
    held = gate()  # fn(last) waits on this one
    rest_done = threading.Event()

    def fn(i: int) -> None:
        if i == last:
            held()
        with lock:
            log.append(f"range {i}")
            if i != last and sum(x.startswith("range") for x in log) == count - 1:
                rest_done.set()

    rng_ev = ctx.enqueue_cpu_range(fn, count)
    later = ctx.enqueue_cpu_function(lambda: list(log))
    assert log == []  # nothing before the gate
    g0.open()
    assert held.entered.wait(TIMEOUT_S)
    assert rest_done.wait(TIMEOUT_S)
    # Every call but the last has finished; the range, and what follows it, has not.
    assert not rng_ev.query()
    assert not later.query()
    held.open()
    seen = later.synchronize()
    assert seen[0] == "before"
    assert sorted(seen[1:]) == sorted(f"range {i}" for i in range(count))


@pytest.mark.asyncio
async def test_cpu_range_errors_come_back_at_the_await(ctx: DeviceContext) -> None:
    calls: list[int] = []

    def fn(i: int) -> None:
        calls.append(i)
        if i == 3:
            raise ValueError("three")

    with pytest.raises(ValueError, match="three"):
        await ctx.enqueue_cpu_range(fn, 8)
    assert sorted(calls) == list(range(8))  # the other calls still ran
    assert await ctx.enqueue_cpu_function(lambda: "next") == "next"


def test_cpu_range_arguments(ctx: DeviceContext) -> None:
    with pytest.raises(TypeError):
        ctx.enqueue_cpu_range(None, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ctx.enqueue_cpu_range(print, -1)
    with pytest.raises(TypeError):
        ctx.enqueue_cpu_range(print, 2.0)  # type: ignore[arg-type]


def test_cpu_range_writes_a_host_buffer(ctx: DeviceContext, rng: np.random.Generator) -> None:
    n = 500
    data = random_array(rng, np.float64, n)
    host = ctx.enqueue_create_host_buffer(np.float64, n)
    ctx.enqueue_copy(host, poison(np.float64, n))

    def fn(i: int) -> None:
        host[i] = data[i] * 3

    ctx.enqueue_cpu_range(fn, n)
    dev = ctx.enqueue_create_buffer(np.float64, n)
    ctx.enqueue_copy(dev, host)
    out = poison(np.float64, n)
    ctx.enqueue_copy(out, dev).synchronize()
    np.testing.assert_array_equal(out, data * 3)
