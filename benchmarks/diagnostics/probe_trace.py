"""Where a traced launch's time goes (CUDA).

The suite's ``fast_launch`` phase times an empty launch with ``ctx.trace()`` on
against the same launch untraced. This probe splits the difference: the traced
launch as the suite times it, the same with ``device_times=False`` (the host
part of the trace alone), and the driver calls a timestamp is made of, each timed by
itself through cuda.bindings (``cuEventCreate``, ``cuEventRecord``,
``cuEventElapsedTime``).

    python benchmarks/diagnostics/probe_trace.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CALLS, ROUNDS = 2500, 5


def _per_call_us(fn: Any, sync: Any, calls: int = CALLS, rounds: int = ROUNDS) -> float:
    """Median over ``rounds`` of the mean µs per call of ``calls`` calls."""
    out = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter_ns() - t0) / calls / 1e3)
        sync()
    return statistics.median(out)


def main() -> dict[str, Any]:
    from cuda.bindings import driver as cu

    import asyncgpu as ag

    src = 'extern "C" __global__ void empty() {}\n'
    res: dict[str, Any] = {"calls": CALLS, "rounds": ROUNDS}
    with ag.DeviceContext() as ctx:
        res["device"] = ctx.default_device_info.name
        empty = ctx.compile_function(src, "empty")
        sync = ctx.synchronize

        def launch() -> None:
            ctx.enqueue_function(empty, grid_dim=1, block_dim=1)

        for _ in range(2000):
            launch()
        res["untraced_us"] = _per_call_us(launch, sync)
        with ctx.trace() as t:
            res["traced_us"] = _per_call_us(launch, sync)
            res["traced_nodes"] = len(t.nodes)
        with ctx.trace():
            gc.disable()
            try:
                res["traced_gc_off_us"] = _per_call_us(launch, sync)
            finally:
                gc.enable()
        # The host part alone: no timing events.
        with ctx.trace(device_times=False):
            res["traced_host_only_us"] = _per_call_us(launch, sync)
        # The same phases again in another order, each in a trace of its own and
        # the traces above dropped: does a phase's figure depend on what ran
        # before it (the traces kept alive, their nodes and timing events)?
        # Each phase also counts, over 1000 more launches, how many placed a marker
        # (the stream's issued marker moved) and whether the stream was eager.
        del t
        gc.collect()
        stream = ctx._impl
        order = []

        def markers_per_launch() -> float:
            moved, last = 0, stream._issued_mark
            for _ in range(1000):
                launch()
                if stream._issued_mark != last:
                    moved, last = moved + 1, stream._issued_mark
            return moved / 1000

        for mode in ("untraced", "host_only", "untraced", "device", "host_only", "untraced"):
            if mode == "untraced":
                us = _per_call_us(launch, sync)
                marks = markers_per_launch()
            else:
                with ctx.trace(device_times=mode == "device"):
                    us = _per_call_us(launch, sync)
                    marks = markers_per_launch()
                gc.collect()
            order.append(
                {"mode": mode, "us": us, "markers_per_launch": marks, "eager": bool(stream._eager)}
            )
        res["phases_in_order"] = order
        impl = stream

        # The driver calls of one timestamp, through cuda.bindings.
        backend = ctx._state.backend
        backend.make_current()
        raw = impl.raw
        events: list[Any] = []

        def create() -> None:
            events.append(cu.cuEventCreate(0)[1])

        res["cuEventCreate_us"] = _per_call_us(create, sync)
        it = iter(events)

        def record() -> None:
            cu.cuEventRecord(next(it), raw)

        res["cuEventRecord_us"] = _per_call_us(record, sync)
        origin = events[0]
        it = iter(events[1:])

        def elapsed() -> None:
            cu.cuEventElapsedTime(origin, next(it))

        res["cuEventElapsedTime_us"] = _per_call_us(elapsed, sync, CALLS - 1)
        it = iter(events)

        def destroy() -> None:
            cu.cuEventDestroy(next(it))

        res["cuEventDestroy_us"] = _per_call_us(destroy, sync, CALLS, 1)
        res["new_stamp_recycled_us"] = _per_call_us(
            lambda: backend.drop_stamp(backend.new_stamp()), sync
        )
        res["make_current_us"] = _per_call_us(backend.make_current, sync)
    return res


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    r = main()
    text = json.dumps(r, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
