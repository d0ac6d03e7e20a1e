"""DeviceGraph and DeviceGraphBuilder: MAX's device graphs, with awaitable replay.

``DeviceGraph.create(ctx, build)`` hands a ``DeviceGraphBuilder`` to ``build``,
which adds kernel, copy, memset, CPU function and join nodes with their
dependencies; the graph is then instantiated once by the context's device
(``Backend.graph``) and each ``replay()`` is one stream-ordered operation
returning a ``DeviceEvent``. The builder checks every argument here, as the
matching ``enqueue_*`` call would, so a graph fails at its call, not at a
replay; the definition itself (nodes, edges, stages) is the core's
(``_core.graph``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from .._core.event import DeviceEvent
from .._core.function import (
    ARG_BUFFER,
    ARG_CUDA_CORE,
    ARG_FOREIGN,
    DeviceFunction,
    kernel_arg_kind,
)
from .._core.function import refuse_coroutine_function as _refuse_coroutine_function
from .._core.graph import (
    COPY,
    CPU,
    EMPTY,
    KERNEL,
    MEMSET,
    CopyOp,
    CpuOp,
    DeviceGraphNode,
    GraphDefinition,
    KernelOp,
    MemsetOp,
)
from .._core.memory import DeviceBuffer, HostBuffer, _BufferBase
from .._core.ops import check_kernel_buffer, check_writable, copy_operands
from .._errors import UnsupportedError
from .._types import DimLike, FuncAttribute
from .context import DeviceContext, _scalar_for

__all__ = ["DeviceGraph", "DeviceGraphBuilder", "RecordingContext"]

_NodeList = Iterable[DeviceGraphNode]


class DeviceGraphBuilder:
    """What ``DeviceGraph.create`` hands to its ``build`` function: adds the nodes
    of one graph. Every ``add_*`` method returns a ``DeviceGraphNode``; a node
    with no ``dependencies`` is a root, and a list of nodes gives its incoming
    edges (it runs after all of them). Nodes are added only while ``build``
    runs; the nodes of one graph cannot be dependencies in another
    (``ValueError``).

    Arguments are checked at the call, as the matching ``enqueue_*`` call
    checks them. The graph keeps every buffer it names alive for as long as it
    exists (see ``DeviceGraph``)."""

    __slots__ = ("_ctx", "_def", "_lanes", "_scopes")

    def __init__(self, ctx: DeviceContext, definition: GraphDefinition) -> None:
        self._ctx = ctx
        self._def = definition
        self._lanes: dict[int, _Lane] = {}  # what recording contexts have recorded per stream
        # Open regions, innermost last: (their dependencies, index of their first node).
        self._scopes: list[tuple[tuple[int, ...], int]] = []

    def _deps(self, dependencies: _NodeList) -> tuple[int, ...]:
        """The checked dependencies of a new node; inside a region, a node that
        depends on nothing added in the region gets the region's dependencies."""
        self._def._check_open()
        self._ctx._check_open()
        deps = self._def.dep_indices(dependencies)
        if self._scopes:
            outer, start = self._scopes[-1]
            if not any(i >= start for i in deps):
                deps = self._def.dep_indices((), (*outer, *deps))
        return deps

    def add_function(
        self,
        f: DeviceFunction | Any,
        *args: Any,
        grid_dim: DimLike,
        block_dim: DimLike,
        shared_mem_bytes: int | None = None,
        func_attribute: FuncAttribute | None = None,
        dependencies: _NodeList = (),
    ) -> DeviceGraphNode:
        """A kernel node: ``f`` launched with ``args`` (a kernel node,
        ``cuGraphAddKernelNode``, on CUDA; the NumPy body once per block on the
        CPU device). ``f`` and the arguments are what ``enqueue_function``
        takes (another library's arrays and cuda.core objects excepted, with
        ``TypeError``: copy them into a ``DeviceBuffer``); the argument values
        are fixed when the node is added, and buffers are used in place at
        every replay."""
        deps = self._deps(dependencies)
        ctx = self._ctx
        fn = f if type(f) is DeviceFunction else ctx._compiled(f, func_attribute)
        if fn._ctx._state is not ctx._state:
            raise ValueError("this DeviceFunction was compiled for another context")
        cfg = ctx._launch_config(fn, grid_dim, block_dim, None, shared_mem_bytes, ())
        buffers = _kernel_buffers(ctx, args)
        return self._def.add(KERNEL, KernelOp(fn, args, cfg), deps, buffers)

    def add_copy(
        self,
        dst: DeviceBuffer | HostBuffer,
        src: DeviceBuffer | HostBuffer,
        dependencies: _NodeList = (),
    ) -> DeviceGraphNode:
        """A copy node between two buffers (``cuGraphAddMemcpyNode`` on CUDA):
        the same dtype, the destination's length copied, as in
        ``enqueue_copy``. NumPy arrays and raw addresses are not taken: copy
        through a ``HostBuffer``."""
        deps = self._deps(dependencies)
        return self._def.add(COPY, _copy_op(self._ctx, dst, src), deps, (dst, src))

    def add_memset(
        self, buf: DeviceBuffer, value: Any, dependencies: _NodeList = ()
    ) -> DeviceGraphNode:
        """A memset node: every element of the device buffer ``buf`` set to
        ``value``, which must fit its dtype (``cuGraphAddMemsetNode`` on CUDA;
        8-byte elements as two 4-byte memsets of every other word). A
        ``HostBuffer`` is filled by a CPU function node instead."""
        deps = self._deps(dependencies)
        return self._def.add(MEMSET, _memset_op(self._ctx, buf, value), deps, (buf,))

    def add_cpu_function(
        self, fn: Callable[..., Any], *args: Any, dependencies: _NodeList = ()
    ) -> DeviceGraphNode:
        """A CPU function node: ``fn(*args)`` runs on asyncgpu's CPU pool once in
        every replay, after the nodes it depends on and before the nodes that
        depend on it (on CUDA the replay is split around it, and the device
        work behind it is handed to the driver once it returns: no Python runs
        on a driver thread). Its return value is dropped; the first error a
        CPU function raises in a replay is raised by that replay's event."""
        deps = self._deps(dependencies)
        if not callable(fn):
            raise TypeError(f"add_cpu_function needs a callable, not {fn!r}")
        _refuse_coroutine_function(fn, "add_cpu_function")
        return self._def.add(CPU, CpuOp(fn, args), deps, args)

    def region(
        self, fn: Callable[[DeviceGraphBuilder], Any], dependencies: _NodeList = ()
    ) -> DeviceGraphNode:
        """Run ``fn(builder)``; every node it adds that depends on nothing else
        added in the region depends on ``dependencies``. Returns one join node
        that depends on everything the region added (an empty region's join
        depends on ``dependencies`` directly, so it still gates on them)."""
        deps = self._deps(dependencies)
        if not callable(fn):
            raise TypeError(f"region needs a callable, not {fn!r}")
        nodes = self._def.nodes
        start = len(nodes)
        self._scopes.append((deps, start))
        try:
            fn(self)
        finally:
            self._scopes.pop()
        added = range(start, len(nodes))
        if not added:
            return self._def.add(EMPTY, None, deps)
        used = {d for i in added for d in nodes[i]._deps}
        return self._def.add(EMPTY, None, tuple(i for i in added if i not in used))

    def recording_context(self) -> RecordingContext:
        """A stand-in for the context on which the ordinary calls are recorded as
        nodes instead of run: ``enqueue_function``, ``enqueue_copy``,
        ``enqueue_copy_no_cross_stream_sync``, ``enqueue_memset``,
        ``enqueue_cpu_function``, ``select_stream`` and ``enqueue_wait_for``. Each
        stream of the context is a lane: a call depends on the call before it on
        its lane and on what ``enqueue_wait_for`` made the lane wait for, and a
        copy is ordered with the lanes of its buffers' owning streams, as
        ``enqueue_copy`` orders it with those streams. Each call returns its
        node. Code written against a ``DeviceContext`` becomes a graph
        unchanged, as long as it only enqueues (allocate buffers, and await
        nothing, inside ``build``)."""
        self._def._check_open()
        index = self._ctx._impl.index
        return RecordingContext(self, index if 0 <= index < self._ctx.num_streams() else 0)

    def add_output(self, node: DeviceGraphNode) -> int:
        """Name ``node`` an output of the graph; returns its index among the
        outputs (in the order they were added)."""
        return self._def.add_output(node)

    def num_outputs(self) -> int:
        """How many outputs the graph has so far."""
        return len(self._def.outputs)

    def context(self) -> DeviceContext:
        """The context the graph is built for."""
        return self._ctx


