"""Device graphs: DeviceGraph.create(ctx, build) and awaitable replay().

A graph is built once from kernel, copy, memset, CPU function and join nodes
and their dependencies, then each replay() runs every node once, in dependency
order, as one stream-ordered operation. The same graphs run on every device.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from _kernels import ADD_ONE, AXPY, SCALE, Gate, blocks_for, random_array

from asyncgpu import (
    ContextClosedError,
    DeviceBuffer,
    DeviceContext,
    DeviceEvent,
    DeviceGraph,
    DeviceGraphBuilder,
    DeviceGraphNode,
    HostBuffer,
    UnsupportedError,
)

N = 1000  # elements per buffer (not a multiple of the block: the tail is exercised)


def _add_ones(
    b: DeviceGraphBuilder, x: DeviceBuffer, k: int, after: DeviceGraphNode
) -> DeviceGraphNode:
    """``k`` kernels, each adding 1 to every element of ``x``, one after another."""
    node = after
    for _ in range(k):
        node = b.add_function(
            ADD_ONE, x, np.int32(len(x)), grid_dim=blocks_for(len(x)), block_dim=256,
            dependencies=[node],
        )  # fmt: skip
    return node


# -- building and replaying ----------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_chain_of_kernels_replays_with_one_awaitable_event(ctx: DeviceContext) -> None:
    x = ctx.enqueue_create_buffer(np.int32, N)
    out = ctx.enqueue_create_host_buffer(np.int32, N)

    def build(b: DeviceGraphBuilder) -> None:
        start = b.add_memset(x, 0)
        end = _add_ones(b, x, 20, start)
        b.add_copy(out, x, dependencies=[end])

    graph = DeviceGraph.create(ctx, build)
    assert graph.num_nodes() == 22
    for _ in range(5):
        out.as_numpy()[:] = -1
        ev = graph.replay()
        assert isinstance(ev, DeviceEvent)
        assert await ev is None
        assert (out.as_numpy() == 20).all()


def test_a_replay_is_ordered_with_the_streams_other_work(ctx: DeviceContext) -> None:
    """Work enqueued before a replay is finished before the graph starts; work
    after it starts after the graph has finished."""
    x = ctx.enqueue_create_buffer(np.int32, N)
    out = ctx.enqueue_create_host_buffer(np.int32, N)
    graph = DeviceGraph.create(ctx, lambda b: _add_ones(b, x, 3, b.add_memset(x, 0)))
    ctx.enqueue_memset(x, 7)  # (overwritten by the graph's memset, which comes after it)
    graph.replay()
    ctx.enqueue_function(ADD_ONE, x, np.int32(N), grid_dim=blocks_for(N), block_dim=256)
    ctx.enqueue_copy(out, x).synchronize()
    assert (out.as_numpy() == 4).all()


@pytest.mark.asyncio
async def test_a_four_branch_diamond_is_right_over_many_replays(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    """One input fans out to four kernels that run independently (y_i = 2**i * x),
    which join into a chain summing them: z = 15 * x. The input changes between
    replays: a graph reads its buffers as they are when it runs."""
    src = ctx.enqueue_create_host_buffer(np.float32, N)
    x = ctx.enqueue_create_buffer(np.float32, N)
    ys = [ctx.enqueue_create_buffer(np.float32, N) for _ in range(4)]
    z = ctx.enqueue_create_buffer(np.float32, N)
    out = ctx.enqueue_create_host_buffer(np.float32, N)
    n, grid = np.int32(N), blocks_for(N)

    def build(b: DeviceGraphBuilder) -> None:
        load = b.add_copy(x, src)
        zero = b.add_memset(z, 0.0)

        def branches(b: DeviceGraphBuilder) -> None:
            for i, y in enumerate(ys):
                b.add_function(SCALE, y, x, np.float32(2**i), n, grid_dim=grid, block_dim=256)

        joined = b.region(branches, dependencies=[load])
        node = b.add_function(  # (the first sum waits for the memset too)
            AXPY, np.float32(1), ys[0], z, n, grid_dim=grid, block_dim=256,
            dependencies=[joined, zero],
        )  # fmt: skip
        for y in ys[1:]:
            node = b.add_function(
                AXPY, np.float32(1), y, z, n, grid_dim=grid, block_dim=256, dependencies=[node]
            )
        b.add_output(b.add_copy(out, z, dependencies=[node]))

    graph = DeviceGraph.create(ctx, build)
    assert graph.num_outputs() == 1
    replays = 1000 if ctx.api() == "cuda" else 100
    for _ in range(replays):
        # Small integers: every sum is exact on every device.
        data = rng.integers(-1000, 1000, N).astype(np.float32)
        src.as_numpy()[:] = data
        await graph.replay()
        np.testing.assert_array_equal(out.as_numpy(), 15 * data)


@pytest.mark.parametrize(
    ("dtype", "value"),
    [(np.uint8, 0xA5), (np.int16, -12345), (np.float32, -1.5), (np.int64, -1234567890123456789),
     (np.float64, 2.5e-300)],
)  # fmt: skip
def test_memset_and_copy_nodes(ctx: DeviceContext, dtype: type, value: float) -> None:
    """A memset node of each element size (8-byte elements included), then copies
    device to device and device to host."""
    a = ctx.enqueue_create_buffer(dtype, N)
    b_ = ctx.enqueue_create_buffer(dtype, N)
    out = ctx.enqueue_create_host_buffer(dtype, N)

    def build(b: DeviceGraphBuilder) -> None:
        s = b.add_memset(a, value)
        c = b.add_copy(b_, a, dependencies=[s])
        b.add_copy(out, b_, dependencies=[c])

    graph = DeviceGraph.create(ctx, build)
    graph.replay().synchronize()
    np.testing.assert_array_equal(out.as_numpy(), np.full(N, value, dtype))


def test_a_host_to_device_copy_node_reads_the_host_buffer_at_each_replay(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    host = ctx.enqueue_create_host_buffer(np.int32, N)
    dev = ctx.enqueue_create_buffer(np.int32, N)
    back = ctx.enqueue_create_host_buffer(np.int32, N)

    def build(b: DeviceGraphBuilder) -> None:
        b.add_copy(back, dev, dependencies=[b.add_copy(dev, host)])

    graph = DeviceGraph.create(ctx, build)
    for _ in range(3):
        data = random_array(rng, np.int32, N)
        host.as_numpy()[:] = data
        graph.replay().synchronize()
        np.testing.assert_array_equal(back.as_numpy(), data)


@pytest.mark.asyncio
async def test_cpu_function_nodes_run_once_per_replay_in_order_both_ways(
    ctx: DeviceContext,
) -> None:
    """kernel -> CPU function -> kernel -> CPU function: each CPU function sees
    the device work before it finished, and the device work after it sees what
    it wrote. Counted over many replays."""
    x = ctx.enqueue_create_buffer(np.int32, N)
    y = ctx.enqueue_create_buffer(np.int32, N)
    seen_x = ctx.enqueue_create_host_buffer(np.int32, N)
    handed = ctx.enqueue_create_host_buffer(np.int32, N)
    seen_y = ctx.enqueue_create_host_buffer(np.int32, N)
    log: list[tuple[str, int]] = []

    def first() -> None:
        log.append(("first", int(seen_x[0])))
        handed.as_numpy()[:] = 10 * seen_x.as_numpy()

    def second() -> None:
        log.append(("second", int(seen_y[N - 1])))

    def build(b: DeviceGraphBuilder) -> None:
        k1 = _add_ones(b, x, 1, b.add_memset(x, 0))
        c1 = b.add_copy(seen_x, x, dependencies=[k1])
        f1 = b.add_cpu_function(first, dependencies=[c1])
        c2 = b.add_copy(y, handed, dependencies=[f1])
        k2 = _add_ones(b, y, 1, c2)
        c3 = b.add_copy(seen_y, y, dependencies=[k2])
        b.add_cpu_function(second, dependencies=[c3])

    graph = DeviceGraph.create(ctx, build)
    replays = 50
    for _ in range(replays):
        await graph.replay()
    assert log == [("first", 1), ("second", 11)] * replays


@pytest.mark.asyncio
async def test_a_cpu_function_nodes_error_comes_back_at_the_replays_await(
    ctx: DeviceContext,
) -> None:
    ran: list[str] = []

    def boom() -> None:
        ran.append("boom")
        raise KeyError("boom")

    def build(b: DeviceGraphBuilder) -> None:
        f = b.add_cpu_function(boom)
        b.add_cpu_function(ran.append, "after", dependencies=[f])

    graph = DeviceGraph.create(ctx, build)
    with pytest.raises(KeyError, match="boom"):
        await graph.replay()
    assert ran == ["boom", "after"]  # the graph went on, as a stream does
    assert await ctx.enqueue_cpu_function(lambda: "stream goes on") == "stream goes on"


def test_an_empty_region_still_gates_on_its_dependencies(ctx: DeviceContext) -> None:
    x = ctx.enqueue_create_buffer(np.int32, N)
    out = ctx.enqueue_create_host_buffer(np.int32, N)

    def build(b: DeviceGraphBuilder) -> None:
        set_ = b.add_memset(x, 41)
        gate = b.region(lambda b: None, dependencies=[set_])
        assert isinstance(gate, DeviceGraphNode)
        assert gate.dependencies == (set_,)
        b.add_copy(out, x, dependencies=[_add_ones(b, x, 1, gate)])

    DeviceGraph.create(ctx, build).replay().synchronize()
    assert (out.as_numpy() == 42).all()


def test_nested_regions_depend_on_the_outer_regions_dependencies(ctx: DeviceContext) -> None:
    x = ctx.enqueue_create_buffer(np.int32, N)
    out = ctx.enqueue_create_host_buffer(np.int32, N)

    def build(b: DeviceGraphBuilder) -> None:
        set_ = b.add_memset(x, 0)

        def outer(b: DeviceGraphBuilder) -> None:
            inner = b.region(lambda b: _add_ones(b, x, 2, b.region(lambda b: None)))
            _add_ones(b, x, 1, inner)

        b.add_copy(out, x, dependencies=[b.region(outer, dependencies=[set_])])

    DeviceGraph.create(ctx, build).replay().synchronize()
    assert (out.as_numpy() == 3).all()


def test_outputs_are_counted_in_order(ctx: DeviceContext) -> None:
    x = ctx.enqueue_create_buffer(np.int32, N)
    counts = []

    def build(b: DeviceGraphBuilder) -> None:
        assert b.num_outputs() == 0
        a = b.add_memset(x, 1)
        assert b.add_output(a) == 0
        assert b.add_output(b.add_memset(x, 2, dependencies=[a])) == 1
        counts.append(b.num_outputs())

    graph = DeviceGraph.create(ctx, build)
    assert counts == [2]
    assert graph.num_outputs() == 2


@pytest.mark.asyncio
async def test_an_empty_graph_replays_as_a_point_in_stream_order(ctx: DeviceContext, gate) -> None:
    graph = DeviceGraph.create(ctx, lambda b: None)
    g = gate()
    ctx.enqueue_cpu_function(g)
    ev = graph.replay()
    assert not ev.query()  # behind the gate
    g.open()
    assert await ev is None


@pytest.mark.asyncio
async def test_replays_run_on_the_selected_stream(ctx: DeviceContext, gate) -> None:
    """A graph made with ``ctx.select_stream(1)`` replays on stream 1; ``replay(view)``
    on that view's stream. A gate on each stream shows which one a replay is on."""
    x = ctx.enqueue_create_buffer(np.int32, N)
    ctx.synchronize()
    s1, s2 = ctx.select_stream(1), ctx.select_stream(2)
    graph = DeviceGraph.create(s1, lambda b: b.add_memset(x, 3))
    g1, g2 = gate(), gate()
    s1.enqueue_cpu_function(g1)
    s2.enqueue_cpu_function(g2)
    on_s1 = graph.replay()
    on_s2 = graph.replay(s2)
    on_s0 = graph.replay(ctx)
    await on_s0  # stream 0 has no gate
    assert not on_s1.query() and not on_s2.query()
    g2.open()
    await on_s2
    assert not on_s1.query()
    g1.open()
    await on_s1


