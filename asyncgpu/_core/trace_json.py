"""A recorded ``Trace`` as Chrome/Perfetto trace JSON (the JSON Object Format of
the Trace Event Format, which ``ui.perfetto.dev`` and ``chrome://tracing`` open):

* one process per device context (the part of a stream label before ``/``, e.g.
  ``cuda:0``) and one thread lane per stream (``s0``, ``s1``, ...), named with
  ``process_name`` / ``thread_name`` metadata events;
* one complete event (``"ph": "X"``) per operation, from its ``start_ns`` to its
  ``end_ns`` (``submit_ns`` where those are missing), in microseconds relative to
  ``Trace.t0_ns``; ``args`` carry the node id, stream, kind, nbytes, deps and
  error;
* one flow (``"ph": "s"`` on the source, ``"ph": "f"`` on the destination, sharing
  an ``id``) for every cross-stream ``wait`` edge, so the viewers draw an arrow.

``DeviceContext.trace(path)`` writes it on exit; the timeline picture
(``asyncgpu._tools.timeline``) reads it back. A context's ``ASYNCGPU_TRACE``
trace is written by its ``close()`` or, for a context dropped without one,
once the garbage collector frees it (``TraceFile``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import re
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from .._version import __version__

if TYPE_CHECKING:
    from .trace import Trace

__all__ = [
    "chrome_trace_dict",
    "load_chrome_trace",
    "write_chrome_trace",
    "TraceFile",
    "write_trace_file",
]

PathLike = Union[str, "os.PathLike[str]"]

_MIN_DUR_US = 0.001  # a zero-length operation still gets a visible, bindable slice


# -- lanes -----------------------------------------------------------------------------


def _split_lane(lane: str) -> tuple[str, str]:
    """``"cuda:0/s3"`` -> ``("cuda:0", "s3")``; a label without ``/`` is its own
    process."""
    proc, sep, thread = lane.partition("/")
    return (proc, thread) if sep else (lane, lane)


def _stream_number(thread: str) -> int | None:
    m = re.fullmatch(r"s(\d+)", thread)
    return int(m.group(1)) if m else None


def _lane_order(lane: str) -> tuple[str, float, str]:
    proc, thread = _split_lane(lane)
    n = _stream_number(thread)
    return (proc, float("inf") if n is None else float(n), thread)


def _lane_ids(streams: list[str]) -> dict[str, tuple[int, int]]:
    """A ``(pid, tid)`` for every stream lane: pids count processes from 1 in order
    of appearance; a tid is the stream's pool index where the label has one."""
    pids: dict[str, int] = {}
    used: dict[int, set[int]] = {}
    out: dict[str, tuple[int, int]] = {}
    pending: list[str] = []
    for lane in streams:
        proc, thread = _split_lane(lane)
        pid = pids.setdefault(proc, len(pids) + 1)
        n = _stream_number(thread)
        taken = used.setdefault(pid, set())
        if n is not None and n not in taken:
            taken.add(n)
            out[lane] = (pid, n)
        else:
            pending.append(lane)
    for lane in pending:
        pid = pids[_split_lane(lane)[0]]
        taken = used[pid]
        tid = 1000
        while tid in taken:
            tid += 1
        taken.add(tid)
        out[lane] = (pid, tid)
    return out


# -- Chrome / Perfetto JSON -----------------------------------------------------------


def _span_ns(node: Any) -> tuple[int, int]:
    """The operation's span: the device's times where it measured them (CUDA),
    else the host's."""
    if node.device_end_ns is not None and node.device_start_ns is not None:
        return node.device_start_ns, max(node.device_end_ns, node.device_start_ns)
    start = node.start_ns if node.start_ns is not None else node.submit_ns
    end = node.end_ns if node.end_ns is not None else start
    return start, max(end, start)


def chrome_trace_dict(trace: Trace) -> dict[str, Any]:
    """The Chrome/Perfetto JSON object for ``trace`` (what ``write_chrome_trace``
    writes)."""
    trace.device_times()
    with trace._lock:
        nodes = list(trace.nodes.values())
        edges = list(trace.edges)
        streams = list(trace.streams)
    for n in nodes:
        if n.stream not in streams:
            streams.append(n.stream)
    t0 = trace.t0_ns
    ids = _lane_ids(streams)
    events: list[dict[str, Any]] = []

    procs_seen: set[int] = set()
    for lane in streams:
        pid, tid = ids[lane]
        proc, thread = _split_lane(lane)
        if pid not in procs_seen:
            procs_seen.add(pid)
            events.append(
                {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": proc}}
            )
            events.append(
                {
                    "name": "process_sort_index",
                    "ph": "M",
                    "pid": pid,
                    "tid": 0,
                    "args": {"sort_index": pid},
                }
            )
        events.append(
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}}
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": pid,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )

    spans: dict[int, tuple[float, float]] = {}
    for n in sorted(nodes, key=lambda n: n.id):
        start, end = _span_ns(n)
        ts = round((start - t0) / 1e3, 3)
        dur = max(round((end - start) / 1e3, 3), _MIN_DUR_US)
        spans[n.id] = (ts, dur)
        pid, tid = ids[n.stream]
        args: dict[str, Any] = {
            "id": n.id,
            "stream": n.stream,
            "kind": n.kind,
            "nbytes": n.nbytes,
            "deps": list(n.deps),
            "error": n.error,
            "submit_us": round((n.submit_ns - t0) / 1e3, 3),
        }
        if n.end_ns is None:
            args["incomplete"] = True
        if n.device_start_ns is not None and n.device_end_ns is not None:
            args["device_us"] = (n.device_end_ns - n.device_start_ns) / 1e3
        events.append(
            {
                "name": n.label or n.kind,
                "cat": n.kind,
                "ph": "X",
                "ts": ts,
                "dur": dur,
                "pid": pid,
                "tid": tid,
                "args": args,
            }
        )

    by_id = {n.id: n for n in nodes}
    flow = 0
    for e in edges:
        if e.kind != "wait" or e.src not in spans or e.dst not in spans:
            continue
        flow += 1
        s_ts, s_dur = spans[e.src]
        d_ts, _ = spans[e.dst]
        spid, stid = ids[by_id[e.src].stream]
        dpid, dtid = ids[by_id[e.dst].stream]
        # The start sits just inside the end of the source slice so that viewers
        # bind it to that slice; the finish binds to the enclosing slice ("e").
        common = {"name": "wait", "cat": "wait", "id": flow}
        events.append(
            {
                **common,
                "ph": "s",
                "ts": round(s_ts + s_dur * 0.999, 4),
                "pid": spid,
                "tid": stid,
                "args": {"src": e.src, "dst": e.dst},
            }
        )
        events.append(
            {
                **common,
                "ph": "f",
                "bp": "e",
                "ts": d_ts,
                "pid": dpid,
                "tid": dtid,
                "args": {"src": e.src, "dst": e.dst},
            }
        )

    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": f"asyncgpu {__version__}",
            "t0_ns": str(t0),
            "streams": ", ".join(streams),
            "nodes": str(len(nodes)),
            "edges": str(len(edges)),
        },
    }


