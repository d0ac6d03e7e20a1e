"""The dependency graph of enqueued work, recorded while tracing is on.

Nodes are operations; edges are stream order (the previous operation on the same
stream), explicit waits (``enqueue_wait_for``) and the waits that cross-stream
copies insert. With tracing off, the enqueue paths test one attribute and do
nothing else.

Times are nanoseconds of ``time.perf_counter_ns`` on the host: ``submit_ns`` when
the operation was enqueued, ``end_ns`` when its completion was noticed and
``start_ns`` the later of its submission and the end of everything it depends on
(on the CPU device that is when it could start).

On CUDA every traced operation is followed by a timing event on its stream, and
``device_end_ns`` is the time the device passed it, on the same host clock (the
trace maps the device's clock once, with an event it waits for: a few
microseconds of error); ``device_start_ns`` is the later of the submission and
the device ends of everything the operation depends on. Device times are read
without blocking when the trace is read (``node_of``, ``as_dict``,
``device_times``, the exports), for the operations the device has finished.

Tracing asks for no completion of its own: it costs an operation its node (and
on CUDA one ``cuEventRecord``), and ``end_ns`` is noticed whenever something
else notices the completion (an await, a synchronize, the engine's sweep of
finished work).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import _buffer

if TYPE_CHECKING:
    from ._event import DeviceEvent
    from ._stream import _StreamImpl

__all__ = ["Trace", "TraceEdge", "TraceNode"]


@dataclass
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


@dataclass(frozen=True)
class TraceEdge:
    src: int
    dst: int
    kind: str  # "stream" (same stream order) or "wait" (a cross-stream edge)


@dataclass
class Trace:
    """The recorded graph: ``nodes`` by id, ``edges``, and the stream lanes."""

    nodes: dict[int, TraceNode] = field(default_factory=dict)
    edges: list[TraceEdge] = field(default_factory=list)
    streams: list[str] = field(default_factory=list)
    path: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _by_event: dict[int, int] = field(default_factory=dict, repr=False)
    _last: dict[str, int] = field(default_factory=dict, repr=False)
    # CUDA: node id -> (stream, timing event) not read back yet, and per device
    # backend (by id) the origin of its clock: (backend, event, host ns).
    _stamps: dict[int, tuple[Any, Any]] = field(default_factory=dict, repr=False)
    _origins: dict[int, tuple[Any, Any, int]] = field(default_factory=dict, repr=False)
    t0_ns: int = field(default_factory=time.perf_counter_ns)

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
        if stream.device_clock:
            backend = stream.backend  # type: ignore[attr-defined]
            if id(backend) not in self._origins:
                event, host_ns = backend.trace_clock()  # (before the first stamp it maps)
                with self._lock:
                    self._origins.setdefault(id(backend), (backend, event, host_ns))
            stamp = stream.trace_stamp()
        with self._lock:
            nid = len(self.nodes)
            lane = stream.label
            if lane not in self.streams:
                self.streams.append(lane)
            deps: list[int] = []
            prev = self._last.get(lane)
            if prev is not None:
                deps.append(prev)
                self.edges.append(TraceEdge(prev, nid, "stream"))
            sources = [self._by_event.get(id(w)) for w in waits]
            sources += [self._last.get(other) for other in after_lanes]
            for src in sources:
                if src is not None and src not in deps:
                    deps.append(src)
                    self.edges.append(TraceEdge(src, nid, "wait"))
            node = TraceNode(nid, lane, kind, label or kind, nbytes, deps, now)
            self.nodes[nid] = node
            self._by_event[id(ev)] = nid
            self._last[lane] = nid
            if stamp is not None:
                self._stamps[nid] = (stream, stamp)
        ev._node = node
        # A waiter, not add_done_callback: the trace asks for no marker and no
        # watch of its own (that made every traced launch cost about 5x).
        if ev._done or not ev._add_waiter(self._on_done):
            self._on_done(ev)
        return node

    def _on_done(self, ev: DeviceEvent) -> None:
        node = ev._node
        if node is None:
            return
        end = time.perf_counter_ns()
        with self._lock:
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
        events = [(s.backend, e) for s, e in self._stamps.values()]
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
        for nid, (stream, stamp) in list(self._stamps.items()):
            backend, origin, origin_ns = self._origins[id(stream.backend)]
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
                "nodes": [vars(n).copy() for n in self.nodes.values()],
                "edges": [vars(e).copy() for e in self.edges],
            }


def _start_ns(node: TraceNode, end: int, dep_ends: list[int | None]) -> int:
    """When ``node`` started: the later of its submission and the ends of what it
    depends on (those known), and no later than its own ``end``."""
    return min(end, max([node.submit_ns, *(e for e in dep_ends if e is not None)]))