def test_a_traced_replay_is_one_operation_of_kind_graph(ctx: DeviceContext) -> None:
    x = ctx.enqueue_create_buffer(np.int32, N)
    graph = DeviceGraph.create(ctx, lambda b: _add_ones(b, x, 2, b.add_memset(x, 0)))
    with ctx.trace() as t:
        graph.replay()
        ctx.enqueue_memset(x, 1).synchronize()
    kinds = [n.kind for n in t.nodes.values()]
    assert kinds == ["graph", "memset"]
    assert next(iter(t.nodes.values())).label == "graph (3 nodes)"


# -- recording existing code ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_four_stream_diamond_recorded_from_ordinary_calls(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    """The calls a program makes on a context (select_stream, enqueue_wait_for,
    enqueue_*), made on a recording context instead, become the graph: four
    streams each scale the input, stream 0 sums them. Checked over many replays."""
    src = ctx.enqueue_create_host_buffer(np.float32, N)
    x = ctx.enqueue_create_buffer(np.float32, N)
    ys = [ctx.enqueue_create_buffer(np.float32, N) for _ in range(4)]
    z = ctx.enqueue_create_buffer(np.float32, N)
    out = ctx.enqueue_create_host_buffer(np.float32, N)
    n, grid = np.int32(N), blocks_for(N)

    def program(c) -> None:  # written for a DeviceContext
        c.enqueue_copy(x, src)
        c.enqueue_memset(z, 0.0)
        streams = [c.select_stream(1 + i) for i in range(4)]
        for i, (s, y) in enumerate(zip(streams, ys, strict=True)):
            s.enqueue_wait_for(c)
            s.enqueue_function(SCALE, y, x, np.float32(2**i), n, grid_dim=grid, block_dim=256)
        for s in streams:
            c.enqueue_wait_for(s)
        for y in ys:
            c.enqueue_function(AXPY, np.float32(1), y, z, n, grid_dim=grid, block_dim=256)
        c.enqueue_copy(out, z)

    graph = DeviceGraph.create(ctx, lambda b: program(b.recording_context()))
    scale_nodes = [graph._def.nodes[i] for i in (2, 3, 4, 5)]
    assert all(node.kind == "kernel" for node in scale_nodes)
    assert all(len(node.dependencies) == 1 for node in scale_nodes)  # the four run side by side
    replays = 1000 if ctx.api() == "cuda" else 100
    for _ in range(replays):
        data = rng.integers(-1000, 1000, N).astype(np.float32)
        src.as_numpy()[:] = data
        await graph.replay()
        np.testing.assert_array_equal(out.as_numpy(), 15 * data)
    # The same program, run directly, gives the same result.
    program(ctx)
    await ctx
    np.testing.assert_array_equal(out.as_numpy(), 15 * data)


def test_a_recorded_copy_is_ordered_with_its_buffers_owning_streams(ctx: DeviceContext) -> None:
    """As enqueue_copy on stream 1 of a buffer stream 0 owns waits for stream 0's
    earlier work and holds up its later work, so does the recorded copy."""
    x = ctx.enqueue_create_buffer(np.int32, N)  # owned by stream 0
    y = ctx.enqueue_create_buffer(np.int32, N)
    out = ctx.enqueue_create_host_buffer(np.int32, N)
    found = {}

    def build(b: DeviceGraphBuilder) -> None:
        r = b.recording_context()
        found["set"] = r.enqueue_memset(x, 5)
        found["copy"] = r.select_stream(1).enqueue_copy(y, x)
        found["reset"] = r.enqueue_memset(x, 0)
        r.enqueue_copy_no_cross_stream_sync(out, y)

    graph = DeviceGraph.create(ctx, build)
    assert found["set"] in found["copy"].dependencies
    assert found["copy"] in found["reset"].dependencies
    graph.replay().synchronize()
    assert (out.as_numpy() == 5).all()


def test_recorded_cpu_functions_run_in_order_in_every_replay(ctx: DeviceContext) -> None:
    log: list[str] = []

    def build(b: DeviceGraphBuilder) -> None:
        r = b.recording_context()
        r.enqueue_cpu_function(log.append, "a")
        r.select_stream(1).enqueue_cpu_function(lambda *, tag: log.append(tag), tag="b")
        r.enqueue_cpu_function(log.append, "c")

    graph = DeviceGraph.create(ctx, build)
    for _ in range(20):
        graph.replay().synchronize()
    assert log.count("b") == 20
    assert [t for t in log if t != "b"] == ["a", "c"] * 20


def test_what_a_recording_cannot_record_raises(ctx: DeviceContext) -> None:
    def build(b: DeviceGraphBuilder) -> None:
        r = b.recording_context()
        with pytest.raises(UnsupportedError, match="enqueue_create_buffer is not recorded"):
            r.enqueue_create_buffer(np.int32, 4)
        with pytest.raises(UnsupportedError, match="synchronize is not recorded"):
            r.synchronize()
        with pytest.raises(TypeError, match="outside"):
            r.enqueue_wait_for(ctx)
        with pytest.raises(IndexError):
            r.select_stream(ctx.num_streams())

    DeviceGraph.create(ctx, build)


# -- updating nodes between replays --------------------------------------------------------


@pytest.mark.asyncio
async def test_kernel_copy_and_memset_nodes_are_updated_without_rebuilding(
    ctx: DeviceContext,
) -> None:
    x = ctx.enqueue_create_buffer(np.int32, N)
    y = ctx.enqueue_create_buffer(np.int32, N)
    out = ctx.enqueue_create_host_buffer(np.int32, N)
    other = ctx.enqueue_create_host_buffer(np.int32, N)
    nodes: dict[str, DeviceGraphNode] = {}

    def build(b: DeviceGraphBuilder) -> None:
        nodes["set"] = b.add_memset(x, 0)
        nodes["add"] = _add_ones(b, x, 1, nodes["set"])
        nodes["copy"] = b.add_copy(out, x, dependencies=[nodes["add"]])

    graph = DeviceGraph.create(ctx, build)
    await graph.replay()
    assert (out.as_numpy() == 1).all()

    graph.update(nodes["set"], value=41)
    await graph.replay()
    assert (out.as_numpy() == 42).all()

    ctx.enqueue_memset(y, 100)
    graph.update(nodes["add"], y, np.int32(N // 2))  # another buffer, half of it
    graph.update(nodes["copy"], src=y, dst=other)
    await graph.replay()
    assert (other.as_numpy()[: N // 2] == 101).all() and (other.as_numpy()[N // 2 :] == 100).all()
    assert (out.as_numpy() == 42).all()  # no longer written

    graph.update(nodes["set"], buf=y, value=-5)  # the memset now sets y, before the kernel
    await graph.replay()
    assert (other.as_numpy()[: N // 2] == -4).all() and (other.as_numpy()[N // 2 :] == -5).all()


@pytest.mark.asyncio
async def test_an_update_leaves_replays_enqueued_before_it_as_they_were(
    ctx: DeviceContext, gate
) -> None:
    """Replays held behind a gate: each runs with the parameters current when it
    was enqueued, and every CPU function node runs once per replay, in order,
    with its replay's arguments (counted), before and after updates."""
    x = ctx.enqueue_create_buffer(np.int32, N)
    seen = ctx.enqueue_create_host_buffer(np.int32, N)
    log: list[tuple[str, int]] = []

    def record(tag: str) -> None:
        log.append((tag, int(seen[N - 1])))

    nodes: list[DeviceGraphNode] = []

    def build_chain(b: DeviceGraphBuilder) -> None:
        set_x = b.add_memset(x, 1)
        added = _add_ones(b, x, 1, set_x)
        copy = b.add_copy(seen, x, dependencies=[added])
        nodes[:] = [set_x, b.add_cpu_function(record, "first", dependencies=[copy])]

    graph = DeviceGraph.create(ctx, build_chain)
    set_x, cpu = nodes
    g = gate()
    ctx.enqueue_cpu_function(g)
    held = [graph.replay()]
    graph.update(set_x, value=10)
    held.append(graph.replay())
    graph.update(cpu, "second")
    held.append(graph.replay())
    graph.update(set_x, value=20)
    graph.update(cpu, "third")
    rounds = 100
    held += [graph.replay() for _ in range(rounds)]
    assert log == []  # all behind the gate
    g.open()
    for ev in held:
        await ev
    assert log == [("first", 2), ("first", 11), ("second", 11)] + [("third", 21)] * rounds


