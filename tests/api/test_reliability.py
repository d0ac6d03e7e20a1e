"""Reliability: lifetimes, closing, cancellation, errors, faults, threads, soak.

Each test pins one promise of docs/guarantees.md. Order comes from gates (CPU
functions that hold a stream until the test opens them), barriers and events,
never from sleeping: where a timer opens a gate, it only gives a broken
implementation the chance to show itself, and the test's verdict does not
depend on when it fires.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import sys
import textwrap
import threading
import tracemalloc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import trio
from _kernels import ADD_ONE, TIMEOUT_S, TRAP_AND_SPIN, Gate, blocks_for, poison, random_array

from asyncgpu import ContextClosedError, DeviceContext, DeviceEvent
from asyncgpu._core import engine as _engine
from asyncgpu._core.pool import pool_size

ROOT = Path(__file__).resolve().parents[2]
N = 1024


def pattern(n: int, salt: int = 0, start: int = 0) -> np.ndarray:
    """Elements ``start..start+n-1`` of deterministic data that no stale or zeroed
    memory holds."""
    i = np.arange(start, start + n, dtype=np.uint32)
    return (i * np.uint32(2654435761) + np.uint32(salt + 1)).view(np.int32)


def wait_released(refs: list[weakref.ref[Any]], what: str) -> None:
    """Wait until every object behind ``refs`` has been freed (what finished work
    kept alive is released by the thread that retires it: a pool thread, or on
    CUDA the watcher)."""
    freed = threading.Event()
    for r in refs:
        obj = r()
        if obj is not None:
            weakref.finalize(obj, freed.set)
        del obj
    deadline = threading.Event()
    timer = threading.Timer(TIMEOUT_S, deadline.set)
    timer.start()
    try:
        while any(r() is not None for r in refs):
            assert not deadline.is_set(), (
                f"{what} still alive {TIMEOUT_S} s after completion: {_holders(refs)}"
            )
            gc.collect()
            freed.wait(0.01)
            freed.clear()
    finally:
        timer.cancel()


def _holders(refs: list[weakref.ref[Any]]) -> str:
    """What still holds the objects behind ``refs`` (for a failure message)."""
    out = []
    for i, r in enumerate(refs):
        obj = r()
        if obj is not None:
            held_by = [type(o).__name__ for o in gc.get_referrers(obj) if o is not refs]
            out.append(f"#{i} {type(obj).__name__} held by {held_by[:6]}")
        del obj
    return "; ".join(out)


def pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncgpu-cpu")]


def other_threads() -> set[int]:
    """Threads that are neither the CPU pool's nor the staged-copy pool's (fixed
    sizes, made once) nor the CUDA watcher (one thread that stops when idle)."""
    return {
        t.ident or 0
        for t in threading.enumerate()
        if not t.name.startswith(("asyncgpu-cpu", "asyncgpu-copy", "asyncgpu-watcher"))
    }


# -- lifetimes ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_dropped_operands_stay_alive_until_their_operations_finish(
    ctx: DeviceContext, gate
) -> None:
    """Drop every reference right after enqueueing large copies (64 MiB), a kernel
    and a CPU function: the operations keep their operands alive, the data that
    arrives is right, and once they have finished everything is released."""
    n = 16 << 20  # int32: 64 MiB
    g = gate()
    ctx.enqueue_cpu_function(g)  # nothing below runs before every reference is gone
    data = pattern(n)
    dev = ctx.enqueue_create_buffer(np.int32, n)
    host = ctx.enqueue_create_host_buffer(np.int32, n)
    out = np.empty(n, np.int32)
    ctx.enqueue_copy(dev, data)  # a NumPy array as a span, H2D
    ctx.enqueue_copy(host, dev)  # D2H into pinned memory
    ctx.enqueue_copy(out, host)  # host buffer to a NumPy span
    small = ctx.enqueue_create_buffer(np.int32, N)
    small_in = pattern(N, salt=7)
    small_out = np.empty(N, np.int32)
    ctx.enqueue_copy(small, small_in)
    ctx.enqueue_function(ADD_ONE, small, np.int32(N), grid_dim=blocks_for(N), block_dim=256)
    ctx.enqueue_copy(small_out, small)
    total = [0]

    def checksum(a: np.ndarray) -> int:
        total[0] = int(a[: 1 << 16].astype(np.int64).sum())
        return total[0]

    fn = lambda: checksum(out)  # noqa: E731 (only the operation refers to it)
    last = ctx.enqueue_cpu_function(fn)
    refs = [weakref.ref(x) for x in (data, dev, host, small, small_in, fn)]
    del data, dev, host, small, small_in, fn
    gc.collect()
    assert all(r() is not None for r in refs), "an operation dropped an operand early"
    assert not last.query()
    g.open()
    assert await asyncio.wait_for(last, TIMEOUT_S) == int(pattern(1 << 16).astype(np.int64).sum())
    piece = 1 << 22
    for lo in range(0, n, piece):  # compare in pieces: no second 64 MiB array
        np.testing.assert_array_equal(out[lo : lo + piece], pattern(piece, start=lo))
    np.testing.assert_array_equal(small_out, pattern(N, salt=7) + 1)
    wait_released(refs, "an operand of a finished operation")


@pytest.mark.parametrize("where", ["same stream", "other stream"])
def test_freed_buffers_are_not_reused_before_their_operations_finish(
    ctx: DeviceContext, gate, where: str
) -> None:
    """A buffer dropped while its operations are pending goes back to its pool
    only after they finish: buffers allocated meanwhile (same size, same or another
    stream, device and pinned host memory) never alias it."""
    a_data, b_data = pattern(N, 1), pattern(N, 2)
    g = gate()
    ctx.enqueue_cpu_function(g)
    view = ctx if where == "same stream" else ctx.select_stream(1)
    out_dev, out_host = poison(np.int32, N), poison(np.int32, N)
    dev = ctx.enqueue_create_buffer(np.int32, N)
    host = ctx.enqueue_create_host_buffer(np.int32, N)
    ctx.enqueue_copy(dev, a_data)
    ctx.enqueue_copy(host, dev)
    ctx.enqueue_copy(out_dev, dev)
    ctx.enqueue_copy(out_host, host)
    del dev, host
    gc.collect()
    fresh = []
    for _ in range(4):  # a pool hands back its most recent blocks first
        d = view.enqueue_create_buffer(np.int32, N)
        h = view.enqueue_create_host_buffer(np.int32, N)
        h.as_numpy()[:] = b_data  # the host writes pinned memory at once
        view.enqueue_copy(d, h)
        fresh.append((d, h))
    if where == "other stream":
        view.synchronize()  # the other stream is done while stream 0 is still held
    g.open()
    ctx.synchronize()
    view.synchronize()
    np.testing.assert_array_equal(out_dev, a_data)
    np.testing.assert_array_equal(out_host, a_data)
    for d, h in fresh:
        got = poison(np.int32, N)
        view.enqueue_copy(got, d).synchronize()
        np.testing.assert_array_equal(got, b_data)
        np.testing.assert_array_equal(h.as_numpy(), b_data)


# -- closing ---------------------------------------------------------------------------------


def _work_behind_a_gate(
    c: DeviceContext, g: Gate
) -> tuple[DeviceEvent, list[DeviceEvent], np.ndarray, list[str]]:
    """Enqueue a gate on stream 0 and work behind it on streams 0 and 1."""
    data = pattern(N)
    out = poison(np.int32, N)
    ran: list[str] = []
    held = c.enqueue_cpu_function(g)
    buf = c.enqueue_create_buffer(np.int32, N)
    evs = [c.enqueue_copy(buf, data)]
    evs.append(c.enqueue_function(ADD_ONE, buf, np.int32(N), grid_dim=blocks_for(N), block_dim=256))
    s1 = c.select_stream(1)
    s1.enqueue_wait_for(c)
    evs.append(s1.enqueue_copy(out, buf))
    evs.append(s1.enqueue_cpu_function(ran.append, "stream 1"))
    evs.append(c.enqueue_cpu_function(ran.append, "stream 0"))
    return held, evs, out, ran


@pytest.mark.parametrize("how", ["close", "with", "aclose", "async with"])
def test_closing_with_work_in_flight_waits_for_it(api: str, how: str) -> None:
    """Closing (``close()``, leaving ``with``, ``aclose()``, leaving ``async with``)
    while work is pending returns only after that work has run; the async forms
    keep the loop running meanwhile. Then everything is released."""
    g = Gate()
    c = DeviceContext(api=api)
    held, evs, out, ran = _work_behind_a_gate(c, g)
    done_at_exit: list[bool] = []
    try:
        if how in ("close", "with"):
            # Another thread opens the gate a little later. If close() did not wait,
            # it would return before that, with the work undone.
            opener = threading.Timer(0.05, g.open)
            opener.start()
            if how == "close":
                c.close()
            else:
                with c:
                    pass
            done_at_exit = [ev.query() for ev in evs]
            opener.join()
        else:

            async def main() -> None:
                async def ticker() -> None:
                    # Runs only while the exit is waiting without blocking the loop,
                    # and only then opens the gate.
                    for _ in range(20):
                        await asyncio.sleep(0)
                    g.open()

                t = asyncio.create_task(ticker())
                if how == "aclose":
                    await c.aclose()
                else:
                    async with c:
                        pass
                done_at_exit.extend(ev.query() for ev in evs)
                await t

            asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    finally:
        g.open()
    assert held.synchronize() == "opened"  # opened by the test, not timed out
    assert done_at_exit == [True] * len(evs), "the exit returned before the work had run"
    assert sorted(ran) == ["stream 0", "stream 1"]
    np.testing.assert_array_equal(out, pattern(N) + 1)
    with pytest.raises(ContextClosedError):
        c.enqueue_create_buffer(np.int32, 1)


def test_a_cancelled_aclose_still_closes_the_context(api: str) -> None:
    """Cancelling the task that waits in ``aclose()`` (or the exit of ``async
    with``) stops the wait, not the closing: a background thread waits for the
    work and releases the context; the work completes."""
    g = Gate()
    c = DeviceContext(api=api)
    held, evs, out, _ = _work_behind_a_gate(c, g)

    async def main() -> None:
        closing = asyncio.create_task(c.aclose())
        # asyncio runs the new task's first step before this one resumes: it is then
        # suspended in its wait, which cannot end while the gate is shut.
        await asyncio.sleep(0)
        assert not closing.done()
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing

    try:
        asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
        assert not held.query()
        closers = [t for t in threading.enumerate() if t.name == "asyncgpu-close"]
        assert closers, "nobody is left to close the context"
    finally:
        g.open()
    for t in closers:
        t.join(TIMEOUT_S)
    assert held.synchronize() == "opened"
    assert all(ev.query() for ev in evs)
    np.testing.assert_array_equal(out, pattern(N) + 1)
    with pytest.raises(ContextClosedError):
        c.enqueue_create_buffer(np.int32, 1)


def test_everything_of_a_closed_context_raises_context_closed_error(api: str) -> None:
    """Objects made before ``close()``: contexts and views, streams, buffers and
    sub-buffers, host buffers, functions. Every use afterwards raises
    ``ContextClosedError`` (never a crash); finished events keep their values;
    dropping it all later is silent."""

    def use_everything_after_close() -> None:
        c = DeviceContext(api=api)
        view = c.select_stream(1)
        stream = view.stream()
        buf = c.enqueue_create_buffer(np.int32, N)
        sub = buf.create_sub_buffer(np.int32, 8, 8)
        host = c.enqueue_create_host_buffer(np.int32, N)
        fn = c.compile_function(ADD_ONE)
        done = c.enqueue_cpu_function(lambda: "value")
        user_event = c.create_event()
        c.close()
        out = np.empty(N, np.int32)
        uses: dict[str, Callable[[], Any]] = {
            "enqueue_create_buffer": lambda: c.enqueue_create_buffer(np.int32, 1),
            "enqueue_copy": lambda: c.enqueue_copy(out, buf),
            "view.enqueue_copy": lambda: view.enqueue_copy(buf, out),
            "select_stream": lambda: c.select_stream(2),
            "synchronize": c.synchronize,
            "stream.synchronize": stream.synchronize,
            "stream.record_event": lambda: stream.record_event(user_event),
            "enqueue_function": lambda: c.enqueue_function(
                fn, buf, np.int32(N), grid_dim=4, block_dim=256
            ),
            "enqueue_cpu_function": lambda: view.enqueue_cpu_function(print),
            "enqueue_wait_for": lambda: view.enqueue_wait_for(c),
            "buf.enqueue_fill": lambda: buf.enqueue_fill(1),
            "buf.enqueue_copy_to": lambda: buf.enqueue_copy_to(out),
            "buf.unsafe_ptr": buf.unsafe_ptr,
            "buf.create_sub_buffer": lambda: buf.create_sub_buffer(np.int32, 0, 1),
            "buf.map_to_host": buf.map_to_host,
            "sub.enqueue_fill": lambda: sub.enqueue_fill(2),
            "host.as_numpy": host.as_numpy,
            "host[0]": lambda: host[0],
            "compile_function": lambda: c.compile_function(ADD_ONE),
            "fn.get_attribute": lambda: fn.get_attribute(0),
            "get_memory_info": c.get_memory_info,
            "DeviceContext(copy=)": lambda: DeviceContext(copy=c),
        }
        for name, use in uses.items():
            with pytest.raises(ContextClosedError):
                use()
                pytest.fail(f"{name} worked on a closed context")

        async def awaits() -> None:
            assert await done == "value"  # a finished event keeps its outcome
            with pytest.raises(ContextClosedError):
                await c
            with pytest.raises(ContextClosedError):
                await stream

        asyncio.run(awaits())

    use_everything_after_close()
    gc.collect()  # everything made above is dropped after the close, silently


# -- cancellation ------------------------------------------------------------------------------

TASKS = 10_000


async def _cancel_round(c: DeviceContext, streams: int) -> tuple[int, int]:
    """TASKS tasks each enqueue one operation behind a gate and await it; all are
    cancelled while they wait; then the gate opens. Checks that the work ran and
    that no waiter is left; returns (operations checked, waiters seen)."""
    g = Gate()
    held = c.enqueue_cpu_function(g)
    views = [c.select_stream(i) for i in range(streams)]
    for v in views[1:]:
        v.enqueue_wait_for(held)
    slots = c.enqueue_create_buffer(np.int32, 8 * TASKS)
    events: list[DeviceEvent] = [None] * TASKS  # type: ignore[list-item]
    waiting = 0
    all_waiting = asyncio.Event()

    async def one(i: int) -> None:
        nonlocal waiting
        v = views[i % streams]
        kind = i % 4
        if kind == 0:
            ev = v.enqueue_cpu_function(int.__mul__, i, 3)
        elif kind == 1:
            ev = v.enqueue_copy(
                slots.create_sub_buffer(np.int32, 8 * i, 8), np.full(8, i, np.int32)
            )
        elif kind == 2:
            ev = v.enqueue_memset(slots.create_sub_buffer(np.int32, 8 * i, 8), -i)
        else:
            ev = v.enqueue_wait_for(views[(i + 1) % streams])
        events[i] = ev
        waiting += 1
        if waiting == TASKS:
            all_waiting.set()
        await ev

    tasks = [asyncio.create_task(one(i)) for i in range(TASKS)]
    # Each task runs from its enqueue to its await in one step, so once the last
    # one has counted itself, every task is suspended in its await.
    await asyncio.wait_for(all_waiting.wait(), TIMEOUT_S)
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    # Mid-flight: nothing has run, and every waiter the tasks left is cancelled.
    assert not any(ev.query() for ev in events), "an operation ran before the gate opened"
    # (An await of CUDA work leaves its future with the loop's reactor, not on
    # the event.)
    waiters = _awaiting_futures(events)
    for ev, fut in waiters:
        assert fut.cancelled(), f"a live waiter on {ev!r} after its task was cancelled"
    seen = len(waiters)
    g.open()
    for v in views:
        await asyncio.wait_for(v, TIMEOUT_S)
    for i, ev in enumerate(events):  # every operation ran, and a later await works
        value = await ev
        assert value == (i * 3 if i % 4 == 0 else None)
        assert ev._waiters is None, f"{ev!r} kept its waiters after completing"
    reactor = _engine._reactors.get(asyncio.get_running_loop())
    if reactor is not None:
        reactor._poll_once()  # one reactor pass: the awaits of finished work leave it
    assert not _awaiting_futures(events), "the reactor kept awaits of finished work"
    got = np.empty(8 * TASKS, np.int32)
    await c.enqueue_copy(got, slots)
    got = got.reshape(TASKS, 8)
    i = np.arange(TASKS)
    np.testing.assert_array_equal(got[i % 4 == 1], np.repeat(i[i % 4 == 1], 8).reshape(-1, 8))
    np.testing.assert_array_equal(got[i % 4 == 2], np.repeat(-i[i % 4 == 2], 8).reshape(-1, 8))
    return TASKS, seen


def _awaiting_futures(events: list[DeviceEvent]) -> list[tuple[DeviceEvent, asyncio.Future]]:
    """The futures of asyncio awaits of ``events``: on the events' waiter lists
    (push-completed work) or in the running loop's reactor (polled work)."""
    found = [(ev, w.fut) for ev in events for w in ev._waiters or () if getattr(w, "fut", None)]
    reactor = _engine._reactors.get(asyncio.get_running_loop())
    if reactor is not None:
        mine = {id(ev) for ev in events}
        found += [(ev, f) for q in reactor.pending.values() for _, ev, f in q if id(ev) in mine]
    return found


