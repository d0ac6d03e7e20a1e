"""The completion engine on the GPU: asyncgpu's awaits against blocking sync and
the naive strategies, measured in the same process (issue 4's goals).

    python benchmarks/bench_engine.py [--quick] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _harness

import asyncgpu as ag

SRC = r"""
extern "C" __global__ void empty() {}
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _summ(ns: list[int]) -> dict[str, float]:
    us = [x / 1e3 for x in ns]
    return {
        "median_us": statistics.median(us),
        "p10_us": _pct(us, 0.10),
        "p90_us": _pct(us, 0.90),
        "p99_us": _pct(us, 0.99),
        "n": len(us),
    }


WARM_S = 0.3


def warm_gpu(ctx: ag.DeviceContext, empty: ag.DeviceFunction, seconds: float = WARM_S) -> int:
    """Launch and synchronize empty kernels for ``seconds`` before timing. An idle
    data-center GPU lowers its SM clocks (nvidia-smi shows it), and the clocks
    take time to rise: where this section followed seconds of CPU-only work, the
    await round trip timed half again the blocking one, and the same code right
    after other GPU work did not. Returns the number of launches."""
    n = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(100):
            ctx.enqueue_function(empty, grid_dim=1, block_dim=1)
        ctx.synchronize()
        n += 100
    return n


def blocking_round_trip(ctx: ag.DeviceContext, empty: ag.DeviceFunction) -> Callable[[], int]:
    """The await's baseline: ``empty`` launched on the context's current stream
    through cuda.core, then a blocking ``cuStreamSynchronize``; the callable
    returns the nanoseconds of one such round trip."""
    from cuda.bindings import driver as cu
    from cuda.core import LaunchConfig, launch

    stream = ctx.stream()
    raw = cu.CUstream(stream.handle)
    cs = stream._impl.cs  # type: ignore[attr-defined]
    kernel = empty._impl.kernel
    cfg = LaunchConfig(grid=1, block=1)

    def once() -> int:
        t0 = time.perf_counter_ns()
        launch(cs, cfg, kernel)
        cu.cuStreamSynchronize(raw)
        return time.perf_counter_ns() - t0

    return once


def latency(ctx: ag.DeviceContext, empty: ag.DeviceFunction, n: int) -> dict[str, Any]:
    """Enqueue an empty kernel and learn it finished: asyncgpu await vs the same
    launch through cuda.core followed by a blocking cuStreamSynchronize."""
    blocking_once = blocking_round_trip(ctx, empty)

    async def await_once() -> int:
        t0 = time.perf_counter_ns()
        await ctx.enqueue_function(empty, grid_dim=1, block_dim=1)
        return time.perf_counter_ns() - t0

    def blocking_event_sync_once() -> int:
        t0 = time.perf_counter_ns()
        ctx.enqueue_function(empty, grid_dim=1, block_dim=1).synchronize()
        return time.perf_counter_ns() - t0

    async def run() -> dict[str, Any]:
        warm_gpu(ctx, empty)
        for _ in range(200):
            blocking_once()
            await await_once()
        # Interleave the strategies so drift (clocks, other load) hits both alike.
        b: list[int] = []
        a: list[int] = []
        s: list[int] = []
        for _ in range(n):
            b.append(blocking_once())
            a.append(await await_once())
            s.append(blocking_event_sync_once())
        return {
            "blocking_stream_sync": _summ(b),
            "asyncgpu_await": _summ(a),
            "asyncgpu_event_synchronize": _summ(s),
        }

    out = asyncio.run(run())
    out["ratio_await_over_blocking"] = (
        out["asyncgpu_await"]["median_us"] / out["blocking_stream_sync"]["median_us"]
    )
    return out