def write_chrome_trace(trace: Trace, path: PathLike) -> None:
    """Write ``trace`` as Chrome/Perfetto trace JSON to ``path`` (parent folders
    are created). Open it in ``ui.perfetto.dev`` or ``chrome://tracing``."""
    data = chrome_trace_dict(trace)
    p = Path(os.fspath(path))
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=None, separators=(",", ":"))
        fh.write("\n")
    os.replace(tmp, p)


def load_chrome_trace(path: PathLike) -> dict[str, Any]:
    """Read a trace JSON file (the object format, or a bare list of events, which
    is returned as ``{"traceEvents": [...]}``). Raises ``ValueError`` for a file
    that is not trace JSON."""
    p = Path(os.fspath(path))
    try:
        with open(p, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not JSON: {e}") from None
    if isinstance(data, list):
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{p} is not a Chrome trace (no 'traceEvents' list)")
    return data


# -- the ASYNCGPU_TRACE file of a context ------------------------------------------------


def write_trace_file(trace: Trace, path: str) -> None:
    """Write ``trace`` to ``path`` (``{pid}`` in it: the writing process's id), as a
    context's ``ASYNCGPU_TRACE`` file. A file that cannot be written is logged
    on the ``asyncgpu`` logger, never raised: it must not fail the close (or
    the collection) that writes it."""
    try:
        write_chrome_trace(trace, path.replace("{pid}", str(os.getpid())))
    except Exception as e:
        logging.getLogger("asyncgpu").warning("could not write the trace to %s: %s", path, e)


# Traces of contexts the garbage collector freed, for the writer thread. A
# SimpleQueue's put may be called from a finalizer (it is reentrant: the
# collector may run it on a thread that is inside the queue already, where a
# lock-based queue would deadlock), and the finalizer does nothing else: the
# file is built and written on the writer thread, never by the collector, which
# may run on any thread at any allocation (inside a lock the writing would need).
_dropped: queue.SimpleQueue[tuple[Trace, str] | None] = queue.SimpleQueue()
_writer: threading.Thread | None = None
_writer_lock = threading.Lock()


class TraceFile:
    """A context's ``ASYNCGPU_TRACE`` file: ``trace`` written to ``path`` by
    ``write()`` (the context's ``close()``) or, if ``owner`` (the context's
    state) is freed without one, by the writer thread once the collector has
    freed it. Made when the context is made, which starts the writer thread if
    needed (never from the collector). Not at interpreter exit: a context
    alive then was neither closed nor dropped. (``trace`` must not refer to
    ``owner``, or it would never be freed: a trace refers to no stream or
    context.)"""

    __slots__ = ("_dropped", "path", "trace")

    def __init__(self, owner: Any, trace: Trace, path: str) -> None:
        global _writer
        self.trace, self.path = trace, path
        with _writer_lock:
            if _writer is None or not _writer.is_alive():
                _writer = threading.Thread(
                    target=_write_dropped, name="asyncgpu-trace", daemon=True
                )
                _writer.start()
        self._dropped = weakref.finalize(owner, _dropped.put, (trace, path))
        self._dropped.atexit = False

    def write(self) -> None:
        """Write the file now, on this thread (once: a second call, or one after
        the owner was freed, writes nothing)."""
        if self._dropped.detach() is not None:
            write_trace_file(self.trace, self.path)


def _write_dropped() -> None:
    """The writer thread: each dropped context's trace, in the order they were
    freed, until the exit's ``None``."""
    while (item := _dropped.get()) is not None:
        write_trace_file(*item)


@atexit.register
def _finish_writing() -> None:
    """At exit, the traces queued so far are written before the process ends
    (the writer is a daemon thread, which the exit would stop mid-file)."""
    writer = _writer
    if writer is not None and writer.is_alive():
        _dropped.put(None)
        writer.join(timeout=30)


def _after_fork_in_child() -> None:
    # The parent's writer thread does not exist in a forked child: it starts its own.
    global _writer, _writer_lock
    _writer, _writer_lock = None, threading.Lock()


with contextlib.suppress(AttributeError):  # (no fork on this platform)
    os.register_at_fork(after_in_child=_after_fork_in_child)