def _live(kind: type) -> int:
    return sum(1 for o in gc.get_objects() if type(o) is kind)


def test_ten_thousand_cancelled_tasks_leak_nothing(ctx: DeviceContext, api: str) -> None:
    """10,000 tasks cancelled mid-flight: the work still runs, the context stays
    usable, and no events, waiters, futures, threads, Python memory, pinned memory
    or device pool memory are left behind (measured before and after a second
    round, after a first one has warmed every pool up)."""
    streams = 4
    # Round 1 warms up: the CPU pool's threads, the reactor, the memory pools.
    assert asyncio.run(_cancel_round(ctx, streams))[0] == TASKS
    gc.collect()
    threads_before = other_threads()
    pool_before = len(pool_threads())  # more than pool_size() after blocked waits
    events_before = _live(DeviceEvent)
    futures_before = _live(asyncio.Future)
    pinned_before = device_before = 0
    if api == "cuda":
        from asyncgpu._devices.cuda import memory as _memory

        pinned_before = _memory._pinned.cached_bytes()
        device_before = ctx.get_memory_info()[0]
    tracemalloc.start()
    try:
        snap_before = tracemalloc.take_snapshot()
        checked, seen = asyncio.run(_cancel_round(ctx, streams))
        gc.collect()
        snap_after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert checked == TASKS and seen == TASKS
    grown = sum(s.size_diff for s in snap_after.compare_to(snap_before, "filename"))
    assert grown < 256 * 1024, f"{grown} bytes of Python memory left after {TASKS} cancelled tasks"
    assert _live(DeviceEvent) <= events_before + 2 * streams
    assert _live(asyncio.Future) <= futures_before
    assert other_threads() <= threads_before
    assert len(pool_threads()) <= max(pool_before, pool_size())
    if api == "cuda":
        assert _memory._pinned.cached_bytes() <= pinned_before + (1 << 20)
        assert ctx.get_memory_info()[0] >= device_before - (64 << 20)
    # ... and the context still works.
    data = pattern(N)
    out = poison(np.int32, N)
    buf = ctx.enqueue_create_buffer(np.int32, N)
    ctx.enqueue_copy(buf, data)
    ctx.enqueue_copy(out, buf).synchronize()
    np.testing.assert_array_equal(out, data)