def throughput(
    ctx: ag.DeviceContext,
    empty: ag.DeviceFunction,
    tasks: int,
    per_task: int,
    streams: int,
    rounds: int = 3,
) -> dict[str, Any]:
    """``tasks`` concurrent tasks each awaiting ``per_task`` empty launches, spread
    over ``streams`` streams, with a ticker measuring loop lag: ``rounds`` rounds
    (as the peers' throughput cases), reported by the median round, with every
    round's rate and the garbage collector's passes during each."""
    per_round = []
    for _ in range(rounds):
        with _harness.GcRecorder() as rec:
            r = _throughput_round(ctx, empty, tasks, per_task, streams)
        r.update(rec.metrics())
        per_round.append(r)
    per_round.sort(key=lambda r: r["ops_per_s"])
    out = dict(per_round[len(per_round) // 2])
    out["rounds"] = rounds
    out["ops_per_s_rounds"] = [r["ops_per_s"] for r in per_round]
    out["ticker_lag_p99_ms_rounds"] = [r["ticker_lag_p99_ms"] for r in per_round]
    out["gc_passes_by_generation_rounds"] = [r["gc_passes_by_generation"] for r in per_round]
    return out


def _throughput_round(
    ctx: ag.DeviceContext, empty: ag.DeviceFunction, tasks: int, per_task: int, streams: int
) -> dict[str, Any]:
    views = [ctx.select_stream(i % ctx.num_streams()) for i in range(streams)]

    started = [0]
    steady_at = [float("inf")]

    async def worker(k: int) -> None:
        v = views[k % streams]
        for i in range(per_task):
            await v.enqueue_function(empty, grid_dim=1, block_dim=1)
            if i == 0:
                started[0] += 1
                if started[0] == tasks:
                    steady_at[0] = time.perf_counter()

    async def run() -> dict[str, Any]:
        stop = False
        lags: list[float] = []
        steady: list[float] = []  # ticks begun once every task had run (not the start burst)

        async def ticker() -> None:
            period = 0.001
            while not stop:
                t0 = time.perf_counter()
                await asyncio.sleep(period)
                lag = time.perf_counter() - t0 - period
                lags.append(lag)
                if t0 >= steady_at[0]:
                    steady.append(lag)

        # Loop iteration lengths: a callback that reschedules itself runs once
        # per iteration, so the gaps between its runs are the iterations.
        loop = asyncio.get_running_loop()
        laps: list[float] = []

        def lap(prev: float) -> None:
            now = time.perf_counter()
            laps.append(now - prev)
            if not stop:
                loop.call_soon(lap, now)

        warm_gpu(ctx, empty)
        await asyncio.gather(*(worker(k) for k in range(64)))  # warm up
        floor_ms = _bare_launches_ms(ctx, empty, tasks)
        asyncio_ms = min([await _task_burst_ms(tasks) for _ in range(3)])
        started[0] = 0
        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        lags.clear()
        t0 = time.perf_counter()
        loop.call_soon(lap, t0)
        await asyncio.gather(*(worker(k) for k in range(tasks)))
        dt = time.perf_counter() - t0
        stop = True
        await tick
        return {
            "ops": tasks * per_task,
            "seconds": dt,
            "ops_per_s": tasks * per_task / dt,
            "ticker_lag_p50_ms": _pct(lags, 0.5) * 1e3 if lags else None,
            "ticker_lag_p99_ms": _pct(lags, 0.99) * 1e3 if lags else None,
            "ticker_samples": len(lags),
            # asyncio starts all ``tasks`` tasks in one loop iteration; the ticks
            # after that show the steady state of the load.
            "ticker_lag_steady_p99_ms": _pct(steady, 0.99) * 1e3 if steady else None,
            "ticker_steady_samples": len(steady),
            # The first iteration runs every task's first launch: ``tasks`` bare
            # driver launches back to back (no task, await or event) take this
            # long, so no engine that submits at the call makes that iteration
            # shorter (see iteration_max_ms).
            "start_burst_floor_ms": floor_ms,
            # asyncio's own share of that iteration: as many tasks whose first
            # step awaits a plain asyncio future (no GPU), the least of three.
            "start_burst_asyncio_ms": asyncio_ms,
            "loop_iterations": len(laps),
            "iteration_p50_ms": _pct(laps, 0.5) * 1e3 if laps else None,
            "iteration_p99_ms": _pct(laps, 0.99) * 1e3 if laps else None,
            "iteration_max_ms": max(laps) * 1e3 if laps else None,
        }

    return asyncio.run(run())


def throughput_paired(
    ctx: ag.DeviceContext,
    empty: ag.DeviceFunction,
    tasks: int,
    per_task: int,
    streams: int,
    pairs: int = 5,
) -> dict[str, Any]:
    """The I4.2 workload (``tasks`` tasks each awaiting ``per_task`` empty launches
    over ``streams`` streams) in rounds that alternate asyncgpu with the
    host-callback strategy (``cuLaunchHostFunc`` + ``call_soon_threadsafe``,
    ``peers_gpu.hostfunc_awaits``) on the same streams, kernel and event loop,
    the garbage collector on for both, as applications run: the ratio of each
    pair, free of drift between the suite's phases (the peers' own case runs
    minutes later, with the collector paused for it), and their median. Who goes
    first alternates from pair to pair. No ticker runs here (``throughput`` has
    it)."""
    import peers_gpu
    from cuda.bindings import driver as drv

    views = [ctx.select_stream(i % ctx.num_streams()) for i in range(streams)]
    raw_streams = [drv.CUstream(v._impl.h) for v in views]
    raw_empty = drv.CUfunction(int(empty._impl.fn))
    bridge = peers_gpu.HostFnBridge()

    async def ours(k: int) -> None:
        v = views[k % streams]
        for _ in range(per_task):
            await v.enqueue_function(empty, grid_dim=1, block_dim=1)

    async def rate(task: Callable[[int], Any]) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(task(k) for k in range(tasks)))
        return tasks * per_task / (time.perf_counter() - t0)

    async def run() -> tuple[list[float], list[float]]:
        theirs = peers_gpu.hostfunc_awaits(raw_empty, raw_streams, per_task, bridge)
        warm_gpu(ctx, empty)
        for task in (ours, theirs):  # warm up
            await asyncio.gather(*(task(k) for k in range(64)))
        a: list[float] = []
        b: list[float] = []
        for i in range(pairs):
            if i % 2 == 0:
                a.append(await rate(ours))
                b.append(await rate(theirs))
            else:
                b.append(await rate(theirs))
                a.append(await rate(ours))
        bridge.check()
        return a, b

    with _harness.GcRecorder() as rec:
        a, b = asyncio.run(run())
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    return {
        "asyncgpu_median_ops_per_s": statistics.median(a),
        "hostfunc_median_ops_per_s": statistics.median(b),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "asyncgpu_ops_per_s_rounds": a,
        "hostfunc_ops_per_s_rounds": b,
        "ratio_rounds": ratios,
        "pairs": pairs,
        **rec.metrics(),
    }


async def _task_burst_ms(n: int) -> float:
    """Milliseconds of the loop iteration in which ``n`` new tasks take their
    first step, each awaiting an asyncio future that a later iteration resolves:
    what asyncio itself spends starting ``n`` awaiting tasks, with no GPU work."""
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(n)]
    laps: list[float] = []

    async def wait(f: asyncio.Future[None]) -> None:
        await f

    def lap(prev: float) -> None:
        now = time.perf_counter()
        laps.append(now - prev)
        if len(laps) < 3:
            loop.call_soon(lap, now)
        else:
            for f in futures:
                f.set_result(None)

    tasks = [asyncio.ensure_future(wait(f)) for f in futures]
    loop.call_soon(lap, time.perf_counter())
    await asyncio.gather(*tasks)
    return max(laps) * 1e3


