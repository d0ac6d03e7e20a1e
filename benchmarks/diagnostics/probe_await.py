"""Where the time of an awaited launch goes, in one process: the enqueue alone,
the await alone, the await as the benchmark times it (interleaved with a
blocking launch + ``cuStreamSynchronize`` and an ``event.synchronize()``) and
back to back, how often the await fell back to the reactor, and a naive peer
(launch, counter write, ``asyncio.sleep(0)`` polling) in the same process.

    python benchmarks/diagnostics/probe_await.py [--completion counter|event] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _med(xs: list[int]) -> float:
    return statistics.median(xs) / 1e3


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--completion", choices=("counter", "event"))
    p.add_argument("--json")
    p.add_argument("-n", type=int, default=3000)
    a = p.parse_args()
    if a.completion:
        os.environ["ASYNCGPU_COMPLETION"] = a.completion
    from _harness import environment_info, report_probe
    from bench_engine import blocking_round_trip
    from bench_fastpaths import SRC

    import asyncgpu as ag
    from asyncgpu._core import engine as _engine

    out: dict[str, Any] = {"environment": environment_info()}
    falls = [0]
    add = _engine._Reactor.add

    def counting_add(self: Any, *args: Any) -> Any:
        falls[0] += 1
        return add(self, *args)

    _engine._Reactor.add = counting_add  # type: ignore[method-assign]
    n = a.n
    with ag.DeviceContext(api="cuda") as ctx:
        out["completion"] = ctx._state.backend.completion
        empty = ctx.compile_function(SRC, "empty")
        blocking = blocking_round_trip(ctx, empty)  # (the suite's own baseline)

        async def run() -> None:
            enq: list[int] = []
            aw: list[int] = []
            whole: list[int] = []
            inter: list[int] = []
            blk: list[int] = []
            fire: list[int] = []
            for _ in range(300):  # warm up
                await ctx.enqueue_function(empty, grid_dim=1, block_dim=1)
            # back to back: the enqueue and the await timed apart
            falls[0] = 0
            for _ in range(n):
                t0 = time.perf_counter_ns()
                ev = ctx.enqueue_function(empty, grid_dim=1, block_dim=1)
                t1 = time.perf_counter_ns()
                await ev
                t2 = time.perf_counter_ns()
                enq.append(t1 - t0)
                aw.append(t2 - t1)
                whole.append(t2 - t0)
            out["back_to_back_reactor_fallbacks"] = falls[0]
            # interleaved as bench_engine.latency times it
            falls[0] = 0
            for _ in range(n):
                blk.append(blocking())
                t0 = time.perf_counter_ns()
                await ctx.enqueue_function(empty, grid_dim=1, block_dim=1)
                inter.append(time.perf_counter_ns() - t0)
                ctx.enqueue_function(empty, grid_dim=1, block_dim=1).synchronize()
            out["interleaved_reactor_fallbacks"] = falls[0]
            # fire and forget
            ctx.synchronize()
            for _ in range(n):
                t0 = time.perf_counter_ns()
                ctx.enqueue_function(empty, grid_dim=1, block_dim=1)
                fire.append(time.perf_counter_ns() - t0)
            ctx.synchronize()
            out["back_to_back_enqueue_us"] = _med(enq)
            out["back_to_back_await_us"] = _med(aw)
            out["back_to_back_whole_us"] = _med(whole)
            out["interleaved_await_us"] = _med(inter)
            out["interleaved_blocking_us"] = _med(blk)
            out["fire_and_forget_enqueue_us"] = _med(fire)

        asyncio.run(run())
    out["ratio_interleaved"] = out["interleaved_await_us"] / out["interleaved_blocking_us"]
    out["ratio_back_to_back"] = out["back_to_back_whole_us"] / out["interleaved_blocking_us"]
    report_probe(out, a.json)
    return out


if __name__ == "__main__":
    main()