@pytest.mark.asyncio
async def test_wait_for_timeouts_bound_the_wait_not_the_work(ctx: DeviceContext, gate) -> None:
    """``asyncio.wait_for`` and ``asyncio.timeout`` give up on the wait; the
    operations run on and can be awaited again."""
    g = gate()
    ctx.enqueue_cpu_function(g)
    data = pattern(N)
    buf = ctx.enqueue_create_buffer(np.int32, N)
    copied = ctx.enqueue_copy(buf, data)
    values = [ctx.select_stream(i % 4).enqueue_cpu_function(int.__neg__, i) for i in range(200)]
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(copied, 0.001)
    timeouts = 0
    for ev in values[::4]:  # those on stream 0, behind the gate
        try:
            async with asyncio.timeout(0):
                await ev
        except TimeoutError:
            timeouts += 1
    assert timeouts == len(values[::4])
    assert not copied.query()
    g.open()
    assert await asyncio.wait_for(copied, TIMEOUT_S) is None
    assert [await ev for ev in values] == [-i for i in range(200)]
    out = poison(np.int32, N)
    await ctx.enqueue_copy(out, buf)
    np.testing.assert_array_equal(out, data)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.anyio
async def test_an_anyio_cancel_scope_leaves_the_work_running(
    ctx: DeviceContext, anyio_backend: str
) -> None:
    """Tasks of an anyio task group (asyncio and trio) awaiting copies, a kernel
    and CPU functions are cancelled through the group's cancel scope while they
    wait: the work runs on, and a later await gets each result."""
    g = Gate()
    try:
        data = pattern(N)
        out = poison(np.int32, N)
        ctx.enqueue_cpu_function(g)
        buf = ctx.enqueue_create_buffer(np.int32, N)
        events = [ctx.enqueue_copy(buf, data)]
        events.append(
            ctx.enqueue_function(ADD_ONE, buf, np.int32(N), grid_dim=blocks_for(N), block_dim=256)
        )
        events.append(ctx.enqueue_copy(out, buf))
        events += [ctx.enqueue_cpu_function(int.__add__, i, 1) for i in range(50)]
        waiting = 0
        all_waiting = anyio.Event()
        finished = 0

        async def one(ev: DeviceEvent) -> None:
            nonlocal waiting, finished
            waiting += 1
            if waiting == len(events):
                all_waiting.set()
            await ev
            finished += 1  # never reached: cancelled first

        with anyio.fail_after(TIMEOUT_S):
            async with anyio.create_task_group() as tg:
                for ev in events:
                    tg.start_soon(one, ev)
                await all_waiting.wait()  # every task is suspended in its await
                tg.cancel_scope.cancel()
            assert finished == 0
            assert not any(ev.query() for ev in events)
            with anyio.move_on_after(0) as scope:  # a scope that is already cancelled
                await events[-1]
            assert scope.cancelled_caught
            g.open()
            values = [await ev for ev in events]
    finally:
        g.open()
    assert values == [None, None, None] + [i + 1 for i in range(50)]
    np.testing.assert_array_equal(out, data + 1)