def _bare_launches_ms(ctx: ag.DeviceContext, empty: ag.DeviceFunction, n: int) -> float | None:
    """Milliseconds that ``n`` launches of ``empty`` take through the bare C entry
    point (``_native.launch``: the driver call, no event), back to back on stream
    0; None on the CPU device or before the driver is bound."""
    from asyncgpu._devices.cuda import driver as _driver

    native = getattr(_driver, "_native", None) if ctx.api() == "cuda" else None
    if native is None:
        return None
    fn, h, dims = int(empty._impl.fn), ctx.stream()._impl.h, (1, 1, 1, 1, 1, 1, 0)
    ctx.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        native.launch(fn, dims, h, (), b"", (), 0, 0)
    dt = time.perf_counter() - t0
    ctx.synchronize()
    return dt * 1e3


def idle(
    ctx: ag.DeviceContext, spin: ag.DeviceFunction, ms: float, waits: int = 3
) -> dict[str, Any]:
    """CPU use of the process while one task awaits a kernel that runs ``ms``:
    the median of ``waits`` such waits (each one is in ``samples``)."""
    cycles = np.int64(ctx.default_device_info.clock_rate_khz * ms)

    async def run() -> list[tuple[float, float]]:
        await ctx.enqueue_function(spin, np.int64(1000), grid_dim=1, block_dim=1)
        out = []
        for _ in range(waits):
            ev = ctx.enqueue_function(spin, cycles, grid_dim=1, block_dim=1)
            c0, t0 = time.process_time(), time.perf_counter()
            await ev
            c1, t1 = time.process_time(), time.perf_counter()
            out.append(((c1 - c0) * 1e3, (t1 - t0) * 1e3))
        return out

    samples = asyncio.run(run())
    cpu_ms, wall_ms = (statistics.median(v) for v in zip(*samples, strict=True))
    fractions = [c / w for c, w in samples]
    return {
        "kernel_ms_requested": ms,
        "waits": waits,
        "wall_ms": wall_ms,
        "cpu_ms": cpu_ms,
        "cpu_fraction_of_one_core": statistics.median(fractions),
        "cpu_fraction_max": max(fractions),
        "samples_cpu_wall_ms": [[round(c, 3), round(w, 3)] for c, w in samples],
    }


