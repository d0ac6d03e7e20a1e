"""The dependency graph of enqueued work, recorded while tracing is on.

Nodes are operations; edges are stream order (the previous operation on the same
stream), explicit waits (``enqueue_wait_for``) and the waits that cross-stream
copies insert. With tracing off, the enqueue paths test one attribute and do
nothing else.

Times are nanoseconds of ``time.perf_counter_ns`` on the host: ``submit_ns`` when
the operation was enqueued, ``end_ns`` when its completion was noticed and
``start_ns`` the later of its submission and the end of everything it depends on
(when it could start), unless the device stamped when it really started: the CPU
device does, when a pool thread starts the work.
The end is stamped before the operation's event is marked done, so whoever sees
it done finds the node complete.

On CUDA every traced operation is followed by a timing event on its stream, and
``device_end_ns`` is the time the device passed it, on the same host clock (the
trace maps the device's clock once, with an event it waits for: a few
microseconds of error); ``device_start_ns`` is the later of the submission and
the device ends of everything the operation depends on. Device times are read
without blocking when the trace is read (``node_of``, ``as_dict``,
``device_times``, the exports), for the operations the device has finished.

``ctx.trace(device_times=False)`` records no timing events: the device times
stay None, and tracing adds to a launch about half of what device times add
or less, since it skips each operation's ``cuEventRecord`` (see the
performance page).

Tracing asks for no completion of its own: it costs an operation its node (on
CUDA also one ``cuEventRecord``) and its finish one Python call, and ``end_ns``
is noticed whenever something else notices the completion (an await, a
synchronize, the engine's sweep of finished work). A traced kernel launch
keeps the launch's fast path (the C extension calls ``Trace.record`` after
it). The edges are not stored apart from the nodes' ``deps``: ``edges`` builds
them when it is read.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from . import memory as _buffer

if TYPE_CHECKING:
    from .event import DeviceEvent
    from .stream import _StreamImpl

__all__ = ["Trace", "TraceEdge", "TraceNode"]


@dataclass(slots=True)
class TraceNode:
    id: int
    stream: str
    kind: str
    label: str
    nbytes: int
    deps: list[int]
    submit_ns: int
    start_ns: int | None = None
    end_ns: int | None = None
    error: str | None = None
    device_start_ns: int | None = None
    device_end_ns: int | None = None
    # The trace that stamps this node's end (a weak reference: the trace holds
    # its nodes, and a dropped trace must not wait for the garbage collector).
    _trace: Any = field(default=None, repr=False, compare=False)


_NODE_FIELDS = tuple(f.name for f in fields(TraceNode) if not f.name.startswith("_"))


@dataclass(frozen=True)
class TraceEdge:
    src: int
    dst: int
    kind: str  # "stream" (same stream order) or "wait" (a cross-stream edge)


@dataclass
class Trace:
    """The recorded graph: ``nodes`` by id, ``edges``, and the stream lanes."""

    nodes: dict[int, TraceNode] = field(default_factory=dict)
    streams: list[str] = field(default_factory=list)
    path: str | None = None
    device_stamps: bool = True  # CUDA: a timing event after each operation
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # Per lane the last node recorded on it. The edges are not kept apart: they
    # are the nodes' ``deps`` (see ``_edge_tuples``).
    _last: dict[str, int] = field(default_factory=dict, repr=False)
    # CUDA: node id -> (device backend, timing event) not read back yet, and per
    # device backend (by id) the origin of its clock: (backend, event, host ns).
    # Backends, not streams: a trace refers to no stream, so it keeps no context
    # alive (a dropped context's trace is written once the context is freed).
    _stamps: dict[int, tuple[Any, Any]] = field(default_factory=dict, repr=False)
    _origins: dict[int, tuple[Any, Any, int]] = field(default_factory=dict, repr=False)
    t0_ns: int = field(default_factory=time.perf_counter_ns)
    _ref: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._ref = weakref.ref(self)

    @property
    def edges(self) -> list[TraceEdge]:
        """The edges recorded so far, in the order they were recorded (a new list
        on each read)."""
        return [TraceEdge(*e) for e in self._edge_tuples()]

    def _edge_tuples(self) -> list[tuple[int, int, str]]:
        """The edges as (src, dst, kind), in the order they were recorded: each
        node's ``deps`` in order, nodes in id order. A node's first dependency is
        its "stream" edge when it is on the node's own lane (the previous node
        there: a wait never adds that one again, and before it the lane had no
        node); every other dependency is a "wait"."""
        # One step under the GIL: a node's deps are complete before it is added.
        by_id = self.nodes
        out: list[tuple[int, int, str]] = []
        for n in list(by_id.values()):
            deps = n.deps
            if deps:
                first = deps[0]
                out.append((first, n.id, "stream" if by_id[first].stream == n.stream else "wait"))
                out.extend((d, n.id, "wait") for d in deps[1:])
        return out

    # -- the enqueue paths' part (hot while tracing: keep it short) ----------------------

    def record(
        self,
        stream: _StreamImpl,
        ev: DeviceEvent,
        kind: str,
        label: str = "",
        nbytes: int = 0,
        waits: tuple[DeviceEvent, ...] = (),
        after_lanes: tuple[str, ...] = (),
    ) -> TraceNode:
        now = time.perf_counter_ns()
        stamp = None
        if stream.device_clock and self.device_stamps:
            backend = stream.backend  # type: ignore[attr-defined]
            if id(backend) not in self._origins:
                event, host_ns = backend.trace_clock()  # (before the first stamp it maps)
                with self._lock:
                    self._origins.setdefault(id(backend), (backend, event, host_ns))
            stamp = stream.trace_stamp()
        lane = stream.label
        with self._lock:
            nodes, last = self.nodes, self._last
            nid = len(nodes)
            prev = last.get(lane)
            if prev is None:
                deps = []
                if lane not in self.streams:
                    self.streams.append(lane)
            else:
                deps = [prev]
            if waits or after_lanes:
                self._wait_edges(deps, waits, after_lanes)
            node = TraceNode(nid, lane, kind, label or kind, nbytes, deps, now, _trace=self._ref)
            nodes[nid] = node
            last[lane] = nid
            if stamp is not None:
                self._stamps[nid] = (backend, stamp)
        # No waiter and no done callback: the trace asks for no marker and no
        # watch of its own (that would make every traced launch cost several
        # times as much). The event's finish calls ``_on_done`` (through
        # ``DeviceEvent._trace_end``) before it marks the event done, so nobody
        # who sees the event done, an awaiting task included, finds the node
        # without its end. Finished before the node was attached: stamped here
        # (both may run; the first stamp stands).
        ev._node = node
        if ev._done:
            self._on_done(ev)
        return node

    def _wait_edges(
        self,
        deps: list[int],
        waits: tuple[DeviceEvent, ...],
        after_lanes: tuple[str, ...],
    ) -> None:
        """Under ``_lock``: add to ``deps`` the "wait" edges of a new node: from the
        nodes of the events it waits for (those traced here) and from what was
        traced last on the lanes it orders after."""
        nodes = self.nodes
        sources: list[int | None] = []
        for w in waits:
            n = w._node
            sources.append(n.id if isinstance(n, TraceNode) and nodes.get(n.id) is n else None)
        sources += [self._last.get(other) for other in after_lanes]
        for src in sources:
            if src is not None and src not in deps:
                deps.append(src)

    def _on_done(self, ev: DeviceEvent) -> None:
        node = ev._node
        if node is None:
            return
        end = time.perf_counter_ns()
        with self._lock:
            if node.end_ns is None:
                deps, nodes = node.deps, self.nodes
                if not deps or (len(deps) == 1 and nodes[deps[0]].end_ns is not None):
                    # (the usual case: what it follows on its stream was seen first)
                    start = sub = node.submit_ns
                    node.end_ns = end = end if end > sub else sub
                    if node.start_ns is not None:  # (stamped where the work began)
                        start = node.start_ns
                    elif deps:
                        dep_end: int = nodes[deps[0]].end_ns  # type: ignore[assignment]
                        if dep_end > start:
                            start = dep_end
                    node.start_ns = start if start < end else end
                else:
                    self._noticed(node, end)
            if ev._error is not None:
                node.error = f"{type(ev._error).__name__}: {ev._error}"

    def _noticed(self, node: TraceNode, now: int) -> None:
        """Under ``_lock``: ``node`` is seen finished at ``now``, and so is every
        operation it depends on that nobody has seen finish yet (completions are
        noticed in no particular order across streams, and a node's start must not
        come before the end of what it waited for). Each gets its end, then its
        start: the later of its submission and its dependencies' ends."""
        nodes = self.nodes
        stack = [node]
        while stack:
            n = stack[-1]
            if n.end_ns is not None:
                stack.pop()
                continue
            todo = [nodes[d] for d in n.deps if nodes[d].end_ns is None]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            n.end_ns = end = max(now, n.submit_ns)
            if n.start_ns is not None:  # (stamped where the work began)
                n.start_ns = min(n.start_ns, end)
            else:
                n.start_ns = _start_ns(n, end, [nodes[d].end_ns for d in n.deps])

    def device_times(self) -> None:
        """Fill ``device_start_ns`` / ``device_end_ns`` of every node whose end the
        device has passed (CUDA; ``cuEventElapsedTime``, never blocks). Reading
        the trace (``node_of``, ``as_dict``, the exports) does it too."""
        if self._stamps:
            with self._lock:
                self._read_stamps()

    def __del__(self) -> None:
        # The clocks' origins and the stamps nobody read back: their events go back
        # to their device (not once the interpreter exits: the driver's objects may
        # be gone, see _buffer; nor once this module's globals are cleared).
        try:
            if _buffer._BufferBase._exiting:
                return
        except AttributeError:
            return
        events = list(self._stamps.values())
        events += [(b, e) for b, e, _ in self._origins.values()]
        for backend, event in events:
            with contextlib.suppress(Exception):  # (a finalizer raises nothing)
                backend.drop_stamp(event)
        self._stamps.clear()
        self._origins.clear()

    def _read_stamps(self) -> None:
        """Under ``_lock``: read back the timing events the device has passed, in
        node order (``_stamps`` is filled in that order), so that a node's
        dependencies have their device ends first."""
        for nid, (backend, stamp) in list(self._stamps.items()):
            _, origin, origin_ns = self._origins[id(backend)]
            ns = backend.stamp_ns(origin, stamp)
            if ns is None:
                continue
            del self._stamps[nid]
            node = self.nodes[nid]
            node.device_end_ns = end = origin_ns + ns
            node.device_start_ns = _start_ns(
                node, end, [self.nodes[d].device_end_ns for d in node.deps]
            )

    # -- reading back ------------------------------------------------------------------

    def node_of(self, ev: DeviceEvent) -> TraceNode | None:
        """The node recorded for ``ev`` (None if it was not traced)."""
        n = ev._node
        if isinstance(n, TraceNode):
            self.device_times()
            return n
        return None

    def as_dict(self) -> dict[str, Any]:
        self.device_times()
        with self._lock:
            return {
                "t0_ns": self.t0_ns,
                "streams": list(self.streams),
                "nodes": [{f: getattr(n, f) for f in _NODE_FIELDS} for n in self.nodes.values()],
                "edges": [dict(src=a, dst=b, kind=k) for a, b, k in self._edge_tuples()],
            }


def _start_ns(node: TraceNode, end: int, dep_ends: list[int | None]) -> int:
    """When ``node`` started: the later of its submission and the ends of what it
    depends on (those known), and no later than its own ``end``."""
    return min(end, max([node.submit_ns, *(e for e in dep_ends if e is not None)]))