def test_trio_move_on_after_leaves_the_work_running(ctx: DeviceContext) -> None:
    """100 trio tasks give up their awaits through ``trio.move_on_after``; the
    operations complete and keep their values."""
    g = Gate()
    ctx.enqueue_cpu_function(g)
    events = [ctx.select_stream(i % 3).enqueue_cpu_function(int.__add__, i, 1) for i in range(100)]
    caught: list[int] = []

    async def one(i: int) -> None:
        with trio.move_on_after(0) as scope:
            await events[i]
        if scope.cancelled_caught:
            caught.append(i)

    async def main() -> list[int]:
        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(one, i)
        g.open()
        with trio.fail_after(TIMEOUT_S):
            return [await ev for ev in events]

    try:
        values = trio.run(main)
    finally:
        g.open()
    assert set(range(0, 100, 3)) <= set(caught)  # those on stream 0 were all behind the gate
    assert values == [i + 1 for i in range(100)]


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_cpu_function_error_reaches_only_its_awaiters(ctx: DeviceContext, gate) -> None:
    """The exception of a CPU function reaches the tasks awaiting that operation,
    the very object raised; awaiters of the operations around it, of the stream
    and of the context get their own outcomes; the stream goes on."""
    err = OSError("disk full")

    def fail() -> None:
        raise err

    g = gate()
    ctx.enqueue_cpu_function(g)
    before = ctx.enqueue_cpu_function(lambda: "before")
    bad = ctx.enqueue_cpu_function(fail)
    after = ctx.enqueue_cpu_function(lambda: "after")
    data = pattern(N)
    buf = ctx.enqueue_create_buffer(np.int32, N)
    copied = ctx.enqueue_copy(buf, data)
    waiting = 0
    all_waiting = asyncio.Event()

    async def wait(aw: Any) -> Any:
        nonlocal waiting
        waiting += 1
        if waiting == 6:
            all_waiting.set()
        return await aw

    tasks = [
        asyncio.create_task(wait(aw)) for aw in (before, bad, bad, after, copied, ctx.stream())
    ]
    await asyncio.wait_for(all_waiting.wait(), TIMEOUT_S)
    g.open()
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), TIMEOUT_S)
    assert results[0] == "before"
    assert results[1] is err and results[2] is err
    assert results[3] == "after"
    assert results[4] is None
    assert results[5] is None  # a stream-level wait does not re-raise it
    ctx.synchronize()  # nor does a blocking one
    with pytest.raises(OSError) as info:
        bad.synchronize()
    assert info.value is err
    out = poison(np.int32, N)
    await ctx.enqueue_copy(out, buf)  # the stream goes on
    np.testing.assert_array_equal(out, data)