# -- the checks of a node's operation, made when it is added and when it is updated ---------


def _kernel_buffers(ctx: DeviceContext, args: tuple[Any, ...]) -> list[_BufferBase]:
    """The buffers among a kernel node's arguments, every argument checked: the
    kinds ``enqueue_function`` takes (by ``kernel_arg_kind``), another library's
    array or cuda.core object excepted, and buffers the graph's context may use in place, by the
    rule of its launches (``check_kernel_buffer``: its own, another context's
    of the same device, a peer's once peer access is enabled). (The device
    checks the count and sizes against the kernel when it makes or updates the
    node.)"""
    buffers = []
    for n, a in enumerate(args):
        kind = kernel_arg_kind(n, a)
        # A node replays its argument values long after they were given, and
        # neither kind tells the graph how long its memory lives (a cuda.core
        # Buffer can be closed while the graph still holds the object), so both
        # are refused, alike: a DeviceBuffer's memory is owned by asyncgpu.
        if kind in (ARG_FOREIGN, ARG_CUDA_CORE):
            raise TypeError(
                f"kernel argument {n}: a graph takes DeviceBuffers, HostBuffers and NumPy "
                f"scalars, not another library's array or object ({type(a).__name__}); copy it "
                "into a DeviceBuffer"
            )
        if kind == ARG_BUFFER:
            check_kernel_buffer(ctx._state, a, f"kernel argument {n}")
            buffers.append(a)
    return buffers


