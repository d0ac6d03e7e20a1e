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

Updates: a node's parameters are changed in the instantiated graphs through
cuda.core's executable-node views (``graph[node].update``:
``cuGraphExecKernelNodeSetParams``, ``cuGraphExecMemcpyNodeSetParams``,
``cuGraphExecMemsetNodeSetParams``), which affect only launches made after
them. The driver copies the new parameters (kernel argument values included)
when it is called, so no host memory of an update is read by a launch. A
replay uses the parameters current when it was enqueued (its
``GraphParams``): a launch held behind host work that reaches the driver after
a later update first sets its own version's parameters again. Every driver
call on the instantiated graphs (launches, updates) is made under the graph's
lock, as the driver requires for one graph used from several threads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cuda.bindings import driver as cu

from ... import _accel
from ..._core.event import DeviceEvent
from ..._core.graph import (
    COPY,
    CPU,
    EMPTY,
    KERNEL,
    MEMSET,
    CopyOp,
    GraphDefinition,
    GraphParams,
    KernelOp,
    run_cpu_nodes,
)
from ..._errors import UnsupportedError
from .driver import _SUCCESS, _error
from .launch import _arg_plan, _kernel_args

if TYPE_CHECKING:
    from ..._core.graph import DeviceGraphNode
    from .stream import CudaStream

__all__ = ["CudaGraph"]


class CudaGraph:
    """A device graph instantiated on one CUDA device: ``steps`` in replay order,
    each ``(exe, None)`` for a device stage (the ``CUgraphExec`` that
    ``cuGraphLaunch`` takes) or ``(None, nodes)`` for a CPU stage."""

    def __init__(self, backend: Any, definition: GraphDefinition, params: GraphParams) -> None:
        backend.make_current()
        self.backend = backend
        self.definition = definition
        self.params = params  # the current version (an update replaces it)
        self._graphs: list[Any] = []  # cuda.core's executable graphs (they own the exec)
        self.steps: list[tuple[Any, list[DeviceGraphNode] | None]] = []
        self._handles: dict[int, int] = {}  # per step: its CUgraphExec as an int (for C)
        # Per graph node with parameters in a driver graph: its executable graph
        # and the cuda.core nodes that carry them (two for 8-byte memsets).
        self._exec_nodes: dict[int, tuple[Any, list[Any]]] = {}
        for kind, nodes in definition.stages():
            if kind == "cpu":
                self.steps.append((None, nodes))
            else:
                exe, made = _instantiate(nodes, params.ops)
                self._graphs.append(exe)
                self._handles[len(self.steps)] = int(exe.handle)
                self.steps.append((exe.handle, None))
                for i, core_nodes in made.items():
                    self._exec_nodes[i] = (exe, core_nodes)
        self._cpu = any(n.kind == CPU for n in definition.nodes)
        only = self.steps[0][0] if len(self.steps) == 1 else None
        self._single = only
        self._single_h = self._handles.get(0, 0)
        # The extension's RLock: every driver call on the executable graphs is
        # made holding it (after the stream's submit lock, never before), which
        # the compiled launch (``StreamCore._graph_c``) takes without Python.
        self.lock = _accel.native.RLock()
        # What the driver graphs hold, as its ``GraphParams.serials`` (which,
        # unlike its operations, keep no buffer alive): a list of one, which the
        # compiled launch reads (None while partly set).
        self.applied: list[tuple[int, ...] | None] = [params.serials]

    def replay(self, stream: CudaStream) -> DeviceEvent:
        """Enqueue one replay on ``stream`` (``cuGraphLaunch`` per device stage,
        host work per CPU stage) with the parameters current now; never blocks
        the host. The event is the last step's, which finishes after every
        node, and holds the parameters until then; with CPU nodes its error is
        the first a CPU function raised in this replay."""
        params = self.params
        single = self._single
        if single is not None:
            return stream.graph_launch(self, single, self._single_h, params)
        errors: list[BaseException] = []
        ev: DeviceEvent | None = None
        last = len(self.steps) - 1
        for k, (exe, nodes) in enumerate(self.steps):
            if exe is not None:
                ev = stream.graph_launch(self, exe, self._handles[k], params)
            else:
                ev = stream.cpu_call(run_cpu_nodes, (nodes, params, errors, k == last), {})
        if self._cpu and self.steps[last][0] is not None:
            # The errors of earlier CPU stages reach the replay's event.
            ev = stream.cpu_call(run_cpu_nodes, ((), params, errors, True), {})
        if ev is None:  # an empty graph: a point in stream order all the same
            done = DeviceEvent(None)
            done._done = True
            ev = stream.wait_event(done)
        return ev

    def launch(self, exe: Any, params: GraphParams, raw: Any) -> None:
        """``cuGraphLaunch`` of the stage ``exe`` on the stream ``raw`` with the
        parameters ``params`` (set again first when an update has changed the
        driver graphs since), under the graph's lock; the caller holds the
        stream's submit lock. Enqueues and returns."""
        with self.lock:
            if self.applied[0] is not params.serials:
                self._apply(params)
            err = cu.cuGraphLaunch(exe, raw)[0]
        if err != _SUCCESS:
            raise _error(err, "cuGraphLaunch")

    def update(self, index: int, op: Any, buffers: Any) -> None:
        """Make node ``index`` do ``op`` in the replays enqueued from now on:
        checked as the node was when instantiated (a kernel's arguments against
        its signature), then set in the driver graph now
        (``cuGraphExec{Kernel,Memcpy,Memset}NodeSetParams``, which the driver
        checks too and which affect only later launches; they do not block on
        the device). Replays enqueued before keep their parameters. A CPU
        function node's new arguments are used by the replays from now on."""
        if isinstance(op, KernelOp):
            _kernel_parts(op)  # (its checks)
        self.backend.make_current()
        with self.lock:
            new = self.params.replaced(index, op, buffers)
            if self.applied[0] is self.params.serials:
                # The driver graphs hold the current version: only this node differs.
                self.applied[0] = None  # (until set: a failure leaves it so)
                carriers = self._exec_nodes.get(index)
                if carriers is not None:
                    _set_params(carriers[0], carriers[1], op)
                self.applied[0] = new.serials
            else:
                self._apply(new)
            self.params = new

    def _apply(self, params: GraphParams) -> None:
        """Set in the driver graphs the parameters of every node whose operation
        in ``params`` differs from what they hold, all of them when that is not
        known (under the lock; a failure leaves ``applied`` unknown, so the next
        launch sets its own version again)."""
        self.backend.make_current()
        was = self.applied[0]
        self.applied[0] = None
        serials = params.serials
        for i, (exe, core_nodes) in self._exec_nodes.items():
            if was is not None and was[i] == serials[i]:
                continue
            _set_params(exe, core_nodes, params.ops[i])
        self.applied[0] = serials


