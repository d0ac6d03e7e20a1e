"""Peer baselines for asyncgpu, measured in the same run so results are ratios.

What is measured (DESIGN.md sections 4, 5 and 7): how fast the host learns that
an empty kernel finished under every known strategy (blocking syncs, polling,
host-mapped counters, host callbacks, executors, CuPy, PyTorch, numba-cuda),
how many awaited operations per second naive asyncio strategies sustain, the
host cost of a kernel launch, copy/memset bandwidth, allocation costs, NVRTC
compile time and stream overlap.  Nothing here imports asyncgpu.

Run::

    python benchmarks/peers_gpu.py --json OUT.json [--quick] [--only SUBSTR,...]

Every case is a function ``case(gpu, params) -> dict`` of plain numbers
(microseconds ``*_us``, milliseconds ``*_ms``, GB/s ``*_gbps``, ops/s).  A
library that cannot be imported, or a missing GPU, turns the case into an
``unavailable`` record with the reason; any other failure becomes an ``error``
record; the rest of the run continues.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

try:
    from . import _harness as H
except ImportError:  # run as a script: benchmarks/ is on sys.path
    import _harness as H  # type: ignore[no-redef]

try:
    from cuda.bindings import driver as drv
except Exception as _exc:  # pragma: no cover - depends on the machine
    drv = None  # type: ignore[assignment]
    _DRV_IMPORT_ERROR = H.describe_exception(_exc)
else:
    _DRV_IMPORT_ERROR = ""

Unavailable = H.Unavailable

# --------------------------------------------------------------------------- kernels

EMPTY_SRC = 'extern "C" __global__ void empty(){}'

AXPY_SRC = r"""
extern "C" __global__ void axpy(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""

CUDA_SRC = (
    EMPTY_SRC
    + "\n"
    + AXPY_SRC
    + r"""
extern "C" __global__ void scale(float* out, const float* in, float a, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        out[i] = a * in[i];
}

// Spins for `ns` nanoseconds of %globaltimer (one thread is enough).
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}
"""
)

KERNEL_NAMES = ("empty", "axpy", "scale", "spin")

# A small module for the cold-compile figure; @ID@ makes every compile unique.
COMPILE_SRC = r"""
// asyncgpu peers compile benchmark @ID@
extern "C" __global__ void k_axpy_@ID@(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void k_sum_@ID@(const float* x, float* out, int n) {
    __shared__ float buf[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    buf[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) buf[threadIdx.x] += buf[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(out, buf[0]);
}
template <typename T>
__device__ T clampv(T v, T lo, T hi) { return v < lo ? lo : (v > hi ? hi : v); }
extern "C" __global__ void k_clamp_@ID@(float* x, int n, float lo, float hi) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = clampv(x[i], lo, hi);
}
"""

# Reference figures from DESIGN.md (its numbers to beat), for the printed table only.
REFERENCES: dict[str, tuple[str, float]] = {
    "rt_mapped_counter_spin": ("median_us", 8.4),
    "rt_asyncio_mapped_counter": ("median_us", 8.7),
    "rt_stream_sync": ("median_us", 10.8),
    "rt_event_query_spin": ("median_us", 10.7),
    "rt_asyncio_event_poll": ("median_us", 13.4),
    "rt_blocking_event_sync": ("median_us", 57.8),
    "rt_hostfunc_threading_event": ("median_us", 76.2),
    "rt_hostfunc_asyncio": ("median_us", 100.2),
    "rt_executor_event_sync": ("median_us", 92.5),
    "rt_cupy_stream_sync": ("median_us", 10.7),
    "rt_torch_sync": ("median_us", 20.8),
    "tp_hostfunc_asyncio": ("median_ops_per_s", 22000.0),
    "launch_core_empty": ("median_us", 4.3),
    "launch_raw_empty": ("median_us", 5.2),
    "launch_raw_4args": ("median_us", 5.0),
    "launch_core_4args": ("median_us", 4.9),
    "launch_cupy_4args": ("median_us", 7.3),
    "launch_torch_add": ("median_us", 9.8),
    "compile_nvrtc": ("median_ms", 264.0),
    "copy_h2d_pinned": ("median_gbps", 55.0),
    "copy_d2h_pinned": ("median_gbps", 55.0),
    "copy_h2d_pageable": ("median_gbps", 8.4),
    "copy_d2d": ("median_gbps", 4240.0),
    "memset_d32": ("median_gbps", 4500.0),
    "overlap_spin_streams": ("many_streams_ms", 2.23),
}

# --------------------------------------------------------------------------- parameters


@dataclass
class Params:
    """Repeat counts and sizes; :meth:`quick` cuts them about 10x."""

    device: int = 0
    repeats: int = 5000  # completion round trips (samples per case)
    warmup: int = 500
    host_call_batch: int = 5000  # calls per batch for per-call host costs
    host_call_rounds: int = 7
    tasks: int = 1000  # throughput: concurrent asyncio tasks
    ops_per_task: int = 10
    streams: int = 8
    tp_rounds: int = 3
    launch_batch: int = 5000  # launches per batch for launch cost
    launch_rounds: int = 7
    copy_mib: int = 512
    copy_repeats: int = 10
    alloc_repeats: int = 2000
    alloc_warmup: int = 100
    compile_repeats: int = 8
    spin_ms: float = 2.0
    overlap_streams: int = 16
    overlap_repeats: int = 10
    pipeline_chunks: int = 32
    pipeline_chunk_mib: int = 8
    pipeline_streams: int = 4
    pipeline_repeats: int = 5
    numba_timeout_s: float = 60.0
    async_timeout_s: float = 120.0  # bound on any asyncio case (hangs become errors)

    @classmethod
    def quick(cls, **overrides: Any) -> Params:
        base = {
            "repeats": 500,
            "warmup": 50,
            "host_call_batch": 500,
            "host_call_rounds": 3,
            "tp_rounds": 1,  # 1000 tasks x 10 ops kept: ops/s depends on the task count
            "launch_batch": 500,
            "launch_rounds": 3,
            "copy_mib": 64,
            "copy_repeats": 3,
            "alloc_repeats": 200,
            "alloc_warmup": 10,
            "compile_repeats": 2,
            "overlap_repeats": 3,
            "pipeline_chunks": 8,
            "pipeline_chunk_mib": 4,
            "pipeline_repeats": 2,
            "numba_timeout_s": 30.0,
            "async_timeout_s": 60.0,
        }
        base.update(overrides)
        return cls(**base)


# --------------------------------------------------------------------------- CUDA helpers


class CudaError(RuntimeError):
    def __init__(self, call: str, err: Any) -> None:
        name = getattr(err, "name", None) or str(err)
        try:
            code = int(err)
        except (TypeError, ValueError):
            code = -1
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.err = err


def _fail(call: str, err: Any) -> None:
    raise CudaError(call, err)


def ck(ret: tuple[Any, ...], call: str) -> Any:
    """Check a cuda.bindings ``(err, *outputs)`` tuple; return the output(s)."""
    err = ret[0]
    if err:
        raise CudaError(call, err)
    if len(ret) == 1:
        return None
    if len(ret) == 2:
        return ret[1]
    return ret[1:]


def _require_driver() -> Any:
    if drv is None:
        raise Unavailable(f"cuda.bindings: {_DRV_IMPORT_ERROR}")
    return drv


def _host_view(ptr: int, nbytes: int, dtype: Any = np.uint8) -> np.ndarray:
    """A NumPy array over ``nbytes`` of host memory at ``ptr`` (no copy)."""
    raw = (ctypes.c_uint8 * nbytes).from_address(int(ptr))
    return np.frombuffer(raw, dtype=np.uint8).view(dtype)


_HOSTFN_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class HostFnBridge:
    """One C host function for ``cuLaunchHostFunc`` dispatching to Python by token.

    cuda.bindings 13.3's ``cuLaunchHostFunc(hStream, fn, userData)`` takes a
    ``CUhostFn`` (a C function pointer, built here from a ctypes ``CFUNCTYPE``
    thunk) and an ``int`` user-data pointer; it does not accept a Python
    callable.  The thunk runs on the driver's callback thread and takes the
    GIL (ctypes) before calling Python; the bindings release the GIL around
    every driver call, so this does not deadlock here.  Keep the bridge alive
    until every enqueued callback has run.
    """

    def __init__(self) -> None:
        self._pending: dict[int, Callable[[], object]] = {}
        self._tokens = itertools.count(1)
        self.errors: list[BaseException] = []
        self._thunk = _HOSTFN_TYPE(self._dispatch)
        addr = ctypes.cast(self._thunk, ctypes.c_void_p).value
        self.fn = _require_driver().CUhostFn(addr)

    def _dispatch(self, user_data: int | None) -> None:
        try:
            self._pending.pop(user_data or 0)()
        except BaseException as exc:  # never let an exception escape into the driver
            self.errors.append(exc)

    def add(self, callback: Callable[[], object]) -> int:
        token = next(self._tokens)
        self._pending[token] = callback
        return token

    def check(self) -> None:
        if self.errors:
            raise RuntimeError(f"host callback failed: {H.describe_exception(self.errors[0])}")


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_context(ctx: Any) -> None:
    ck(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


class Gpu:
    """The device, the compiled kernels (cuda.core and raw handles) and streams."""

    def __init__(self, params: Params) -> None:
        _require_driver()
        try:
            from cuda.core import Device, LaunchConfig, Program, ProgramOptions, launch
        except Exception as exc:
            raise Unavailable(f"cuda.core: {H.describe_exception(exc)}") from exc
        try:
            (err,) = drv.cuInit(0)
        except RuntimeError as exc:  # libcuda.so.1 cannot be loaded
            raise Unavailable(f"no CUDA driver: {H.describe_exception(exc)}") from exc
        if err:
            raise Unavailable(f"cuInit failed: {getattr(err, 'name', err)}")
        count = ck(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if count <= params.device:
            raise Unavailable(f"no CUDA device {params.device} ({count} present)")

        self.params = params
        self.Program, self.ProgramOptions = Program, ProgramOptions
        self.LaunchConfig, self.launch = LaunchConfig, launch
        self.dev = Device(params.device)
        self.dev.set_current()
        self.ctx = ck(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self.cu_device = ck(drv.cuDeviceGet(params.device), "cuDeviceGet")
        cc = self.dev.compute_capability
        self.arch = f"sm_{cc.major}{cc.minor}"
        t0 = time.perf_counter()
        opts = ProgramOptions(arch=self.arch, name="asyncgpu_peers")
        self.obj = Program(CUDA_SRC, "c++", opts).compile("cubin")
        self.first_compile_ms = (time.perf_counter() - t0) * 1e3
        self.kernels = {n: self.obj.get_kernel(n) for n in KERNEL_NAMES}
        self.module = ck(drv.cuModuleLoadData(self.obj.code), "cuModuleLoadData")
        self.fn = {
            n: ck(drv.cuModuleGetFunction(self.module, n.encode()), f"cuModuleGetFunction({n})")
            for n in KERNEL_NAMES
        }
        self.core_stream = self.dev.create_stream()
        n_streams = max(params.streams, params.overlap_streams, params.pipeline_streams, 1)
        flag = int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)
        self.streams = [ck(drv.cuStreamCreate(flag), "cuStreamCreate") for _ in range(n_streams)]
        self.stream = self.streams[0]
        self._copy_bufs: CopyBuffers | None = None

    # -- small helpers (not used inside timed loops) --

    def event(self, *, timing: bool = False, blocking: bool = False) -> Any:
        flags = 0
        if not timing:
            flags |= int(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if blocking:
            flags |= int(drv.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        return ck(drv.cuEventCreate(flags), "cuEventCreate")

    def sync_all(self) -> None:
        for s in self.streams:
            ck(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
        self.core_stream.sync()

    def attribute(self, attr: Any) -> int:
        return int(ck(drv.cuDeviceGetAttribute(attr, self.cu_device), "cuDeviceGetAttribute"))

    def copy_buffers(self, nbytes: int) -> CopyBuffers:
        if self._copy_bufs is None or self._copy_bufs.nbytes != nbytes:
            if self._copy_bufs is not None:
                self._copy_bufs.free()
                self._copy_bufs = None
            self._copy_bufs = CopyBuffers(nbytes)
        return self._copy_bufs

    def release_copy_buffers(self) -> None:
        if self._copy_bufs is not None:
            self.sync_all()
            self._copy_bufs.free()
            self._copy_bufs = None

    def close(self) -> None:
        try:
            self.sync_all()
        finally:
            self.release_copy_buffers()
            for s in self.streams:
                drv.cuStreamDestroy(s)
            self.streams = []
            drv.cuModuleUnload(self.module)
            self.core_stream.close()


class CopyBuffers:
    """Pinned source/destination, a pageable source, and two device buffers."""

    def __init__(self, nbytes: int) -> None:
        if nbytes % 8:
            raise ValueError("copy size must be a multiple of 8 bytes")
        self.nbytes = nbytes
        self._host: list[int] = []
        self._dev: list[Any] = []
        try:
            self.h_src = int(ck(drv.cuMemAllocHost(nbytes), "cuMemAllocHost"))
            self._host.append(self.h_src)
            self.h_dst = int(ck(drv.cuMemAllocHost(nbytes), "cuMemAllocHost"))
            self._host.append(self.h_dst)
            self.d_a = ck(drv.cuMemAlloc(nbytes), "cuMemAlloc")
            self._dev.append(self.d_a)
            self.d_b = ck(drv.cuMemAlloc(nbytes), "cuMemAlloc")
            self._dev.append(self.d_b)
        except BaseException:
            self.free()
            raise
        rng = np.random.default_rng(0x5EED)
        self.src = _host_view(self.h_src, nbytes)
        rng.random(out=self.src.view(np.float64))  # random, non-zero bytes
        self.dst = _host_view(self.h_dst, nbytes)
        self.dst[:] = 0
        self.pageable = rng.random(nbytes // 8)  # fresh pageable NumPy memory
        self.pageable_out = np.empty_like(self.pageable)

    def free(self) -> None:
        for p in self._host:
            drv.cuMemFreeHost(p)
        for d in self._dev:
            drv.cuMemFree(d)
        self._host, self._dev = [], []


_SPIN_LIMIT = 200_000_000  # busy-wait iterations before a spin loop gives up


# --------------------------------------------------------------------------- completion


def rt_stream_sync(gpu: Gpu, p: Params) -> dict[str, float]:
    """1. launch + blocking ``cuStreamSynchronize``."""
    f, s, launch, sync = gpu.fn["empty"], gpu.stream, drv.cuLaunchKernel, drv.cuStreamSynchronize

    def once() -> None:
        (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
        if err:
            _fail("cuLaunchKernel", err)
        (err,) = sync(s)
        if err:
            _fail("cuStreamSynchronize", err)

    return H.summarize_ns(H.time_calls(once, p.repeats, p.warmup))


def rt_event_query_spin(gpu: Gpu, p: Params) -> dict[str, float]:
    """2. launch + ``cuEventRecord`` + busy ``cuEventQuery`` loop."""
    f, s = gpu.fn["empty"], gpu.stream
    launch, record, query = drv.cuLaunchKernel, drv.cuEventRecord, drv.cuEventQuery
    not_ready = drv.CUresult.CUDA_ERROR_NOT_READY
    ev = gpu.event()
    try:

        def once() -> None:
            (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
            if err:
                _fail("cuLaunchKernel", err)
            (err,) = record(ev, s)
            if err:
                _fail("cuEventRecord", err)
            for _ in range(_SPIN_LIMIT):
                (err,) = query(ev)
                if not err:
                    return
                if err != not_ready:
                    _fail("cuEventQuery", err)
            raise TimeoutError("event never completed")

        return H.summarize_ns(H.time_calls(once, p.repeats, p.warmup))
    finally:
        drv.cuStreamSynchronize(s)
        drv.cuEventDestroy(ev)


def rt_asyncio_event_poll(gpu: Gpu, p: Params) -> dict[str, float]:
    """3. launch + ``cuEventRecord``; asyncio polls ``cuEventQuery`` with ``sleep(0)``."""
    f, s = gpu.fn["empty"], gpu.stream
    launch, record, query = drv.cuLaunchKernel, drv.cuEventRecord, drv.cuEventQuery
    not_ready = drv.CUresult.CUDA_ERROR_NOT_READY
    sleep = asyncio.sleep
    ev = gpu.event()

    async def once() -> None:
        (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
        if err:
            _fail("cuLaunchKernel", err)
        (err,) = record(ev, s)
        if err:
            _fail("cuEventRecord", err)
        while True:
            (err,) = query(ev)
            if not err:
                return
            if err != not_ready:
                _fail("cuEventQuery", err)
            await sleep(0)

    try:
        samples = H.run_async(
            lambda: H.time_calls_async(once, p.repeats, p.warmup), p.async_timeout_s
        )
        return H.summarize_ns(samples)
    finally:
        drv.cuStreamSynchronize(s)
        drv.cuEventDestroy(ev)


class MappedCounter:
    """A uint64 counter in host-mapped pinned memory, written by the GPU."""

    def __init__(self, gpu: Gpu, slots: int = 8) -> None:
        attr = drv.CUdevice_attribute
        if not gpu.attribute(attr.CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY):
            raise Unavailable("device cannot map host memory")
        if not gpu.attribute(attr.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS):
            raise Unavailable("device lacks 64-bit stream memory operations")
        flags = drv.CU_MEMHOSTALLOC_DEVICEMAP | drv.CU_MEMHOSTALLOC_PORTABLE
        self.hptr = int(ck(drv.cuMemHostAlloc(8 * slots, flags), "cuMemHostAlloc"))
        try:
            self.dptr = ck(drv.cuMemHostGetDevicePointer(self.hptr, 0), "cuMemHostGetDevicePointer")
        except BaseException:
            drv.cuMemFreeHost(self.hptr)
            raise
        self.view = np.ctypeslib.as_array((ctypes.c_uint64 * slots).from_address(self.hptr))
        self.view[:] = 0
        self.value = 0

    def free(self) -> None:
        drv.cuMemFreeHost(self.hptr)


def rt_mapped_counter_spin(gpu: Gpu, p: Params) -> dict[str, float]:
    """4. launch + ``cuStreamWriteValue64`` into host-mapped memory; host spins on it."""
    f, s = gpu.fn["empty"], gpu.stream
    launch, write = drv.cuLaunchKernel, drv.cuStreamWriteValue64
    flag = int(drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
    ctr = MappedCounter(gpu)
    view, dptr = ctr.view, ctr.dptr
    try:

        def once() -> None:
            v = ctr.value + 1
            ctr.value = v
            (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
            if err:
                _fail("cuLaunchKernel", err)
            (err,) = write(s, dptr, v, flag)
            if err:
                _fail("cuStreamWriteValue64", err)
            for _ in range(_SPIN_LIMIT):
                if view[0] >= v:
                    return
            raise TimeoutError("mapped counter never advanced")

        return H.summarize_ns(H.time_calls(once, p.repeats, p.warmup))
    finally:
        drv.cuStreamSynchronize(s)
        ctr.free()


def rt_asyncio_mapped_counter(gpu: Gpu, p: Params) -> dict[str, float]:
    """5. the mapped counter polled from asyncio with ``await asyncio.sleep(0)``."""
    f, s = gpu.fn["empty"], gpu.stream
    launch, write = drv.cuLaunchKernel, drv.cuStreamWriteValue64
    flag = int(drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT)
    sleep = asyncio.sleep
    ctr = MappedCounter(gpu)
    view, dptr = ctr.view, ctr.dptr

    async def once() -> None:
        v = ctr.value + 1
        ctr.value = v
        (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
        if err:
            _fail("cuLaunchKernel", err)
        (err,) = write(s, dptr, v, flag)
        if err:
            _fail("cuStreamWriteValue64", err)
        while view[0] < v:
            await sleep(0)

    try:
        samples = H.run_async(
            lambda: H.time_calls_async(once, p.repeats, p.warmup), p.async_timeout_s
        )
        return H.summarize_ns(samples)
    finally:
        drv.cuStreamSynchronize(s)
        ctr.free()


def rt_blocking_event_sync(gpu: Gpu, p: Params) -> dict[str, float]:
    """6. ``CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING`` event + ``cuEventSynchronize``."""
    f, s = gpu.fn["empty"], gpu.stream
    launch, record, esync = drv.cuLaunchKernel, drv.cuEventRecord, drv.cuEventSynchronize
    ev = gpu.event(blocking=True)
    try:

        def once() -> None:
            (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
            if err:
                _fail("cuLaunchKernel", err)
            (err,) = record(ev, s)
            if err:
                _fail("cuEventRecord", err)
            (err,) = esync(ev)
            if err:
                _fail("cuEventSynchronize", err)

        return H.summarize_ns(H.time_calls(once, p.repeats, p.warmup))
    finally:
        drv.cuStreamSynchronize(s)
        drv.cuEventDestroy(ev)


def rt_hostfunc_threading_event(gpu: Gpu, p: Params) -> dict[str, float]:
    """7. ``cuLaunchHostFunc`` -> ``threading.Event.set``; the host waits on the Event."""
    f, s = gpu.fn["empty"], gpu.stream
    launch, hostfunc = drv.cuLaunchKernel, drv.cuLaunchHostFunc
    bridge = HostFnBridge()
    done = threading.Event()
    hfn, setter = bridge.fn, done.set

    def once() -> None:
        done.clear()
        token = bridge.add(setter)
        (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
        if err:
            _fail("cuLaunchKernel", err)
        (err,) = hostfunc(s, hfn, token)
        if err:
            _fail("cuLaunchHostFunc", err)
        if not done.wait(30.0):
            bridge.check()
            raise TimeoutError("host function never ran")

    try:
        res = H.summarize_ns(H.time_calls(once, p.repeats, p.warmup))
        bridge.check()
        return res
    finally:
        drv.cuStreamSynchronize(s)


def rt_hostfunc_asyncio(gpu: Gpu, p: Params) -> dict[str, float]:
    """8. ``cuLaunchHostFunc`` -> ``loop.call_soon_threadsafe`` -> ``await`` a future."""
    f, s = gpu.fn["empty"], gpu.stream
    bridge = HostFnBridge()

    async def main() -> list[int]:
        once = hostfunc_awaits(f, [s], 1, bridge)  # one awaited launch per call
        return await H.time_calls_async(lambda: once(0), p.repeats, p.warmup)

    try:
        res = H.summarize_ns(H.run_async(main, p.async_timeout_s))
        bridge.check()
        return res
    finally:
        drv.cuStreamSynchronize(s)


def _executor_round_trip(gpu: Gpu, p: Params, *, blocking: bool) -> dict[str, float]:
    f, s = gpu.fn["empty"], gpu.stream
    launch, record, esync = drv.cuLaunchKernel, drv.cuEventRecord, drv.cuEventSynchronize
    ev = gpu.event(blocking=blocking)

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(
            ThreadPoolExecutor(
                thread_name_prefix="peers", initializer=_set_context, initargs=(gpu.ctx,)
            )
        )

        async def once() -> None:
            (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
            if err:
                _fail("cuLaunchKernel", err)
            (err,) = record(ev, s)
            if err:
                _fail("cuEventRecord", err)
            (err,) = await loop.run_in_executor(None, esync, ev)
            if err:
                _fail("cuEventSynchronize", err)

        return await H.time_calls_async(once, p.repeats, p.warmup)

    try:
        return H.summarize_ns(H.run_async(main, p.async_timeout_s))
    finally:
        drv.cuStreamSynchronize(s)
        drv.cuEventDestroy(ev)


def rt_executor_event_sync(gpu: Gpu, p: Params) -> dict[str, float]:
    """9. ``await run_in_executor(None, cuEventSynchronize, ev)`` (spin-wait event)."""
    return _executor_round_trip(gpu, p, blocking=False)


def rt_executor_blocking_event_sync(gpu: Gpu, p: Params) -> dict[str, float]:
    """9b. as 9, with a ``CU_EVENT_BLOCKING_SYNC`` event (the worker sleeps)."""
    return _executor_round_trip(gpu, p, blocking=True)


def _import_cupy(gpu: Gpu) -> Any:
    try:
        import cupy as cp
    except Exception as exc:
        raise Unavailable(f"cupy: {H.describe_exception(exc)}") from exc
    cp.cuda.Device(gpu.params.device).use()
    return cp


def _import_torch(gpu: Gpu) -> Any:
    try:
        import torch
    except Exception as exc:
        raise Unavailable(f"torch: {H.describe_exception(exc)}") from exc
    if not torch.cuda.is_available():
        raise Unavailable("torch: torch.cuda.is_available() is False")
    torch.cuda.set_device(gpu.params.device)
    return torch


def rt_cupy_stream_sync(gpu: Gpu, p: Params) -> dict[str, float]:
    """10. CuPy ``RawKernel`` empty launch + ``stream.synchronize()``."""
    cp = _import_cupy(gpu)
    kernel = cp.RawKernel(EMPTY_SRC, "empty")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:

        def once() -> None:
            kernel((1,), (1,), ())
            stream.synchronize()

        return H.summarize_ns(H.time_calls(once, p.repeats, p.warmup))


def rt_torch_sync(gpu: Gpu, p: Params) -> dict[str, float]:
    """11. PyTorch ``x.add_(1)`` on a 1-element CUDA tensor + ``torch.cuda.synchronize()``."""
    torch = _import_torch(gpu)
    x = torch.zeros(1, device=f"cuda:{p.device}")
    sync = torch.cuda.synchronize

    def once() -> None:
        x.add_(1)
        sync()

    return H.summarize_ns(H.time_calls(once, p.repeats, p.warmup))


def rt_numba_async_done(gpu: Gpu | None, p: Params) -> dict[str, float]:
    """12. numba-cuda ``await stream.async_done()`` after an empty ``@cuda.jit`` kernel.

    Runs in a child process with a timeout: numba-cuda may fail to import
    (NumPy 2.5) or deadlock in its host callback (numba-cuda#317).
    """
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_numba-child",
        "--device",
        str(p.device),
        "--repeats",
        str(p.repeats),
        "--warmup",
        str(p.warmup),
    ]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=p.numba_timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(
            f"numba-cuda child gave no result within {p.numba_timeout_s:.0f} s "
            "(hang; host-callback deadlock as in numba-cuda#317?)"
        ) from exc
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"numba-cuda child exited {proc.returncode}: {' | '.join(tail)}")
    out = json.loads(lines[-1])
    if out.get("status") == "unavailable":
        raise Unavailable(f"numba-cuda: {out.get('reason')}")
    if out.get("status") != "ok":
        raise RuntimeError(f"numba-cuda: {out.get('reason')}")
    return out["metrics"]


def _numba_child(device: int, repeats: int, warmup: int) -> dict[str, Any]:
    import numpy as np

    if not hasattr(np, "row_stack"):
        # numba-cuda 0.30.4 registers an overload of np.row_stack at import, which
        # NumPy 2.5 removed; restore the alias (np.vstack) in this child only.
        np.row_stack = np.vstack  # type: ignore[attr-defined]
    try:
        from numba import cuda
    except BaseException as exc:  # numba raises assorted errors at import
        return {"status": "unavailable", "reason": H.describe_exception(exc)}
    try:
        cuda.select_device(device)

        @cuda.jit
        def empty() -> None:
            pass

        stream = cuda.stream()

        async def once() -> None:
            empty[1, 1, stream]()
            await stream.async_done()

        samples = H.run_async(lambda: H.time_calls_async(once, repeats, warmup), 300.0)
        return {"status": "ok", "metrics": H.summarize_ns(samples)}
    except AttributeError as exc:
        if "CUstream' object has no attribute 'value'" not in str(exc):
            return {"status": "error", "reason": H.describe_exception(exc)}
        # numba-cuda 0.30.4's Stream.add_callback, which async_done uses, passes
        # self.handle.value to cuStreamAddCallback; cuda-bindings' CUstream has no
        # .value (its other stream calls use int(handle)). The kernel launch works.
        return {
            "status": "unavailable",
            "reason": "numba-cuda's Stream.async_done fails before it waits: its "
            "add_callback reads CUstream.value, which this cuda-bindings lacks "
            f"({H.describe_exception(exc)})",
        }
    except BaseException as exc:
        return {"status": "error", "reason": H.describe_exception(exc)}


# --------------------------------------------------------------------------- host call costs


def host_call_costs(gpu: Gpu, p: Params) -> dict[str, float]:
    """Host time per call: cuEventRecord, cuEventQuery, cuStreamQuery, cuStreamWriteValue64."""
    s = gpu.stream
    record, query, squery = drv.cuEventRecord, drv.cuEventQuery, drv.cuStreamQuery
    write = drv.cuStreamWriteValue64
    n = p.host_call_batch
    ev = gpu.event()
    ctr = MappedCounter(gpu)
    dptr = ctr.dptr

    def per_call(batch: Callable[[], None]) -> float:
        batch()  # warm-up
        ck(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
        vals = []
        with H.gc_paused():
            for _ in range(p.host_call_rounds):
                t0 = time.perf_counter_ns()
                batch()
                vals.append((time.perf_counter_ns() - t0) / n / 1e3)
                ck(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
        return H.median(vals)

    def b_record() -> None:
        for _ in range(n):
            (err,) = record(ev, s)
            if err:
                _fail("cuEventRecord", err)

    def b_query() -> None:
        for _ in range(n):
            (err,) = query(ev)
            if err:
                _fail("cuEventQuery", err)

    def b_squery() -> None:
        for _ in range(n):
            (err,) = squery(s)
            if err:
                _fail("cuStreamQuery", err)

    def b_write() -> None:
        for i in range(n):
            (err,) = write(s, dptr, i, 0)
            if err:
                _fail("cuStreamWriteValue64", err)

    try:
        return {
            "event_record_us": per_call(b_record),
            "event_query_us": per_call(b_query),
            "stream_query_us": per_call(b_squery),
            "stream_write_value64_us": per_call(b_write),
            "calls_per_batch": n,
        }
    finally:
        drv.cuStreamSynchronize(s)
        drv.cuEventDestroy(ev)
        ctr.free()


# --------------------------------------------------------------------------- throughput


async def _run_task_rounds(task: Callable[[int], Any], gpu: Gpu, p: Params) -> dict[str, float]:
    await asyncio.gather(*(task(i) for i in range(min(p.tasks, 4 * p.streams))))  # warm-up
    rates, walls = [], []
    for _ in range(p.tp_rounds):
        with H.gc_paused():
            t0 = time.perf_counter_ns()
            await asyncio.gather(*(task(i) for i in range(p.tasks)))
            dt = time.perf_counter_ns() - t0
        rates.append(p.tasks * p.ops_per_task / (dt * 1e-9))
        walls.append(dt * 1e-6)
    gpu.sync_all()
    return {
        "median_ops_per_s": H.median(rates),
        "max_ops_per_s": max(rates),
        "min_ops_per_s": min(rates),
        "median_wall_ms": H.median(walls),
        "tasks": p.tasks,
        "ops_per_task": p.ops_per_task,
        "streams": p.streams,
        "rounds": p.tp_rounds,
    }


def hostfunc_awaits(
    f: Any, streams: Sequence[Any], ops_per_task: int, bridge: HostFnBridge
) -> Callable[[int], Any]:
    """The host-callback strategy's task (call it on the running loop): task ``i``
    awaits ``ops_per_task`` launches of ``f`` on ``streams[i % len(streams)]``,
    each resolved by a ``cuLaunchHostFunc`` that calls ``call_soon_threadsafe``.
    (Also asyncgpu's paired throughput rounds, ``bench_engine.throughput_paired``.)"""
    launch, hostfunc = _require_driver().cuLaunchKernel, drv.cuLaunchHostFunc
    hfn = bridge.fn
    loop = asyncio.get_running_loop()
    threadsafe = loop.call_soon_threadsafe

    async def task(i: int) -> None:
        s = streams[i % len(streams)]
        for _ in range(ops_per_task):
            fut = loop.create_future()
            token = bridge.add(functools.partial(threadsafe, _resolve, fut))
            (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
            if err:
                _fail("cuLaunchKernel", err)
            (err,) = hostfunc(s, hfn, token)
            if err:
                _fail("cuLaunchHostFunc", err)
            await fut

    return task


def tp_hostfunc_asyncio(gpu: Gpu, p: Params) -> dict[str, float]:
    """1000 tasks x 10 awaited empty launches on 8 streams; host callback strategy."""
    f, streams = gpu.fn["empty"], gpu.streams[: p.streams]
    bridge = HostFnBridge()

    async def main() -> dict[str, float]:
        task = hostfunc_awaits(f, streams, p.ops_per_task, bridge)
        return await _run_task_rounds(task, gpu, p)

    try:
        res = H.run_async(main, p.async_timeout_s)
        bridge.check()
        return res
    finally:
        gpu.sync_all()


def tp_event_poll_asyncio(gpu: Gpu, p: Params) -> dict[str, float]:
    """Same workload; each task records its event and polls it with ``sleep(0)``."""
    f, streams = gpu.fn["empty"], gpu.streams[: p.streams]
    launch, record, query = drv.cuLaunchKernel, drv.cuEventRecord, drv.cuEventQuery
    not_ready = drv.CUresult.CUDA_ERROR_NOT_READY
    events = [gpu.event() for _ in range(p.tasks)]
    sleep = asyncio.sleep

    async def task(i: int) -> None:
        s, ev = streams[i % len(streams)], events[i]
        for _ in range(p.ops_per_task):
            (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
            if err:
                _fail("cuLaunchKernel", err)
            (err,) = record(ev, s)
            if err:
                _fail("cuEventRecord", err)
            while True:
                (err,) = query(ev)
                if not err:
                    break
                if err != not_ready:
                    _fail("cuEventQuery", err)
                await sleep(0)

    try:
        return H.run_async(lambda: _run_task_rounds(task, gpu, p), p.async_timeout_s)
    finally:
        gpu.sync_all()
        for ev in events:
            drv.cuEventDestroy(ev)


def tp_executor_event_sync(gpu: Gpu, p: Params) -> dict[str, float]:
    """Same workload; each op awaits ``run_in_executor(None, cuEventSynchronize, ev)``."""
    f, streams = gpu.fn["empty"], gpu.streams[: p.streams]
    launch, record, esync = drv.cuLaunchKernel, drv.cuEventRecord, drv.cuEventSynchronize
    events = [gpu.event() for _ in range(p.tasks)]

    async def main() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        pool = ThreadPoolExecutor(
            thread_name_prefix="peers", initializer=_set_context, initargs=(gpu.ctx,)
        )
        loop.set_default_executor(pool)

        async def task(i: int) -> None:
            s, ev = streams[i % len(streams)], events[i]
            for _ in range(p.ops_per_task):
                (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
                if err:
                    _fail("cuLaunchKernel", err)
                (err,) = record(ev, s)
                if err:
                    _fail("cuEventRecord", err)
                (err,) = await loop.run_in_executor(None, esync, ev)
                if err:
                    _fail("cuEventSynchronize", err)

        res = await _run_task_rounds(task, gpu, p)
        res["executor_threads"] = pool._max_workers
        return res

    try:
        return H.run_async(main, p.async_timeout_s)
    finally:
        gpu.sync_all()
        for ev in events:
            drv.cuEventDestroy(ev)


# --------------------------------------------------------------------------- launch cost


def _launch_cost(
    batch: Callable[[int], None], sync: Callable[[], object], p: Params
) -> dict[str, float]:
    """Host time per launch: ``n`` launches timed, then one sync; median over rounds."""
    n = p.launch_batch
    batch(min(n, 500))
    sync()
    per, per_sync = [], []
    with H.gc_paused():
        for _ in range(p.launch_rounds):
            t0 = time.perf_counter_ns()
            batch(n)
            t1 = time.perf_counter_ns()
            sync()
            t2 = time.perf_counter_ns()
            per.append((t1 - t0) / n / 1e3)
            per_sync.append((t2 - t0) / n / 1e3)
    return {
        "median_us": H.median(per),
        "min_us": min(per),
        "median_us_incl_sync": H.median(per_sync),
        "launches_per_round": n,
        "rounds": p.launch_rounds,
    }


def _raw_sync(stream: Any) -> Callable[[], None]:
    def sync() -> None:
        ck(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")

    return sync


def launch_core_empty(gpu: Gpu, p: Params) -> dict[str, float]:
    """cuda.core ``launch`` of the empty kernel."""
    launch, k, cs = gpu.launch, gpu.kernels["empty"], gpu.core_stream
    cfg = gpu.LaunchConfig(grid=1, block=1)

    def batch(n: int) -> None:
        for _ in range(n):
            launch(cs, cfg, k)

    return _launch_cost(batch, cs.sync, p)


def launch_raw_empty(gpu: Gpu, p: Params) -> dict[str, float]:
    """raw ``cuLaunchKernel`` of the empty kernel (no parameters)."""
    f, s, launch = gpu.fn["empty"], gpu.stream, drv.cuLaunchKernel

    def batch(n: int) -> None:
        for _ in range(n):
            (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
            if err:
                _fail("cuLaunchKernel", err)

    return _launch_cost(batch, _raw_sync(s), p)


_AXPY_N = 256


def _device_zeros(nbytes: int, stream: Any) -> Any:
    d = ck(drv.cuMemAlloc(nbytes), "cuMemAlloc")
    ck(drv.cuMemsetD32Async(d, 0, nbytes // 4, stream), "cuMemsetD32Async")
    return d


def launch_raw_4args(gpu: Gpu, p: Params) -> dict[str, float]:
    """raw ``cuLaunchKernel`` of ``axpy(float*, const float*, float, int)``, params packed once."""
    f, s, launch = gpu.fn["axpy"], gpu.stream, drv.cuLaunchKernel
    nbytes = _AXPY_N * 4
    dy, dx = _device_zeros(nbytes, s), _device_zeros(nbytes, s)
    try:
        # kernelParams as a void** address: an array of pointers to each value.
        vals = (
            np.array([int(dy)], dtype=np.uint64),
            np.array([int(dx)], dtype=np.uint64),
            np.array([2.0], dtype=np.float32),
            np.array([_AXPY_N], dtype=np.int32),
        )
        ptrs = np.array([v.ctypes.data for v in vals], dtype=np.uint64)
        addr = int(ptrs.ctypes.data)

        def batch(n: int) -> None:
            for _ in range(n):
                (err,) = launch(f, 1, 1, 1, _AXPY_N, 1, 1, 0, s, addr, 0)
                if err:
                    _fail("cuLaunchKernel", err)

        res = _launch_cost(batch, _raw_sync(s), p)
        del vals, ptrs
        return res
    finally:
        drv.cuStreamSynchronize(s)
        drv.cuMemFree(dy)
        drv.cuMemFree(dx)


def launch_core_4args(gpu: Gpu, p: Params) -> dict[str, float]:
    """cuda.core ``launch`` of axpy with two ``Buffer``s, ``np.float32`` and ``np.int32``."""
    launch, k, cs = gpu.launch, gpu.kernels["axpy"], gpu.core_stream
    cfg = gpu.LaunchConfig(grid=1, block=_AXPY_N)
    y = gpu.dev.allocate(_AXPY_N * 4, stream=cs)
    x = gpu.dev.allocate(_AXPY_N * 4, stream=cs)
    try:
        ck(drv.cuMemsetD32Async(int(y.handle), 0, _AXPY_N, cs.handle), "cuMemsetD32Async")
        ck(drv.cuMemsetD32Async(int(x.handle), 0, _AXPY_N, cs.handle), "cuMemsetD32Async")
        a, n_arg = np.float32(2.0), np.int32(_AXPY_N)

        def batch(n: int) -> None:
            for _ in range(n):
                launch(cs, cfg, k, y, x, a, n_arg)

        return _launch_cost(batch, cs.sync, p)
    finally:
        cs.sync()
        y.close(cs)
        x.close(cs)


def launch_cupy_4args(gpu: Gpu, p: Params) -> dict[str, float]:
    """CuPy ``RawKernel`` axpy launch with two arrays, ``np.float32`` and ``np.int32``."""
    cp = _import_cupy(gpu)
    kernel = cp.RawKernel(AXPY_SRC, "axpy")
    y = cp.zeros(_AXPY_N, dtype=cp.float32)
    x = cp.zeros(_AXPY_N, dtype=cp.float32)
    cp.cuda.Device(p.device).synchronize()  # the arrays were made on the legacy stream
    args = (y, x, np.float32(2.0), np.int32(_AXPY_N))
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:

        def batch(n: int) -> None:
            for _ in range(n):
                kernel((1,), (_AXPY_N,), args)

        return _launch_cost(batch, stream.synchronize, p)


def launch_torch_add(gpu: Gpu, p: Params) -> dict[str, float]:
    """PyTorch ``x.add_(1)`` on a 256-element CUDA tensor."""
    torch = _import_torch(gpu)
    x = torch.zeros(_AXPY_N, device=f"cuda:{p.device}")

    def batch(n: int) -> None:
        for _ in range(n):
            x.add_(1)

    return _launch_cost(batch, torch.cuda.synchronize, p)


# --------------------------------------------------------------------------- copies


def _event_timed(gpu: Gpu, enqueue: Callable[[], None], repeats: int) -> list[float]:
    """Seconds per ``enqueue()`` on gpu.stream, timed with CUDA events."""
    s = gpu.stream
    start, stop = gpu.event(timing=True), gpu.event(timing=True)
    try:
        enqueue()  # warm-up
        ck(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
        out = []
        for _ in range(repeats):
            ck(drv.cuEventRecord(start, s), "cuEventRecord")
            enqueue()
            ck(drv.cuEventRecord(stop, s), "cuEventRecord")
            ck(drv.cuEventSynchronize(stop), "cuEventSynchronize")
            ms = ck(drv.cuEventElapsedTime(start, stop), "cuEventElapsedTime")
            out.append(float(ms) * 1e-3)
        return out
    finally:
        drv.cuStreamSynchronize(s)
        drv.cuEventDestroy(start)
        drv.cuEventDestroy(stop)


def _check_equal(a: np.ndarray, b: np.ndarray, what: str) -> None:
    span = min(a.size, 1 << 20)
    if not (np.array_equal(a[:span], b[:span]) and np.array_equal(a[-span:], b[-span:])):
        raise RuntimeError(f"{what}: copied data does not match the source")


def copy_h2d_pinned(gpu: Gpu, p: Params) -> dict[str, float]:
    """``cuMemcpyHtoDAsync`` from pinned (``cuMemAllocHost``) memory, random data."""
    b = gpu.copy_buffers(p.copy_mib << 20)
    s = gpu.stream

    def go() -> None:
        ck(drv.cuMemcpyHtoDAsync(b.d_a, b.h_src, b.nbytes, s), "cuMemcpyHtoDAsync")

    return H.summarize_bandwidth(b.nbytes, _event_timed(gpu, go, p.copy_repeats))


def copy_d2h_pinned(gpu: Gpu, p: Params) -> dict[str, float]:
    """``cuMemcpyDtoHAsync`` into pinned memory (device holds the random source)."""
    b = gpu.copy_buffers(p.copy_mib << 20)
    s = gpu.stream
    ck(drv.cuMemcpyHtoDAsync(b.d_a, b.h_src, b.nbytes, s), "cuMemcpyHtoDAsync")

    def go() -> None:
        ck(drv.cuMemcpyDtoHAsync(b.h_dst, b.d_a, b.nbytes, s), "cuMemcpyDtoHAsync")

    res = H.summarize_bandwidth(b.nbytes, _event_timed(gpu, go, p.copy_repeats))
    _check_equal(b.dst, b.src, "pinned H2D/D2H round trip")
    return res


def copy_h2d_pageable(gpu: Gpu, p: Params) -> dict[str, float]:
    """Synchronous ``cuMemcpyHtoD`` from a pageable NumPy array (host-timed)."""
    b = gpu.copy_buffers(p.copy_mib << 20)
    src = int(b.pageable.ctypes.data)

    def go() -> None:
        ck(drv.cuMemcpyHtoD(b.d_a, src, b.nbytes), "cuMemcpyHtoD")

    go()
    secs = [t * 1e-9 for t in H.time_calls(go, p.copy_repeats, 0, pause_gc=False)]
    return H.summarize_bandwidth(b.nbytes, secs)


def copy_d2h_pageable(gpu: Gpu, p: Params) -> dict[str, float]:
    """Synchronous ``cuMemcpyDtoH`` into a pageable NumPy array (host-timed)."""
    b = gpu.copy_buffers(p.copy_mib << 20)
    ck(drv.cuMemcpyHtoD(b.d_a, int(b.pageable.ctypes.data), b.nbytes), "cuMemcpyHtoD")
    dst = int(b.pageable_out.ctypes.data)

    def go() -> None:
        ck(drv.cuMemcpyDtoH(dst, b.d_a, b.nbytes), "cuMemcpyDtoH")

    go()
    secs = [t * 1e-9 for t in H.time_calls(go, p.copy_repeats, 0, pause_gc=False)]
    res = H.summarize_bandwidth(b.nbytes, secs)
    _check_equal(
        b.pageable_out.view(np.uint8), b.pageable.view(np.uint8), "pageable H2D/D2H round trip"
    )
    return res


D2D_PER_WINDOW = 4


def copy_d2d(gpu: Gpu, p: Params) -> dict[str, float]:
    """``cuMemcpyDtoDAsync``; bandwidth counts read + write bytes (2x size). One
    copy takes about 0.25 ms, so each timed window holds ``D2D_PER_WINDOW`` copies:
    the host's gap before the first (the same for every library) stays small."""
    b = gpu.copy_buffers(p.copy_mib << 20)
    s = gpu.stream
    ck(drv.cuMemcpyHtoDAsync(b.d_a, b.h_src, b.nbytes, s), "cuMemcpyHtoDAsync")

    def go() -> None:
        for _ in range(D2D_PER_WINDOW):
            ck(drv.cuMemcpyDtoDAsync(b.d_b, b.d_a, b.nbytes, s), "cuMemcpyDtoDAsync")

    res = H.summarize_bandwidth(
        2 * b.nbytes * D2D_PER_WINDOW, _event_timed(gpu, go, p.copy_repeats)
    )
    res["copy_bytes"] = float(b.nbytes)
    return res


def memset_d32(gpu: Gpu, p: Params) -> dict[str, float]:
    """``cuMemsetD32Async`` bandwidth (bytes written)."""
    b = gpu.copy_buffers(p.copy_mib << 20)
    s = gpu.stream

    def go() -> None:
        ck(drv.cuMemsetD32Async(b.d_b, 0x3F8CCCCD, b.nbytes // 4, s), "cuMemsetD32Async")

    res = H.summarize_bandwidth(b.nbytes, _event_timed(gpu, go, p.copy_repeats))
    gpu.release_copy_buffers()  # last user of the 512 MiB buffers
    return res


# --------------------------------------------------------------------------- allocation

_ALLOC_BYTES = 1 << 20


def alloc_device(gpu: Gpu, p: Params) -> dict[str, float]:
    """``cuMemAlloc`` + ``cuMemFree`` of 1 MiB, microseconds per pair."""
    alloc, free = drv.cuMemAlloc, drv.cuMemFree

    def once() -> None:
        err, d = alloc(_ALLOC_BYTES)
        if err:
            _fail("cuMemAlloc", err)
        (err,) = free(d)
        if err:
            _fail("cuMemFree", err)

    return H.summarize_ns(H.time_calls(once, p.alloc_repeats, p.alloc_warmup))


def alloc_async_pool(gpu: Gpu, p: Params) -> dict[str, float]:
    """``cuMemAllocAsync`` + ``cuMemFreeAsync`` of 1 MiB (device's current/default pool)."""
    if not gpu.attribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED):
        raise Unavailable("device does not support memory pools")
    s = gpu.stream
    alloc, free = drv.cuMemAllocAsync, drv.cuMemFreeAsync

    def once() -> None:
        err, d = alloc(_ALLOC_BYTES, s)
        if err:
            _fail("cuMemAllocAsync", err)
        (err,) = free(d, s)
        if err:
            _fail("cuMemFreeAsync", err)

    try:
        return H.summarize_ns(H.time_calls(once, p.alloc_repeats, p.alloc_warmup))
    finally:
        drv.cuStreamSynchronize(s)


def alloc_pinned_host(gpu: Gpu, p: Params) -> dict[str, float]:
    """``cuMemAllocHost`` + ``cuMemFreeHost`` of 1 MiB."""
    alloc, free = drv.cuMemAllocHost, drv.cuMemFreeHost

    def once() -> None:
        err, h = alloc(_ALLOC_BYTES)
        if err:
            _fail("cuMemAllocHost", err)
        (err,) = free(h)
        if err:
            _fail("cuMemFreeHost", err)

    return H.summarize_ns(H.time_calls(once, p.alloc_repeats, p.alloc_warmup))


# --------------------------------------------------------------------------- compile


def compile_nvrtc(gpu: Gpu | None, p: Params) -> dict[str, float]:
    """Cold NVRTC compile of a small 3-kernel module to cubin via cuda.core ``Program``.

    Each compile uses a never-seen source (unique kernel names), so no cache
    can serve it.  Needs NVRTC only; without a GPU the arch defaults to sm_90.
    """
    try:
        from cuda.core import Program, ProgramOptions
    except Exception as exc:
        raise Unavailable(f"cuda.core: {H.describe_exception(exc)}") from exc
    arch = gpu.arch if gpu is not None else "sm_90"
    stamp = f"{os.getpid()}_{time.time_ns()}"
    times = []
    for i in range(p.compile_repeats):
        uid = f"{stamp}_{i}"
        src = COMPILE_SRC.replace("@ID@", uid)
        opts = ProgramOptions(arch=arch, name=f"peers_compile_{uid}")
        t0 = time.perf_counter_ns()
        obj = Program(src, "c++", opts).compile("cubin")
        times.append(time.perf_counter_ns() - t0)
        if not obj.code:
            raise RuntimeError("NVRTC produced an empty cubin")
    res = H.summarize_ns(times, "ms")
    out = {k: res[k] for k in ("median_ms", "min_ms", "max_ms", "n")}
    out["first_ms"] = times[0] * 1e-6
    if gpu is not None:
        out["first_in_process_ms"] = gpu.first_compile_ms
    return out


# --------------------------------------------------------------------------- overlap


def _spin_params(ns: int) -> tuple[int, tuple[np.ndarray, np.ndarray]]:
    val = np.array([ns], dtype=np.uint64)
    ptrs = np.array([val.ctypes.data], dtype=np.uint64)
    return int(ptrs.ctypes.data), (val, ptrs)  # keep the arrays alive with the address


def overlap_spin_streams(gpu: Gpu, p: Params) -> dict[str, float]:
    """A one-block ~2 ms %globaltimer spin kernel: once on one stream, then N streams."""
    f, launch, sync = gpu.fn["spin"], drv.cuLaunchKernel, drv.cuStreamSynchronize
    addr, keep = _spin_params(int(p.spin_ms * 1e6))
    streams = gpu.streams[: p.overlap_streams]

    def run(ss: Sequence[Any]) -> float:
        t0 = time.perf_counter_ns()
        for s in ss:
            (err,) = launch(f, 1, 1, 1, 1, 1, 1, 0, s, addr, 0)
            if err:
                _fail("cuLaunchKernel(spin)", err)
        for s in ss:
            (err,) = sync(s)
            if err:
                _fail("cuStreamSynchronize", err)
        return (time.perf_counter_ns() - t0) * 1e-6

    run(streams[:1])
    run(streams)  # warm-up
    one = [run(streams[:1]) for _ in range(p.overlap_repeats)]
    many = [run(streams) for _ in range(p.overlap_repeats)]
    del keep
    return {
        "one_stream_ms": H.median(one),
        "many_streams_ms": H.median(many),
        "serial_ms_if_no_overlap": H.median(one) * len(streams),
        "overlap_factor": H.median(one) * len(streams) / H.median(many),
        "streams": len(streams),
        "spin_ms": p.spin_ms,
        "repeats": p.overlap_repeats,
    }


def pipeline_streams(gpu: Gpu, p: Params) -> dict[str, float]:
    """H2D + scale kernel + D2H over N chunks: one stream vs several (raw cuda.bindings)."""
    chunk = p.pipeline_chunk_mib << 20
    total = chunk * p.pipeline_chunks
    nf = chunk // 4
    f, launch = gpu.fn["scale"], drv.cuLaunchKernel
    h_in = int(ck(drv.cuMemAllocHost(total), "cuMemAllocHost"))
    h_out = int(ck(drv.cuMemAllocHost(total), "cuMemAllocHost"))
    d_in = d_out = None
    try:
        d_in = ck(drv.cuMemAlloc(total), "cuMemAlloc")
        d_out = ck(drv.cuMemAlloc(total), "cuMemAlloc")
        src = _host_view(h_in, total, np.float32)
        np.random.default_rng(7).random(out=src, dtype=np.float32)  # random, in [0, 1)
        out = _host_view(h_out, total, np.float32)
        out[:] = 0
        a = 3.0
        grid = min(
            (nf + 255) // 256,
            4 * gpu.attribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        )
        # Per-chunk kernel parameters, packed before timing.
        packs = []
        for i in range(p.pipeline_chunks):
            off = i * chunk
            vals = (
                np.array([int(d_out) + off], dtype=np.uint64),
                np.array([int(d_in) + off], dtype=np.uint64),
                np.array([a], dtype=np.float32),
                np.array([nf], dtype=np.int32),
            )
            ptrs = np.array([v.ctypes.data for v in vals], dtype=np.uint64)
            packs.append((vals, ptrs, int(ptrs.ctypes.data)))

        def run(n_streams: int) -> float:
            ss = gpu.streams[:n_streams]
            t0 = time.perf_counter_ns()
            for i in range(p.pipeline_chunks):
                s, off = ss[i % n_streams], i * chunk
                ck(
                    drv.cuMemcpyHtoDAsync(int(d_in) + off, h_in + off, chunk, s),
                    "cuMemcpyHtoDAsync",
                )
                (err,) = launch(f, grid, 1, 1, 256, 1, 1, 0, s, packs[i][2], 0)
                if err:
                    _fail("cuLaunchKernel(scale)", err)
                ck(
                    drv.cuMemcpyDtoHAsync(h_out + off, int(d_out) + off, chunk, s),
                    "cuMemcpyDtoHAsync",
                )
            for s in ss:
                ck(drv.cuStreamSynchronize(s), "cuStreamSynchronize")
            return (time.perf_counter_ns() - t0) * 1e-9

        n_multi = max(1, min(p.pipeline_streams, len(gpu.streams)))
        run(1)
        run(n_multi)  # warm-up
        one = H.median([run(1) for _ in range(p.pipeline_repeats)])
        out[:] = 0
        multi = H.median([run(n_multi) for _ in range(p.pipeline_repeats)])
        expect = src[: 1 << 16] * np.float32(a)
        if not np.allclose(out[: 1 << 16], expect) or not np.allclose(
            out[-(1 << 16) :], src[-(1 << 16) :] * np.float32(a)
        ):
            raise RuntimeError("pipeline output does not match a * input")
        moved = 2 * total
        return {
            "throughput_ratio": one / multi,
            "one_stream_ms": one * 1e3,
            "multi_stream_ms": multi * 1e3,
            "one_stream_gbps": H.bandwidth_gbps(moved, one),
            "multi_stream_gbps": H.bandwidth_gbps(moved, multi),
            "streams": n_multi,
            "chunks": p.pipeline_chunks,
            "chunk_bytes": chunk,
        }
    finally:
        gpu.sync_all()
        drv.cuMemFreeHost(h_in)
        drv.cuMemFreeHost(h_out)
        for d in (d_in, d_out):
            if d is not None:
                drv.cuMemFree(d)


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Case:
    name: str
    group: str
    fn: Callable[[Any, Params], dict[str, float]]
    needs_gpu: bool = True


CASES: tuple[Case, ...] = (
    Case("rt_stream_sync", "completion", rt_stream_sync),
    Case("rt_event_query_spin", "completion", rt_event_query_spin),
    Case("rt_asyncio_event_poll", "completion", rt_asyncio_event_poll),
    Case("rt_mapped_counter_spin", "completion", rt_mapped_counter_spin),
    Case("rt_asyncio_mapped_counter", "completion", rt_asyncio_mapped_counter),
    Case("rt_blocking_event_sync", "completion", rt_blocking_event_sync),
    Case("rt_hostfunc_threading_event", "completion", rt_hostfunc_threading_event),
    Case("rt_hostfunc_asyncio", "completion", rt_hostfunc_asyncio),
    Case("rt_executor_event_sync", "completion", rt_executor_event_sync),
    Case("rt_executor_blocking_event_sync", "completion", rt_executor_blocking_event_sync),
    Case("rt_cupy_stream_sync", "completion", rt_cupy_stream_sync),
    Case("rt_torch_sync", "completion", rt_torch_sync),
    Case("rt_numba_async_done", "completion", rt_numba_async_done, needs_gpu=False),
    Case("host_call_costs", "host_calls", host_call_costs),
    Case("tp_hostfunc_asyncio", "throughput", tp_hostfunc_asyncio),
    Case("tp_event_poll_asyncio", "throughput", tp_event_poll_asyncio),
    Case("tp_executor_event_sync", "throughput", tp_executor_event_sync),
    Case("launch_core_empty", "launch", launch_core_empty),
    Case("launch_raw_empty", "launch", launch_raw_empty),
    Case("launch_raw_4args", "launch", launch_raw_4args),
    Case("launch_core_4args", "launch", launch_core_4args),
    Case("launch_cupy_4args", "launch", launch_cupy_4args),
    Case("launch_torch_add", "launch", launch_torch_add),
    Case("copy_h2d_pinned", "copy", copy_h2d_pinned),
    Case("copy_d2h_pinned", "copy", copy_d2h_pinned),
    Case("copy_h2d_pageable", "copy", copy_h2d_pageable),
    Case("copy_d2h_pageable", "copy", copy_d2h_pageable),
    Case("copy_d2d", "copy", copy_d2d),
    Case("memset_d32", "copy", memset_d32),
    Case("alloc_device", "alloc", alloc_device),
    Case("alloc_async_pool", "alloc", alloc_async_pool),
    Case("alloc_pinned_host", "alloc", alloc_pinned_host),
    Case("compile_nvrtc", "compile", compile_nvrtc, needs_gpu=False),
    Case("overlap_spin_streams", "overlap", overlap_spin_streams),
    Case("pipeline_streams", "overlap", pipeline_streams),
)


def select_cases(only: Sequence[str] | None, skip: Sequence[str] | None = None) -> list[Case]:
    """Cases whose name or group contains any ``only`` substring and no ``skip`` one."""
    out = []
    for c in CASES:
        key = (c.name, c.group)
        if only and not any(o in k for o in only for k in key):
            continue
        if skip and any(s in k for s in skip for k in key):
            continue
        out.append(c)
    return out


def run_all(
    params: Params, cases: Sequence[Case], *, log: Callable[[str], None] | None = None
) -> list[H.CaseResult]:
    """Open the GPU once, run every case through :func:`_harness.run_case`."""
    log = log or (lambda _msg: None)
    gpu: Gpu | None = None
    gpu_reason = ""
    if cases:  # compile_nvrtc also uses the device's arch when there is one
        try:
            gpu = Gpu(params)
        except Unavailable as exc:
            gpu_reason = str(exc)
        except Exception as exc:
            gpu_reason = f"GPU setup failed: {H.describe_exception(exc)}"
    results = []
    try:
        for c in cases:
            if c.needs_gpu and gpu is None:
                r = H.CaseResult(
                    c.name, c.group, "unavailable", reason=f"unavailable: {gpu_reason}"
                )
            else:
                log(f"running {c.name} ...")
                r = H.run_case(c.name, c.group, c.fn, gpu, params)
            log(
                f"  {c.name}: {r.status} ({r.seconds:.2f} s)" + (f" {r.reason}" if r.reason else "")
            )
            results.append(r)
    finally:
        if gpu is not None:
            try:
                gpu.close()
            except Exception as exc:
                log(f"GPU teardown failed: {H.describe_exception(exc)}")
    return results


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description="Peer baselines for asyncgpu (raw cuda.bindings, cuda.core, CuPy, "
        "PyTorch, numba-cuda, naive asyncio strategies)."
    )
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    ap.add_argument("--quick", action="store_true", help="cut repeat counts and sizes ~10x")
    ap.add_argument("--only", default="", help="comma-separated substrings of case/group names")
    ap.add_argument("--skip", default="", help="comma-separated substrings to leave out")
    ap.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    ap.add_argument("--repeats", type=int, help="round-trip samples per case")
    ap.add_argument("--warmup", type=int, help="untimed round trips before sampling")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="override any Params field, e.g. --set copy_mib=256 (repeatable)",
    )
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument(
        "--_numba-child", dest="numba_child", action="store_true", help=argparse.SUPPRESS
    )
    return ap


def params_from_args(args: argparse.Namespace) -> Params:
    over: dict[str, Any] = {"device": args.device}
    if args.repeats is not None:
        over["repeats"] = args.repeats
    if args.warmup is not None:
        over["warmup"] = args.warmup
    kinds = {f.name: type(f.default) for f in fields(Params)}
    for item in getattr(args, "set", None) or []:
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in kinds:
            raise SystemExit(f"--set {item!r}: expected NAME=VALUE with NAME in {sorted(kinds)}")
        over[name] = kinds[name](value)
    return Params.quick(**over) if args.quick else Params(**over)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    params = params_from_args(args)

    if args.numba_child:
        print(json.dumps(_numba_child(params.device, params.repeats, params.warmup)))
        return 0

    cases = select_cases(_split(args.only), _split(args.skip))
    if args.list:
        for c in cases:
            print(f"{c.name:34s} {c.group:12s} {(c.fn.__doc__ or '').strip().splitlines()[0]}")
        return 0
    if not cases:
        print("no case matches --only/--skip", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    started = H.utc_now()
    t0 = time.perf_counter()
    env = H.environment_info(params.device)
    log(
        f"device: {H.device_name(env)}; driver {env.get('driver_version')}; "
        f"{'quick' if args.quick else 'full'} run of {len(cases)} cases"
    )
    results = run_all(params, cases, log=log)
    env["libraries"] = H.library_versions()  # now includes what the cases imported
    total = time.perf_counter() - t0
    print(H.format_table(results, REFERENCES))
    print(f"\n{sum(r.status == 'ok' for r in results)}/{len(results)} ok in {total:.1f} s")
    if args.json:
        record = H.make_record(
            results,
            env,
            suite="peers_gpu",
            params={**asdict(params), "quick": bool(args.quick)},
            started_at=started,
            total_seconds=total,
        )
        path = H.write_json(args.json, record)
        print(f"wrote {path}")
    return 0 if all(r.status != "error" for r in results) else 1


__all__ = [c.name for c in CASES] + [
    "CASES",
    "Case",
    "CudaError",
    "Gpu",
    "HostFnBridge",
    "Params",
    "build_parser",
    "main",
    "params_from_args",
    "run_all",
    "select_cases",
]

if __name__ == "__main__":
    sys.exit(main())
