"""The dependency graph of enqueued work, recorded while tracing is on.

Nodes are operations; edges are stream order (the previous operation on the same
stream), explicit waits (``enqueue_wait_for``) and the waits that cross-stream
copies insert. With tracing off, the enqueue paths test one attribute and do
nothing else.

Times are nanoseconds of ``time.perf_counter_ns`` on the host: ``submit_ns`` when
the operation was enqueued, ``end_ns`` when its completion was noticed and
``start_ns`` the later of its submission and the end of everything it depends on
(on the CPU device that is when it could start; ``device_start_ns`` /
``device_end_ns`` hold device-measured times where a backend records them).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
        ev._node = node
        ev.add_done_callback(self._on_done)
        return node

    def _on_done(self, ev: DeviceEvent) -> None:
        node = ev._node
        if node is None:
            return
        end = time.perf_counter_ns()
        with self._lock:
            node.end_ns = end
            ready = [self.nodes[d].end_ns for d in node.deps]
            ends = [e for e in ready if e is not None]
            node.start_ns = max([node.submit_ns, *ends]) if ends else node.submit_ns
            if ev._error is not None:
                node.error = f"{type(ev._error).__name__}: {ev._error}"

    # -- reading back ------------------------------------------------------------------

    def node_of(self, ev: DeviceEvent) -> TraceNode | None:
        """The node recorded for ``ev`` (None if it was not traced)."""
        n = ev._node
        return n if isinstance(n, TraceNode) else None

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {
                "t0_ns": self.t0_ns,
                "streams": list(self.streams),
                "nodes": [vars(n).copy() for n in self.nodes.values()],
                "edges": [vars(e).copy() for e in self.edges],
            }
