"""Where the time of the reliability suite's 10,000-cancelled-tasks round goes on a
device: the round of ``tests/api/test_reliability.py`` (each task enqueues one
operation behind a gate, on one of 4 streams, and is cancelled while it waits),
timed by phase, with each stream's state printed every half second while the
streams drain, and when each stream finished.

    python benchmarks/diagnostics/probe_cancel_round.py [--api cuda] [--tasks 10000]
    python benchmarks/diagnostics/probe_cancel_round.py --api cuda --staged 2000 \
        [--switch-interval 0.0001]

``--switch-interval`` sets ``sys.setswitchinterval`` for the run (CPython's
default is 0.005 s): if the gaps between host work shrink with it, threads are
waiting for the GIL (a diagnostic only; asyncgpu never changes it).

A diagnostic: nothing here is a benchmark figure.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncgpu import DeviceContext


def _state(s: object) -> str:
    inflight = getattr(s, "_inflight", ())
    pending = getattr(s, "_pending", None)
    done = s._completed() if hasattr(s, "_completed") else "-"  # type: ignore[attr-defined]
    return (
        f"seq={getattr(s, '_seq', '-')} marked={getattr(s, '_marked', '-')} "
        f"issued={getattr(s, '_issued_mark', '-')} completed={done} "
        f"held={'-' if pending is None else len(pending)} inflight={len(inflight)}"
    )


async def round_(
    ctx: DeviceContext, tasks: int, streams: int, kinds: set[int], quiet: bool
) -> None:
    go = threading.Event()
    t0 = time.perf_counter()
    held = ctx.enqueue_cpu_function(go.wait, 60)
    views = [ctx.select_stream(i) for i in range(streams)]
    for v in views[1:]:
        v.enqueue_wait_for(held)
    slots = ctx.enqueue_create_buffer(np.int32, 8 * tasks)
    started = asyncio.Event()
    count = [0]

    calls: list[float] = []  # when each CPU function ran

    def mul(i: int) -> int:
        calls.append(time.perf_counter())
        return i * 3

    async def one(i: int) -> None:
        v = views[i % streams]
        kind = i % 4
        if kind not in kinds:
            ev = v.enqueue_memset(slots.create_sub_buffer(np.int32, 8 * i, 8), -i)
        elif kind == 0:
            ev = v.enqueue_cpu_function(mul, i)
        elif kind == 1:
            dst = slots.create_sub_buffer(np.int32, 8 * i, 8)
            ev = v.enqueue_copy(dst, np.full(8, i, np.int32))
        elif kind == 2:
            ev = v.enqueue_memset(slots.create_sub_buffer(np.int32, 8 * i, 8), -i)
        else:
            ev = v.enqueue_wait_for(views[(i + 1) % streams])
        count[0] += 1
        if count[0] == tasks:
            started.set()
        await ev

    ts = [asyncio.create_task(one(i)) for i in range(tasks)]
    await started.wait()
    t1 = time.perf_counter()
    for t in ts:
        t.cancel()
    await asyncio.gather(*ts, return_exceptions=True)
    t2 = time.perf_counter()
    print(f"enqueue {t1 - t0:.3f} s, cancel {t2 - t1:.3f} s", flush=True)
    impls = [ctx._state.stream(i) for i in range(streams)]
    go.set()
    t3 = time.perf_counter()
    finished: dict[int, float] = {}

    async def drain(k: int) -> None:
        await views[k]
        finished[k] = time.perf_counter() - t3

    waits = [asyncio.create_task(drain(k)) for k in range(streams)]
    while not all(w.done() for w in waits):
        await asyncio.wait(waits, timeout=0.5)
        now = time.perf_counter() - t3
        for k, s in enumerate(() if quiet else impls):
            mark = f"done at {finished[k]:.3f} s" if k in finished else _state(s)
            print(f"  {now:6.2f} s stream {k}: {mark}", flush=True)
        if now > 120:
            print("gave up after 120 s", flush=True)
            break
    print(f"drain {time.perf_counter() - t3:.3f} s; per stream {finished}", flush=True)
    if len(calls) > 1:
        gaps = sorted(b - a for a, b in itertools.pairwise(calls))
        q = [gaps[int(f * (len(gaps) - 1))] * 1e6 for f in (0.1, 0.5, 0.9, 0.99)]
        print(
            f"CPU functions: {len(calls)}, first {calls[0] - t3:.4f} s after the gate opened, "
            f"gaps p10/p50/p90/p99 {q[0]:.0f}/{q[1]:.0f}/{q[2]:.0f}/{q[3]:.0f} us",
            flush=True,
        )


def staged(ctx: DeviceContext, n: int) -> None:
    """Small pageable copies: the staged copy alone, then chained on one stream."""
    buf = ctx.enqueue_create_buffer(np.int32, 8)
    src = np.arange(8, dtype=np.int32)
    ctx.synchronize()
    from asyncgpu._core.memory import _Span

    backend = ctx._state.backend
    host = _Span(src, writable=False)
    if hasattr(backend, "staged_copy"):
        t0 = time.perf_counter()
        for _ in range(n):
            backend.staged_copy(buf, host, 32, True, None)
        print(f"staged_copy alone: {(time.perf_counter() - t0) / n * 1e6:.1f} us each", flush=True)
    t0 = time.perf_counter()
    for _ in range(n):
        ctx.enqueue_copy(buf, src)
    ctx.synchronize()
    print(f"chained on one stream: {(time.perf_counter() - t0) / n * 1e6:.1f} us each", flush=True)

    async def awaited() -> float:
        t = time.perf_counter()
        for _ in range(n):
            await ctx.enqueue_copy(buf, src)
        return (time.perf_counter() - t) / n * 1e6

    print(f"awaited one by one: {asyncio.run(awaited()):.1f} us each", flush=True)

    async def awaited_cpu() -> float:
        t = time.perf_counter()
        for i in range(n):
            await ctx.enqueue_cpu_function(int.__mul__, i, 3)
        return (time.perf_counter() - t) / n * 1e6

    print(f"CPU function awaited one by one: {asyncio.run(awaited_cpu()):.1f} us each", flush=True)

    # CPU functions chained on one stream while copies chain on another: the
    # pattern of the 10,000-task round, without its tasks and cancellations.
    calls: list[float] = []

    def mul(i: int) -> int:
        calls.append(time.perf_counter())
        return i * 3

    on_cpu, on_copy = ctx.create_stream().context(), ctx.create_stream().context()
    t0 = time.perf_counter()
    for i in range(n):
        on_cpu.enqueue_cpu_function(mul, i)
        on_copy.enqueue_copy(buf, src)
    on_cpu.synchronize()
    t_cpu = time.perf_counter() - t0
    on_copy.synchronize()
    t_all = time.perf_counter() - t0
    gaps = sorted(b - a for a, b in itertools.pairwise(calls))
    q = [gaps[int(f * (len(gaps) - 1))] * 1e6 for f in (0.1, 0.5, 0.9, 0.99)]
    print(
        f"side by side: CPU functions {t_cpu / n * 1e6:.1f} us each "
        f"(gaps p10/p50/p90/p99 {q[0]:.0f}/{q[1]:.0f}/{q[2]:.0f}/{q[3]:.0f} us), "
        f"copies done after {t_all / n * 1e6:.1f} us each",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--api", default=None)
    p.add_argument("--tasks", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kinds", default="0,1,2,3", help="kinds of operation (others: memsets)")
    p.add_argument("--quiet", action="store_true", help="no per-stream lines")
    p.add_argument("--staged", type=int, default=0, help="only: N small pageable copies")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval")
    p.add_argument(
        "--watcher-spin-s",
        type=float,
        default=None,
        help="the CUDA watcher's spin after progress (_engine.SPIN_S; 0: park at once)",
    )
    a = p.parse_args()
    from asyncgpu._core import engine as _engine

    if a.watcher_spin_s is not None:
        _engine.SPIN_S = a.watcher_spin_s
    print(f"watcher spin {_engine.SPIN_S} s", flush=True)
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    print(f"switch interval {sys.getswitchinterval()} s", flush=True)
    with DeviceContext(api=a.api) as ctx:
        if a.staged:
            staged(ctx, a.staged)
            return
        for r in range(a.rounds):
            print(f"round {r + 1}", flush=True)
            kinds = {int(k) for k in a.kinds.split(",")}
            asyncio.run(round_(ctx, a.tasks, 4, kinds, a.quiet))


if __name__ == "__main__":
    main()