def _copy_op(ctx: DeviceContext, dst: Any, src: Any) -> CopyOp:
    """A copy node's operation, checked as ``enqueue_copy`` checks two buffers,
    each one a buffer the graph's device addresses (``check_kernel_buffer``, as
    for kernel nodes): a driver graph's copy node cannot wait for another
    device's stream, which ``enqueue_copy`` does for a CPU context's buffer in
    a CUDA copy, and the rule is one for every node."""
    for x, name in ((dst, "dst"), (src, "src")):
        if not isinstance(x, (DeviceBuffer, HostBuffer)):
            raise TypeError(
                f"a graph's copy: {name} must be a DeviceBuffer or HostBuffer (a graph copies "
                f"between buffers; stage arrays through a HostBuffer), not {type(x).__name__}"
            )
        check_kernel_buffer(ctx._state, x, f"a graph's copy: {name}")
    d, s, nbytes = copy_operands(ctx, dst, src, None, None)
    return CopyOp(d, s, nbytes)


def _memset_op(ctx: DeviceContext, buf: Any, value: Any) -> MemsetOp:
    """A memset node's operation, checked as ``enqueue_memset`` checks it."""
    if not isinstance(buf, DeviceBuffer):
        raise TypeError(
            f"a graph's memset sets a DeviceBuffer, not {type(buf).__name__} (fill a "
            "HostBuffer with add_cpu_function)"
        )
    check_kernel_buffer(ctx._state, buf, "a graph's memset")
    check_writable(buf)
    v = _scalar_for(buf._dtype, value)
    if buf._dtype.itemsize not in (1, 2, 4, 8):
        raise TypeError(f"memset supports 1, 2, 4 and 8-byte elements, not {buf._dtype}")
    return MemsetOp(buf, v, buf._size)


def _only(
    kind: str, args: tuple[Any, ...], keywords: dict[str, Any], names: tuple[str, ...]
) -> None:
    """A copy or memset node's update names what changes, as keywords."""
    if args or not keywords or not set(keywords) <= set(names):
        given = [*(["positional arguments"] if args else []), *(f"{k}=" for k in keywords)]
        raise TypeError(
            f"a {kind} node is updated with {' and/or '.join(f'{k}=' for k in names)}, not "
            f"{', '.join(given) or 'nothing'}"
        )


class _Lane:
    """One stream of a recording: its last node, and the nodes its next node waits
    for besides (``enqueue_wait_for``, copies on other lanes of its buffers)."""

    __slots__ = ("last", "waits")

    def __init__(self) -> None:
        self.last: DeviceGraphNode | None = None
        self.waits: list[DeviceGraphNode] = []


_RECORDED = (
    "enqueue_function, enqueue_copy, enqueue_copy_no_cross_stream_sync, enqueue_memset, "
    "enqueue_cpu_function, select_stream and enqueue_wait_for"
)