FAULT_SCRIPT = textwrap.dedent(
    r"""
    import asyncio, sys, threading, time
    import numpy as np
    import asyncgpu as ag

    SRC = sys.argv[1]  # (tests/_kernels.py's TRAP_AND_SPIN)
    ctx = ag.DeviceContext(api="cuda")
    trap = ctx.compile_function(SRC, "trap")
    spin = ctx.compile_function(SRC, "spin")
    khz = ctx.default_device_info.clock_rate_khz
    out = [np.empty(1024, np.float32) for _ in range(4)]

    async def main():
        pending = []
        s0 = ctx.select_stream(0)
        s0.enqueue_function(spin, np.int64(khz * 100), grid_dim=1, block_dim=1)  # ~100 ms
        pending.append(s0.enqueue_function(trap, grid_dim=1, block_dim=1))
        for i in range(4):
            s = ctx.select_stream(i)
            if i:  # work independent of the trap, still running when it strikes
                long_spin = np.int64(khz * 3000)  # ~3 s
                pending.append(s.enqueue_function(spin, long_spin, grid_dim=1, block_dim=1))
            pending.append(s.enqueue_cpu_function(lambda: "ran after the fault"))
            buf = s.enqueue_create_buffer(np.float32, 1024)
            pending.append(s.enqueue_memset(buf, 1.0))
            if i:
                pending.append(s.enqueue_wait_for(s0))  # work behind the trap
            pending.append(s.enqueue_copy(out[i], buf))
        blocking = []
        t = threading.Thread(target=lambda: blocking.append(_sync(pending[-1])))
        t.start()
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(_await(ev)) for ev in pending for _ in range(8)]
        res = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        dt = time.perf_counter() - t0
        t.join(10)
        kinds = sorted({type(r).__name__ for r in res})
        faults = [r for r in res if isinstance(r, ag.DeviceFaultError)]
        print("KINDS", kinds, "FAULTS", len(faults), "OF", len(res), "SECONDS", round(dt, 3))
        print("BLOCKING", [type(b).__name__ for b in blocking])
        print("MESSAGE", faults[0] if faults else None)
        assert len(faults) == len(res), kinds
        assert all(isinstance(b, ag.DeviceFaultError) for b in blocking), blocking
        assert dt < 1.0, dt
        assert any("operation #" in str(f) for f in faults)

    async def _await(ev):
        return await ev

    def _sync(ev):
        try:
            return ev.synchronize()
        except BaseException as e:
            return e

    asyncio.run(main())
    print("OK")
    """
)


