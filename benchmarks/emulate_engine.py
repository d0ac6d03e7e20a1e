"""The host side of asyncgpu's CUDA hot paths on a stand-in driver: no GPU needed.

CUDA streams are built as ``CudaStream`` builds them, but ``asyncgpu._native`` is
bound to ``_stub_driver.c`` (compiled here with the system's C compiler): a
launch that does nothing, and a completion counter that the "GPU" writes either
at once or, for the throughput case, once per event-loop iteration. What is left
is asyncgpu's own cost: the enqueue path, the await machinery, the reactor.

These are figures of the machine it runs on, for comparing two versions of the
code there (run it before and after a change). They are not GPU figures and are
never reported as such; the GPUs' are in ``benchmarks/results/``.

    python benchmarks/emulate_engine.py [--quick] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Unavailable, environment_info, report_probe

from asyncgpu import (
    DeviceContext,
    DeviceEvent,
    DeviceFunction,
    _accel,
)
from asyncgpu._core.engine import watcher
from asyncgpu._core.state import _ContextState, _Ref
from asyncgpu._core.trace import Trace
from asyncgpu._devices.cuda import backend as _backend
from asyncgpu._devices.cuda import driver as _driver
from asyncgpu._devices.cuda import launch as _launch
from asyncgpu._devices.cuda import memory as _memory
from asyncgpu._devices.cuda import stream as _stream

DIMS = (1, 1, 1, 1, 1, 1, 0)


def stub_driver(workdir: str) -> ctypes.CDLL:
    """``_stub_driver.c``, compiled into ``workdir``."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise Unavailable("no C compiler for the stand-in driver")
    lib = Path(workdir) / "libstubdriver.so"
    src = Path(__file__).with_name("_stub_driver.c")
    subprocess.run([cc, "-O2", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    return ctypes.CDLL(str(lib))


def bind(lib: ctypes.CDLL, deferred: bool) -> None:
    """Bind ``_native`` to the stand-in (``deferred``: counter writes do nothing;
    the emulated GPU writes the counters itself)."""
    native = _accel.native
    addr = [
        ctypes.cast(f, ctypes.c_void_p).value
        for f in (
            lib.stub_launch,
            lib.stub_write64_deferred if deferred else lib.stub_write64,
            lib.stub_record,
            lib.stub_query,
        )
    ]
    native.bind(*addr)
    native.configure(
        DeviceEvent,
        watcher.sweep_later,
        _stream._PolledStream.MARK_EVERY,
        _stream.CudaStream,
        _memory._DeviceAlloc,
    )
    _driver._native = native


class _CorePool:
    """What ``CudaBackend.alloc_device`` reads of cuda.core's memory resource: an
    allocation that costs no driver call."""

    def allocate(self, nbytes: int, stream: Any = None) -> Any:
        return _CoreBuffer()


class _Backend:
    completion = "counter"
    mr = _CorePool()
    alloc_device = _backend.CudaBackend.alloc_device

    def make_current(self) -> None:
        pass


class _Buffer(_accel.native.BufferCore):
    """What the launch path reads of a device buffer (in C fields, as asyncgpu's
    buffers keep them): a buffer of the context whose state is ``state`` (a
    launch packs buffers of its own context in C)."""

    def __init__(self, ptr: int, state: Any) -> None:
        self._ptr = ptr
        self._alloc = object()
        self._ctx = SimpleNamespace(_state=state)


def stream(index: int) -> Any:
    """A ``CudaStream`` as ``CudaStream.__init__`` makes one, without a driver."""
    state = SimpleNamespace(device_id=0, api="cuda", closed=False, backend=_Backend())
    s = _stream.CudaStream.__new__(_stream.CudaStream)
    _stream._PolledStream.__init__(s, state, index, 0)
    s.backend, s.owned, s.is_closed = state.backend, True, False
    s._events, s._copy_marks, s._free_events = None, deque(), []
    s._after_copy, s._counter_mark, s._done_seq, s._host_ops = False, 0, 0, 0
    s._marker_lock = threading.Lock()
    s._counter = ctypes.c_uint64(0)
    s.h, s.caddr = 0x5EA0 + index, ctypes.addressof(s._counter)
    s._counter_in_c, s._kernel_event_markers = True, False
    s._write_marker = lambda seq: _accel.native.write64(s.h, s.caddr, seq)
    s._query_fault = lambda: None
    s._handle_use = _stream._HandleUse()
    s._param_mem, s.label = {}, f"stub:0/s{index}"
    s.spare = _memory._SpareBuffers(_memory._SPARE_BYTES, _memory._SPARE_PER_SIZE)
    return s


class _CoreBuffer:
    """What an allocation reads of cuda.core's Buffer."""

    handle = 0x7F00_0000_0000

    def close(self, stream: Any = None) -> None:
        pass


def context(s: Any) -> DeviceContext:
    """A DeviceContext on the stream ``s``, as ``DeviceContext.__init__`` leaves
    one (its state's ``closed`` and ``trace``, its reference; the stream is the
    state's from now on), without a driver."""
    state = object.__new__(_ContextState)
    state.closed, state.trace, state.backend = False, None, s.backend
    ctx = object.__new__(DeviceContext)
    ctx._state, ctx._ref, ctx._impl = state, _Ref(), s
    s.state = state
    return ctx


def function(ctx: DeviceContext, f: Any, grid: int, block: int) -> DeviceFunction:
    """A DeviceFunction of ``ctx`` on the stand-in function ``f`` (see ``kernel``),
    its launch configuration for ``grid`` x ``block`` validated."""
    fn = DeviceFunction(ctx, "stub", f)
    fn._cfgs[_accel.native.launch_key(grid, block, None, None, ())] = f
    return fn


def kernel(streams: list[Any], args: tuple[Any, ...], codes: bytes) -> Any:
    """A function whose last plan is ``args``' types, with parameter memory on
    every stream; it is also its own compiled code and launch configuration."""
    plan = _launch._ArgPlan((), tuple(map(type, args)), codes)
    for s in streams:
        s._param_mem[plan] = _launch._ParamMemory(8 * len(args))
    f = _StubKernel()
    f.last, f.handle, f.dims, f._impl = plan, 0xF00, DIMS, f
    return f


class _StubKernel(_accel.native.KernelCore):
    """A stand-in for ``_CudaFunction``: its ``last`` plan in the extension's
    ``KernelCore``, as the launch reads it, and the handle and dimensions."""

    __slots__ = ("_impl", "dims", "handle")


async def throughput(
    streams: list[Any], g: Any, tasks: int, per_task: int, warm_up: int = 64
) -> float:
    """Awaited launches per second: ``tasks`` tasks each awaiting ``per_task``
    launches of ``g`` (see ``kernel``) on ``streams`` (bound with
    ``deferred=True``), after ``warm_up`` such tasks; the "device" is a task
    that writes every marker handed to it once per loop iteration."""
    stop = False

    async def gpu() -> None:
        while not stop:
            for t in streams:
                t._counter.value = t._issued_mark
            await asyncio.sleep(0)

    async def worker(k: int) -> None:
        t = streams[k % len(streams)]
        for _ in range(per_task):
            await t.launch(g, (), g, ())

    device = asyncio.create_task(gpu())
    await asyncio.gather(*(worker(k) for k in range(warm_up)))
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(tasks)))
    dt = time.perf_counter() - t0
    stop = True
    await device
    return tasks * per_task / dt