@pytest.mark.asyncio
async def test_replays_held_behind_host_work_each_run_with_their_own_version(
    ctx: DeviceContext, gate
) -> None:
    """An update between every two replays, all held behind a gate: each replay
    sets its own value and copies into its own host buffer (on CUDA every held
    launch sets its version's parameters again before it goes in)."""
    x = ctx.enqueue_create_buffer(np.int32, N)
    rounds = 40
    outs = [ctx.enqueue_create_host_buffer(np.int32, N) for _ in range(rounds)]
    nodes: list[DeviceGraphNode] = []

    def build(b: DeviceGraphBuilder) -> None:
        set_x = b.add_memset(x, -1)
        nodes[:] = [set_x, b.add_copy(outs[0], x, dependencies=[set_x])]

    graph = DeviceGraph.create(ctx, build)
    set_x, copy = nodes
    g = gate()
    ctx.enqueue_cpu_function(g)
    held = []
    for i, out in enumerate(outs):
        graph.update(set_x, value=i)
        graph.update(copy, dst=out)
        held.append(graph.replay())
    g.open()
    for ev in held:
        await ev
    for i, out in enumerate(outs):
        assert (out.as_numpy() == i).all(), i


def test_the_graph_holds_new_buffers_and_drops_old_ones_after_their_replays(
    ctx: DeviceContext, gate
) -> None:
    out = ctx.enqueue_create_host_buffer(np.int32, N)
    graph, old = _graph_on_a_dropped_buffer(ctx, out)
    (set_x,) = (n for n in graph._def.nodes if n.kind == "memset")
    g = gate()
    ctx.enqueue_cpu_function(g)
    ev = graph.replay()  # held: it uses the old buffer
    new = ctx.enqueue_create_buffer(np.int32, N)
    replaced = weakref.ref(new)
    for node in graph._def.nodes:
        if node.kind == "kernel":
            graph.update(node, new, np.int32(N))
    graph.update(set_x, buf=new)
    (copy,) = (n for n in graph._def.nodes if n.kind == "copy")
    graph.update(copy, src=new)
    del new
    gc.collect()
    assert old() is not None and replaced() is not None  # the held replay, and the graph
    g.open()
    ev.synchronize()
    del ev
    ctx.synchronize()
    gc.collect()
    assert old() is None  # no replay uses it any more
    assert replaced() is not None
    graph.replay().synchronize()
    assert (out.as_numpy() == 7).all()
    del graph
    ctx.synchronize()
    gc.collect()
    assert replaced() is None