@pytest.mark.gpu
def test_a_device_fault_fails_every_pending_awaiter_within_a_second(tmp_path: Path) -> None:
    """A trap on one stream of a context with work pending on four: every pending
    await (asyncio, 8 awaiters per operation) and a blocking ``synchronize`` in
    another thread raise ``DeviceFaultError`` within 1 s, naming the operation.
    Runs in a child process: a sticky fault ruins the process's CUDA context."""
    from conftest import CUDA_DEVICES, NO_CUDA_REASON

    if CUDA_DEVICES == 0:
        pytest.skip(NO_CUDA_REASON)
    import os
    import subprocess

    script = tmp_path / "fault.py"
    script.write_text(FAULT_SCRIPT)
    env = dict(os.environ, ASYNCGPU_DISABLE_HEALTHCHECK="1")
    proc = subprocess.run(
        [sys.executable, str(script), TRAP_AND_SPIN],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


# -- threads ---------------------------------------------------------------------------------


def test_one_context_from_four_threads_each_with_its_own_loop(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    """Four threads, each running its own asyncio loop, use one context at once
    (the same streams, interleaved, released together by a barrier every round):
    copies, kernels, CPU functions, sub-buffers and cross-stream waits all give
    the right results."""
    threads, rounds = 4, 25
    streams = ctx.num_streams()
    barrier = threading.Barrier(threads, timeout=TIMEOUT_S)
    datas = [[random_array(rng, np.int32, N) // 2 for _ in range(rounds)] for _ in range(threads)]
    results: dict[int, BaseException | int] = {}

    async def work(t: int) -> int:
        checked = 0
        for r in range(rounds):
            barrier.wait()  # every thread enqueues at the same moment
            a = ctx.select_stream((t + r) % streams)
            b = ctx.select_stream((t + r + 1) % streams)
            data = datas[t][r]
            buf = a.enqueue_create_buffer(np.int32, 2 * N)
            half = buf.create_sub_buffer(np.int32, N, N)
            a.enqueue_copy(half, data)
            a.enqueue_function(ADD_ONE, half, np.int32(N), grid_dim=blocks_for(N), block_dim=256)
            b.enqueue_wait_for(a)
            out = poison(np.int32, N)
            copied = b.enqueue_copy(out, half)
            value = b.enqueue_cpu_function(lambda t=t, r=r: (t, r))
            assert await value == (t, r)
            await copied
            np.testing.assert_array_equal(out, data + 1)
            checked += 1
        return checked

    def run(t: int) -> None:
        try:
            results[t] = asyncio.run(asyncio.wait_for(work(t), TIMEOUT_S))
        except BaseException as e:
            results[t] = e
            barrier.abort()

    pool = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    for t in range(threads):
        r = results[t]
        if isinstance(r, BaseException):
            raise r
        assert r == rounds


# -- soak ------------------------------------------------------------------------------------


def _soak_module() -> Any:
    spec = importlib.util.spec_from_file_location("asyncgpu_soak", ROOT / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("asyncgpu_soak", mod)
    spec.loader.exec_module(mod)
    return mod


def test_soak_small(api: str) -> None:
    """benchmarks/soak.py, small, in this process: mixed awaited operations from
    100 tasks on 8 streams with random cancellations, every result checked, no
    error, and memory, threads and events flat from 10% to the end."""
    soak = _soak_module()
    rec = soak.run(ops=6000, tasks=100, streams=8, device=api, cancel_rate=0.02, seed=1)
    assert rec["errors"] == 0, rec["error_examples"]
    assert rec["awaited_ops"] == 6000
    assert rec["groups_checked"] == sum(rec["groups"].values())
    assert rec["cancelled_awaits"] > 0
    assert all(rec["groups"][k] for k in soak.KINDS)
    assert rec["all_flat"], rec["flat"]
    assert rec["passed"]


EXIT_SCRIPT = """
import sys
import numpy as np
import asyncgpu as ag

with ag.DeviceContext(api=sys.argv[1]) as ctx:
    kept = ctx.enqueue_create_buffer(np.float32, 1024)  # outlives the context
    host = ctx.enqueue_create_host_buffer(np.float32, 1024)
    ctx.enqueue_memset(kept, 1.0)
    with ctx.trace() as trace:  # kept too, with device stamps nobody read (CUDA)
        ctx.enqueue_memset(kept, 2.0)
print("OK")
"""


def test_buffers_kept_past_their_context_let_the_interpreter_exit_cleanly(
    api: str, tmp_path: Path
) -> None:
    """Buffers (and a trace) held in module globals after their context closed
    are dropped during the interpreter's teardown; the process exits with
    status 0. A device buffer once crashed the teardown in 5 runs of 8:
    cuda.core freed it on the stream it was allocated on, destroyed when the
    context closed (``cuMemFreeAsync`` on a destroyed stream)."""
    import os
    import subprocess

    script = tmp_path / "kept.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    for _ in range(6):  # the crash did not come every time
        proc = subprocess.run(
            [sys.executable, "-X", "faulthandler", str(script), api],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "OK" in proc.stdout


def test_at_interpreter_exit_a_dropped_buffer_gives_nothing_back(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once ``atexit`` has run, a buffer being dropped neither frees its memory
    nor hands it back to the pool: the end of the process frees it, and the
    allocation, dropped with the buffer, decides what its own teardown may do
    (the CUDA device allocation abandons its cuda.core buffer rather than free
    it on a destroyed stream, see ``test_cuda_logic``)."""
    from asyncgpu._core.memory import _BufferBase

    calls: list[str] = []

    class _Recorder:
        def release(self, stream: object) -> None:
            calls.append("release")

        def abandon(self) -> None:
            calls.append("abandon")

    with DeviceContext(api=api) as ctx:
        buf = ctx.enqueue_create_buffer(np.float32, 16)
        ctx.synchronize()
        real, buf._alloc = buf._alloc, _Recorder()
        monkeypatch.setattr(_BufferBase, "_exiting", True)
        del buf
        gc.collect()
        assert calls == []
        monkeypatch.setattr(_BufferBase, "_exiting", False)
        other = ctx.enqueue_create_buffer(np.float32, 16)
        mine, other._alloc = other._alloc, _Recorder()
        del other
        gc.collect()
        assert calls == ["release"]
        # The real allocations go back to their stream while it lives: dropped after
        # the close, cuda.core would free them on that stream, destroyed by then.
        for alloc in (real, mine):
            alloc.release(ctx._impl)
