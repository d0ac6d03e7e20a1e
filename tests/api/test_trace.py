"""Tracing: the dependency graph of the work enqueued inside ``with ctx.trace()``."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
from _kernels import ADD_ONE, random_array
from _recording_stream import RecordingStream

from asyncgpu import (
    DeviceContext,
    DeviceEvent,
    Trace,
    TraceEdge,
    TraceNode,
)
from asyncgpu._core import trace_json as _trace_export


def test_trace_records_nodes_and_stream_edges(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.int32, 256) // 2
    with ctx.trace() as t:
        assert isinstance(t, Trace)
        buf = ctx.enqueue_create_buffer(np.int32, 256)
        copy_in = ctx.enqueue_copy(buf, data)
        fill = ctx.enqueue_memset(buf, 3)
        launch = ctx.enqueue_function(ADD_ONE, buf, np.int32(256), grid_dim=1, block_dim=256)
        cpu = ctx.enqueue_cpu_function(lambda: None)
        rng_ev = ctx.enqueue_cpu_range(lambda i: None, 4)
        ctx.synchronize()
    nodes = [t.node_of(e) for e in (copy_in, fill, launch, cpu, rng_ev)]
    assert all(isinstance(n, TraceNode) for n in nodes)
    assert [n.kind for n in nodes] == ["copy", "memset", "kernel", "cpu", "cpu_range"]
    assert {n.stream for n in nodes} == {f"{ctx.api()}:{ctx.id()}/s0"}  # one lane per stream
    assert nodes[0].nbytes == 256 * 4
    assert nodes[2].label == "add_one"
    # Each operation depends on the one before it on the stream.
    for a, b in itertools.pairwise(nodes):
        assert TraceEdge(a.id, b.id, "stream") in t.edges
        assert a.id in b.deps
    # Completion times were noticed.
    for n in nodes:
        assert n.end_ns is not None and n.submit_ns <= n.end_ns
        assert n.start_ns is not None and n.submit_ns <= n.start_ns <= n.end_ns


def test_trace_records_a_wait_edge_across_streams(ctx: DeviceContext) -> None:
    s1 = ctx.select_stream(1)
    with ctx.trace() as t:
        first = ctx.enqueue_cpu_function(lambda: 0)
        waited = s1.enqueue_wait_for(ctx)
        after = s1.enqueue_cpu_function(lambda: 1)
        s1.synchronize()
    a, w, b = (t.node_of(e) for e in (first, waited, after))
    assert a.stream != w.stream == b.stream
    assert w.kind == "wait"
    assert TraceEdge(a.id, w.id, "wait") in t.edges
    assert TraceEdge(w.id, b.id, "stream") in t.edges
    assert set(t.streams) == {a.stream, w.stream}


def test_a_wait_for_a_stream_whose_work_has_finished_still_draws_the_edge(
    ctx: DeviceContext,
) -> None:
    # Fast devices finish the source's work before the wait is enqueued; the graph
    # must not depend on that race.
    s1, s2 = ctx.select_stream(1), ctx.select_stream(2)
    with ctx.trace() as t:
        first = s1.enqueue_cpu_function(lambda: 0)
        first.synchronize()
        waited = s2.enqueue_wait_for(s1)
        via_context = s2.enqueue_wait_for(ctx.select_stream(1))
        s2.synchronize()
    a, w, v = (t.node_of(e) for e in (first, waited, via_context))
    assert waited.query() and w.kind == v.kind == "wait"
    assert TraceEdge(a.id, w.id, "wait") in t.edges
    assert TraceEdge(a.id, v.id, "wait") in t.edges


def test_waiting_for_the_own_stream_records_nothing(ctx: DeviceContext) -> None:
    with ctx.trace() as t:
        ctx.enqueue_cpu_function(lambda: 0)
        ev = ctx.enqueue_wait_for(ctx.stream())
        ctx.synchronize()
    assert ev.query() and t.node_of(ev) is None
    assert [n.kind for n in t.nodes.values()] == ["cpu"]


def test_trace_records_the_waits_of_a_cross_stream_copy(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    s1, s2 = ctx.select_stream(1), ctx.select_stream(2)
    buf = s1.enqueue_create_buffer(np.float32, 64)
    with ctx.trace() as t:
        wrote = s1.enqueue_copy(buf, random_array(rng, np.float32, 64))
        out = np.empty(64, np.float32)
        read = s2.enqueue_copy(out, buf)
        s2.synchronize()
    w, r = t.node_of(wrote), t.node_of(read)
    assert r.stream == f"{ctx.api()}:{ctx.id()}/s2"
    # The copy was ordered after the owner's write: a wait edge between the lanes.
    assert TraceEdge(w.id, r.id, "wait") in t.edges
    assert w.id in r.deps


def test_as_dict_is_plain_data(ctx: DeviceContext) -> None:
    with ctx.trace() as t:
        ctx.enqueue_cpu_function(lambda: 0)
        ctx.select_stream(1).enqueue_wait_for(ctx)
        ctx.select_stream(1).synchronize()
    d = t.as_dict()
    assert set(d) >= {"t0_ns", "streams", "nodes", "edges"}
    assert json.loads(json.dumps(d)) == d
    assert [n["kind"] for n in d["nodes"]] == ["cpu", "wait"]
    assert all({"id", "stream", "kind", "label", "deps"} <= set(n) for n in d["nodes"])
    assert {"src": 0, "dst": 1, "kind": "wait"} in d["edges"]


def test_nothing_is_recorded_outside_the_block(ctx: DeviceContext) -> None:
    before = ctx.enqueue_cpu_function(lambda: 0)
    with ctx.trace() as t:
        inside = ctx.enqueue_cpu_function(lambda: 1)
    after = ctx.enqueue_cpu_function(lambda: 2)
    after.synchronize()
    assert t.node_of(before) is None and t.node_of(after) is None
    assert t.node_of(inside) is not None
    assert len(t.nodes) == 1


def test_errors_are_recorded(ctx: DeviceContext) -> None:
    def fail() -> None:
        raise RuntimeError("traced failure")

    with ctx.trace() as t:
        ev = ctx.enqueue_cpu_function(fail)
        ctx.synchronize()
    assert "traced failure" in t.node_of(ev).error


def test_trace_with_a_path_writes_chrome_json(ctx: DeviceContext, tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    with ctx.trace(path):
        ctx.enqueue_cpu_function(lambda: 0)
        ctx.select_stream(1).enqueue_wait_for(ctx)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    assert any(e.get("ph") == "X" for e in events)


# -- ASYNCGPU_TRACE: every new context records a trace and writes it ----------------------


def _traced_work(ctx: DeviceContext) -> None:
    """Three operations on two streams, finished."""
    buf = ctx.enqueue_create_buffer(np.int32, 64)
    ctx.enqueue_memset(buf, 1)
    ctx.enqueue_cpu_function(int)
    ctx.select_stream(1).enqueue_wait_for(ctx)
    ctx.synchronize()
    ctx.select_stream(1).synchronize()


def _spans(path: Path) -> list[dict]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def test_asyncgpu_trace_is_written_by_close(
    api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close()`` writes the file before it returns, on its own thread, with
    ``{pid}`` in the path the process's id; the context dropped afterwards
    writes nothing more."""
    import os

    monkeypatch.setenv("ASYNCGPU_TRACE", str(tmp_path / "{pid}.json"))
    ctx = DeviceContext(api=api)
    _traced_work(ctx)
    trace_file = ctx._state.trace_file
    ctx.close()
    path = tmp_path / f"{os.getpid()}.json"
    assert len(_spans(path)) == 3
    assert not trace_file._dropped.alive  # (nothing is left to write when it is freed)