class _ForeignArray:
    """Another library's device array, as a kernel argument sees it."""

    def __init__(self, buf: DeviceBuffer) -> None:
        self.__cuda_array_interface__ = {
            "shape": (len(buf),),
            "typestr": "<i4",
            "data": (buf.unsafe_ptr(), False),
            "version": 3,
        }


# A cuda.core Buffer as enqueue_function recognizes one: a ``handle`` and a type
# of the cuda.core package (no cuda.core needed to make it).
_CudaCoreBuffer = type("Buffer", (), {"__module__": "cuda.core._memory", "handle": 0x1000})


def test_a_kernel_node_refuses_other_libraries_arrays_and_cuda_core_objects_alike(
    ctx: DeviceContext,
) -> None:
    """A node replays its arguments long after they were given, and neither
    another library's array nor a cuda.core object (a ``Buffer`` its owner can
    close) says how long its memory lives: both are refused, with one
    ``TypeError``, when the node is added and when it is updated. Only
    asyncgpu's buffers are kept alive, and used in place, by the graph."""
    x = ctx.enqueue_create_buffer(np.int32, N)
    nodes: list[DeviceGraphNode] = []
    graph = DeviceGraph.create(
        ctx, lambda b: nodes.append(_add_ones(b, x, 1, b.region(lambda b: None)))
    )
    for other, name in ((_ForeignArray(x), "_ForeignArray"), (_CudaCoreBuffer(), "Buffer")):
        refused = rf"kernel argument 0: a graph takes DeviceBuffers.*another library's .*\({name}\)"
        with pytest.raises(TypeError, match=refused) as built:
            DeviceGraph.create(
                ctx,
                lambda b, a=other: b.add_function(
                    ADD_ONE, a, np.int32(N), grid_dim=blocks_for(N), block_dim=256
                ),
            )
        with pytest.raises(TypeError) as updated:
            graph.update(nodes[0], other, np.int32(N))
        assert str(updated.value) == str(built.value)
    graph.replay().synchronize()  # (the refused update left the node as it was)