def per_call_us(fn: Any, calls: int, rounds: int = 5) -> float:
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter_ns() - t0) / calls / 1e3)
    return min(per)


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    calls = 2000 if a.quick else 50000
    tasks, per_task = (200, 5) if a.quick else (1000, 10)
    out: dict[str, Any] = {"environment": environment_info(), "what": __doc__.splitlines()[0]}
    with tempfile.TemporaryDirectory() as tmp:
        lib = stub_driver(tmp)
        bind(lib, deferred=False)
        s = stream(0)
        args = (np.float32(1.5), _Buffer(0x1000, s.state), _Buffer(0x2000, s.state), np.int32(7))
        f = kernel([s], args, b"fPPi")

        def fire() -> None:
            s.launch(f, args, f, ())

        out["launch_4args_us"] = per_call_us(fire, calls)

        # The same launch through DeviceContext.enqueue_function, as users make it.
        ctx = context(s)
        fn = function(ctx, f, 1, 1)
        a_, x, y, n = args
        x._ctx = y._ctx = ctx
        out["enqueue_function_4args_us"] = per_call_us(
            lambda: ctx.enqueue_function(fn, a_, x, y, n, grid_dim=1, block_dim=1), calls
        )
        e = kernel([s], (), b"")
        fn0 = function(ctx, e, 1, 1)
        out["enqueue_function_empty_us"] = per_call_us(
            lambda: ctx.enqueue_function(fn0, grid_dim=1, block_dim=1), calls
        )
        # The same while tracing host times alone (the stand-in stream has no
        # device clock): what the trace adds to a launch, node and end included.
        trace = Trace(device_stamps=False)
        ctx._state.trace = trace
        try:
            out["enqueue_function_empty_traced_host_only_us"] = per_call_us(
                lambda: ctx.enqueue_function(fn0, grid_dim=1, block_dim=1), calls // 4
            )
        finally:
            ctx._state.trace = None
        out["traced_nodes"] = len(trace.nodes)
        del trace

        # A 1 MiB device buffer created from what the stream kept, and dropped.
        alloc = _memory._DeviceAlloc(None, _CoreBuffer(), None, 1 << 20)  # type: ignore[arg-type]
        s.spare.keep(alloc, 1 << 20)

        def create_drop() -> None:
            b = ctx.enqueue_create_buffer(np.uint8, 1 << 20)
            del b

        out["create_drop_1mib_us"] = per_call_us(create_drop, calls)
        if s.spare.take(1 << 20) is not alloc:
            raise AssertionError("the kept buffer did not come back to its stream")
        # The same with nothing kept: every pair through the backend's allocation
        # (a stand-in for cuda.core's pool, no driver call) and its release.
        s.cs = None
        room, s.spare.room = s.spare.room, 0
        out["create_drop_1mib_nothing_kept_us"] = per_call_us(create_drop, calls)
        s.spare.room = room

        async def awaited() -> float:
            async def once() -> None:
                await s.launch(f, args, f, ())

            for _ in range(100):
                await once()
            samples = []
            for _ in range(calls // 5):
                t0 = time.perf_counter_ns()
                await once()
                samples.append(time.perf_counter_ns() - t0)
            return statistics.median(samples) / 1e3

        out["launch_and_await_us"] = asyncio.run(awaited())

        bind(lib, deferred=True)
        streams = [stream(i) for i in range(8)]
        g = kernel(streams, (), b"")

        out["throughput_ops_per_s"] = max(
            asyncio.run(throughput(streams, g, tasks, per_task)) for _ in range(3)
        )

        bind(lib, deferred=False)
        c = stream(9)
        steps = 200 if a.quick else 2000

        async def chain() -> float:
            evs = [c.cpu_call(int.__mul__, (i, 3), {}) for i in range(steps)]
            t0 = time.perf_counter()
            await evs[-1]
            return (time.perf_counter() - t0) / steps * 1e6

        out["cpu_function_chain_us_per_step"] = asyncio.run(chain())
    report_probe(out, a.json)
    return out


if __name__ == "__main__":
    main()
