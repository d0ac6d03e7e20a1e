"""Why a launch can cost more in one phase of the suite than in another.

The suite's ``fast_launch`` phase has timed ``enqueue_function`` up to 1.5x its
own alternating rounds with cuda.core a second later (about 6.4 against
4.2 µs with 4 arguments, in one run on a GPU). This probe times the same launches, round
by round, in a fresh process, after the engine's phases of the suite (run as
``benchmarks/run.py`` runs them), and again later, with what could explain a
difference beside each phase: every thread's CPU time and context switches
(``/proc/self/task``), the device time the rounds' kernels took (driver events
around each round), the stream's marker state, and the watcher thread's work.

    python benchmarks/diagnostics/probe_launch_phases.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CALLS, ROUNDS = 10000, 15


def _threads() -> dict[int, tuple[str, int, int, int]]:
    """tid -> (name, ns on CPU, voluntary, involuntary context switches)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[int, tuple[str, int, int, int]] = {}
    base = Path("/proc/self/task")
    for d in base.iterdir():
        try:
            tid = int(d.name)
            ns = int((d / "schedstat").read_text().split()[0])
            vol = invol = 0
            for line in (d / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    vol = int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    invol = int(line.split()[1])
            comm = (d / "comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue
        out[tid] = (names.get(tid, comm), ns, vol, invol)
    return out


def _thread_delta(
    before: dict[int, tuple[str, int, int, int]], after: dict[int, tuple[str, int, int, int]]
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for tid, (name, ns, vol, invol) in after.items():
        b = before.get(tid, (name, 0, 0, 0))
        if ns - b[1] > 1_000_000 or vol - b[2] > 100:
            rows.append(
                {
                    "thread": name,
                    "tid": tid,
                    "cpu_ms": (ns - b[1]) / 1e6,
                    "voluntary_switches": vol - b[2],
                    "involuntary_switches": invol - b[3],
                }
            )
    rows.sort(key=lambda r: -r["cpu_ms"])
    return rows


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    a = p.parse_args()
    import bench_engine
    import numpy as np
    from _harness import environment_info, report_probe
    from bench_fastpaths import SRC, _alternating_rounds
    from cuda.bindings import driver as drv

    import asyncgpu as ag
    from asyncgpu._core import engine as _engine
    from asyncgpu._devices.cuda import backend as _backend

    out: dict[str, Any] = {"environment": environment_info(), "phases": []}
    ctx = ag.DeviceContext(api="cuda")
    empty = ctx.compile_function(SRC, "empty")
    axpy = ctx.compile_function(SRC, "axpy")
    e_empty = ctx.compile_function(bench_engine.SRC, "empty")
    spin = ctx.compile_function(bench_engine.SRC, "spin")
    n = 1 << 10
    x = ctx.enqueue_create_buffer(np.float32, n)
    y = ctx.enqueue_create_buffer(np.float32, n)
    ctx.enqueue_copy(x, np.random.default_rng().standard_normal(n).astype(np.float32))
    ctx.enqueue_copy(y, np.random.default_rng().standard_normal(n).astype(np.float32))
    af, nn = np.float32(1.0001), np.int32(n)
    s: Any = ctx._impl
    h = drv.CUstream(s.h)
    ev0 = drv.cuEventCreate(0)[1]
    ev1 = drv.cuEventCreate(0)[1]

    def state() -> dict[str, Any]:
        w = _engine.watcher
        return {
            "eager": bool(s._eager),
            "solo": bool(s._queues.solo),
            "live_streams_of_device": len(s._queues.streams),
            "inflight": len(s._inflight),
            "watcher_running": w.running,
            "watcher_pending_streams": len(w._pending),
            "watcher_sweep_streams": len(w._sweep),
            "threads": threading.active_count(),
        }

    def rounds(label: str, fn: Any) -> dict[str, Any]:
        host: list[float] = []
        first: list[float] = []
        dev: list[float] = []
        sync_ms: list[float] = []
        st = state()
        before = _threads()
        t_start = time.perf_counter()
        for _ in range(ROUNDS):
            ctx.synchronize()
            drv.cuEventRecord(ev0, h)
            t0 = time.perf_counter_ns()
            for _ in range(1024):
                fn()
            t1 = time.perf_counter_ns()
            for _ in range(CALLS - 1024):
                fn()
            t2 = time.perf_counter_ns()
            drv.cuEventRecord(ev1, h)
            ctx.synchronize()
            t3 = time.perf_counter_ns()
            host.append((t2 - t0) / CALLS / 1e3)
            first.append((t1 - t0) / 1024 / 1e3)
            sync_ms.append((t3 - t2) / 1e6)
            dev.append(drv.cuEventElapsedTime(ev0, ev1)[1] * 1e3 / CALLS)
        wall = time.perf_counter() - t_start
        r = {
            "label": label,
            "median_us": statistics.median(host),
            "min_us": min(host),
            "rounds_us": host,
            "first_1024_median_us": statistics.median(first),
            "device_us_per_launch_median": statistics.median(dev),
            "sync_after_round_ms_median": statistics.median(sync_ms),
            "wall_s": wall,
            "state_before": st,
            "state_after": state(),
            "threads": _thread_delta(before, _threads()),
        }
        out["phases"].append(r)
        print(
            f"{label:40s} {r['median_us']:.2f} us (min {r['min_us']:.2f}, first 1024"
            f" {r['first_1024_median_us']:.2f}, device {r['device_us_per_launch_median']:.2f})"
            f" eager={st['eager']} solo={st['solo']} streams={st['live_streams_of_device']}",
            flush=True,
        )
        return r

    def launch_empty() -> Any:
        return ctx.enqueue_function(empty, grid_dim=1, block_dim=1)

    def launch_axpy() -> Any:
        return ctx.enqueue_function(axpy, af, x, y, nn, grid_dim=4, block_dim=256)

    def both(tag: str) -> None:
        for _ in range(2000):
            launch_axpy()
            launch_empty()
        rounds(f"{tag}: empty", launch_empty)
        rounds(f"{tag}: axpy4", launch_axpy)

    both("fresh")
    # The engine's phases, as benchmarks/run.py runs them (without the event-marker
    # variants, which only switch the marker kind of these same streams).
    t0 = time.perf_counter()
    bench_engine.latency(ctx, e_empty, 2000)
    bench_engine.throughput(ctx, e_empty, 1000, 10, 8)
    bench_engine.idle(ctx, spin, 200.0)
    loops = bench_engine.loops(ctx, e_empty)
    out["engine_phases_s"] = time.perf_counter() - t0
    out["loops"] = loops
    both("after the engine phases")
    out["paired"] = _alternating_rounds(ctx, empty, axpy, x, y, af, nn, CALLS, ROUNDS)
    print("paired", {k: v for k, v in out["paired"].items() if k.endswith("median_us")})
    both("after the paired rounds")
    time.sleep(2.0)
    both("2 s later")
    out["streams_alive"] = len(_backend._all_streams(ctx._state.backend))
    drv.cuEventDestroy(ev0)
    drv.cuEventDestroy(ev1)
    ctx.close()
    out["pid_threads_at_end"] = len(os.listdir("/proc/self/task"))
    report_probe(out, a.json, skip=("phases", "loops", "paired"))
    return out


if __name__ == "__main__":
    main()