def test_bad_updates_raise_at_the_call_and_leave_the_graph_as_it_was(
    ctx: DeviceContext,
) -> None:
    x = ctx.enqueue_create_buffer(np.int32, N)
    f = ctx.enqueue_create_buffer(np.float32, N)
    short = ctx.enqueue_create_buffer(np.int32, N - 1)
    out = ctx.enqueue_create_host_buffer(np.int32, N)
    nodes: list[DeviceGraphNode] = []

    def build(b: DeviceGraphBuilder) -> None:
        set_x = b.add_memset(x, 0)
        add = _add_ones(b, x, 1, set_x)
        copy = b.add_copy(out, x, dependencies=[add])
        cpu = b.add_cpu_function(print, dependencies=[copy])
        nodes[:] = [set_x, add, copy, cpu, b.region(lambda b: None)]

    graph = DeviceGraph.create(ctx, build)
    set_x, add, copy, cpu, join = nodes
    kept: list[DeviceGraphNode] = []
    DeviceGraph.create(ctx, lambda b: kept.append(b.add_memset(x, 0)))

    with pytest.raises(ValueError, match="another device graph"):
        graph.update(kept[0], value=1)
    with pytest.raises(TypeError, match="DeviceGraphNode"):
        graph.update("set", value=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="argument 1"):  # as add_function says it
        graph.update(add, x, N)
    with pytest.raises(TypeError) as built:
        DeviceGraph.create(ctx, lambda b: b.add_function(ADD_ONE, x, grid_dim=4, block_dim=256))
    with pytest.raises(TypeError) as updated:
        graph.update(add, x)  # too few arguments: what creating such a graph raises
    assert str(updated.value) == str(built.value)
    with pytest.raises(TypeError, match="new arguments"):
        graph.update(add, value=1)
    with pytest.raises(TypeError, match="dst= and/or src="):
        graph.update(copy, x)
    with pytest.raises(TypeError, match="dst= and/or src="):
        graph.update(copy)
    with pytest.raises(TypeError, match="another HostBuffer"):
        graph.update(copy, dst=x)
    with pytest.raises(TypeError, match="dtype mismatch"):
        graph.update(copy, src=f)
    with pytest.raises(ValueError, match="as many bytes"):
        graph.update(copy, dst=ctx.enqueue_create_host_buffer(np.int32, N - 1), src=short)
    with pytest.raises(ValueError, match="does not fit"):
        graph.update(set_x, value=2**40)
    with pytest.raises(ValueError, match="same dtype and length"):
        graph.update(set_x, buf=short)
    with pytest.raises(TypeError, match="DeviceBuffer"):
        graph.update(set_x, buf=out)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="new arguments"):
        graph.update(cpu, dst=x)
    with pytest.raises(TypeError, match="join"):
        graph.update(join)
    graph.replay().synchronize()  # all as it was
    assert (out.as_numpy() == 1).all()


