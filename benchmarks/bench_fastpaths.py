"""asyncgpu's launch, copy, allocation, compile and overlap paths on the GPU
(issue 5). Each function returns a flat dict; ``run.py`` sets them against the
peers measured in the same run.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncgpu as ag

SRC = r"""
extern "C" __global__ void empty() {}
extern "C" __global__ void axpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void scale(float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    for (; i < n; i += gridDim.x * blockDim.x) x[i] = a * x[i];
}
extern "C" __global__ void spin_ns(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""

rng = np.random.default_rng()


def _median_per_call_us(fn: Any, calls: int, rounds: int, sync: Any) -> dict[str, float]:
    per: list[float] = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter_ns()
        sync()
        per.append((t1 - t0) / calls / 1e3)
    return {"median_us": statistics.median(per), "min_us": min(per)}


def launch(ctx: ag.DeviceContext, quick: bool) -> dict[str, float]:
    """Host cost of ``enqueue_function`` (with the DeviceEvent it returns)."""
    empty = ctx.compile_function(SRC, "empty")
    axpy = ctx.compile_function(SRC, "axpy")
    n = 1 << 10
    x = ctx.enqueue_create_buffer(np.float32, n)
    y = ctx.enqueue_create_buffer(np.float32, n)
    ctx.enqueue_copy(x, rng.standard_normal(n).astype(np.float32))
    ctx.enqueue_copy(y, rng.standard_normal(n).astype(np.float32))
    a, nn = np.float32(1.0001), np.int32(n)
    calls, rounds = (2000, 5) if quick else (10000, 15)
    for _ in range(2000):
        ctx.enqueue_function(axpy, a, x, y, nn, grid_dim=4, block_dim=256)
        ctx.enqueue_function(empty, grid_dim=1, block_dim=1)
    e = _median_per_call_us(
        lambda: ctx.enqueue_function(empty, grid_dim=1, block_dim=1), calls, rounds, ctx.synchronize
    )
    f = _median_per_call_us(
        lambda: ctx.enqueue_function(axpy, a, x, y, nn, grid_dim=4, block_dim=256),
        calls,
        rounds,
        ctx.synchronize,
    )
    pairs = _alternating_rounds(ctx, empty, axpy, x, y, a, nn, calls, rounds)
    traced = {}
    for device_times in (True, False):
        with ctx.trace(device_times=device_times):
            traced[device_times] = _median_per_call_us(
                lambda: ctx.enqueue_function(empty, grid_dim=1, block_dim=1),
                calls // 4,
                3,
                ctx.synchronize,
            )
    return {
        "empty_median_us": e["median_us"],
        "empty_min_us": e["min_us"],
        "axpy4_median_us": f["median_us"],
        "axpy4_min_us": f["min_us"],
        "empty_traced_median_us": traced[True]["median_us"],
        "empty_traced_host_only_median_us": traced[False]["median_us"],
        **pairs,
    }


def _alternating_rounds(
    ctx: ag.DeviceContext,
    empty: Any,
    axpy: Any,
    x: Any,
    y: Any,
    a: np.float32,
    nn: np.int32,
    calls: int,
    rounds: int,
) -> dict[str, Any]:
    """``enqueue_function`` and the peers' launches of the same kernels (cuda.core's
    ``launch`` with the same geometry and argument types; with 4 arguments also
    CuPy's ``RawKernel`` and PyTorch's ``add_``, where they import), timed in
    alternating rounds in this one process, so that the CPU's clock and the
    process's state are the same for all (the peers' section of the run times
    them in another phase, whose host speed has differed by up to 15%). Garbage
    collection stays on for all, as in an application.

    Keys: ``paired_{who}{kind}_median_us`` with ``who`` "" (asyncgpu), "core_",
    "cupy_" and ``kind`` "empty" or "axpy4"; ``paired_torch_add_median_us``
    (in the 4-argument rounds); and each one's collector pauses and passes."""
    try:
        from cuda.core import Device, LaunchConfig
        from cuda.core import launch as core_launch
    except ImportError:
        return {}
    dev = Device(ctx.id())
    dev.set_current()
    cs = dev.create_stream()
    n = int(nn)
    cx, cy = dev.allocate(n * 4, stream=cs), dev.allocate(n * 4, stream=cs)
    cs.sync()
    k_empty, k_axpy = empty._impl.kernel, axpy._impl.kernel
    one, four = LaunchConfig(grid=1, block=1), LaunchConfig(grid=4, block=256)
    Timed = tuple[str, Callable[[], Any], Callable[[], Any]]  # (key, launch, sync)
    cases: dict[str, list[Timed]] = {
        "empty": [
            (
                "empty",
                lambda: ctx.enqueue_function(empty, grid_dim=1, block_dim=1),
                ctx.synchronize,
            ),
            ("core_empty", lambda: core_launch(cs, one, k_empty), cs.sync),
        ],
        "axpy4": [
            (
                "axpy4",
                lambda: ctx.enqueue_function(axpy, a, x, y, nn, grid_dim=4, block_dim=256),
                ctx.synchronize,
            ),
            ("core_axpy4", lambda: core_launch(cs, four, k_axpy, a, cx, cy, nn), cs.sync),
        ],
    }
    out: dict[str, Any] = {}
    keep: list[Any] = []  # the peers' arrays, alive until every round has run
    restore: list[Callable[[], Any]] = []
    try:
        import cupy as cp

        with cp.cuda.Device(ctx.id()):
            kernel = cp.RawKernel(SRC, "axpy")
            px = cp.asarray(rng.standard_normal(n).astype(np.float32))
            py = cp.asarray(rng.standard_normal(n).astype(np.float32))
            cp.cuda.Device(ctx.id()).synchronize()
            cstream = cp.cuda.Stream(non_blocking=True)
            cargs = (a, px, py, nn)
            # RawKernel launches on CuPy's current stream (of this thread): this
            # one until the rounds end; no other launch here reads it.
            cstream.use()
            restore.append(cp.cuda.Stream.null.use)

            def cupy_launch() -> None:
                kernel((4,), (256,), cargs)

            cupy_launch()
            cstream.synchronize()
        keep += [kernel, px, py, cstream]
        cases["axpy4"].append(("cupy_axpy4", cupy_launch, cstream.synchronize))
    except Exception as e:  # not installed, or no device for it: a row that says so
        out["paired_cupy_unavailable"] = f"{type(e).__name__}: {e}"[:200]
    try:
        import torch

        t = torch.zeros(n, device=f"cuda:{ctx.id()}")
        t.add_(1)
        torch.cuda.synchronize()
        keep.append(t)
        cases["axpy4"].append(("torch_add", lambda: t.add_(1), torch.cuda.synchronize))
    except Exception as e:
        out["paired_torch_unavailable"] = f"{type(e).__name__}: {e}"[:200]
    try:
        for timed in cases.values():
            per: dict[str, list[float]] = {key: [] for key, _, _ in timed}
            gcs = {key: _harness.GcRecorder() for key, _, _ in timed}
            for _ in range(rounds):
                for key, fn, sync in timed:
                    with gcs[key]:
                        per[key].append(_median_per_call_us(fn, calls, 1, sync)["median_us"])
            for key, values in per.items():
                out[f"paired_{key}_median_us"] = statistics.median(values)
                # The collector's share: its pauses per launch, its passes by
                # generation, over every round.
                rec = gcs[key]
                out[f"paired_{key}_gc_pause_us_per_call"] = rec.pause_s * 1e6 / (calls * rounds)
                out[f"paired_{key}_gc_passes"] = list(rec.passes)
    finally:
        cs.sync()
        cx.close(cs)
        cy.close(cs)
        cs.close()
        for undo in restore:
            undo()
        del keep
    return out


def _event_time_gbps(ctx: ag.DeviceContext, op: Any, nbytes: int, reps: int) -> float:
    start = ctx.create_event(disable_timing=False)
    end = ctx.create_event(disable_timing=False)
    s = ctx.stream()
    gbps = []
    for _ in range(reps):
        s.record_event(start)
        op()
        s.record_event(end)
        end.synchronize()
        gbps.append(nbytes / (start.elapsed_time(end) * 1e-3) / 1e9)
    return statistics.median(gbps)


def copies(ctx: ag.DeviceContext, quick: bool) -> dict[str, float]:
    """Bandwidth of ``enqueue_copy`` for 512 MiB (pinned both ways, D2D, pageable)."""
    nbytes = (64 if quick else 512) << 20
    n = nbytes // 4
    reps = 3 if quick else 10
    host = ctx.enqueue_create_host_buffer(np.float32, n)
    d1 = ctx.enqueue_create_buffer(np.float32, n)
    d2 = ctx.enqueue_create_buffer(np.float32, n)
    ctx.synchronize()
    src = rng.standard_normal(n).astype(np.float32)
    host.as_numpy()[:] = src
    h2d = _event_time_gbps(ctx, lambda: ctx.enqueue_copy(d1, host), nbytes, reps)
    d2h = _event_time_gbps(ctx, lambda: ctx.enqueue_copy(host, d1), nbytes, reps)
    # As the peer (peers_gpu.copy_d2d): 4 copies per timed window.
    d2d = _event_time_gbps(
        ctx, lambda: [ctx.enqueue_copy(d2, d1) for _ in range(4)], 2 * nbytes * 4, reps
    )
    check = np.empty(n, np.float32)
    ctx.enqueue_copy(check, d2).synchronize()
    if not np.array_equal(check, src):
        raise AssertionError("copied data differs from the source")
    pageable = []
    for _ in range(max(2, reps // 2)):
        t0 = time.perf_counter()
        ctx.enqueue_copy(d1, src).synchronize()
        pageable.append(nbytes / (time.perf_counter() - t0) / 1e9)
    pageable_d2h = []
    for _ in range(max(2, reps // 2)):
        t0 = time.perf_counter()
        ctx.enqueue_copy(check, d1).synchronize()
        pageable_d2h.append(nbytes / (time.perf_counter() - t0) / 1e9)
    if not np.array_equal(check, src):
        raise AssertionError("pageable round trip differs from the source")
    return {
        "h2d_pinned_gbps": h2d,
        "d2h_pinned_gbps": d2h,
        "d2d_gbps": d2d,
        "h2d_pageable_gbps": statistics.median(pageable),
        "d2h_pageable_gbps": statistics.median(pageable_d2h),
        "bytes": nbytes,
    }


def alloc(ctx: ag.DeviceContext, quick: bool) -> dict[str, float]:
    """1 MiB device and pinned host buffers from the pools, created and dropped."""
    reps = 2000 if quick else 10000

    def dev() -> None:
        b = ctx.enqueue_create_buffer(np.uint8, 1 << 20)
        del b

    def host() -> None:
        b = ctx.enqueue_create_host_buffer(np.uint8, 1 << 20)
        del b

    for _ in range(200):
        dev()
        host()
    d = _median_per_call_us(dev, reps // 5, 5, ctx.synchronize)
    h = _median_per_call_us(host, reps // 5, 5, ctx.synchronize)
    out = {"device_1mib_us": d["median_us"], "host_1mib_us": h["median_us"]}
    # The same with the stream keeping no spare buffers: every pair goes to the
    # driver's pool (cuMemAllocFromPoolAsync + cuMemFreeAsync through cuda.core).
    spare = getattr(ctx._impl, "spare", None)
    if spare is not None:
        spare.free(ctx._impl.cs, False)
        room, spare.room = spare.room, 0
        try:
            p = _median_per_call_us(dev, reps // 5, 5, ctx.synchronize)
        finally:
            spare.room = room
        out["device_1mib_no_spare_us"] = p["median_us"]
    return out


def compile_cache(ctx: ag.DeviceContext, quick: bool) -> dict[str, float]:
    """A fresh process compiling a source no cache has seen (NVRTC's load
    included, as a user's first compile pays it), fresh processes hitting the
    on-disk cache for the same source and options (the median of several), a
    compile with NVRTC loaded (the median of three sources), and an in-process
    repeat."""
    src = SRC + f"\n// {time.time_ns()}\n"
    child = textwrap.dedent(
        """
        import sys, time
        from asyncgpu._devices.cuda.compiler import compile_cuda
        src = sys.stdin.read()
        t0 = time.perf_counter()
        m = compile_cuda(src, "axpy", arch=sys.argv[1])
        print(time.perf_counter() - t0, m.cache_hit)
        """
    )

    def fresh_process() -> tuple[float, bool]:
        out = subprocess.run(
            [sys.executable, "-c", child, ctx.default_device_info.arch],
            input=src,
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ),
        ).stdout.split()
        return float(out[0]), out[1] == "True"

    miss, hit = fresh_process()
    if hit:
        raise AssertionError("a new source hit the disk cache")
    hits = [fresh_process() for _ in range(3 if quick else 7)]
    if not all(hit for _, hit in hits):
        raise AssertionError("a fresh process did not hit the disk cache")
    disk = statistics.median(t for t, _ in hits)
    t0 = time.perf_counter()
    ctx.compile_function(src, "axpy")  # this process: from the disk cache
    first_here = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        ctx.compile_function(src, "axpy")
    warm = (time.perf_counter() - t0) / 100
    from asyncgpu._devices.cuda import compiler as _compiler

    loaded = []
    for i in range(3):
        t0 = time.perf_counter()
        _compiler.compile_cuda(
            src + f"//{i}", "axpy", arch=ctx.default_device_info.arch, use_cache=False
        )
        loaded.append(time.perf_counter() - t0)
    cold_compile_only = statistics.median(loaded)
    return {
        "fresh_process_cold_compile_ms": miss * 1e3,
        "fresh_process_disk_hit_ms": disk * 1e3,
        "cold_nvrtc_ms": cold_compile_only * 1e3,
        "compile_function_disk_hit_ms": first_here * 1e3,
        "in_process_repeat_us": warm * 1e6,
    }


def _sixteen_streams(ctx: ag.DeviceContext, reps: int) -> tuple[float, float]:
    """Seconds for one 2 ms one-block kernel on one stream, and for one on each
    of 16 streams (medians of ``reps``)."""
    spin = ctx.compile_function(SRC, "spin_ns")
    ns = np.uint64(2_000_000)
    views = [ctx.select_stream(i % ctx.num_streams()) for i in range(16)]
    extra = [ctx.create_stream() for _ in range(16 - ctx.num_streams())]
    streams = views[: ctx.num_streams()] + [s.context() for s in extra]
    for v in streams:
        v.enqueue_function(spin, np.uint64(1000), grid_dim=1, block_dim=1)
    for v in streams:
        v.synchronize()

    def one() -> float:
        t0 = time.perf_counter()
        ctx.enqueue_function(spin, ns, grid_dim=1, block_dim=1).synchronize()
        return time.perf_counter() - t0

    def many() -> float:
        t0 = time.perf_counter()
        evs = [v.enqueue_function(spin, ns, grid_dim=1, block_dim=1) for v in streams]
        for e in evs:
            e.synchronize()
        return time.perf_counter() - t0

    return statistics.median(one() for _ in range(reps)), statistics.median(
        many() for _ in range(reps)
    )


def _sixteen_streams_child(connections: int, reps: int) -> dict[str, float] | None:
    """The same in a fresh process with ``CUDA_DEVICE_MAX_CONNECTIONS`` set (the
    driver's hardware queues shared by streams; 8 by default), or None."""
    env = dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS=str(connections))
    r = subprocess.run(
        [sys.executable, __file__, "--sixteen-streams-child", str(reps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    if r.returncode != 0:
        return None
    import json

    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def overlap(ctx: ag.DeviceContext, quick: bool) -> dict[str, float]:
    """16 streams each running a 2 ms one-block kernel, against one; and a 4-stream
    H2D + kernel + D2H pipeline against the same work on one stream."""
    scale = ctx.compile_function(SRC, "scale")
    reps = 3 if quick else 10
    t1, t16 = _sixteen_streams(ctx, reps)
    wide = _sixteen_streams_child(32, reps)

    # 32 chunks of 8 MiB, as the raw cuda.bindings peer (peers_gpu.pipeline_streams)
    # moves them; 16 MiB chunks are reported too.
    chunks, chunk_n = (8, 1 << 20) if quick else (32, 2 << 20)
    data = rng.standard_normal(chunks * 2 * chunk_n).astype(np.float32)

    def pipeline(nstreams: int, chunk_n: int = chunk_n) -> float:
        # Each chunk's host buffers are created on (owned by) the stream that uses
        # them, so the automatic cross-stream ordering adds no waits.
        vs = [ctx.select_stream(i) for i in range(nstreams)]
        devs = [v.enqueue_create_buffer(np.float32, chunk_n) for v in vs]
        ins = [
            vs[i % nstreams].enqueue_create_host_buffer(np.float32, chunk_n) for i in range(chunks)
        ]
        outs = [
            vs[i % nstreams].enqueue_create_host_buffer(np.float32, chunk_n) for i in range(chunks)
        ]
        for v in vs:
            v.synchronize()
        for i, h in enumerate(ins):
            h.as_numpy()[:] = data[i * chunk_n : (i + 1) * chunk_n]
        t0 = time.perf_counter()
        evs = []
        for i in range(chunks):
            v = vs[i % nstreams]
            d = devs[i % nstreams]
            v.enqueue_copy(d, ins[i])
            v.enqueue_function(
                scale, d, np.float32(2), np.int32(chunk_n), grid_dim=264, block_dim=256
            )
            evs.append(v.enqueue_copy(outs[i], d))  # held, as an application would
        for e in evs:
            e.synchronize()
        dt = time.perf_counter() - t0
        got = np.concatenate([o.as_numpy() for o in outs])
        if not np.allclose(got, 2 * data[: chunks * chunk_n]):
            raise AssertionError("pipeline output is wrong")
        return dt

    def medians(chunk_n: int) -> tuple[float, float]:
        """Median times on one and four streams, the repeats alternating (drift
        hits both alike)."""
        pipeline(1, chunk_n)
        pipeline(4, chunk_n)
        one, four = [], []
        for _ in range(reps):
            one.append(pipeline(1, chunk_n))
            four.append(pipeline(4, chunk_n))
        return statistics.median(one), statistics.median(four)

    p1, p4 = medians(chunk_n)
    b1, b4 = medians(2 * chunk_n)
    return {
        "one_stream_ms": t1 * 1e3,
        "sixteen_streams_ms": t16 * 1e3,
        "sixteen_over_one": t16 / t1,
        "pipeline_1_stream_ms": p1 * 1e3,
        "pipeline_4_streams_ms": p4 * 1e3,
        "pipeline_speedup": p1 / p4,
        "pipeline_chunk_mib": chunk_n * 4 / 2**20,
        # informational: the same with chunks twice as large
        "pipeline_speedup_double_chunks": b1 / b4,
        # informational: the same with 32 hardware queues (CUDA_DEVICE_MAX_CONNECTIONS)
        **(
            {"sixteen_over_one_32_connections": wide["sixteen_ms"] / wide["one_ms"]} if wide else {}
        ),
    }


if __name__ == "__main__" and sys.argv[1:2] == ["--sixteen-streams-child"]:
    import json

    with ag.DeviceContext(api="cuda") as _ctx:
        _t1, _t16 = _sixteen_streams(_ctx, int(sys.argv[2]))
    print(json.dumps({"one_ms": _t1 * 1e3, "sixteen_ms": _t16 * 1e3}))