class RecordingContext:
    """What ``DeviceGraphBuilder.recording_context()`` returns: the enqueue calls
    of a ``DeviceContext`` (bound to one stream of it, a lane), recorded as nodes
    of the graph being built. Anything else a context does (allocate, wait,
    synchronize) raises: a recording runs nothing."""

    __slots__ = ("_builder", "_index")

    def __init__(self, builder: DeviceGraphBuilder, index: int) -> None:
        self._builder = builder
        self._index = index

    def _lane(self, index: int | None = None) -> _Lane:
        lanes = self._builder._lanes
        i = self._index if index is None else index
        lane = lanes.get(i)
        if lane is None:
            lane = lanes[i] = _Lane()
        return lane

    def _deps(self, lane: _Lane) -> list[DeviceGraphNode]:
        return ([lane.last] if lane.last is not None else []) + lane.waits

    def _did(self, lane: _Lane, node: DeviceGraphNode) -> DeviceGraphNode:
        lane.last = node
        lane.waits = []
        return node

    def num_streams(self) -> int:
        """The size of the context's stream pool: the lanes a recording has."""
        return self._builder._ctx.num_streams()

    def select_stream(self, stream_id: int) -> RecordingContext:
        """The recording of stream ``stream_id`` of the pool (``IndexError``
        outside ``0..num_streams()-1``)."""
        self._builder._ctx.select_stream(stream_id)  # (its checks)
        return RecordingContext(self._builder, int(stream_id))

    def enqueue_function(
        self,
        f: Any,
        *args: Any,
        grid_dim: DimLike,
        block_dim: DimLike,
        shared_mem_bytes: int | None = None,
        func_attribute: FuncAttribute | None = None,
    ) -> DeviceGraphNode:
        """Record a kernel launch (``DeviceGraphBuilder.add_function``)."""
        lane = self._lane()
        node = self._builder.add_function(
            f,
            *args,
            grid_dim=grid_dim,
            block_dim=block_dim,
            shared_mem_bytes=shared_mem_bytes,
            func_attribute=func_attribute,
            dependencies=self._deps(lane),
        )
        return self._did(lane, node)

    def enqueue_copy(self, dst: Any, src: Any) -> DeviceGraphNode:
        """Record a copy between two buffers, ordered with the lanes of the
        streams that own them: after their earlier nodes, before their later
        ones (as ``enqueue_copy`` orders a copy with those streams)."""
        return self._copy(dst, src, True)

    def enqueue_copy_no_cross_stream_sync(self, dst: Any, src: Any) -> DeviceGraphNode:
        """Record a copy ordered on this lane alone."""
        return self._copy(dst, src, False)

    def _copy(self, dst: Any, src: Any, cross: bool) -> DeviceGraphNode:
        lane = self._lane()
        deps = self._deps(lane)
        owners: list[_Lane] = []
        if cross:
            n = self.num_streams()
            for b in (dst, src):
                owner = getattr(b, "_owner", None)
                if owner is None or owner.state is not self._builder._ctx._state:
                    continue
                i = owner.index
                if i != self._index and 0 <= i < n:
                    other = self._lane(i)
                    if other not in owners:
                        owners.append(other)
                        deps += self._deps(other)
        node = self._builder.add_copy(dst, src, dependencies=deps)
        for other in owners:
            other.waits.append(node)
        return self._did(lane, node)

    def enqueue_memset(self, dst: Any, val: Any) -> DeviceGraphNode:
        """Record a memset (``DeviceGraphBuilder.add_memset``)."""
        lane = self._lane()
        node = self._builder.add_memset(dst, val, dependencies=self._deps(lane))
        return self._did(lane, node)

    def enqueue_cpu_function(
        self, func: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> DeviceGraphNode:
        """Record a CPU function (``DeviceGraphBuilder.add_cpu_function``)."""
        lane = self._lane()
        fn = partial(func, **kwargs) if kwargs else func
        if kwargs:
            _refuse_coroutine_function(func, "enqueue_cpu_function")
        node = self._builder.add_cpu_function(fn, *args, dependencies=self._deps(lane))
        return self._did(lane, node)

    def enqueue_wait_for(self, other: RecordingContext | DeviceGraphNode) -> None:
        """Make this lane's next node wait for ``other``: another lane (what it has
        recorded so far) or a node of this graph. Work outside the graph cannot
        be waited for (``TypeError``)."""
        lane = self._lane()
        if isinstance(other, RecordingContext):
            if other._builder is not self._builder:
                raise ValueError("enqueue_wait_for: a recording of another graph")
            if other._index != self._index:
                lane.waits += self._deps(other._lane())
            return
        if isinstance(other, DeviceGraphNode):
            (i,) = self._builder._def.dep_indices((other,))
            lane.waits.append(self._builder._def.nodes[i])
            return
        raise TypeError(
            "a recording waits for another lane of the recording or a node of the graph, not "
            f"{type(other).__name__} (a graph cannot wait for work outside it)"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnsupportedError(
            f"a recording context records {_RECORDED}; {name} is not recorded (allocate "
            "buffers before recording, and await the graph's replays instead)"
        )

    def __await__(self) -> Any:
        raise UnsupportedError("a recording context runs nothing: await graph.replay() instead")

    def __repr__(self) -> str:
        return f"<RecordingContext lane {self._index} of {self._builder._ctx!r}>"


class DeviceGraph:
    """A device graph, instantiated once and replayed as one operation.

    ``DeviceGraph.create(ctx, build)`` builds it; ``await graph.replay()`` runs
    every node once, in dependency order, on the context's current stream;
    ``graph.update(node, ...)`` changes a node's parameters for later replays.

    Lifetime: the graph holds every buffer, function and argument its nodes
    name (the current parameters), and each replay holds the graph and the
    parameters it runs with until it has finished, so nothing a replay uses is
    freed before the replay ends, whatever the program drops or updates. While
    the graph names a buffer, and until the last replay using it has ended,
    ``take_ptr()`` on it raises ``ValueError`` (the memory would leave
    asyncgpu's hands while a replay may still use it)."""

    __slots__ = ("__weakref__", "_ctx", "_def", "_exec")

    _ctx: DeviceContext
    _def: GraphDefinition
    _exec: Any

    def __init__(self) -> None:
        raise TypeError("make a DeviceGraph with DeviceGraph.create(ctx, build)")

    @classmethod
    def create(cls, ctx: DeviceContext, build: Callable[[DeviceGraphBuilder], Any]) -> DeviceGraph:
        """Call ``build(builder)`` once, then instantiate the graph on ``ctx``'s
        device (on CUDA: one driver graph per stretch between CPU function
        nodes, ``cuGraphInstantiate``, which blocks while the driver builds it).
        Replays run on ``ctx``'s current stream. The builder cannot be used
        after this returns."""
        if not isinstance(ctx, DeviceContext):
            raise TypeError(f"DeviceGraph.create takes a DeviceContext, not {type(ctx).__name__}")
        ctx._check_open()
        if not callable(build):
            raise TypeError(f"DeviceGraph.create needs a build function, not {build!r}")
        definition = GraphDefinition()
        try:
            build(DeviceGraphBuilder(ctx, definition))
        finally:
            definition.sealed = True
        ctx._check_open()
        graph = object.__new__(cls)
        graph._ctx = ctx
        graph._def = definition
        graph._exec = ctx._state.backend.graph(definition, definition.seal())
        return graph

    def replay(self, ctx: DeviceContext | None = None) -> DeviceEvent:
        """Enqueue one run of the whole graph on the current stream of the
        context it was created with (or of ``ctx``, another view of the same
        context: ``graph.replay(ctx.select_stream(1))``), in stream order: it
        starts after the stream's earlier work and later work waits for it.
        Returns at once (``cuGraphLaunch`` per stretch between CPU function
        nodes on CUDA); the event completes when every node has. Buffers the
        graph uses that other streams write are ordered as for a kernel: with
        ``enqueue_wait_for``."""
        view = self._ctx
        if ctx is not None:
            if not isinstance(ctx, DeviceContext):
                raise TypeError(f"replay takes a DeviceContext, not {type(ctx).__name__}")
            if ctx._state is not view._state:
                raise ValueError("a graph replays only on streams of the context it was built for")
            view = ctx
        state = view._state
        if state.closed or not view._ref.open:
            view._check_open()
        impl = view._impl
        ev: DeviceEvent = self._exec.replay(impl)
        if state.trace is not None:
            state.trace.record(impl, ev, "graph", f"graph ({len(self._def.nodes)} nodes)")
        return ev

    def update(
        self,
        node: DeviceGraphNode,
        *args: Any,
        dst: DeviceBuffer | HostBuffer | None = None,
        src: DeviceBuffer | HostBuffer | None = None,
        buf: DeviceBuffer | None = None,
        value: Any = None,
    ) -> None:
        """Change what ``node`` (a node of this graph) does in the replays
        enqueued from now on, without building the graph again:

        - a kernel node: ``graph.update(node, *args)``, all of its arguments
          anew (the same function and launch geometry);
        - a copy node: ``graph.update(node, dst=..., src=...)``, either or both
          buffers (the same kind of buffer on each side, the same byte count);
        - a memset node: ``graph.update(node, value=..., buf=...)``, either or
          both (a buffer of the same dtype and length);
        - a CPU function node: ``graph.update(node, *args)``, the function's
          arguments anew.

        Checked here as the builder checks the node (and, for a kernel, as the
        device checks it when the graph is made), so bad input raises at this
        call and the graph is left as it was. Replays enqueued before this call
        keep the parameters they were enqueued with, and hold them (buffers
        included) until they have finished; the graph holds the new ones. On
        CUDA the instantiated graph is changed in place
        (``cuGraphExecKernelNodeSetParams``, ``cuGraphExecMemcpyNodeSetParams``,
        ``cuGraphExecMemsetNodeSetParams``, through cuda.core's executable-node
        views), which affects only later launches and does not block on the
        device; the driver copies the new arguments at the call. ``ValueError``
        for a node of another graph; ``ContextClosedError`` once the context is
        closed."""
        ctx = self._ctx
        ctx._check_open()
        if not isinstance(node, DeviceGraphNode):
            raise TypeError(f"update takes a DeviceGraphNode, not {type(node).__name__}")
        n = self._def.node_of(node)
        i = n._index
        params = self._exec.params  # (what an update changes is the same in every version)
        old = params.ops[i]
        keywords = {
            k: v for k, v in (("dst", dst), ("src", src), ("buf", buf), ("value", value))
            if v is not None
        }  # fmt: skip
        op: Any
        if n.kind in (KERNEL, CPU):
            if keywords:
                raise TypeError(
                    f"a {n.kind} node is updated with its new arguments, "
                    f"graph.update(node, *args), not {', '.join(keywords)}="
                )
            if n.kind == KERNEL:
                buffers: tuple[Any, ...] = tuple(_kernel_buffers(ctx, args))
                op = KernelOp(old.fn, args, old.cfg)
            else:
                buffers, op = args, CpuOp(old.fn, args)
        elif n.kind == COPY:
            _only(n.kind, args, keywords, ("dst", "src"))
            was_dst, was_src = params.buffers[i]
            new_dst = was_dst if dst is None else dst
            new_src = was_src if src is None else src
            for was, now, name in ((was_dst, new_dst, "dst"), (was_src, new_src, "src")):
                if type(now) is not type(was):
                    raise TypeError(
                        f"a copy node's {name} is updated with another {type(was).__name__}, "
                        f"not a {type(now).__name__} (the driver changes a copy's "
                        "addresses, not its kind)"
                    )
            op = _copy_op(ctx, new_dst, new_src)
            if op.nbytes != old.nbytes:
                raise ValueError(
                    f"a copy node's update copies as many bytes as the node ({old.nbytes}), "
                    f"not {op.nbytes}"
                )
            buffers = (new_dst, new_src)
        elif n.kind == MEMSET:
            _only(n.kind, args, keywords, ("buf", "value"))
            new_buf = old.dst if buf is None else buf
            op = _memset_op(ctx, new_buf, old.value if value is None else value)
            if new_buf._dtype != old.dst._dtype or op.count != old.count:
                raise ValueError(
                    f"a memset node's buffer is updated with one of the same dtype and length "
                    f"({old.dst._dtype}, {old.count}), not ({new_buf._dtype}, {op.count})"
                )
            buffers = (new_buf,)
        else:
            raise TypeError(f"{n!r}: a join node has nothing to update")
        self._exec.update(i, op, buffers)

    def num_outputs(self) -> int:
        """How many nodes the build named outputs (``add_output``)."""
        return len(self._def.outputs)

    def num_nodes(self) -> int:
        """How many nodes the graph has (joins included)."""
        return len(self._def.nodes)

    def context(self) -> DeviceContext:
        """The context (bound to the stream replays run on) the graph was built for."""
        return self._ctx

    def __repr__(self) -> str:
        return f"<DeviceGraph {len(self._def.nodes)} nodes on {self._ctx!r}>"