def test_an_update_after_the_context_closed_raises(api: str) -> None:
    ctx = DeviceContext(api=api)
    x = ctx.enqueue_create_buffer(np.int32, N)
    nodes: list[DeviceGraphNode] = []
    graph = DeviceGraph.create(ctx, lambda b: nodes.append(b.add_memset(x, 0)))
    ctx.close()
    with pytest.raises(ContextClosedError):
        graph.update(nodes[0], value=1)


# -- lifetime ------------------------------------------------------------------------------


def _graph_on_a_dropped_buffer(
    ctx: DeviceContext, out: HostBuffer
) -> tuple[DeviceGraph, weakref.ref[DeviceBuffer]]:
    """A graph using a buffer nothing else refers to once this returns."""
    x = ctx.enqueue_create_buffer(np.int32, N)

    def build(b: DeviceGraphBuilder) -> None:
        b.add_copy(out, x, dependencies=[_add_ones(b, x, 2, b.add_memset(x, 5))])

    return DeviceGraph.create(ctx, build), weakref.ref(x)


def test_the_graph_keeps_its_buffers_alive(ctx: DeviceContext) -> None:
    out = ctx.enqueue_create_host_buffer(np.int32, N)
    graph, alive = _graph_on_a_dropped_buffer(ctx, out)
    gc.collect()
    assert alive() is not None  # the graph holds it
    graph.replay().synchronize()
    assert (out.as_numpy() == 7).all()
    ev = graph.replay()
    del graph
    gc.collect()
    ev.synchronize()  # the replay held the graph until it finished
    assert (out.as_numpy() == 7).all()
    del ev
    ctx.synchronize()
    gc.collect()
    assert alive() is None  # and nothing holds it now


