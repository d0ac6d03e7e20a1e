"""Streams (the pool, created and external ones), waits between them, and events."""

from __future__ import annotations

import asyncio
import logging
import threading

import numpy as np
import pytest
from _kernels import TIMEOUT_S, Gate, poison, random_array

from asyncgpu import (
    AsyncGPUError,
    DeviceContext,
    DeviceEvent,
    DeviceStream,
    StreamPriorityRange,
    UnsupportedError,
)

N = 256

# -- the stream pool ------------------------------------------------------------------------


def test_num_streams_is_the_pool_size(ctx: DeviceContext) -> None:
    n = ctx.num_streams()
    assert isinstance(n, int) and n >= 2
    assert ctx.select_stream(n - 1).num_streams() == n


def test_select_stream_is_a_view_of_the_same_context(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    s1 = ctx.select_stream(1)
    assert s1.api() == ctx.api() and s1.id() == ctx.id()
    assert s1.stream() != ctx.stream()
    assert s1.stream().index == 1 and ctx.stream().index == 0
    # Memory is shared: a buffer made through the view is usable from the base.
    data = random_array(rng, np.int32, N)
    buf = s1.enqueue_create_buffer(np.int32, N)
    s1.enqueue_copy(buf, data)
    out = poison(np.int32, N)
    ctx.enqueue_copy(out, buf).synchronize()
    np.testing.assert_array_equal(out, data)
    # Views of views are views of the same context.
    assert s1.select_stream(2) == ctx.select_stream(2)
    assert s1.select_stream(0) == ctx


@pytest.mark.parametrize("bad", [-1, "num_streams"])
def test_select_stream_out_of_range_is_an_index_error(ctx: DeviceContext, bad: object) -> None:
    idx = ctx.num_streams() if bad == "num_streams" else bad
    with pytest.raises(IndexError):
        ctx.select_stream(idx)


def test_select_stream_needs_an_int(ctx: DeviceContext) -> None:
    with pytest.raises(TypeError):
        ctx.select_stream(1.0)  # type: ignore[arg-type]


def test_stream_is_the_views_current_stream(ctx: DeviceContext) -> None:
    s = ctx.stream()
    assert isinstance(s, DeviceStream)
    assert s == ctx.stream()
    assert s.context() == ctx
    assert ctx.select_stream(3).stream().context() == ctx.select_stream(3)
    assert isinstance(s.handle, int)
    assert ctx.api() in repr(s)


# -- created and external streams -------------------------------------------------------------


def test_stream_priority_range(ctx: DeviceContext, api: str) -> None:
    rng = ctx.stream_priority_range()
    assert isinstance(rng, StreamPriorityRange)
    assert rng.greatest <= rng.least  # lower numbers are higher priorities
    if api == "cpu":
        assert rng == (0, 0)


def test_create_stream_with_each_priority(ctx: DeviceContext, rng: np.random.Generator) -> None:
    prio = ctx.stream_priority_range()
    data = random_array(rng, np.float32, N)
    for p in sorted({prio.least, prio.greatest, 0}):
        s = ctx.create_stream(priority=p)
        assert isinstance(s, DeviceStream)
        assert s.priority() == p
        assert s != ctx.stream()
        view = s.context()
        buf = view.enqueue_create_buffer(np.float32, N)
        view.enqueue_copy(buf, data)
        out = poison(np.float32, N)
        view.enqueue_copy(out, buf)
        s.synchronize()
        np.testing.assert_array_equal(out, data)


def test_create_stream_outside_the_range_is_a_value_error(ctx: DeviceContext) -> None:
    prio = ctx.stream_priority_range()
    with pytest.raises(ValueError):
        ctx.create_stream(priority=prio.least + 1)
    with pytest.raises(ValueError):
        ctx.create_stream(priority=prio.greatest - 1)


@pytest.mark.parametrize("api", ["cpu"])
def test_cpu_device_has_no_external_streams(ctx: DeviceContext) -> None:
    with pytest.raises(UnsupportedError):
        ctx.create_external_stream(0)


class _TheirStream:
    """Another library's stream object: a new one for the same native stream at
    each call, as ``torch.cuda.current_stream()`` gives."""

    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


@pytest.mark.parametrize("api", ["cpu"])
def test_a_context_wraps_each_native_stream_once(ctx: DeviceContext, monkeypatch) -> None:
    """Wrapping a native stream again gives the first wrapper back (one stream of
    ours per native stream, whatever object names it): wrapping per request
    costs a look-up. The CPU device has no native streams, so its backend is
    given the CUDA backend's two steps here: read the handle, wrap it."""
    backend = ctx._state.backend
    made: list[int] = []

    def external_stream(state, theirs, index):
        made.append(theirs.cuda_stream)
        return backend.new_stream(state, index, 0)

    monkeypatch.setattr(backend, "external_handle", lambda theirs: theirs.cuda_stream)
    monkeypatch.setattr(backend, "external_stream", external_stream)
    first = ctx.create_external_stream(_TheirStream(0x10))
    again = ctx.create_external_stream(_TheirStream(0x10))
    other = ctx.create_external_stream(_TheirStream(0x20))
    assert first == again and first != other
    assert made == [0x10, 0x20]
    assert ctx._state.external_streams == {0x10: first._impl, 0x20: other._impl}


@pytest.mark.parametrize("api", [pytest.param("cuda", marks=pytest.mark.gpu)])
def test_external_stream_wraps_a_native_handle(api: str, rng: np.random.Generator) -> None:
    from _kernels import cuda_device_count

    if cuda_device_count() == 0:
        pytest.skip("no CUDA GPU")
    with DeviceContext(api=api) as ctx:
        owned = ctx.create_stream()
        ext = ctx.create_external_stream(owned.handle)
        assert ext.handle == owned.handle
        data = random_array(rng, np.int32, N)
        view = ext.context()
        buf = view.enqueue_create_buffer(np.int32, N)
        view.enqueue_copy(buf, data)
        out = poison(np.int32, N)
        view.enqueue_copy(out, buf)
        ext.synchronize()
        np.testing.assert_array_equal(out, data)


# -- waits between streams ------------------------------------------------------------------


@pytest.mark.parametrize("form", ["context", "stream", "event", "stream.enqueue_wait_for"])
def test_enqueue_wait_for_orders_work_across_streams(
    ctx: DeviceContext, rng: np.random.Generator, gate, form: str
) -> None:
    s1 = ctx.select_stream(1)
    data = random_array(rng, np.int64, N)
    buf = s1.enqueue_create_buffer(np.int64, N)  # owned by stream 1
    g = gate()
    s1.enqueue_cpu_function(g)
    s1.enqueue_copy(buf, data)  # held behind the gate on stream 1
    if form == "context":
        ctx.enqueue_wait_for(s1)
    elif form == "stream":
        ctx.enqueue_wait_for(s1.stream())
    elif form == "event":
        ev = ctx.create_event()
        s1.stream().record_event(ev)
        ctx.enqueue_wait_for(ev)
    else:
        ctx.stream().enqueue_wait_for(s1)
    out = poison(np.int64, N)
    # No automatic cross-stream sync here: only the wait orders this copy.
    copied = ctx.enqueue_copy_no_cross_stream_sync(out, buf)
    assert g.entered.wait(TIMEOUT_S)
    assert not copied.query()
    g.open()
    copied.synchronize()
    np.testing.assert_array_equal(out, data)


def test_enqueue_wait_for_returns_an_event(ctx: DeviceContext, gate) -> None:
    s1 = ctx.select_stream(1)
    g = gate()
    held = s1.enqueue_cpu_function(g)
    waited = ctx.enqueue_wait_for(s1)
    assert isinstance(waited, DeviceEvent)
    assert not waited.query()
    g.open()
    waited.synchronize()
    assert held.query()


def test_waiting_for_oneself_or_nothing_is_a_no_op(ctx: DeviceContext) -> None:
    assert ctx.enqueue_wait_for(ctx).query()
    assert ctx.enqueue_wait_for(ctx.select_stream(5)).query()  # nothing enqueued there
    with pytest.raises(TypeError):
        ctx.enqueue_wait_for(42)  # type: ignore[arg-type]


def test_wait_across_contexts(api: str, rng: np.random.Generator, gate) -> None:
    with DeviceContext(api=api) as a, DeviceContext(api=api) as b:
        g = gate()
        a.enqueue_cpu_function(g)
        seen = []
        a.enqueue_cpu_function(seen.append, "a")
        b.enqueue_wait_for(a)
        after = b.enqueue_cpu_function(lambda: list(seen))
        assert not after.query()
        g.open()
        assert after.synchronize() == ["a"]


# -- events -----------------------------------------------------------------------------------


def test_a_new_event_is_done_until_recorded(ctx: DeviceContext, gate) -> None:
    ev = ctx.create_event()
    assert isinstance(ev, DeviceEvent)
    assert ev.query()
    g = gate()
    ctx.enqueue_cpu_function(g)
    ctx.stream().record_event(ev)
    assert not ev.query()
    g.open()
    ev.synchronize()
    assert ev.query()


def test_recording_again_moves_the_event(ctx: DeviceContext, gate) -> None:
    ev = ctx.create_event()
    ctx.stream().record_event(ev)
    ev.synchronize()
    g = gate()
    ctx.enqueue_cpu_function(g)
    ctx.stream().record_event(ev)
    assert not ev.query()
    g.open()
    ev.synchronize()
    assert ev.query()


def test_record_on_an_idle_stream_is_done_at_once(ctx: DeviceContext) -> None:
    ev = ctx.create_event()
    ctx.select_stream(4).stream().record_event(ev)
    ev.synchronize()
    assert ev.query()


@pytest.mark.asyncio
async def test_await_event_stream_and_context(ctx: DeviceContext, gate) -> None:
    for target in ("event", "stream", "context"):
        g = gate()
        held = ctx.enqueue_cpu_function(g)
        ev = ctx.create_event()
        ctx.stream().record_event(ev)
        awaitable = {"event": ev, "stream": ctx.stream(), "context": ctx}[target]

        async def wait(a=awaitable) -> None:
            await a

        task = asyncio.create_task(wait())
        await asyncio.sleep(0)
        assert not task.done(), target
        g.open()
        await asyncio.wait_for(task, TIMEOUT_S)
        assert held.query(), target


@pytest.mark.asyncio
@pytest.mark.parametrize("form", ["stream", "context", "view"])
async def test_await_of_a_stream_is_not_its_last_operations_error(
    ctx: DeviceContext, gate, form: str
) -> None:
    """A CPU function's exception belongs to its event: awaiting the stream it
    ran on (``await stream``, ``await ctx`` or ``await`` a view bound to that
    stream: one implementation) waits for it (pending or done) and returns,
    and its event raises."""
    view = ctx.select_stream(2)

    def boom() -> None:
        raise ValueError("boom")

    for pending in (True, False):
        g = gate()
        view.enqueue_cpu_function(g)
        failed = view.enqueue_cpu_function(boom)
        awaited = {"stream": view.stream(), "context": view, "view": ctx.select_stream(2)}[form]
        if pending:
            task = asyncio.create_task(_await(awaited))
            await asyncio.sleep(0)
            assert not task.done()
            g.open()
            await asyncio.wait_for(task, TIMEOUT_S)
        else:
            g.open()
            with pytest.raises(ValueError, match="boom"):
                await asyncio.wait_for(_await(failed), TIMEOUT_S)
            await awaited  # done, with the error: returns at once
        assert failed.query()
        with pytest.raises(ValueError, match="boom"):
            await failed


@pytest.mark.asyncio
async def test_awaiting_a_context_waits_for_its_current_stream_alone(
    ctx: DeviceContext, gate
) -> None:
    """``await view`` waits for the work enqueued on the view's current stream
    when the await began: not for work enqueued there after, nor for other
    streams' held work."""
    g, after, elsewhere = gate(), gate(), gate()
    held_elsewhere = ctx.select_stream(1).enqueue_cpu_function(elsewhere)
    view = ctx.select_stream(3)
    held = view.enqueue_cpu_function(g)
    task = asyncio.create_task(_await(view))
    await asyncio.sleep(0)  # (the await has begun: its point is taken)
    assert not task.done()
    later = view.enqueue_cpu_function(after)
    try:
        g.open()
        await asyncio.wait_for(task, TIMEOUT_S)
        assert held.query()
        assert not later.query() and not held_elsewhere.query()
        await asyncio.wait_for(_await(ctx), TIMEOUT_S)  # stream 0: idle
    finally:
        after.open()
        elsewhere.open()
    await asyncio.wait_for(_await(view), TIMEOUT_S)
    assert later.query()


@pytest.mark.asyncio
async def test_awaiting_a_context_takes_the_events_compiled_await(
    ctx: DeviceContext, gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``await ctx`` waits as ``await stream`` does, through its point's own
    await (``DeviceEvent.__await__``, in C), not the Python wait of
    ``_wait_async`` with a separate fault check."""

    def python_wait(self):  # pragma: no cover (must not be called)
        raise AssertionError("await ctx took the Python wait")

    monkeypatch.setattr(DeviceEvent, "_wait_async", python_wait)
    g = gate()
    held = ctx.enqueue_cpu_function(g)
    task = asyncio.create_task(_await(ctx))
    await asyncio.sleep(0)
    assert not task.done()
    g.open()
    await asyncio.wait_for(task, TIMEOUT_S)
    assert held.query()


async def _await(awaitable) -> None:
    await awaitable


@pytest.mark.asyncio
async def test_await_of_an_idle_stream_returns(ctx: DeviceContext) -> None:
    await ctx.select_stream(6)
    await ctx.select_stream(6).stream()


def test_await_of_a_never_recorded_event_is_done(ctx: DeviceContext) -> None:
    ev = ctx.create_event()
    assert ev.synchronize() is None


def test_stream_synchronize_waits_for_that_stream_only(ctx: DeviceContext, gate) -> None:
    s1, s2 = ctx.select_stream(1), ctx.select_stream(2)
    g = gate()
    held = s1.enqueue_cpu_function(g)
    mine = s2.enqueue_cpu_function(lambda: 2)
    s2.stream().synchronize()  # returns though stream 1 is held
    assert mine.query() and not held.query()
    g.open()
    s1.synchronize()
    assert held.query()


def test_elapsed_time_between_timing_events(ctx: DeviceContext, gate) -> None:
    start = ctx.create_event(disable_timing=False)
    end = ctx.create_event(disable_timing=False)
    s = ctx.stream()
    s.record_event(start)
    g = gate()
    ctx.enqueue_cpu_function(g)
    s.record_event(end)
    g.open()
    end.synchronize()
    ms = start.elapsed_time(end)
    assert isinstance(ms, float)
    assert ms > 0


def test_elapsed_time_needs_timing_events(ctx: DeviceContext) -> None:
    start = ctx.create_event()  # timing is off by default
    end = ctx.create_event()
    ctx.stream().record_event(start)
    ctx.stream().record_event(end)
    end.synchronize()
    with pytest.raises((ValueError, AsyncGPUError)):
        start.elapsed_time(end)


def test_elapsed_time_needs_recorded_events(ctx: DeviceContext) -> None:
    start = ctx.create_event(disable_timing=False)
    end = ctx.create_event(disable_timing=False)
    with pytest.raises(AsyncGPUError):
        start.elapsed_time(end)


def test_blocking_sync_events(ctx: DeviceContext, gate) -> None:
    ev = ctx.create_event(blocking_sync=True)
    g = gate()
    ctx.enqueue_cpu_function(g)
    ctx.stream().record_event(ev)
    assert not ev.query()
    g.open()
    ev.synchronize()
    assert ev.query()


@pytest.mark.parametrize("api", ["cpu"])
def test_cpu_device_has_no_interprocess_events(ctx: DeviceContext) -> None:
    with pytest.raises(UnsupportedError):
        ctx.create_event(interprocess=True)


def test_add_done_callback(ctx: DeviceContext, gate) -> None:
    import threading

    g = gate()
    ev = ctx.enqueue_cpu_function(g)
    called = threading.Event()
    seen: list[DeviceEvent] = []

    def cb(e: DeviceEvent) -> None:
        seen.append(e)
        called.set()

    ev.add_done_callback(cb)
    assert not called.is_set()
    g.open()
    assert called.wait(TIMEOUT_S)
    assert seen == [ev]
    # On a finished event the callback runs at once, on this thread.
    late: list[DeviceEvent] = []
    ev.add_done_callback(late.append)
    assert late == [ev]


def test_add_done_callback_needs_a_callable(api: str) -> None:
    """Taken, a non-callable raised later, on whichever thread finished the event,
    and the event's later waiters were never woken."""
    ctx = DeviceContext(api=api)  # (left open if it is taken: closing would hang)
    g = Gate()
    pending = ctx.enqueue_cpu_function(g)
    try:
        with pytest.raises(TypeError, match="callable"):
            pending.add_done_callback(5)  # type: ignore[arg-type]
    finally:
        g.open()
    assert pending.synchronize() == "opened"
    with pytest.raises(TypeError, match="callable"):
        pending.add_done_callback(None)  # type: ignore[arg-type]
    ctx.close()


@pytest.mark.asyncio
async def test_a_done_callback_that_raises_is_logged_and_stops_nothing(
    api: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The error used to escape into whatever finished the event: the event's
    later callbacks never ran, and on the CPU device (where the stream's next
    operation starts from a callback) neither did the stream's later work."""
    ctx = DeviceContext(api=api)  # (left open if the stream stalls: closing would hang)
    g = Gate()
    ev = ctx.enqueue_cpu_function(g)

    def broken(e: DeviceEvent) -> None:
        raise ArithmeticError("a broken callback")

    called = threading.Event()
    ev.add_done_callback(broken)
    ev.add_done_callback(lambda e: called.set())  # the event's other callbacks still run
    after = asyncio.ensure_future(ctx.enqueue_cpu_function(lambda: "after"))  # and the stream
    with caplog.at_level(logging.ERROR, logger="asyncgpu"):
        g.open()
        done, _ = await asyncio.wait({after}, timeout=TIMEOUT_S)
        if not done:
            pytest.fail("the stream's later work never ran")
        assert after.result() == "after"
        assert called.wait(TIMEOUT_S)
    assert ev.synchronize() == "opened"
    logged = [r for r in caplog.records if r.name == "asyncgpu" and r.exc_info]
    assert [type(r.exc_info[1]) for r in logged] == [ArithmeticError]
    assert "a broken callback" in caplog.text
    ctx.close()


# -- recording an event again ---------------------------------------------------------------
# An event stands for its latest record only (cuEventRecord): a record reached later
# finishes nothing once the event has been recorded again.


def test_an_event_recorded_again_stands_for_its_latest_record_only(
    ctx: DeviceContext, gate
) -> None:
    s = ctx.stream()
    ev = ctx.create_event()
    g1, g2 = gate(), gate()
    ctx.enqueue_cpu_function(g1)
    s.record_event(ev)  # the first point
    passed = ctx.enqueue_cpu_function(lambda: "passed")  # right after the first point
    ctx.enqueue_cpu_function(g2)
    s.record_event(ev)  # the second point
    g1.open()
    assert passed.synchronize() == "passed"  # the first point has been passed
    assert not ev.query()
    g2.open()
    ev.synchronize()
    assert ev.query()


@pytest.mark.asyncio
async def test_an_event_recorded_again_on_another_stream_does_not_hold_up_the_first(
    ctx: DeviceContext, gate
) -> None:
    """The CUDA device once queued the user event itself on the stream
    of its first record; recorded again, it carried the other stream's sequence
    number there, and that stream's later work was never seen to finish."""
    s_a, s_b = ctx.select_stream(1), ctx.select_stream(2)
    ev = ctx.create_event()
    gb = gate()
    s_b.enqueue_cpu_function(gb)
    s_b.stream().record_event(ev)  # still ahead on B
    later = s_b.enqueue_cpu_function(lambda: "later on B")
    buf = s_a.enqueue_create_buffer(np.int32, 4)
    for _ in range(40):  # A's point comes far past all of B's work in A's numbering
        s_a.enqueue_memset(buf, 0)
    ga = gate()
    s_a.enqueue_cpu_function(ga)
    s_a.stream().record_event(ev)  # moved to A, behind its gate
    gb.open()
    assert await asyncio.wait_for(later, TIMEOUT_S) == "later on B"
    await asyncio.wait_for(s_b, TIMEOUT_S)
    assert not ev.query()  # B's point passed; A's has not
    ga.open()
    await asyncio.wait_for(ev, TIMEOUT_S)
    assert ev.query()


@pytest.mark.asyncio
async def test_a_wait_for_an_event_is_a_snapshot_of_its_latest_record(
    ctx: DeviceContext, gate
) -> None:
    """``enqueue_wait_for(event)`` waits for the point the event stands for when the
    wait is enqueued (cuStreamWaitEvent): a later record, reached at once or placed
    behind the waiting stream itself, neither releases the wait nor moves it (moved,
    the last one would be a wait for itself)."""
    a, b, c = ctx.select_stream(1), ctx.select_stream(2), ctx.select_stream(3)
    ev = ctx.create_event()
    g = gate()
    a.enqueue_cpu_function(g)
    a.stream().record_event(ev)  # the point B waits for, behind the gate
    waited = b.enqueue_wait_for(ev)
    after = b.enqueue_cpu_function(lambda: "after the wait")
    c.stream().record_event(ev)  # C is idle: this record is reached at once
    assert ev.query()
    assert not waited.query() and not after.query()
    a.enqueue_wait_for(b)
    a.stream().record_event(ev)  # behind A's wait for B, which waits for the old point
    g.open()
    assert await asyncio.wait_for(after, TIMEOUT_S) == "after the wait"
    await asyncio.wait_for(ev, TIMEOUT_S)
    assert waited.query()


@pytest.mark.asyncio
async def test_an_await_of_an_event_recorded_again_on_another_stream_ends_at_its_new_point(
    ctx: DeviceContext, gate
) -> None:
    s_a, s_b = ctx.select_stream(1), ctx.select_stream(2)
    ev = ctx.create_event()
    ga, gb = gate(), gate()
    s_a.enqueue_cpu_function(ga)
    s_a.stream().record_event(ev)
    passed = s_a.enqueue_cpu_function(lambda: "passed")  # right after the first point
    awaiting = asyncio.Event()

    async def wait() -> None:
        awaiting.set()
        await ev

    task = asyncio.create_task(wait())
    await awaiting.wait()  # the task is now suspended on the event
    s_b.enqueue_cpu_function(gb)
    s_b.stream().record_event(ev)  # moved to B, behind its gate
    ga.open()
    assert await asyncio.wait_for(passed, TIMEOUT_S) == "passed"  # the first point passed
    assert not ev.query()
    assert not task.done()
    gb.open()
    await asyncio.wait_for(task, TIMEOUT_S)
    assert ev.query()


def test_record_event_takes_only_events_made_by_create_event(ctx: DeviceContext, gate) -> None:
    """An operation's event is no user event: recorded, it used to lose its value
    (or, as the stream's last operation, wait for itself for ever)."""
    done = ctx.enqueue_cpu_function(lambda: 42)
    assert done.synchronize() == 42
    g = gate()
    held = ctx.enqueue_cpu_function(g)
    tail = ctx.enqueue_cpu_function(lambda: "tail")
    for op in (done, held, tail):
        with pytest.raises(TypeError, match="create_event"):
            ctx.stream().record_event(op)
    with pytest.raises(TypeError):
        ctx.stream().record_event(5)  # type: ignore[arg-type]
    g.open()
    assert tail.synchronize() == "tail"
    assert done.synchronize() == 42 and held.synchronize() == "opened"