def _kernel_parts(op: KernelOp) -> tuple[Any, Any]:
    """A kernel node's loaded kernel and its arguments as cuda.core takes them,
    checked as a graph's kernel node must be (a plain launch, no structured
    scalar, the arguments against the kernel's signature)."""
    fn = op.fn
    impl = fn._impl
    if impl is None:
        raise UnsupportedError(f"{fn!r} was released")
    if op.cfg.dims is None:
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
    return impl.kernel, _kernel_args(plan, op.args, op.fn._ctx._state)


def _instantiate(
    nodes: list[DeviceGraphNode], ops: tuple[Any, ...]
) -> tuple[Any, dict[int, list[Any]]]:
    """One device stage as an executable driver graph (``cuGraphInstantiate``),
    and the cuda.core nodes that carry each graph node's parameters. Edges from
    nodes of earlier stages are left out: the stages run in stream order."""
    from cuda.core.graph import GraphDefinition as CoreGraphDefinition

    gd = CoreGraphDefinition()
    made: dict[int, Any] = {}
    carriers: dict[int, list[Any]] = {}
    for n in nodes:
        preds = [made[i] for i in n._deps if i in made]
        if not preds:
            base: Any = gd
        elif len(preds) == 1:
            base = preds[0]
        else:
            base = preds[0].join(*preds[1:])
        made[n._index], core_nodes = _add(gd, base, n, ops[n._index])
        if core_nodes:
            carriers[n._index] = core_nodes
    return gd.instantiate(), carriers


def _add(gd: Any, base: Any, n: DeviceGraphNode, op: Any) -> tuple[Any, list[Any]]:
    """Add node ``n`` doing ``op`` after ``base`` (a node, or the definition
    ``gd`` for a root): the node later nodes follow, and the nodes that carry
    its parameters."""
    if n.kind == KERNEL:
        kernel, kargs = _kernel_parts(op)
        node = base.launch(op.cfg.cc, kernel, *kargs)
        return node, [node]
    if n.kind == COPY and op.nbytes:
        node = base.memcpy(op.dst._ptr, op.src._ptr, op.nbytes)
        return node, [node]
    if n.kind == MEMSET and op.count:
        raw = op.value.tobytes()  # the element's bytes, as the buffer holds them
        ptr = op.dst._ptr
        if len(raw) in (1, 2, 4):
            node = base.memset(ptr, raw, op.count)
            return node, [node]
        # 8-byte elements: two 4-byte memsets of every other word (rows of one
        # 4-byte element, 8 bytes apart), as cuMemsetD2D32 does for enqueue_memset.
        lo = base.memset(ptr, raw[:4], 1, op.count, 8)
        hi = base.memset(ptr + 4, raw[4:], 1, op.count, 8)
        return lo.join(hi), [lo, hi]
    assert n.kind in (EMPTY, COPY, MEMSET)  # (a join, or nothing to copy or set)
    return (gd.empty() if base is gd else base.join()), []


def _set_params(exe: Any, core_nodes: list[Any], op: Any) -> None:
    """Give the nodes ``core_nodes`` of the executable graph ``exe`` the
    parameters of ``op``, as ``_add`` made them (cuda.core's ``exe[node].update``:
    ``cuGraphExecKernelNodeSetParams``, ``cuGraphExecMemcpyNodeSetParams``,
    ``cuGraphExecMemsetNodeSetParams``)."""
    if isinstance(op, KernelOp):
        kernel, kargs = _kernel_parts(op)
        exe[core_nodes[0]].update(config=op.cfg.cc, kernel=kernel, args=tuple(kargs))
        return
    if isinstance(op, CopyOp):
        exe[core_nodes[0]].update(dst=op.dst._ptr, src=op.src._ptr, size=op.nbytes)
        return
    raw = op.value.tobytes()
    ptr = op.dst._ptr
    if len(core_nodes) == 1:
        exe[core_nodes[0]].update(dst=ptr, value=raw, width=op.count, height=1, pitch=0)
        return
    lo, hi = core_nodes
    exe[lo].update(dst=ptr, value=raw[:4], width=1, height=op.count, pitch=8)
    exe[hi].update(dst=ptr + 4, value=raw[4:], width=1, height=op.count, pitch=8)
