"""Device graphs on the CUDA device (``CudaGraph``).

A finished definition (``_core.graph.GraphDefinition``) is cut at its CPU
nodes into stages (``GraphDefinition.stages``). Each device stage becomes one
driver graph, built with cuda.core's ``GraphDefinition`` (kernel nodes:
``cuGraphAddKernelNode``; copies: ``cuGraphAddMemcpyNode``; memsets:
``cuGraphAddMemsetNode``; joins: ``cuGraphAddEmptyNode``) and instantiated
once (``cuGraphInstantiate``). A replay is then, in the stream order of the
stream it is replayed on, one ``cuGraphLaunch`` per device stage with each CPU
stage between them run as the stream's host work (``CudaStream.cpu_call``),
which holds the launches behind it on the host until the CPU functions have
returned. So CPU functions run on asyncgpu's pool at their place in every
replay, never as a driver host node: no Python runs on a driver thread, and no
stream waits on the device for memory only the host writes. A graph without
CPU nodes replays as a single ``cuGraphLaunch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..._core.event import DeviceEvent
from ..._core.graph import COPY, CPU, EMPTY, KERNEL, MEMSET, GraphDefinition, run_cpu_nodes
from ..._errors import UnsupportedError
from .launch import _arg_plan, _kernel_args

if TYPE_CHECKING:
    from ..._core.graph import DeviceGraphNode
    from .stream import CudaStream

__all__ = ["CudaGraph"]


class CudaGraph:
    """A device graph instantiated on one CUDA device: ``steps`` in replay order,
    each ``(exe, None)`` for a device stage (the ``CUgraphExec`` that
    ``cuGraphLaunch`` takes) or ``(None, nodes)`` for a CPU stage."""

    def __init__(self, backend: Any, definition: GraphDefinition) -> None:
        backend.make_current()
        self.definition = definition
        self._graphs: list[Any] = []  # cuda.core's executable graphs (they own the exec)
        self.steps: list[tuple[Any, list[DeviceGraphNode] | None]] = []
        for kind, nodes in definition.stages():
            if kind == "cpu":
                self.steps.append((None, nodes))
            else:
                exe = _instantiate(nodes)
                self._graphs.append(exe)
                self.steps.append((exe.handle, None))
        self._cpu = any(n.kind == CPU for n in definition.nodes)
        only = self.steps[0][0] if len(self.steps) == 1 else None
        self._single = only

    def replay(self, stream: CudaStream) -> DeviceEvent:
        """Enqueue one replay on ``stream`` (``cuGraphLaunch`` per device stage,
        host work per CPU stage); never blocks the host. The event is the last
        step's, which finishes after every node; with CPU nodes its error is
        the first a CPU function raised in this replay."""
        single = self._single
        if single is not None:
            return stream.graph_launch(single, self)
        errors: list[BaseException] = []
        ev: DeviceEvent | None = None
        last = len(self.steps) - 1
        for k, (exe, nodes) in enumerate(self.steps):
            if exe is not None:
                ev = stream.graph_launch(exe, self)
            else:
                ev = stream.cpu_call(run_cpu_nodes, (nodes, errors, k == last), {})
        if self._cpu and self.steps[last][0] is not None:
            # The errors of earlier CPU stages reach the replay's event.
            ev = stream.cpu_call(run_cpu_nodes, ((), errors, True), {})
        if ev is None:  # an empty graph: a point in stream order all the same
            done = DeviceEvent(None)
            done._done = True
            ev = stream.wait_event(done)
        return ev


def _instantiate(nodes: list[DeviceGraphNode]) -> Any:
    """One device stage as an executable driver graph (``cuGraphInstantiate``).
    Edges from nodes of earlier stages are left out: the stages run in stream
    order."""
    from cuda.core.graph import GraphDefinition as CoreGraphDefinition

    gd = CoreGraphDefinition()
    made: dict[int, Any] = {}
    for n in nodes:
        preds = [made[i] for i in n._deps if i in made]
        if not preds:
            base: Any = gd
        elif len(preds) == 1:
            base = preds[0]
        else:
            base = preds[0].join(*preds[1:])
        made[n._index] = _add(gd, base, n)
    return gd.instantiate()


def _add(gd: Any, base: Any, n: DeviceGraphNode) -> Any:
    """Add node ``n`` after ``base`` (a node, or the definition ``gd`` for a root)."""
    op = n._op
    if n.kind == KERNEL:
        fn = op.fn
        impl = fn._impl
        if impl is None:
            raise UnsupportedError(f"{fn!r} was released")
        cfg = op.cfg
        if cfg.dims is None:
            raise UnsupportedError(
                f"kernel {fn.name!r}: a graph's kernel node takes a plain launch (no "
                "cluster, cooperative launch or priority)"
            )
        plan = _arg_plan(impl, op.args)
        if plan.structs:
            raise UnsupportedError(
                f"kernel {fn.name!r}: a graph's kernel node cannot take a structured scalar; "
                "pass the struct's fields instead"
            )
        return base.launch(cfg.cc, impl.kernel, *_kernel_args(plan, op.args, fn._ctx._state))
    if n.kind == COPY and op.nbytes:
        return base.memcpy(op.dst._ptr, op.src._ptr, op.nbytes)
    if n.kind == MEMSET and op.count:
        raw = op.value.tobytes()  # the element's bytes, as the buffer holds them
        ptr = op.dst._ptr
        if len(raw) in (1, 2, 4):
            return base.memset(ptr, raw, op.count)
        # 8-byte elements: two 4-byte memsets of every other word (rows of one
        # 4-byte element, 8 bytes apart), as cuMemsetD2D32 does for enqueue_memset.
        lo = base.memset(ptr, raw[:4], 1, op.count, 8)
        hi = base.memset(ptr + 4, raw[4:], 1, op.count, 8)
        return lo.join(hi)
    assert n.kind in (EMPTY, COPY, MEMSET)  # (a join, or nothing to copy or set)
    return gd.empty() if base is gd else base.join()