def test_take_ptr_is_refused_while_a_graph_uses_the_buffer(api: str) -> None:
    with DeviceContext(api=api) as ctx:
        x = ctx.enqueue_create_buffer(np.int32, N)
        sub = x.create_sub_buffer(np.int32, 10, 10)
        graph = DeviceGraph.create(ctx, lambda b: b.add_memset(sub, 1))
        with pytest.raises(ValueError, match="DeviceGraph"):
            x.take_ptr()  # the parent of a buffer the graph uses: the same memory
        gate = Gate()
        ctx.enqueue_cpu_function(gate)
        try:
            ev = graph.replay()  # (held behind the gate)
            del graph
            gc.collect()
            with pytest.raises(ValueError, match="DeviceGraph"):
                x.take_ptr()  # the graph is gone, its replay is not: still refused
        finally:
            gate.open()
        ev.synchronize()
        del ev
        ctx.synchronize()
        gc.collect()
        if api == "cpu":  # (on CUDA the address would be the test's to free)
            assert x.take_ptr() != 0


# -- bad input -----------------------------------------------------------------------------


def test_a_node_of_another_graph_is_refused(ctx: DeviceContext) -> None:
    x = ctx.enqueue_create_buffer(np.int32, N)
    kept: list[DeviceGraphNode] = []
    DeviceGraph.create(ctx, lambda b: kept.append(b.add_memset(x, 0)))

    def build(b: DeviceGraphBuilder) -> None:
        with pytest.raises(ValueError, match="another device graph"):
            b.add_memset(x, 1, dependencies=[kept[0]])
        with pytest.raises(ValueError, match="another device graph"):
            b.region(lambda b: None, dependencies=[kept[0]])
        with pytest.raises(ValueError, match="another device graph"):
            b.add_output(kept[0])
        with pytest.raises(TypeError, match="DeviceGraphNode"):
            b.add_memset(x, 1, dependencies=["first"])
        with pytest.raises(TypeError, match="sequence of DeviceGraphNode"):
            b.add_memset(x, 1, dependencies=7)  # type: ignore[arg-type]

    DeviceGraph.create(ctx, build)


def test_a_builder_cannot_add_nodes_after_create(ctx: DeviceContext) -> None:
    x = ctx.enqueue_create_buffer(np.int32, N)
    builders: list[DeviceGraphBuilder] = []
    DeviceGraph.create(ctx, builders.append)
    with pytest.raises(RuntimeError, match="already built"):
        builders[0].add_memset(x, 0)


def test_a_replay_on_a_closed_context_raises(api: str) -> None:
    ctx = DeviceContext(api=api)
    x = ctx.enqueue_create_buffer(np.int32, N)
    graph = DeviceGraph.create(ctx, lambda b: b.add_memset(x, 0))
    view = ctx.select_stream(1)
    ctx.close()
    with pytest.raises(ContextClosedError):
        graph.replay()
    with pytest.raises(ContextClosedError):
        graph.replay(view)
    with pytest.raises(ContextClosedError):
        DeviceGraph.create(ctx, lambda b: None)


def test_bad_arguments_raise_at_the_call(ctx: DeviceContext) -> None:
    x = ctx.enqueue_create_buffer(np.int32, N)
    h = ctx.enqueue_create_host_buffer(np.int32, N)
    f = ctx.enqueue_create_buffer(np.float32, N)

    async def coro() -> None:
        pass

    def build(b: DeviceGraphBuilder) -> None:
        with pytest.raises(TypeError, match="argument 1"):
            b.add_function(ADD_ONE, x, N, grid_dim=4, block_dim=256)  # a Python int
        with pytest.raises(ValueError, match="block_dim"):
            b.add_function(ADD_ONE, x, np.int32(N), grid_dim=4, block_dim=4096)
        with pytest.raises(TypeError, match="DeviceBuffer or HostBuffer"):
            b.add_copy(np.zeros(N, np.int32), x)
        with pytest.raises(TypeError, match="dtype mismatch"):
            b.add_copy(f, x)
        with pytest.raises(ValueError, match="does not fit"):
            b.add_memset(x, 2**40)
        with pytest.raises(TypeError, match="DeviceBuffer"):
            b.add_memset(h, 0)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="callable"):
            b.add_cpu_function(42)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            b.add_cpu_function(coro)

    graph = DeviceGraph.create(ctx, build)
    assert graph.num_nodes() == 0  # nothing was added by the failed calls


def test_a_build_that_raises_makes_no_graph(ctx: DeviceContext) -> None:
    def build(b: DeviceGraphBuilder) -> None:
        raise LookupError("no graph today")

    with pytest.raises(LookupError, match="no graph today"):
        DeviceGraph.create(ctx, build)
    with pytest.raises(TypeError, match="DeviceContext"):
        DeviceGraph.create("cuda", build)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"DeviceGraph\.create"):
        DeviceGraph()


