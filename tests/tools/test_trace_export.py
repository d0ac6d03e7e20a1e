"""asyncgpu._tools.timeline: Chrome/Perfetto trace JSON and the timeline PNG.

Everything runs on the CPU device; the PNG cases skip where matplotlib is not
installed.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from asyncgpu import DeviceContext, Kernel, Trace
from asyncgpu._tools.timeline import (
    chrome_trace_dict,
    draw_timeline,
    load_chrome_trace,
    timeline_of,
    write_chrome_trace,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _double(b, x, n):
    i = b.global_idx.x
    i = i[i < n]
    x[i] *= 2


DOUBLE = Kernel("double", cpu=_double)


def _record(path=None) -> Trace:
    """Two streams, a kernel, copies, a CPU function and two cross-stream waits."""
    with DeviceContext(api="cpu") as ctx:
        s1, s2 = ctx.select_stream(1), ctx.select_stream(2)
        with ctx.trace(path) as t:
            x = ctx.enqueue_create_buffer(np.float32, 1024)
            ctx.enqueue_copy(x, np.ones(1024, np.float32))
            ctx.enqueue_function(DOUBLE, x, np.int32(1024), grid_dim=4, block_dim=256)
            s1.enqueue_wait_for(ctx)
            out = np.empty(1024, np.float32)
            s1.enqueue_copy(out, x)
            total = s1.enqueue_cpu_function(np.sum, out)
            s2.enqueue_wait_for(total)
            s2.enqueue_memset(s2.enqueue_create_buffer(np.int32, 16), 7)
            assert total.synchronize() == 2048.0
        ctx.synchronize()
        s1.synchronize()
        s2.synchronize()
    return t


@pytest.fixture(scope="module")
def trace() -> Trace:
    return _record()


def test_written_file_is_valid_json(tmp_path, trace):
    path = tmp_path / "sub" / "t.json"
    write_chrome_trace(trace, path)
    data = json.loads(path.read_text())
    assert data == load_chrome_trace(path)
    assert isinstance(data["traceEvents"], list)
    assert data["displayTimeUnit"] == "ms"
    for ev in data["traceEvents"]:
        assert {"ph", "pid", "tid"} <= ev.keys()


def test_context_trace_path_writes_the_json(tmp_path):
    path = tmp_path / "ctx.json"
    t = _record(path)
    data = load_chrome_trace(path)
    xs = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(t.nodes)


def test_one_process_and_one_named_lane_per_stream(trace):
    data = chrome_trace_dict(trace)
    meta = [e for e in data["traceEvents"] if e["ph"] == "M"]
    procs = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert list(procs.values()) == ["cpu:0"]
    assert sorted(threads.values()) == ["s0", "s1", "s2"]
    assert len(threads) == len(trace.streams) == 3
    # Every complete event sits on the lane of its stream.
    for ev in data["traceEvents"]:
        if ev["ph"] == "X":
            assert threads[(ev["pid"], ev["tid"])] == ev["args"]["stream"].split("/")[1]


def test_complete_events_carry_the_node(trace):
    data = chrome_trace_dict(trace)
    xs = {e["args"]["id"]: e for e in data["traceEvents"] if e["ph"] == "X"}
    assert set(xs) == set(trace.nodes)
    for nid, node in trace.nodes.items():
        ev = xs[nid]
        assert ev["cat"] == node.kind
        assert ev["args"]["kind"] == node.kind
        assert ev["args"]["nbytes"] == node.nbytes
        assert ev["args"]["deps"] == node.deps
        assert ev["args"]["error"] is None
        assert ev["ts"] >= 0 and ev["dur"] > 0
        start = node.start_ns if node.start_ns is not None else node.submit_ns
        assert ev["ts"] == pytest.approx((start - trace.t0_ns) / 1e3, abs=1e-3)
    kinds = {e["cat"] for e in xs.values()}
    assert {"copy", "kernel", "cpu", "wait", "memset"} <= kinds


def test_flow_events_for_every_wait_edge(trace):
    data = chrome_trace_dict(trace)
    waits = [e for e in trace.edges if e.kind == "wait"]
    assert len(waits) >= 2
    starts = [e for e in data["traceEvents"] if e["ph"] == "s"]
    finishes = [e for e in data["traceEvents"] if e["ph"] == "f"]
    assert len(starts) == len(finishes) == len(waits)
    xs = {e["args"]["id"]: e for e in data["traceEvents"] if e["ph"] == "X"}
    for edge, s, f in zip(waits, starts, finishes, strict=True):
        assert s["id"] == f["id"] and s["cat"] == f["cat"] == "wait"
        assert f["bp"] == "e"
        src, dst = xs[edge.src], xs[edge.dst]
        # each end lies on (and inside) the slice it binds to
        assert (s["pid"], s["tid"]) == (src["pid"], src["tid"])
        assert src["ts"] <= s["ts"] <= src["ts"] + src["dur"]
        assert (f["pid"], f["tid"]) == (dst["pid"], dst["tid"])
        assert dst["ts"] <= f["ts"] <= dst["ts"] + dst["dur"]
        assert (s["args"]["src"], s["args"]["dst"]) == (edge.src, edge.dst)


def test_unfinished_nodes_fall_back_to_submit_time():
    t = Trace()
    t.streams.append("cpu:0/s0")
    from asyncgpu._core.trace import TraceNode

    t.nodes[0] = TraceNode(0, "cpu:0/s0", "kernel", "k", 0, [], t.t0_ns + 5_000)
    data = chrome_trace_dict(t)
    (x,) = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert x["ts"] == pytest.approx(5.0)
    assert x["args"]["incomplete"] is True


def test_timeline_from_json_matches_trace(tmp_path, trace):
    path = tmp_path / "t.json"
    write_chrome_trace(trace, path)
    a, b = timeline_of(trace), timeline_of(path)
    assert a.lanes == b.lanes == ["cpu:0/s0", "cpu:0/s1", "cpu:0/s2"]
    assert sorted(a.waits) == sorted(b.waits)
    assert [(o.id, o.lane, o.kind) for o in a.ops] == [(o.id, o.lane, o.kind) for o in b.ops]


def test_load_rejects_non_trace(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_chrome_trace(bad)
    other = tmp_path / "other.json"
    other.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="traceEvents"):
        load_chrome_trace(other)
    bare = tmp_path / "bare.json"
    bare.write_text("[]")
    assert load_chrome_trace(bare) == {"traceEvents": []}


def test_draw_timeline_rejects_other_types(tmp_path):
    with pytest.raises(TypeError, match="Trace"):
        draw_timeline(42, tmp_path / "x.png")


def test_png_from_trace_and_from_file(tmp_path, trace):
    pytest.importorskip("matplotlib")
    png = tmp_path / "a.png"
    draw_timeline(trace, png, title="test")
    assert png.read_bytes()[:8] == PNG_MAGIC
    path = tmp_path / "t.json"
    write_chrome_trace(trace, path)
    png2 = tmp_path / "deeper" / "b.png"
    draw_timeline(path, png2)
    assert png2.read_bytes()[:8] == PNG_MAGIC
    draw_timeline(str(path), tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_png_of_empty_trace(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "empty.png"
    draw_timeline(Trace(), png)
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_missing_matplotlib_says_how_to_install(tmp_path, trace, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"asyncgpu\[plot\]"):
        draw_timeline(trace, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_failed_operation_records_its_error(tmp_path):
    pytest.importorskip("matplotlib")

    def boom():
        raise RuntimeError("nope")

    with DeviceContext(api="cpu") as ctx, ctx.trace() as t:
        ev = ctx.enqueue_cpu_function(boom)
        with pytest.raises(RuntimeError):
            ev.synchronize()
    data = chrome_trace_dict(t)
    (x,) = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert "RuntimeError: nope" in x["args"]["error"]
    draw_timeline(t, tmp_path / "err.png")
    assert (tmp_path / "err.png").read_bytes()[:8] == PNG_MAGIC