def test_a_context_dropped_with_asyncgpu_trace_writes_its_trace_once_freed(
    api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A context dropped without ``close()`` is freed by the garbage collector
    once its work is done (the trace refers to none of its streams, so it keeps
    nothing alive); its trace file is then written, by the ``asyncgpu-trace``
    thread: the collector, which may run on any thread inside any lock, only
    queues it."""
    import threading

    path = tmp_path / "dropped.json"
    monkeypatch.setenv("ASYNCGPU_TRACE", str(path))
    written = threading.Event()
    writers: list[str] = []
    real = _trace_export.write_trace_file

    def recording(trace: Trace, where: str) -> None:
        writers.append(threading.current_thread().name)
        real(trace, where)
        written.set()

    monkeypatch.setattr(_trace_export, "write_trace_file", recording)
    ctx = DeviceContext(api=api)
    _traced_work(ctx)
    state = weakref.ref(ctx._state)
    del ctx
    for _ in range(1000):  # (a pool thread may still hold its finished work item)
        gc.collect()
        if state() is None:
            break
        time.sleep(0.001)
    assert state() is None
    assert written.wait(30)
    assert writers == ["asyncgpu-trace"]
    assert len(_spans(path)) == 3


def test_a_trace_dropped_just_before_exit_is_written_by_the_exit(api: str, tmp_path: Path) -> None:
    """The writer thread is a daemon: the exit writes what it has not written
    yet before the process ends."""
    import os
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "at-exit.json"
    root = Path(__file__).resolve().parents[2]
    code = textwrap.dedent(f"""
        import gc
        import time
        import weakref
        import numpy as np
        from asyncgpu import DeviceContext
        ctx = DeviceContext(api={api!r})
        buf = ctx.enqueue_create_buffer(np.int32, 64)
        ctx.enqueue_memset(buf, 1)
        ctx.synchronize()
        state = weakref.ref(ctx._state)
        del ctx, buf
        for _ in range(1000):  # (a pool thread may still hold its finished work item)
            gc.collect()
            if state() is None:
                break
            time.sleep(0.001)
        assert state() is None
    """)
    env = dict(os.environ, PYTHONPATH=str(root), ASYNCGPU_TRACE=str(path))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert len(_spans(path)) == 1


# -- device timestamps (CUDA), and what tracing asks of a stream ------------------------


class _DeviceClock:
    """A device clock the test moves: a stamp reads back once the device passed it."""

    def __init__(self) -> None:
        self.origin_ns = time.perf_counter_ns()
        self.passed: dict[object, int] = {}  # stamp -> ns after the origin

    def trace_clock(self) -> tuple[object, int]:
        return "origin", self.origin_ns

    def stamp_ns(self, origin: object, stamp: object) -> int | None:
        assert origin == "origin"
        return self.passed.get(stamp)


class _ClockedStream:
    """What ``Trace.record`` reads of a stream whose device keeps a clock."""

    device_clock = True

    def __init__(self, label: str, clock: _DeviceClock) -> None:
        self.label, self.backend, self.stamps = label, clock, 0

    def trace_stamp(self) -> object:
        self.stamps += 1
        return (self.label, self.stamps)


def test_device_times_are_read_back_as_the_device_passes_each_stamp() -> None:
    clock = _DeviceClock()
    s = _ClockedStream("gpu:0/s0", clock)
    t = Trace()
    first, second = DeviceEvent(None, 1), DeviceEvent(None, 2)
    a = t.record(s, first, "kernel")
    b = t.record(s, second, "kernel")
    assert s.stamps == 2 and a.device_end_ns is None

    clock.passed[("gpu:0/s0", 1)] = 10_000_000  # the device ends the first kernel
    t.device_times()
    assert a.device_end_ns == clock.origin_ns + 10_000_000
    assert a.device_start_ns == a.submit_ns  # nothing before it: it started when submitted
    assert b.device_end_ns is None  # not passed yet: read later, never waited for

    clock.passed[("gpu:0/s0", 2)] = 25_000_000
    assert t.node_of(second) is b  # reading the trace reads the stamps
    assert b.device_end_ns == clock.origin_ns + 25_000_000
    assert b.device_start_ns == a.device_end_ns  # it started when the one before it ended
    assert _trace_export._span_ns(b) == (b.device_start_ns, b.device_end_ns)


def test_tracing_places_no_marker_and_watches_nothing() -> None:
    """Tracing only listens: a traced operation of a polled stream gets no marker
    and no watch of its own (a done-callback per operation cost a traced launch
    about 5x an untraced one); its end is noticed with the work."""
    s = RecordingStream()
    t = Trace()
    ev = s.submit()
    node = t.record(s, ev, "kernel")
    assert s.markers == [] and not s._eager
    assert node.end_ns is None
    s.finish_all()  # what an await or a synchronize does
    assert node.end_ns is not None and node.submit_ns <= node.end_ns


def test_cuda_device_times_measure_the_kernels(api: str) -> None:
    """On the GPU: two 2 ms kernels back to back on one stream and one on another;
    the device times show each kernel's length and the first two in order."""
    if api != "cuda":
        pytest.skip("device timestamps are CUDA's")
    spin = r"""extern "C" __global__ void spin(long long c) {
        long long t = clock64(); while (clock64() - t < c) {} }"""
    with DeviceContext(api="cuda") as c:
        f = c.compile_function(spin, "spin")
        cycles = np.int64(c.default_device_info.clock_rate_khz * 2)  # 2 ms at full clock
        s1 = c.select_stream(1)
        with c.trace() as t:
            one = c.enqueue_function(f, cycles, grid_dim=1, block_dim=1)
            two = c.enqueue_function(f, cycles, grid_dim=1, block_dim=1)
            other = s1.enqueue_function(f, cycles, grid_dim=1, block_dim=1)
            c.synchronize()
        a, b, o = (t.node_of(e) for e in (one, two, other))
    for n in (a, b, o):
        assert n.device_start_ns is not None and n.device_end_ns is not None
        assert n.device_end_ns - n.device_start_ns >= 1_000_000  # at least 1 of its 2 ms
        assert n.end_ns is not None and n.device_end_ns <= n.end_ns + 100_000
    assert b.device_start_ns == a.device_end_ns and b.device_end_ns > a.device_end_ns


def test_host_times_only_takes_no_device_stamp() -> None:
    clock = _DeviceClock()
    s = _ClockedStream("gpu:0/s0", clock)
    t = Trace(device_stamps=False)
    node = t.record(s, DeviceEvent(None, 1), "kernel")
    assert s.stamps == 0 and not t._origins  # no timing event, no clock mapping
    t.device_times()
    assert node.device_start_ns is None and node.device_end_ns is None


def test_trace_takes_device_times_as_a_bool(ctx: DeviceContext) -> None:
    with pytest.raises(TypeError, match="device_times must be a bool"), ctx.trace(device_times=1):  # type: ignore[arg-type]
        pass


def test_cuda_host_times_only_leaves_the_device_times_empty(api: str) -> None:
    if api != "cuda":
        pytest.skip("device timestamps are CUDA's")
    with DeviceContext(api="cuda") as c:
        f = c.compile_function('extern "C" __global__ void empty() {}', "empty")
        with c.trace(device_times=False) as t:
            ev = c.enqueue_function(f, grid_dim=1, block_dim=1)
            c.synchronize()
        n = t.node_of(ev)
    assert n is not None and n.kind == "kernel" and n.label == "empty"
    assert n.end_ns is not None and n.device_end_ns is None and not t._stamps


def test_a_wait_for_an_event_of_an_earlier_trace_draws_no_edge(ctx: DeviceContext) -> None:
    """Edges come from the nodes of this trace only: an event traced before (its
    node belongs to another trace) is not a source, whatever its node's id."""
    s1 = ctx.select_stream(1)
    with ctx.trace() as old:
        before = ctx.enqueue_cpu_function(lambda: 0)
    with ctx.trace() as t:
        ctx.enqueue_cpu_function(lambda: 1)  # node 0 here, as `before` was there
        waited = s1.enqueue_wait_for(before)
        s1.synchronize()
    assert old.node_of(before).id == 0
    w = t.node_of(waited)
    assert w is not None and w.deps == [] and t.edges == []


def test_a_kernel_launched_while_tracing_is_recorded_once(ctx: DeviceContext) -> None:
    """The same launch, repeated, is one node per launch (the launch's fast path
    records it while tracing, the general path otherwise)."""
    buf = ctx.enqueue_create_buffer(np.int32, 256)
    for _ in range(2):  # (a launch configuration cached before the trace)
        ctx.enqueue_function(ADD_ONE, buf, np.int32(256), grid_dim=1, block_dim=256)
    with ctx.trace() as t:
        evs = [
            ctx.enqueue_function(ADD_ONE, buf, np.int32(256), grid_dim=1, block_dim=256)
            for _ in range(3)
        ]
        ctx.synchronize()
    nodes = [t.node_of(e) for e in evs]
    assert [n.id for n in nodes] == [0, 1, 2] and len(t.nodes) == 3
    assert [n.label for n in nodes] == ["add_one"] * 3
    assert t.edges == [TraceEdge(0, 1, "stream"), TraceEdge(1, 2, "stream")]


def test_a_dropped_trace_gives_back_its_clock_and_the_stamps_nobody_read() -> None:
    dropped: list[object] = []
    clock = _DeviceClock()
    clock.drop_stamp = dropped.append  # type: ignore[attr-defined]
    s = _ClockedStream("gpu:0/s0", clock)
    t = Trace()
    for i in range(3):
        t.record(s, DeviceEvent(None, i + 1), "kernel")
    clock.passed[("gpu:0/s0", 1)] = 1_000
    t.device_times()  # the first is read back (the backend recycles it itself)
    del t
    gc.collect()
    assert dropped == [("gpu:0/s0", 2), ("gpu:0/s0", 3), "origin"]


def test_a_dropped_trace_is_freed_at_once_not_by_the_garbage_collector() -> None:
    """A trace makes no reference cycle: once its events are done and nothing
    holds it, it is gone (with its timing events given back) at the ``del``,
    not at some later collection inside unrelated work."""
    dropped: list[object] = []
    clock = _DeviceClock()
    clock.drop_stamp = dropped.append  # type: ignore[attr-defined]
    s = _ClockedStream("gpu:0/s0", clock)
    t = Trace()
    events = [DeviceEvent(None, i + 1) for i in range(3)]
    for ev in events:
        t.record(s, ev, "kernel")
    for ev in events:
        ev._finish()
    gone = weakref.ref(t)
    gc.disable()
    try:
        del t
        assert gone() is None
        assert dropped == [("gpu:0/s0", 1), ("gpu:0/s0", 2), ("gpu:0/s0", 3), "origin"]
    finally:
        gc.enable()


def test_a_completion_noticed_first_ends_what_it_waited_for_no_later() -> None:
    """Completions are noticed in no set order across streams: when an operation
    is seen finished before one it waited for, that one ended no later, and the
    trace says so (before, the waited-for one got the later end and the graph
    showed an edge running backwards; the dag example caught it on a GPU)."""
    a_stream, b_stream = RecordingStream(), RecordingStream()
    a_stream.label, b_stream.label = "gpu:0/s1", "gpu:0/s2"
    t = Trace()
    first, second = a_stream.submit(), b_stream.submit()
    a = t.record(a_stream, first, "kernel")
    b = t.record(b_stream, second, "wait", waits=(first,))
    assert a.id in b.deps
    b_stream.finish_all()  # the waiting one is noticed first
    assert a.end_ns is not None and a.end_ns <= b.start_ns <= b.end_ns
    noticed = a.end_ns
    a_stream.finish_all()  # the first one's own notice changes nothing
    assert a.end_ns == noticed


def test_the_edges_are_the_nodes_dependencies_in_the_order_they_were_recorded() -> None:
    """A node's first dependency is its "stream" edge when it is the one before it
    on its lane; every other dependency, a wait on an earlier operation of the
    same lane included, is a "wait" edge."""
    a_stream, b_stream = RecordingStream(), RecordingStream()
    a_stream.label, b_stream.label = "gpu:0/s1", "gpu:0/s2"
    t = Trace()
    a0 = a_stream.submit()
    t.record(a_stream, a0, "kernel")
    t.record(a_stream, a_stream.submit(), "kernel")
    t.record(a_stream, a_stream.submit(), "wait", waits=(a0,))  # (an earlier one, same lane)
    t.record(b_stream, b_stream.submit(), "wait", waits=(a0,))  # (the first on its lane)
    assert t.edges == [
        TraceEdge(0, 1, "stream"),
        TraceEdge(1, 2, "stream"),
        TraceEdge(0, 2, "wait"),
        TraceEdge(0, 3, "wait"),
    ]
    assert t.as_dict()["edges"][2] == {"src": 0, "dst": 2, "kind": "wait"}


# -- an awaited operation's record is complete when its await returns --------------------


@pytest.mark.asyncio
async def test_an_awaited_operation_has_its_end_time_when_the_await_returns(
    ctx: DeviceContext,
) -> None:
    streams = [ctx.select_stream(i) for i in range(4)]
    with ctx.trace() as t:
        for i in range(200):
            ev = streams[i % 4].enqueue_cpu_function(lambda: None)
            await ev
            n = t.node_of(ev)
            assert n is not None and n.end_ns is not None and n.start_ns is not None
        ctx.synchronize()


@pytest.mark.asyncio
async def test_the_trace_end_is_stamped_before_any_awaiter_can_run(
    ctx: DeviceContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow end stamp (the thread that finishes the operation pauses in it) is
    still complete before the awaiting task resumes: the stamp comes before the
    event is done, not after its waiters are woken."""
    on_done = Trace._on_done

    def slow_on_done(self: Trace, ev: DeviceEvent) -> None:
        time.sleep(0.002)
        on_done(self, ev)

    monkeypatch.setattr(Trace, "_on_done", slow_on_done)
    with ctx.trace() as t:
        for _ in range(10):
            ev = ctx.enqueue_cpu_function(lambda: None)
            await ev
            assert t.node_of(ev).end_ns is not None
            other = ctx.enqueue_cpu_function(lambda: None)
            other.synchronize()
            assert t.node_of(other).end_ns is not None


# -- async with: the exit awaits the streams ----------------------------------------------


@pytest.mark.asyncio
async def test_async_with_trace_awaits_the_streams_then_writes_the_file(
    ctx: DeviceContext, gate, tmp_path: Path
) -> None:
    """The exit waits for a stream that a gate holds by awaiting, not by blocking
    the loop: another task runs meanwhile (here it is the one that opens the
    gate), and the file, written after, has every operation complete."""
    path = tmp_path / "trace.json"
    g = gate()
    seen: list[bool] = []

    async def opener() -> None:
        while not g.entered.is_set():
            await asyncio.sleep(0.001)
        seen.append(path.exists())  # the exit is waiting: nothing written yet
        g.open()

    async with ctx.trace(path) as t:
        assert isinstance(t, Trace)
        ctx.enqueue_cpu_function(g)
        after = ctx.enqueue_cpu_function(lambda: 1)
        task = asyncio.ensure_future(opener())  # runs once this task yields: in the exit
    assert seen == [False] and task.done()
    assert after.query() and t.node_of(after).end_ns is not None
    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 2 and not [e for e in spans if "incomplete" in e["args"]]


@pytest.mark.asyncio
async def test_async_with_trace_without_a_path_stops_recording(ctx: DeviceContext) -> None:
    async with ctx.trace() as t:
        inside = ctx.enqueue_cpu_function(lambda: 0)
    outside = ctx.enqueue_cpu_function(lambda: 1)
    await outside
    assert t.node_of(inside) is not None and t.node_of(outside) is None


# -- CPU device: a span starts when a pool thread starts the work ---------------------------

_ONE_THREAD_SCRIPT = """
import time
import asyncgpu

with asyncgpu.DeviceContext(api="cpu") as ctx:
    assert ctx.num_streams() >= 4
    with ctx.trace() as t:
        evs = []
        for i in range(4):
            s = ctx.select_stream(i)
            evs.append(s.enqueue_cpu_function(time.sleep, 0.02))
            evs.append(s.enqueue_cpu_range(lambda j: time.sleep(0.005), 2))
        ctx.synchronize()
        for i in range(4):
            ctx.select_stream(i).synchronize()
    spans = sorted((t.node_of(e).start_ns, t.node_of(e).end_ns) for e in evs)
    for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
        assert s0 <= e0 <= s1 <= e1, spans
print("OK")
"""


def test_cpu_spans_start_when_a_pool_thread_starts_the_work(tmp_path: Path) -> None:
    """With one pool thread, work on four streams runs one operation at a time,
    and the trace says so: no two spans overlap (a span that began when the work
    could start, not when the thread took it, would overlap the others). In a
    child process: the pool's size is read once, when it is made."""
    import os
    import subprocess
    import sys

    script = tmp_path / "one_thread.py"
    script.write_text(_ONE_THREAD_SCRIPT)
    env = dict(os.environ, ASYNCGPU_CPU_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_wait_labels_name_what_they_wait_for(ctx: DeviceContext) -> None:
    s1, s2 = ctx.select_stream(1), ctx.select_stream(2)
    user = ctx.create_event()
    with ctx.trace() as t:
        s1.enqueue_cpu_function(lambda: 0)
        op = s1.enqueue_cpu_function(lambda: 1)
        s1.stream().record_event(user)
        waits = [
            s2.enqueue_wait_for(s1),
            s2.enqueue_wait_for(ctx.select_stream(1)),
            s2.enqueue_wait_for(op),
            s2.enqueue_wait_for(user),
        ]
        s2.synchronize()
    labels = [t.node_of(w).label for w in waits]
    assert labels == ["wait s1", "wait s1", f"wait s1#{op._seq}", f"wait s1#{user._seq}"]
    assert all("<" not in n.label for n in t.nodes.values() if n.kind == "wait")