def loops(ctx: ag.DeviceContext, empty: ag.DeviceFunction) -> dict[str, Any]:
    """The same awaits under trio and from several threads with their own loops."""
    out: dict[str, Any] = {}
    try:
        import trio

        async def trio_main() -> int:
            n = 0
            for _ in range(200):
                await ctx.enqueue_function(empty, grid_dim=1, block_dim=1)
                n += 1
            return n

        t0 = time.perf_counter()
        out["trio_awaits"] = trio.run(trio_main)
        out["trio_us_per_await"] = (time.perf_counter() - t0) / 200 * 1e6
    except ImportError as e:
        out["trio"] = f"unavailable: {e}"
    counts: list[int] = []

    def thread_main(k: int) -> None:
        async def main() -> None:
            v = ctx.select_stream(k)
            for _ in range(500):
                await v.enqueue_function(empty, grid_dim=1, block_dim=1)
            counts.append(500)

        asyncio.run(main())

    threads = [threading.Thread(target=thread_main, args=(k,)) for k in range(4)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["threads"] = len(threads)
    out["thread_awaits"] = sum(counts)
    out["thread_ops_per_s"] = sum(counts) / (time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    p.add_argument(
        "--completion",
        choices=("counter", "event"),
        help="completion markers to measure (default: the package default)",
    )
    a = p.parse_args(argv)
    if a.completion:  # a setting of the process, read at import: replaced here
        from asyncgpu import _config

        _config.SETTINGS = _config.SETTINGS.replace(completion=a.completion)
    n = 300 if a.quick else 2000
    with ag.DeviceContext(api="cuda") as ctx:
        empty = ctx.compile_function(SRC, "empty")
        spin = ctx.compile_function(SRC, "spin")
        res = {
            "device": ctx.name(),
            "completion": ctx._state.backend.completion,
            "latency": latency(ctx, empty, n),
            "throughput": throughput(ctx, empty, 1000 if not a.quick else 200, 10, 8),
            "idle": idle(ctx, spin, 200.0),
            "loops": loops(ctx, empty),
        }
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
