"""A recorded ``Trace`` as a timeline picture.

``draw_timeline`` draws with matplotlib (the ``plot`` extra: ``pip install
asyncgpu[plot]``) one horizontal lane per stream, a bar per operation coloured
by kind, an arrow per cross-stream wait, time in ms. It takes a ``Trace``, a
path to a JSON file written by ``write_chrome_trace``, or that file's loaded
``dict``. The JSON itself (its format is described in
``asyncgpu._core.trace_json``) is re-exported here for the command line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._core.trace import Trace
from .._core.trace_json import (
    PathLike,
    _lane_order,
    _span_ns,
    chrome_trace_dict,
    load_chrome_trace,
    write_chrome_trace,
)

__all__ = [
    "chrome_trace_dict",
    "draw_timeline",
    "load_chrome_trace",
    "timeline_of",
    "write_chrome_trace",
]

#: Bar colours of the timeline, by operation kind.
KIND_COLOURS: dict[str, str] = {
    "copy": "#4c78a8",
    "kernel": "#f58518",
    "cpu": "#54a24b",
    "cpu_range": "#88d27a",
    "memset": "#b279a2",
    "wait": "#bab0ac",
}
_OTHER_COLOUR = "#e45756"


# -- timeline model -------------------------------------------------------------------


@dataclass
class _Op:
    id: int
    lane: str
    kind: str
    label: str
    start_ms: float
    end_ms: float
    error: str | None = None


@dataclass
class Timeline:
    """What ``draw_timeline`` draws: lanes in order, operations and wait edges."""

    lanes: list[str] = field(default_factory=list)
    ops: list[_Op] = field(default_factory=list)
    waits: list[tuple[int, int]] = field(default_factory=list)


def _timeline_from_trace(trace: Trace) -> Timeline:
    trace.device_times()
    with trace._lock:
        nodes = list(trace.nodes.values())
        edges = list(trace.edges)
        lanes = list(trace.streams)
    t0 = trace.t0_ns
    tl = Timeline(lanes=lanes)
    for n in sorted(nodes, key=lambda n: n.id):
        if n.stream not in tl.lanes:
            tl.lanes.append(n.stream)
        start, end = _span_ns(n)
        tl.ops.append(
            _Op(n.id, n.stream, n.kind, n.label, (start - t0) / 1e6, (end - t0) / 1e6, n.error)
        )
    tl.lanes.sort(key=_lane_order)
    tl.waits = [(e.src, e.dst) for e in edges if e.kind == "wait"]
    return tl


def _timeline_from_json(data: Mapping[str, Any]) -> Timeline:
    events = data.get("traceEvents", [])
    procs: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for ev in events:
        if ev.get("ph") != "M":
            continue
        name = (ev.get("args") or {}).get("name")
        if ev.get("name") == "process_name" and name is not None:
            procs[ev.get("pid", 0)] = str(name)
        elif ev.get("name") == "thread_name" and name is not None:
            threads[(ev.get("pid", 0), ev.get("tid", 0))] = str(name)

    def lane_of(ev: Mapping[str, Any]) -> str:
        args = ev.get("args") or {}
        if isinstance(args.get("stream"), str):
            return args["stream"]
        pid, tid = ev.get("pid", 0), ev.get("tid", 0)
        proc = procs.get(pid, f"pid {pid}")
        return f"{proc}/{threads.get((pid, tid), f'tid {tid}')}"

    named: dict[tuple[int, int], str] = {}
    for ev in events:
        stream = (ev.get("args") or {}).get("stream")
        if ev.get("ph") == "X" and isinstance(stream, str):
            named.setdefault((ev.get("pid", 0), ev.get("tid", 0)), stream)

    tl = Timeline()
    # Lanes in the order of their metadata, so an empty stream keeps its row.
    for (pid, tid), thread in threads.items():
        lane = named.get((pid, tid)) or f"{procs.get(pid, f'pid {pid}')}/{thread}"
        if lane not in tl.lanes:
            tl.lanes.append(lane)
    by_slice: dict[tuple[int, int], list[_Op]] = {}
    next_id = 0
    for ev in events:
        if ev.get("ph") != "X":
            continue
        args = ev.get("args") or {}
        nid = args.get("id")
        if not isinstance(nid, int):
            nid = -1 - next_id
        next_id += 1
        lane = lane_of(ev)
        if lane not in tl.lanes:
            tl.lanes.append(lane)
        ts = float(ev.get("ts", 0.0))
        dur = float(ev.get("dur", 0.0))
        op = _Op(
            nid,
            lane,
            str(args.get("kind", ev.get("cat", "op"))),
            str(ev.get("name", "")),
            ts / 1e3,
            (ts + dur) / 1e3,
            args.get("error"),
        )
        tl.ops.append(op)
        by_slice.setdefault((ev.get("pid", 0), ev.get("tid", 0)), []).append(op)

    def enclosing(ev: Mapping[str, Any]) -> _Op | None:
        ms = float(ev.get("ts", 0.0)) / 1e3
        for op in by_slice.get((ev.get("pid", 0), ev.get("tid", 0)), []):
            if op.start_ms <= ms <= op.end_ms + 1e-9:
                return op
        return None

    tl.lanes.sort(key=_lane_order)
    starts: dict[Any, int] = {}
    for ev in events:
        ph = ev.get("ph")
        if ph not in ("s", "f"):
            continue
        args = ev.get("args") or {}
        key = (ev.get("cat"), ev.get("id", ev.get("bind_id")))
        if "src" in args and "dst" in args:
            if ph == "s":
                tl.waits.append((int(args["src"]), int(args["dst"])))
            continue
        bound = enclosing(ev)
        if bound is None:
            continue
        if ph == "s":
            starts[key] = bound.id
        elif key in starts:
            tl.waits.append((starts.pop(key), bound.id))
    return tl


def timeline_of(trace_or_path: Any) -> Timeline:
    """The lanes, operations and wait edges of a ``Trace``, a trace JSON path or a
    loaded trace ``dict``."""
    from .._core.trace import Trace

    if isinstance(trace_or_path, Trace):
        return _timeline_from_trace(trace_or_path)
    if isinstance(trace_or_path, Mapping):
        return _timeline_from_json(trace_or_path)
    if isinstance(trace_or_path, (str, os.PathLike)):
        return _timeline_from_json(load_chrome_trace(trace_or_path))
    raise TypeError(
        "draw_timeline takes a Trace, a path to a trace JSON file or its loaded dict, "
        f"not {type(trace_or_path).__name__}"
    )


# -- drawing --------------------------------------------------------------------------


def _short_label(label: str, limit: int = 16) -> str:
    text = label.split(" <", 1)[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "drawing a timeline needs matplotlib, which is not installed: "
            'pip install "asyncgpu[plot]"  (or: pip install matplotlib)'
        ) from e
    return matplotlib


def draw_timeline(trace_or_path: Any, png_path: PathLike, title: str | None = None) -> None:
    """Draw a timeline PNG: one lane per stream, a bar per operation coloured by
    kind (failed operations hatched), an arrow per cross-stream wait, time in ms.

    ``trace_or_path`` is a ``Trace``, a path to a trace JSON file, or its loaded
    ``dict``. Needs matplotlib (``pip install asyncgpu[plot]``); it draws with the
    Agg canvas directly, so no GUI backend and no global pyplot state are touched.
    """
    tl = timeline_of(trace_or_path)
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    lanes = tl.lanes or ["(empty)"]
    row = {lane: i for i, lane in enumerate(lanes)}
    height = 1.4 + 0.55 * len(lanes)
    fig = Figure(figsize=(11, height), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)

    end_ms = max((op.end_ms for op in tl.ops), default=1.0)
    start_ms = min((op.start_ms for op in tl.ops), default=0.0)
    span = max(end_ms - start_ms, 1e-6)
    min_w = span * 0.002  # keep very short operations visible
    kinds_seen: list[str] = []
    ops_by_id: dict[int, _Op] = {}
    for op in tl.ops:
        ops_by_id[op.id] = op
        if op.kind not in kinds_seen:
            kinds_seen.append(op.kind)
        y = row[op.lane]
        colour = KIND_COLOURS.get(op.kind, _OTHER_COLOUR)
        width = max(op.end_ms - op.start_ms, min_w)
        ax.barh(
            y,
            width,
            left=op.start_ms,
            height=0.6,
            color=colour,
            edgecolor="black" if op.error else "white",
            hatch="//" if op.error else None,
            linewidth=0.6 if op.error else 0.5,
        )
        if width > span * 0.07:
            text = _short_label(op.label or op.kind)
            ax.text(
                op.start_ms + width / 2,
                y,
                text,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                clip_on=True,
            )

    for src, dst in tl.waits:
        a, b = ops_by_id.get(src), ops_by_id.get(dst)
        if a is None or b is None:
            continue
        ax.annotate(
            "",
            xy=(b.start_ms, row[b.lane]),
            xytext=(a.end_ms, row[a.lane]),
            arrowprops={"arrowstyle": "->", "color": "#333333", "lw": 0.8, "alpha": 0.8},
        )

    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(lanes)
    ax.set_ylim(len(lanes) - 0.4, -0.6)
    ax.set_xlim(min(0.0, start_ms), end_ms + span * 0.02)
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_title(title or f"asyncgpu timeline: {len(tl.ops)} operations on {len(tl.lanes)} streams")
    handles: list[Any] = [
        Patch(facecolor=KIND_COLOURS.get(k, _OTHER_COLOUR), label=k) for k in sorted(kinds_seen)
    ]
    if tl.waits:
        from matplotlib.lines import Line2D

        handles.append(Line2D([0], [0], color="#333333", lw=0.8, label="cross-stream wait"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    p = Path(os.fspath(png_path))
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, format="png")
