"""Device graphs, device-neutral: the nodes and edges a ``DeviceGraphBuilder``
records (``GraphDefinition``), their checks, and the plan every device can
replay from.

A definition is a DAG of nodes, each a kernel launch, a copy, a memset, a CPU
function or an empty join, added in an order where every dependency already
exists (so the insertion order is a topological order). A device turns the
finished definition into something it can replay (``Backend.graph``): the CPU
device runs the nodes in dependency order on its pool; the CUDA device splits
the DAG at its CPU nodes (``stages``) into driver graphs launched in stream
order with the CPU functions run between them by the stream's host work.

The parameters of the nodes (each node's operation: a kernel's arguments, a
copy's buffers, a memset's value, a CPU function's arguments) live apart from
the nodes, in versions (``GraphParams``): sealing the definition makes the
first, and each update of a node makes a new one, the current. A replay uses
the version that was current when it was enqueued and holds it until it has
finished, so what a replay uses is never freed under it, whatever later
updates replace. While a version lives, the memory its buffers use cannot be
taken out of asyncgpu's hands (``take_ptr``): ``memory`` counts the uses
(``pin_allocations``).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .memory import _BufferBase, pin_allocations, unpin_allocations

__all__ = ["DeviceGraphNode", "GraphDefinition", "GraphParams", "run_cpu_nodes"]

KERNEL, COPY, MEMSET, CPU, EMPTY = "kernel", "copy", "memset", "cpu", "empty"


class DeviceGraphNode:
    """A node of a device graph under construction: what a ``DeviceGraphBuilder``
    method returns, passed in later calls' ``dependencies`` (and, once the
    graph is made, to ``DeviceGraph.update``). A node belongs to
    the one graph whose builder made it. ``kind`` says what it does:
    ``"kernel"``, ``"copy"``, ``"memset"``, ``"cpu"`` (a CPU function) or
    ``"empty"`` (a join)."""

    __slots__ = ("__weakref__", "_deps", "_graph", "_index", "kind")

    def __init__(
        self, graph: GraphDefinition, index: int, kind: str, deps: tuple[int, ...]
    ) -> None:
        self._graph = graph
        self._index = index
        self.kind = kind
        self._deps = deps

    @property
    def dependencies(self) -> tuple[DeviceGraphNode, ...]:
        """The nodes this one waits for (its incoming edges)."""
        nodes = self._graph.nodes
        return tuple(nodes[i] for i in self._deps)

    def __repr__(self) -> str:
        return f"<DeviceGraphNode #{self._index} {self.kind} after {list(self._deps)}>"


class KernelOp:
    """A kernel node: the compiled function, its arguments and the backend's
    launch configuration (``make_launch_config``)."""

    __slots__ = ("args", "cfg", "fn")

    def __init__(self, fn: Any, args: tuple[Any, ...], cfg: Any) -> None:
        self.fn, self.args, self.cfg = fn, args, cfg


class CopyOp:
    """A copy node: two checked buffer operands and the bytes copied."""

    __slots__ = ("dst", "nbytes", "src")

    def __init__(self, dst: _BufferBase, src: _BufferBase, nbytes: int) -> None:
        self.dst, self.src, self.nbytes = dst, src, nbytes


class MemsetOp:
    """A memset node: the buffer, the element value (a NumPy scalar whose bytes
    are the element's) and the element count."""

    __slots__ = ("count", "dst", "value")

    def __init__(self, dst: _BufferBase, value: Any, count: int) -> None:
        self.dst, self.value, self.count = dst, value, count


class CpuOp:
    """A CPU function node: ``fn(*args)`` on the CPU pool at every replay."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args


class _Pins:
    """The memory of one node's buffers, pinned against ``take_ptr`` while any
    version naming that operation lives (versions share the pins of the nodes
    an update left alone, so an update pins one node's memory, not the
    graph's)."""

    __slots__ = ("allocs",)

    def __init__(self, buffers: tuple[_BufferBase, ...]) -> None:
        self.allocs = [b._alloc for b in buffers if b._alloc is not None]
        pin_allocations(self.allocs)

    def __del__(self, _unpin: Callable[[list[Any]], None] = unpin_allocations) -> None:
        _unpin(self.allocs)


# Serial numbers of graph node operations (``GraphParams.serials``); ``next``
# on a count is atomic under the GIL.
_serials = itertools.count(1)


class GraphParams:
    """One version of the parameters of a graph's nodes: ``ops[i]`` is node
    ``i``'s operation (``KernelOp``, ``CopyOp``, ``MemsetOp``, ``CpuOp``, or
    None for a join) and ``buffers[i]`` the buffers it names. Never changed
    once made (an update makes a new version), so a replay reads the one it
    was enqueued with however the graph is updated meanwhile. While it lives,
    the memory of its buffers cannot be taken (``take_ptr``).

    ``serials[i]`` names node ``i``'s operation, unique for the process: what
    a device's instantiated graph records as the parameters it holds, so that
    record keeps no operation, and no buffer, alive after the last replay
    that uses it (the serials tuple is this version's identity)."""

    __slots__ = ("_pins", "buffers", "ops", "serials")

    def __init__(
        self,
        ops: tuple[Any, ...],
        buffers: tuple[tuple[_BufferBase, ...], ...],
        pins: tuple[_Pins | None, ...] | None = None,
        serials: tuple[int, ...] | None = None,
    ) -> None:
        self.ops = ops
        self.buffers = buffers
        if pins is None:
            pins = tuple(_Pins(bs) if bs else None for bs in buffers)
        self._pins = pins
        if serials is None:
            serials = tuple(next(_serials) for _ in ops)
        self.serials = serials

    def replaced(self, index: int, op: Any, buffers: Sequence[Any]) -> GraphParams:
        """A new version: this one with node ``index``'s operation replaced."""
        bufs = tuple(b for b in buffers if isinstance(b, _BufferBase))
        j = index + 1
        return GraphParams(
            (*self.ops[:index], op, *self.ops[j:]),
            (*self.buffers[:index], bufs, *self.buffers[j:]),
            (*self._pins[:index], _Pins(bufs) if bufs else None, *self._pins[j:]),
            (*self.serials[:index], next(_serials), *self.serials[j:]),
        )


class GraphDefinition:
    """The nodes and edges of one device graph. Open while its builder's
    ``build`` runs; ``seal`` closes it for good (a builder kept past ``create``
    cannot add to a graph already instantiated)."""

    def __init__(self) -> None:
        self.nodes: list[DeviceGraphNode] = []
        self.outputs: list[DeviceGraphNode] = []
        self.sealed = False
        # What the nodes do, while the graph is being built (``seal`` makes the
        # first version of them; the instantiated graph holds the current one,
        # not the definition, which every node handle refers to).
        self._ops: list[Any] = []
        self._buffers: list[tuple[_BufferBase, ...]] = []
        self._lock = threading.Lock()

    def _check_open(self) -> None:
        if self.sealed:
            raise RuntimeError(
                "this DeviceGraphBuilder belongs to a graph that is already built; "
                "nodes are added only inside the build function given to DeviceGraph.create"
            )

    def dep_indices(
        self, dependencies: Iterable[Any], extra: Sequence[int] = ()
    ) -> tuple[int, ...]:
        """The indices of ``dependencies`` (and ``extra``), checked: each is a node of
        this graph (``ValueError`` for another graph's, ``TypeError`` for anything
        else); duplicates count once."""
        if isinstance(dependencies, DeviceGraphNode):
            dependencies = (dependencies,)
        try:
            deps = list(dependencies)
        except TypeError:
            raise TypeError(
                f"dependencies must be a sequence of DeviceGraphNode, not "
                f"{type(dependencies).__name__}"
            ) from None
        out: dict[int, None] = dict.fromkeys(extra)
        for d in deps:
            if not isinstance(d, DeviceGraphNode):
                raise TypeError(f"a dependency must be a DeviceGraphNode, not {type(d).__name__}")
            if d._graph is not self:
                raise ValueError(
                    f"{d!r} is a node of another device graph; a node can only depend on "
                    "nodes of its own graph"
                )
            out[d._index] = None
        return tuple(out)

    def add(
        self, kind: str, op: Any, deps: tuple[int, ...], buffers: Sequence[Any] = ()
    ) -> DeviceGraphNode:
        """A new node of ``kind`` after the nodes ``deps`` (from ``dep_indices``)."""
        with self._lock:
            self._check_open()
            node = DeviceGraphNode(self, len(self.nodes), kind, deps)
            self.nodes.append(node)
            self._ops.append(op)
            self._buffers.append(tuple(b for b in buffers if isinstance(b, _BufferBase)))
        return node

    def node_of(self, node: Any) -> DeviceGraphNode:
        """``node``, checked: a node of this graph (``ValueError`` for another
        graph's, ``TypeError`` for anything else)."""
        (i,) = self.dep_indices((node,))
        return self.nodes[i]

    def add_output(self, node: Any) -> int:
        """Name ``node`` an output of the graph; returns its output index."""
        self._check_open()
        (i,) = self.dep_indices((node,))
        self.outputs.append(self.nodes[i])
        return len(self.outputs) - 1

    def seal(self) -> GraphParams:
        """Close the definition for good; returns the first version of its
        parameters, for the device's instantiated graph to hold (once: the
        definition keeps none)."""
        with self._lock:
            self.sealed = True
            params = GraphParams(tuple(self._ops), tuple(self._buffers))
            self._ops, self._buffers = [], []
            return params

    def successors(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for n in self.nodes:
            for d in n._deps:
                out[d].append(n._index)
        return out

    def stages(self) -> list[tuple[str, list[DeviceGraphNode]]]:
        """The definition as alternating CPU and device stages, for a device whose
        graphs cannot run host work themselves (CUDA): ``[("device", nodes),
        ("cpu", nodes), ("device", nodes), ...]``, empty stages (and device
        stages of empty joins only) left out.

        A CPU node's stage is one more than the greatest stage of the nodes it
        depends on (0 for a root); a device node's is the greatest stage of its
        dependencies (0 for a root). CPU stage k runs after device stage k-1 and
        before device stage k. Every edge then points into the same device
        stage or a later stage, and no edge joins two CPU nodes of one stage, so
        running the stages one after another in stream order keeps every
        dependency in both directions (at the cost of ordering independent
        branches through a CPU node that only one of them needs)."""
        depth: list[int] = []
        for n in self.nodes:
            if n.kind == CPU:
                d = max((depth[i] + 1 for i in n._deps), default=0)
            else:
                d = max((depth[i] for i in n._deps), default=0)
            depth.append(d)
        top = max(depth, default=0)
        device: list[list[DeviceGraphNode]] = [[] for _ in range(top + 1)]
        cpu: list[list[DeviceGraphNode]] = [[] for _ in range(top + 1)]
        for n, d in zip(self.nodes, depth, strict=True):
            (cpu if n.kind == CPU else device)[d].append(n)
        out: list[tuple[str, list[DeviceGraphNode]]] = []
        for k in range(top + 1):
            if cpu[k]:
                out.append(("cpu", cpu[k]))
            if any(n.kind != EMPTY for n in device[k]):
                out.append(("device", device[k]))
        return out


def run_cpu_nodes(
    nodes: Sequence[DeviceGraphNode],
    params: GraphParams,
    errors: list[BaseException],
    last: bool,
) -> None:
    """Run one CPU stage's functions in order (host work of the replay's stream),
    with the replay's version of their parameters. An error is kept in
    ``errors`` and the stage goes on, as a stream goes on after a failed CPU
    function; the replay's last stage raises the first one, so ``await
    graph.replay()`` sees it."""
    ops = params.ops
    for n in nodes:
        op: CpuOp = ops[n._index]
        try:
            op.fn(*op.args)
        except Exception as e:
            errors.append(e)
    if last and errors:
        raise errors[0]
