"""The CPU device against the plain tools (issue 2): awaited no-op CPU functions
against ``loop.run_in_executor``, and 64 MiB host-to-host copies against
``numpy.copyto``, in the same run. Runs anywhere.

    python benchmarks/bench_cpu.py [--quick] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncgpu as ag
from asyncgpu._core.pool import pool_size


def _noop() -> None:
    return None


def cpu_functions(quick: bool) -> dict[str, float]:
    """Microseconds per awaited no-op: asyncgpu's enqueue_cpu_function vs
    run_in_executor on a pool of the same size, alternating rounds."""
    n = 2000 if quick else 20000
    rounds = 3 if quick else 7
    executor = ThreadPoolExecutor(pool_size())

    async def run() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        with ag.DeviceContext(api="cpu") as ctx:

            async def ours() -> float:
                t0 = time.perf_counter()
                for _ in range(n):
                    await ctx.enqueue_cpu_function(_noop)
                return (time.perf_counter() - t0) / n * 1e6

            async def theirs() -> float:
                t0 = time.perf_counter()
                for _ in range(n):
                    await loop.run_in_executor(executor, _noop)
                return (time.perf_counter() - t0) / n * 1e6

            await ours()
            await theirs()
            a, b = [], []
            for _ in range(rounds):
                a.append(await ours())
                b.append(await theirs())
        return {
            "asyncgpu_us": statistics.median(a),
            "run_in_executor_us": statistics.median(b),
            "ratio": statistics.median(a) / statistics.median(b),
        }

    try:
        return asyncio.run(run())
    finally:
        executor.shutdown()


def host_copies(quick: bool) -> dict[str, float]:
    """GB/s of a 64 MiB host-to-host copy: asyncgpu (awaited) vs numpy.copyto."""
    nbytes = 64 << 20
    reps = 5 if quick else 20
    rng = np.random.default_rng()
    src_np = rng.integers(0, 255, nbytes, dtype=np.uint8)
    dst_np = np.empty_like(src_np)

    async def run() -> dict[str, float]:
        with ag.DeviceContext(api="cpu") as ctx:
            a = ctx.enqueue_create_host_buffer(np.uint8, nbytes)
            b = ctx.enqueue_create_host_buffer(np.uint8, nbytes)
            a.as_numpy()[:] = src_np
            ours, theirs = [], []
            await ctx.enqueue_copy(b, a)
            np.copyto(dst_np, src_np)
            for _ in range(reps):
                t0 = time.perf_counter()
                await ctx.enqueue_copy(b, a)
                ours.append(nbytes / (time.perf_counter() - t0) / 1e9)
                t0 = time.perf_counter()
                np.copyto(dst_np, src_np)
                theirs.append(nbytes / (time.perf_counter() - t0) / 1e9)
            if not np.array_equal(b.as_numpy(), src_np):
                raise AssertionError("copy result differs")
        o, t = statistics.median(ours), statistics.median(theirs)
        return {"asyncgpu_gbps": o, "numpy_copyto_gbps": t, "fraction_of_copyto": o / t}

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    a = p.parse_args(argv)
    res = {"cpu_functions": cpu_functions(a.quick), "host_copies": host_copies(a.quick)}
    print(json.dumps(res, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
