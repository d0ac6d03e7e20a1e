"""Why does asyncgpu's 4-stream H2D + kernel + D2H pipeline gain less over one
stream than the same work through raw cuda.bindings? Variants in one process,
each reported as (one stream) / (four streams), medians of repeats:

* ``raw_*``: cuda.bindings on asyncgpu's own pinned blocks (``cuMemHostAlloc``)
  and device memory, with the bench's in-place ``scale`` kernel:
  ``cuMemcpyHtoDAsync`` / ``cuMemcpyAsync``, a separate device chunk per chunk
  or one per stream, with and without a ``cuStreamWriteValue64`` after each D2H
  (asyncgpu's completion marker), grid 264 or 528.
* ``ag_*``: asyncgpu's ``enqueue_copy`` / ``enqueue_function``, holding every
  D2H event (as the bench does: a marker after each) or none, one device buffer
  per stream or one per chunk.

    python benchmarks/diagnostics/probe_pipeline.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import asyncgpu as ag
from asyncgpu._devices.cuda import driver as _driver

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import environment_info
from bench_fastpaths import SRC  # its in-place "scale" kernel


def ck(r: Any, what: str) -> Any:
    from cuda.bindings import driver as cu

    if r[0] != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what}: {r[0]}")
    return r[1] if len(r) > 1 else None


def run_size(ctx: ag.DeviceContext, chunk_mib: int, reps: int) -> dict[str, dict[str, float]]:
    """Every variant with 32 chunks of ``chunk_mib`` MiB."""
    from cuda.bindings import driver as cu

    scale = ctx.compile_function(SRC, "scale")
    fn = scale._impl.fn
    chunks = 32
    results: dict[str, dict[str, float]] = {}
    chunk_n = (chunk_mib << 20) // 4
    nbytes = chunk_n * 4
    data = np.random.default_rng(1).standard_normal(chunks * chunk_n, dtype=np.float32)
    ins = [ctx.enqueue_create_host_buffer(np.float32, chunk_n) for _ in range(chunks)]
    outs = [ctx.enqueue_create_host_buffer(np.float32, chunk_n) for _ in range(chunks)]
    per_chunk = [ctx.enqueue_create_buffer(np.float32, chunk_n) for _ in range(chunks)]
    ctx.synchronize()
    for i, h in enumerate(ins):
        h.as_numpy()[:] = data[i * chunk_n : (i + 1) * chunk_n]

    raw_streams = [
        ck(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        for _ in range(4)
    ]
    marks = ctx.enqueue_create_host_buffer(np.uint64, 4)
    ctx.synchronize()
    mark_addr = marks._ptr

    def own(n: int) -> None:
        # asyncgpu orders a copy after the owner streams of its buffers:
        # give chunk i's buffers to stream i % n, as the bench does.
        vs = [ctx.select_stream(i) for i in range(n)]
        for i in range(chunks):
            for b in (ins[i], outs[i], per_chunk[i]):
                b.reassign_ownership_to(vs[i % n])
        ctx.synchronize()

    def check() -> None:
        got = np.concatenate([o.as_numpy() for o in outs])
        if not np.allclose(got, 2 * data):
            raise AssertionError("pipeline output is wrong")
        for o in outs:
            o.as_numpy()[:] = 0

    ev_pool = [ck(cu.cuEventCreate(2), "cuEventCreate") for _ in range(chunks)]  # no timing

    def raw(n: int, *, htod: bool, per: bool, marker: str | None, grid: int) -> float:
        ss = raw_streams[:n]
        params = []
        for i in range(chunks):
            d = per_chunk[i] if per else per_chunk[i % n]
            vals = (
                np.array([d._ptr], dtype=np.uint64),
                np.array([2.0], dtype=np.float32),
                np.array([chunk_n], dtype=np.int32),
            )
            ptrs = np.array([v.ctypes.data for v in vals], dtype=np.uint64)
            params.append((vals, ptrs))
        t0 = time.perf_counter()
        for i in range(chunks):
            s = ss[i % n]
            d = per_chunk[i] if per else per_chunk[i % n]
            if htod:
                ck(cu.cuMemcpyHtoDAsync(d._ptr, ins[i]._ptr, nbytes, s), "h2d")
            else:
                ck(cu.cuMemcpyAsync(d._ptr, ins[i]._ptr, nbytes, s), "h2d")
            err = cu.cuLaunchKernel(
                fn, grid, 1, 1, 256, 1, 1, 0, s, int(params[i][1].ctypes.data), 0
            )[0]
            if err != cu.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"launch: {err}")
            if marker == "write64_after_kernel":
                ck(cu.cuStreamWriteValue64(s, mark_addr + 8 * (i % n), i, 0), "write64")
            if htod:
                ck(cu.cuMemcpyDtoHAsync(outs[i]._ptr, d._ptr, nbytes, s), "d2h")
            else:
                ck(cu.cuMemcpyAsync(outs[i]._ptr, d._ptr, nbytes, s), "d2h")
            if marker == "write64":
                ck(cu.cuStreamWriteValue64(s, mark_addr + 8 * (i % n), i, 0), "write64")
            elif marker == "event":
                ck(cu.cuEventRecord(ev_pool[i], s), "cuEventRecord")
        for s in ss:
            ck(cu.cuStreamSynchronize(s), "sync")
        return time.perf_counter() - t0

    def agp(n: int, *, hold: bool, per: bool, grid: int) -> float:
        own(n)
        vs = [ctx.select_stream(i) for i in range(n)]
        t0 = time.perf_counter()
        evs = []
        for i in range(chunks):
            v = vs[i % n]
            d = per_chunk[i] if per else per_chunk[i % n]
            v.enqueue_copy(d, ins[i])
            v.enqueue_function(
                scale, d, np.float32(2), np.int32(chunk_n), grid_dim=grid, block_dim=256
            )
            e = v.enqueue_copy(outs[i], d)
            if hold:
                evs.append(e)
            del e
        if hold:
            for e in evs:
                e.synchronize()
        else:
            for v in vs:
                v.synchronize()
        return time.perf_counter() - t0

    variants: dict[str, Any] = {
        "raw_per_stream": lambda n: raw(n, htod=False, per=False, marker=None, grid=264),
        **{
            f"raw_per_stream_{m}": (
                lambda n, m=m: raw(n, htod=False, per=False, marker=m, grid=264)
            )
            for m in ("write64", "event", "write64_after_kernel")
        },
        "ag_hold_per_stream": lambda n: agp(n, hold=True, per=False, grid=264),
        "ag_nohold_per_stream": lambda n: agp(n, hold=False, per=False, grid=264),
    }
    # Alternate the variants round by round so host drift hits them alike.
    times: dict[str, dict[int, list[float]]] = {k: {1: [], 4: []} for k in variants}
    for f in variants.values():
        f(1)
        f(4)
        check()
    for _ in range(reps):
        for k, f in variants.items():
            for n in (1, 4):
                times[k][n].append(f(n))
    check()
    for k in variants:
        t1 = statistics.median(times[k][1])
        t4 = statistics.median(times[k][4])
        results[f"{k}_{chunk_mib}mib"] = {
            "one_ms": t1 * 1e3,
            "four_ms": t4 * 1e3,
            "speedup": t1 / t4,
            "four_gbps": 2 * chunks * nbytes / t4 / 1e9,
        }
        print(f"{k}_{chunk_mib}mib: {results[f'{k}_{chunk_mib}mib']}", flush=True)
    for s in raw_streams:
        cu.cuStreamDestroy(s)
    for e in ev_pool:
        cu.cuEventDestroy(e)
    return results


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": environment_info(),
    }
    with ag.DeviceContext(api="cuda") as ctx:
        out["device"] = ctx.name()
        results: dict[str, dict[str, float]] = {}

        for chunk_mib in (8, 16):
            results.update(run_size(ctx, chunk_mib, a.reps))
        out["results"] = results
        out["native"] = _driver._native is not None
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