def test_buffers_of_another_context_of_the_device_are_used_in_place(
    ctx: DeviceContext, api: str
) -> None:
    """A graph's kernel, memset and copy nodes take buffers as its context's
    launches do (one rule, ``check_kernel_buffer``): another context of the
    same device shares its memory, so its buffers are used in place, when the
    node is added and when it is updated. Once that context is closed, its
    buffers are ``ContextClosedError`` at the call."""
    out = ctx.enqueue_create_host_buffer(np.int32, N)
    got = np.empty(N, np.int32)
    nodes: dict[str, DeviceGraphNode] = {}
    with DeviceContext(api=api) as other:
        y = other.enqueue_create_buffer(np.int32, N)
        z = other.enqueue_create_buffer(np.int32, N)
        other.synchronize()  # (the allocations are another stream's work)

        def build(b: DeviceGraphBuilder) -> None:
            nodes["set"] = b.add_memset(y, 4)
            nodes["add"] = b.add_function(
                ADD_ONE, y, np.int32(N), grid_dim=blocks_for(N), block_dim=256,
                dependencies=[nodes["set"]],
            )  # fmt: skip
            nodes["copy"] = b.add_copy(out, y, dependencies=[nodes["add"]])

        graph = DeviceGraph.create(ctx, build)
        graph.replay().synchronize()
        assert (out.as_numpy() == 5).all()
        graph.update(nodes["set"], buf=z, value=9)
        graph.update(nodes["add"], z, np.int32(N))
        graph.update(nodes["copy"], src=z)
        graph.replay().synchronize()
        assert (out.as_numpy() == 10).all()
        other.enqueue_copy(got, z).synchronize()
        assert (got == 10).all()

    def add(b: DeviceGraphBuilder) -> None:
        for use in (
            lambda: b.add_memset(y, 0),
            lambda: b.add_function(ADD_ONE, y, np.int32(N), grid_dim=1, block_dim=256),
            lambda: b.add_copy(out, y),
        ):
            with pytest.raises(ContextClosedError, match="closed context"):
                use()

    assert DeviceGraph.create(ctx, add).num_nodes() == 0
    with pytest.raises(ContextClosedError, match="closed context"):
        graph.update(nodes["add"], y, np.int32(N))


def test_buffers_another_device_does_not_address_are_refused_by_every_node() -> None:
    """Without a GPU: a second CPU context whose ``api`` is renamed stands in
    for another device, as in the kernel tests. Its buffers in a kernel,
    memset or copy node, added or updated, are the launches' ``ValueError``
    naming both contexts, and the graph is left as it was. (A copy node takes
    no other device's buffer, even where ``enqueue_copy`` would: a driver
    graph's copy cannot wait for another device's stream.)"""
    with DeviceContext(api="cpu") as cpu, DeviceContext(api="cpu") as other:
        mine = cpu.enqueue_create_buffer(np.int32, N)
        spare = cpu.enqueue_create_buffer(np.int32, N)
        theirs = other.enqueue_create_buffer(np.int32, N)
        nodes: dict[str, DeviceGraphNode] = {}

        def build(b: DeviceGraphBuilder) -> None:
            nodes["set"] = b.add_memset(mine, 1)
            nodes["add"] = b.add_function(
                ADD_ONE, mine, np.int32(N), grid_dim=blocks_for(N), block_dim=256,
                dependencies=[nodes["set"]],
            )  # fmt: skip
            nodes["copy"] = b.add_copy(spare, mine, dependencies=[nodes["add"]])

        graph = DeviceGraph.create(cpu, build)

        def refused(b: DeviceGraphBuilder) -> None:
            for name, use in (
                ("a graph's memset", lambda: b.add_memset(theirs, 0)),
                ("kernel argument 0", lambda: b.add_function(
                    ADD_ONE, theirs, np.int32(N), grid_dim=1, block_dim=256
                )),
                ("a graph's copy: src", lambda: b.add_copy(mine, theirs)),
                ("a graph's copy: dst", lambda: b.add_copy(theirs, mine)),
                ("a graph's memset", lambda: graph.update(nodes["set"], buf=theirs, value=0)),
                ("kernel argument 0", lambda: graph.update(nodes["add"], theirs, np.int32(N))),
                ("a graph's copy: dst", lambda: graph.update(nodes["copy"], dst=theirs)),
            ):  # fmt: skip
                with pytest.raises(
                    ValueError,
                    match=rf"{name}: a DeviceBuffer of the other:0 context cannot be used "
                    r"by the cpu:0 context.*enqueue_copy",
                ):
                    use()

        other._state.api = "other"
        try:
            assert DeviceGraph.create(cpu, refused).num_nodes() == 0
        finally:
            other._state.api = "cpu"
        graph.replay().synchronize()  # as it was: mine set, added to, copied
        got = np.empty(N, np.int32)
        cpu.enqueue_copy(got, spare).synchronize()
        assert (got == 2).all()
