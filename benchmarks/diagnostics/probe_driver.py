"""Host cost of the hot path's driver calls, one way against another, in one process:
``cuLaunchKernel`` and ``cuStreamWriteValue64`` through cuda.bindings, through
cuda.core's ``launch``, and straight through the driver's entry points
(``asyncgpu._native``). Also checks that a launch through ``_native`` computes
what NumPy does.

    python benchmarks/diagnostics/probe_driver.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import asyncgpu as ag
from asyncgpu import _native
from asyncgpu._devices.cuda import driver as _driver
from asyncgpu._devices.cuda import memory as _memory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _harness import GcRecorder, environment_info, report_probe
from bench_fastpaths import SRC  # its "empty" and "axpy" kernels


def per_call_us(fn: Any, sync: Any, calls: int = 5000, rounds: int = 7) -> float:
    per = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter_ns() - t0) / calls / 1e3)
        sync()
    return statistics.median(per)


def _cfg(ctx: ag.DeviceContext, f: Any) -> Any:
    """The cached launch configuration of ``f`` for grid 4 x block 256."""
    ctx.enqueue_function(
        f, np.float32(0), *[ctx.enqueue_create_buffer(np.float32, 1)] * 2, np.int32(0),
        grid_dim=4, block_dim=256,
    )  # fmt: skip
    ctx.synchronize()
    return f._cfgs[_native.launch_key(4, 256, None, None, ())]


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    a = p.parse_args()
    from cuda.bindings import driver as cu
    from cuda.core import LaunchConfig, launch

    out: dict[str, Any] = {"environment": environment_info(), "native": _driver._native is not None}
    with ag.DeviceContext(api="cuda") as ctx:
        out["native"] = _driver._native is not None
        native = _driver._native
        empty = ctx.compile_function(SRC, "empty")._impl
        axpy = ctx.compile_function(SRC, "axpy")._impl
        stream = ctx.stream()._impl
        h, raw, cs = stream.h, stream.raw, stream.cs
        n = 1 << 10
        rng = np.random.default_rng()
        xs = rng.standard_normal(n).astype(np.float32)
        ys = rng.standard_normal(n).astype(np.float32)
        x = ctx.enqueue_create_buffer(np.float32, n)
        y = ctx.enqueue_create_buffer(np.float32, n)
        ctx.enqueue_copy(x, xs)
        ctx.enqueue_copy(y, ys)
        ctx.synchronize()
        a_, nn = np.float32(1.5), np.int32(n)
        sync = ctx.synchronize
        data = (ctypes.c_uint64 * 4)()
        base = ctypes.addressof(data)
        ptrs = (ctypes.c_uint64 * 4)(*(base + 8 * i for i in range(4)))
        paddr = ctypes.addressof(ptrs)
        packer = struct.Struct("<f4xQQi4x")
        packer.pack_into(data, 0, a_, x.unsafe_ptr(), y.unsafe_ptr(), nn)
        dims = (4, 1, 1, 256, 1, 1, 0)
        cfg4 = LaunchConfig(grid=4, block=256)
        cfg1 = LaunchConfig(grid=1, block=1)
        counter = _memory._slab.take()  # a counter of the probe's own
        seq = [0]

        out["bindings_launch_4args_us"] = per_call_us(
            lambda: cu.cuLaunchKernel(axpy.fn, 4, 1, 1, 256, 1, 1, 0, raw, paddr, 0), sync
        )
        out["bindings_launch_empty_us"] = per_call_us(
            lambda: cu.cuLaunchKernel(empty.fn, 1, 1, 1, 1, 1, 1, 0, raw, 0, 0), sync
        )
        out["core_launch_4args_us"] = per_call_us(
            lambda: launch(cs, cfg4, axpy.kernel, a_, x.unsafe_ptr(), y.unsafe_ptr(), nn), sync
        )
        out["core_launch_empty_us"] = per_call_us(lambda: launch(cs, cfg1, empty.kernel), sync)

        def bump() -> int:
            seq[0] += 1
            return seq[0]

        out["bindings_write64_us"] = per_call_us(
            lambda: cu.cuStreamWriteValue64(raw, counter, bump(), 0), sync
        )
        ev = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)[1]
        out["bindings_event_record_us"] = per_call_us(lambda: cu.cuEventRecord(ev, raw), sync)
        if native is not None:
            types = (np.float32, ag.DeviceBuffer, ag.DeviceBuffer, np.int32)
            codes = b"fPPi"
            args = (a_, x, y, nn)
            fn4, fn0 = int(axpy.fn), int(empty.fn)
            out["native_launch_4args_packed_us"] = per_call_us(
                lambda: native.launch(fn4, dims, h, types, codes, args, base, paddr), sync
            )
            out["native_launch_empty_us"] = per_call_us(
                lambda: native.launch(fn0, (1, 1, 1, 1, 1, 1, 0), h, (), b"", (), 0, 0), sync
            )
            out["native_launch_4args_and_marker_us"] = per_call_us(
                lambda: native.launch(
                    fn4, dims, h, types, codes, args, base, paddr, counter, bump()
                ),
                sync,
            )
            out["native_write64_us"] = per_call_us(lambda: native.write64(h, counter, bump()), sync)
            # Correctness: one launch through _native, against NumPy.
            ctx.enqueue_copy(y, ys)
            sync()
            err = native.launch(fn4, dims, h, types, codes, args, base, paddr)
            got = np.empty(n, np.float32)
            ctx.enqueue_copy(got, y)
            sync()
            out["native_launch_err"] = err
            out["native_axpy_matches_numpy"] = bool(
                np.allclose(got, 1.5 * xs + ys, rtol=1e-5, atol=1e-5)
            )
        # The layers of enqueue_function, outermost last: where the Python time goes.
        axpy_f = ctx.compile_function(SRC, "axpy")
        stream.launch(axpy_f, (a_, x, y, nn), dims_cfg := _cfg(ctx, axpy_f), ())  # the plan
        sync()
        args4 = (a_, x, y, nn)
        lock = stream._submit_lock

        def locked() -> None:
            with lock:
                pass

        out["layer_stream_launch_4args_us"] = per_call_us(
            lambda: stream.launch(axpy_f, args4, dims_cfg, ()), sync
        )
        out["layer_enqueue_function_4args_us"] = per_call_us(
            lambda: ctx.enqueue_function(axpy_f, a_, x, y, nn, grid_dim=4, block_dim=256), sync
        )

        def enqueue4() -> None:
            ctx.enqueue_function(axpy_f, a_, x, y, nn, grid_dim=4, block_dim=256)

        with GcRecorder() as rec:
            out["layer_enqueue_function_4args_10k_calls_us"] = per_call_us(enqueue4, sync, 10000)
        out["layer_10k_calls_gc_passes"] = list(rec.passes)
        out["layer_10k_calls_gc_pause_ms"] = rec.pause_s * 1e3
        # With the heap built so far frozen (gc.freeze): a full pass then scans only
        # what was made since, so this tells the cost of full passes over the
        # libraries' objects from the cost of passes over the launches' own.
        gc.freeze()
        try:
            with GcRecorder() as rec:
                out["layer_enqueue_function_4args_10k_calls_frozen_us"] = per_call_us(
                    enqueue4, sync, 10000
                )
            out["layer_10k_calls_frozen_gc_passes"] = list(rec.passes)
        finally:
            gc.unfreeze()
        gc.disable()
        try:
            out["layer_enqueue_function_4args_10k_calls_no_gc_us"] = per_call_us(
                enqueue4, sync, 10000
            )
        finally:
            gc.enable()
        out["piece_submit_lock_us"] = per_call_us(locked, sync)
        out["piece_before_submit_us"] = per_call_us(stream._before_submit, sync)
        out["piece_prune_us"] = per_call_us(stream._prune, sync)
        out["piece_event_init_us"] = per_call_us(lambda: ag.DeviceEvent(stream, 0, args4), sync)
        out["piece_cfg_lookup_us"] = per_call_us(
            lambda: axpy_f._cfgs[_native.launch_key(4, 256, None, None, ())], sync
        )
        # The bench's own launch section, in this fresh process.
        from bench_fastpaths import launch as bench_launch

        out["bench_launch_section"] = bench_launch(ctx, False)
        # The copy/kernel pipeline by kind of marker after each copy (8 MiB chunks,
        # three rounds): keeps the marker choice visible in every full device call.
        from probe_pipeline import run_size

        try:
            out["pipeline_8mib"] = run_size(ctx, 8, 3)
        except Exception as exc:  # a probe's failure must not lose the rest
            out["pipeline_8mib"] = f"error: {type(exc).__name__}: {exc}"
        sync()
        cu.cuEventDestroy(ev)
        _memory._slab.give_back(counter)
    report_probe(out, a.json, skip=("pipeline_8mib", "bench_launch_section"))
    return out


if __name__ == "__main__":
    main()
