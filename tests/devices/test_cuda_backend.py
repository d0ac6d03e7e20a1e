"""CUDA-only behaviour: what the CPU device cannot show (NVRTC kernels on the real
device, device-side waits, host work holding the device back, faults).

Every case compares against NumPy on fresh random data and poisons outputs first.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import asyncgpu as ag


def _has_cuda() -> bool:
    try:
        return ag.DeviceContext.number_of_devices(api="cuda") > 0
    except Exception:
        return False


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _has_cuda(), reason="no CUDA device on this machine"),
]

AXPY = r"""
extern "C" __global__ void axpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
extern "C" __global__ void trap() { __trap(); }
__constant__ float coeffs[4];
extern "C" __global__ void poly(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = coeffs[0] + coeffs[1] * x[i] + coeffs[2] * x[i] * x[i] + coeffs[3];
}
extern "C" __global__ void big_shared(float* out) {
    extern __shared__ float s[];
    int n = 64 * 1024 / sizeof(float);
    for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = (float)i;
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = s[n - 1];
}
"""

rng = np.random.default_rng()


@pytest.fixture(scope="module")
def ctx():
    with ag.DeviceContext(api="cuda") as c:
        yield c


@pytest.fixture(scope="module")
def fns(ctx):
    return {
        name: ctx.compile_function(AXPY, name)
        for name in ("axpy", "spin", "trap", "poly", "big_shared")
    }


def _spin_cycles(ctx, ms: float) -> np.int64:
    khz = ctx.default_device_info.clock_rate_khz
    return np.int64(int(khz * ms))


def test_device_facts(ctx):
    info = ctx.default_device_info
    assert ctx.api() == "cuda"
    assert info.arch.startswith("sm_") and info.compute_capability is not None
    assert info.arch == f"sm_{info.compute_capability[0]}{info.compute_capability[1]}"
    assert info.sm_count > 0 and info.warp_size == 32
    assert ctx.get_attribute(ag.DeviceAttribute.WARP_SIZE) == 32
    free, total = ctx.get_memory_info()
    assert 0 < free <= total == ctx.max_single_alloc_size()
    assert ctx.get_api_version() >= 12000
    assert ctx.is_compatible()
    assert not ctx.can_access(ctx)  # not its own peer, as cuDeviceCanAccessPeer(d, d)
    ctx.enable_peer_access(ctx)  # a no-op
    assert isinstance(ctx.supports_multicast(), bool)
    rng_ = ctx.stream_priority_range()
    assert rng_.greatest <= rng_.least
    ctx.run_healthcheck()
    with ctx.push_context():
        pass
    ctx.set_as_current()


def test_kernel_axpy_matches_numpy(ctx, fns):
    n = 100_003
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    dx = ctx.enqueue_create_buffer(np.float32, n)
    dy = ctx.enqueue_create_buffer(np.float32, n)
    ctx.enqueue_copy(dx, x)
    ctx.enqueue_copy(dy, y)
    a = np.float32(rng.standard_normal())
    ctx.enqueue_function(
        fns["axpy"], a, dx, dy, np.int32(n), grid_dim=(n + 255) // 256, block_dim=256
    )
    out = np.full(n, np.nan, np.float32)
    ctx.enqueue_copy(out, dy).synchronize()
    np.testing.assert_allclose(out, a * x + y, rtol=1e-6, atol=1e-6)


def test_every_copy_direction(ctx):
    n = 4099
    src = rng.integers(0, 2**31, n, dtype=np.int64)
    h1 = ctx.enqueue_create_host_buffer(np.int64, n)
    h2 = ctx.enqueue_create_host_buffer(np.int64, n)
    d1 = ctx.enqueue_create_buffer(np.int64, n)
    d2 = ctx.enqueue_create_buffer(np.int64, n)
    ctx.synchronize()
    h1.as_numpy()[:] = src
    h2.as_numpy()[:] = -1
    ctx.enqueue_copy(d1, h1)  # H2D pinned
    ctx.enqueue_copy(d2, d1)  # D2D
    ctx.enqueue_copy(h2, d2)  # D2H pinned
    ctx.synchronize()
    assert np.array_equal(h2.as_numpy(), src)
    h3 = ctx.enqueue_create_host_buffer(np.int64, n)
    ctx.enqueue_copy(h3, h2).synchronize()  # host-to-host
    assert np.array_equal(h3.as_numpy(), src)
    big = np.full(n + 10, -7, np.int64)
    ctx.enqueue_copy(big, d1).synchronize()  # D2H pageable span (larger)
    assert np.array_equal(big[:n], src) and (big[n:] == -7).all()
    d3 = ctx.enqueue_create_buffer(np.int64, n)
    ctx.enqueue_copy(d3, src[::-1].copy())  # H2D pageable span
    ctx.enqueue_copy(d3.unsafe_ptr(), d1.unsafe_ptr(), n, dtype=np.int64)  # pointer + size
    back = np.empty(n, np.int64)
    ctx.enqueue_copy(back, d3).synchronize()
    assert np.array_equal(back, src)
    with pytest.raises(ValueError):
        ctx.enqueue_copy(d1, ctx.enqueue_create_buffer(np.int64, n - 1))


def test_large_pageable_copy_is_staged_and_exact(ctx):
    n = (40 << 20) // 4 + 123  # several staging chunks plus a tail
    src = rng.standard_normal(n).astype(np.float32)
    d = ctx.enqueue_create_buffer(np.float32, n)
    ev = ctx.enqueue_copy(d, src)
    del src  # the copy must keep its source alive
    out = np.full(n, np.nan, np.float32)
    ctx.enqueue_copy(out, d).synchronize()
    assert ev.query()
    assert np.isfinite(out).all()
    ref = np.empty(n, np.float32)
    ctx.enqueue_copy(ref, d).synchronize()
    assert np.array_equal(out, ref)


@pytest.mark.parametrize(
    "dtype,value",
    [
        (np.uint8, 0xAB),
        (np.int16, -12345),
        (np.float32, 3.25),
        (np.int32, -7),
        (np.float64, -2.5e100),
        (np.int64, -(2**40) - 3),
        (np.uint64, 2**63 + 5),
    ],
)
def test_memset_every_width(ctx, dtype, value):
    n = 1001
    d = ctx.enqueue_create_buffer(dtype, n)
    ctx.enqueue_copy(d, np.zeros(n, dtype) + np.array(1, dtype))
    ctx.enqueue_memset(d, value)
    out = np.empty(n, dtype)
    ctx.enqueue_copy(out, d).synchronize()
    assert (out == np.array(value, dtype)).all()


def test_cross_stream_copy_waits_for_owner(ctx, fns):
    s1, s2 = ctx.select_stream(1), ctx.select_stream(2)
    n = 1 << 16
    x = rng.standard_normal(n).astype(np.float32)
    buf = s1.enqueue_create_buffer(np.float32, n)
    s1.enqueue_copy(buf, x)
    s1.enqueue_function(fns["spin"], _spin_cycles(ctx, 50), grid_dim=1, block_dim=1)
    s1.enqueue_function(
        fns["axpy"], np.float32(2), buf, buf, np.int32(n), grid_dim=n // 256, block_dim=256
    )  # buf = 3x
    out = np.full(n, np.nan, np.float32)
    ev = s2.enqueue_copy(out, buf)  # ordered after s1's spin and axpy
    ev.synchronize()
    np.testing.assert_allclose(out, 3 * x, rtol=1e-6)


def test_a_held_copy_is_marked_by_a_driver_event_that_other_streams_wait_on(ctx, fns):
    """The marker right after a copy or memset is a recorded driver event: a
    counter write there, whose memory fence waits for the copy engines, cost a
    copy/kernel pipeline a tenth of its overlap. After a kernel it is the counter.
    Another stream that waits for the copy waits on that event, on the device."""
    a, b = ctx.select_stream(5), ctx.select_stream(6)
    impl = a._impl
    n = 1 << 20
    x = rng.standard_normal(n).astype(np.float32)
    src = a.enqueue_create_buffer(np.float32, n)
    dst = a.enqueue_create_buffer(np.float32, n)
    a.enqueue_copy(src, x)
    a.enqueue_memset(dst, np.float32(0))
    a.synchronize()

    spin = a.enqueue_function(fns["spin"], _spin_cycles(ctx, 100), grid_dim=1, block_dim=1)
    copied = a.enqueue_copy(dst, src)  # each event is held, so the next operation marks it
    filled = a.enqueue_memset(src, np.float32(7))
    a.enqueue_function(fns["spin"], np.int64(0), grid_dim=1, block_dim=1)

    assert impl._counter_mark >= spin._seq
    assert [s for s, _ in impl._copy_marks if s > spin._seq] == [copied._seq, filled._seq]
    assert not copied.query()  # still behind the 100 ms spin

    y = b.enqueue_create_buffer(np.float32, n)
    b.enqueue_memset(y, np.float32(0))
    b.enqueue_wait_for(copied)
    b.enqueue_function(
        fns["axpy"], np.float32(1), dst, y, np.int32(n), grid_dim=n // 256, block_dim=256
    )  # y = dst, read only once the copy has finished
    out = np.full(n, np.nan, np.float32)
    b.enqueue_copy(out, y).synchronize()
    np.testing.assert_array_equal(out, x)
    filled.synchronize()
    back = np.empty(n, np.float32)
    a.enqueue_copy(back, src).synchronize()
    assert (back == 7).all()
    assert impl._completed() == impl._seq and not impl._copy_marks


@pytest.mark.asyncio
async def test_awaited_copies_on_four_streams_resolve_and_reuse_their_marker_events(ctx, fns):
    views = [ctx.select_stream(i) for i in range(4)]
    n = 1 << 16
    ins = [v.enqueue_create_host_buffer(np.float32, n) for v in views]
    outs = [v.enqueue_create_host_buffer(np.float32, n) for v in views]
    devs = [v.enqueue_create_buffer(np.float32, n) for v in views]
    for v in views:
        v.synchronize()
    for _ in range(50):
        data = [rng.standard_normal(n).astype(np.float32) for _ in views]
        evs = []
        for v, h, d, o, x in zip(views, ins, devs, outs, data, strict=True):
            h.as_numpy()[:] = x
            o.as_numpy()[:] = np.nan
            v.enqueue_copy(d, h)
            v.enqueue_function(
                fns["axpy"], np.float32(1), d, d, np.int32(n), grid_dim=n // 256, block_dim=256
            )  # d = 2 d
            evs.append(v.enqueue_copy(o, d))
        await asyncio.gather(*evs)
        for o, x in zip(outs, data, strict=True):
            np.testing.assert_array_equal(o.as_numpy(), 2 * x)
    for v in views:
        impl = v._impl
        impl._completed()
        assert not impl._copy_marks
        assert len(impl._free_events) <= 16  # events go back and are recorded again


def test_a_dropped_buffer_is_reused_by_its_streams_next_allocation_of_that_size():
    """Create-and-drop in a loop costs no driver call: the owning stream keeps the
    buffer once its work is done and hands it to its next allocation of the same
    size; another stream or another size gets other memory."""
    n = 1 << 16
    with ag.DeviceContext(api="cuda") as c:  # streams that keep nothing yet
        axpy, spin = (c.compile_function(AXPY, name) for name in ("axpy", "spin"))
        s1 = c.select_stream(1)
        x = rng.standard_normal(n).astype(np.float32)
        buf = c.enqueue_create_buffer(np.float32, n)
        c.enqueue_copy(buf, x)
        c.enqueue_function(spin, _spin_cycles(c, 20), grid_dim=1, block_dim=1)
        c.enqueue_function(
            axpy, np.float32(1), buf, buf, np.int32(n), grid_dim=n // 256, block_dim=256
        )  # buf = 2x, behind the spin
        out = np.full(n, np.nan, np.float32)
        done = c.enqueue_copy(out, buf)
        ptr = buf.unsafe_ptr()
        del buf  # its operations keep it alive until they finish
        other = c.enqueue_create_buffer(np.float32, n)
        assert other.unsafe_ptr() != ptr  # still in use by the device: not handed out
        done.synchronize()
        np.testing.assert_allclose(out, 2 * x, rtol=1e-6)
        c.synchronize()  # the stream retires its finished operations; the buffer is kept
        elsewhere = s1.enqueue_create_buffer(np.float32, n)
        bigger = c.enqueue_create_buffer(np.float32, n + 1)
        again = c.enqueue_create_buffer(np.float32, n)
        assert again.unsafe_ptr() == ptr
        assert elsewhere.unsafe_ptr() != ptr and bigger.unsafe_ptr() != ptr
        y = rng.standard_normal(n).astype(np.float32)
        c.enqueue_copy(again, y)
        got = np.full(n, np.nan, np.float32)
        c.enqueue_copy(got, again).synchronize()
        np.testing.assert_array_equal(got, y)
        del other, elsewhere, bigger, again


def test_kept_buffers_are_freed_when_their_stream_closes_or_memory_runs_short():
    """A closed context keeps nothing; a failed allocation frees what every stream
    of the device keeps before it tries again."""
    with ag.DeviceContext(api="cuda") as c:
        impl = c._impl
        for _ in range(3):
            c.enqueue_create_buffer(np.uint8, 1 << 20)
        c.synchronize()
        assert len(impl.spare.bufs[1 << 20]) == 1  # one buffer, taken and kept again
        held = [c.enqueue_create_buffer(np.uint8, 1 << 20) for _ in range(6)]
        del held
        assert len(impl.spare.bufs[1 << 20]) == 4  # at most four of one size
        assert c._state.backend._free_spare_buffers()
        assert not impl.spare.bufs and not impl.spare.closed
        c.enqueue_create_buffer(np.uint8, 1 << 20)
        assert impl.spare.bufs[1 << 20]
    assert impl.spare.closed and not impl.spare.bufs
    impl.spare.keep(object(), 8)  # a buffer dropped after the close is not kept
    assert not impl.spare.bufs


def test_cpu_function_holds_later_gpu_work_back(ctx, fns):
    s = ctx.select_stream(3)
    n = 4096
    h = s.enqueue_create_host_buffer(np.float32, n)
    d = s.enqueue_create_buffer(np.float32, n)
    s.synchronize()
    x = rng.standard_normal(n).astype(np.float32)
    gate = threading.Event()

    def fill():
        assert gate.wait(10)
        h.as_numpy()[:] = x
        return "filled"

    cpu = s.enqueue_cpu_function(fill)
    copy = s.enqueue_copy(d, h)
    out = np.full(n, np.nan, np.float32)
    done = s.enqueue_copy(out, d)
    assert not copy.query() and not done.query()  # the GPU waits for the CPU function
    gate.set()
    assert cpu.synchronize() == "filled"
    done.synchronize()
    assert np.array_equal(out, x)


def test_kernels_compile_and_load_while_cpu_work_holds_a_stream(ctx, fns):
    """A deadlock once seen on a GPU: a module load waited inside the
    driver for a stream held back on the device by a CPU function that waited for
    the loading thread. Held on the host, the load goes through."""
    s0, s1 = ctx.select_stream(4), ctx.select_stream(5)
    gate = threading.Event()
    behind = s0.enqueue_cpu_function(lambda: gate.wait(30))
    n = 1024
    d = s0.enqueue_create_buffer(np.float32, n)
    s0.enqueue_memset(d, np.float32(1))
    s0.enqueue_function(
        fns["axpy"], np.float32(1), d, d, np.int32(n), grid_dim=n // 256, block_dim=256
    )
    # A source no cache has seen: NVRTC, then a module load, behind the held stream.
    k = float(rng.integers(1, 1 << 20))
    src = AXPY.replace("a * x[i] + y[i]", f"a * x[i] + y[i] + {k}f")
    fresh = s1.compile_function(src, "axpy")
    e = s1.enqueue_create_buffer(np.float32, n)
    s1.enqueue_memset(e, np.float32(0))
    s1.enqueue_function(fresh, np.float32(0), e, e, np.int32(n), grid_dim=n // 256, block_dim=256)
    got = np.full(n, np.nan, np.float32)
    s1.enqueue_copy(got, e).synchronize()
    assert (got == np.float32(k)).all()
    assert not behind.query()  # the CPU function is still waiting for this thread
    gate.set()
    out = np.full(n, np.nan, np.float32)
    s0.enqueue_copy(out, d).synchronize()
    assert behind.synchronize() is True
    assert (out == 2).all()


def test_waits_memsets_constants_and_events_behind_held_work_keep_stream_order(ctx, fns):
    held, other = ctx.select_stream(6), ctx.select_stream(7)
    n = 4096
    x = rng.standard_normal(n).astype(np.float32)
    d = held.enqueue_create_buffer(np.float32, n)
    e = other.enqueue_create_buffer(np.float32, n)
    y = held.enqueue_create_buffer(np.float32, n)
    held.synchronize()
    other.synchronize()
    gate = threading.Event()
    held.enqueue_cpu_function(lambda: gate.wait(30))
    held.enqueue_copy(d, x)  # pageable: staged on the pool, behind the gate too
    held.enqueue_memset(y, np.float32(0.5))
    coeffs = np.array([1, 2, 0, 0], np.float32)
    held.enqueue_function(
        fns["poly"],
        d,
        y,
        np.int32(n),
        grid_dim=n // 256,
        block_dim=256,
        constant_memory=[ag.ConstantMemoryMapping("coeffs", coeffs)],
    )  # y = 1 + 2x
    mark = ctx.create_event()
    held.stream().record_event(mark)
    after = other.enqueue_wait_for(held.stream())  # ``other`` now waits for the gate too
    other.enqueue_copy(e, y)
    out = np.full(n, np.nan, np.float32)
    last = other.enqueue_copy(out, e)
    assert not mark.query() and not after.query() and not last.query()
    gate.set()
    mark.synchronize()
    last.synchronize()
    np.testing.assert_allclose(out, 1 + 2 * x, rtol=1e-5, atol=1e-5)

    def cpu_then_spin(c):
        c.enqueue_cpu_function(lambda: None)
        c.enqueue_function(fns["spin"], _spin_cycles(ctx, 1), grid_dim=1, block_dim=1)

    # The timing events are held with the work: both 1 ms spins fall between them.
    assert held.execution_time(cpu_then_spin, 2) > 1_500_000  # more than one spin


def test_cpu_range_on_cuda_stream(ctx):
    hits = np.zeros(1000, np.int64)

    def mark(i):
        hits[i] += 1

    ctx.enqueue_cpu_range(mark, 1000).synchronize()
    assert (hits == 1).all()


def test_constant_memory_and_big_shared(ctx, fns):
    n = 1000
    x = rng.standard_normal(n).astype(np.float32)
    c = rng.standard_normal(4).astype(np.float32)
    dx = ctx.enqueue_create_buffer(np.float32, n)
    dy = ctx.enqueue_create_buffer(np.float32, n)
    ctx.enqueue_copy(dx, x)
    ctx.enqueue_function(
        fns["poly"],
        dx,
        dy,
        np.int32(n),
        grid_dim=4,
        block_dim=256,
        constant_memory=[ag.ConstantMemoryMapping("coeffs", c)],
    )
    out = np.empty(n, np.float32)
    ctx.enqueue_copy(out, dy).synchronize()
    np.testing.assert_allclose(out, c[0] + c[1] * x + c[2] * x * x + c[3], rtol=1e-5, atol=1e-5)
    res = ctx.enqueue_create_buffer(np.float32, 2)
    ctx.enqueue_function(
        fns["big_shared"], res, grid_dim=2, block_dim=256, shared_mem_bytes=64 * 1024
    )
    o2 = np.empty(2, np.float32)
    ctx.enqueue_copy(o2, res).synchronize()
    assert (o2 == 64 * 1024 / 4 - 1).all()


def test_bad_launches_raise_at_the_call(ctx, fns):
    d = ctx.enqueue_create_buffer(np.float32, 10)
    with pytest.raises(TypeError, match="NumPy type"):
        ctx.enqueue_function(fns["axpy"], 2.0, d, d, np.int32(10), grid_dim=1, block_dim=32)
    with pytest.raises(TypeError, match="4 arguments"):
        ctx.enqueue_function(fns["axpy"], np.float32(2), d, grid_dim=1, block_dim=32)
    with pytest.raises(TypeError, match="bytes"):
        ctx.enqueue_function(
            fns["axpy"], np.float64(2), d, d, np.int32(10), grid_dim=1, block_dim=32
        )
    with pytest.raises(ValueError, match="threads"):
        ctx.enqueue_function(
            fns["axpy"], np.float32(2), d, d, np.int32(10), grid_dim=1, block_dim=2048
        )
    with pytest.raises(ValueError, match="shared_mem_bytes"):
        ctx.enqueue_function(
            fns["big_shared"], d, grid_dim=1, block_dim=32, shared_mem_bytes=10 << 20
        )
    with pytest.raises(ag.CompileError, match="undefined"):
        ctx.compile_function('extern "C" __global__ void k() { undefined_thing(); }', "k")


def test_dump_asm_and_load_ptx(ctx):
    f = ctx.compile_function(AXPY, "axpy", dump_asm=True)
    assert f.asm is not None and ".entry axpy" in f.asm
    g = ctx.load_function(function_name="axpy", asm=f.asm)
    n = 512
    x = rng.standard_normal(n).astype(np.float32)
    dx = ctx.enqueue_create_buffer(np.float32, n)
    dy = ctx.enqueue_create_buffer(np.float32, n)
    ctx.enqueue_copy(dx, x)
    ctx.enqueue_memset(dy, 0.5)
    ctx.enqueue_function(g, np.float32(-1), dx, dy, np.int32(n), grid_dim=2, block_dim=256)
    out = np.empty(n, np.float32)
    ctx.enqueue_copy(out, dy).synchronize()
    np.testing.assert_allclose(out, 0.5 - x, rtol=1e-6)


def test_timing_events_and_execution_time(ctx, fns):
    start = ctx.create_event(disable_timing=False)
    end = ctx.create_event(disable_timing=False)
    st = ctx.stream()
    st.record_event(start)
    ctx.enqueue_function(fns["spin"], _spin_cycles(ctx, 5), grid_dim=1, block_dim=1)
    st.record_event(end)
    end.synchronize()
    ms = start.elapsed_time(end)
    assert 2.0 < ms < 100.0
    ns = ctx.execution_time(
        lambda c: c.enqueue_function(fns["spin"], _spin_cycles(ctx, 1), grid_dim=1, block_dim=1),
        5,
    )
    assert ns > 2_000_000


@pytest.mark.asyncio
async def test_awaits_resolve_in_order_and_survive_cancellation(ctx, fns):
    s = ctx.select_stream(4)
    evs = [
        s.enqueue_function(fns["spin"], _spin_cycles(ctx, 0.2), grid_dim=1, block_dim=1)
        for _ in range(20)
    ]
    order: list[int] = []

    async def wait(i):
        await evs[i]
        order.append(i)

    await asyncio.gather(*(wait(i) for i in reversed(range(20))))
    assert sorted(order) == list(range(20))
    assert all(e.query() for e in evs)
    long = s.enqueue_function(fns["spin"], _spin_cycles(ctx, 30), grid_dim=1, block_dim=1)
    t = asyncio.ensure_future(long)
    await asyncio.sleep(0)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    await long  # the work was not cancelled and can be awaited again
    assert long.query()


@pytest.mark.asyncio
async def test_streams_beyond_the_hardware_queues_are_awaited_without_eager_markers(fns):
    """With more live streams than the driver's hardware queues, some streams
    share a queue, and a marker right after a kernel would hold up the other
    streams' kernels behind it: awaits then place markers only when asked, and
    16 awaited streams of spin kernels still all finish."""
    with ag.DeviceContext(api="cuda") as c:
        spin = c.compile_function(AXPY, "spin")
        views = [c.select_stream(i) for i in range(c.num_streams())]
        views += [c.create_stream().context() for _ in range(16 - len(views))]
        impls = [v._impl for v in views]
        assert not impls[0]._queues.solo
        for _ in range(3):
            evs = [
                v.enqueue_function(spin, _spin_cycles(c, 0.5), grid_dim=1, block_dim=1)
                for v in views
            ]
            await asyncio.gather(*evs)
            assert all(e.query() for e in evs)
            assert not any(i._eager for i in impls)


def test_await_under_trio(ctx, fns):
    trio = pytest.importorskip("trio")

    async def main():
        ev = ctx.enqueue_function(fns["spin"], _spin_cycles(ctx, 2), grid_dim=1, block_dim=1)
        await ev
        return ev.query()

    assert trio.run(main)


def test_awaits_from_several_threads_with_their_own_loops(ctx, fns):
    results = []
    barrier = threading.Barrier(4, timeout=30)

    def worker(k):
        async def main():
            s = ctx.select_stream(k)
            n = 1024
            x = rng.standard_normal(n).astype(np.float32)
            d = s.enqueue_create_buffer(np.float32, n)
            await s.enqueue_copy(d, x)
            barrier.wait()
            for _ in range(50):
                await s.enqueue_function(
                    fns["axpy"], np.float32(1), d, d, np.int32(n), grid_dim=4, block_dim=256
                )
            out = np.empty(n, np.float32)
            await s.enqueue_copy(out, d)
            results.append(np.allclose(out, x * 2**50, rtol=1e-5))

        asyncio.run(main())

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [True] * 4


@pytest.mark.asyncio
async def test_waiting_on_a_long_kernel_leaves_the_loop_free(ctx, fns):
    ev = ctx.enqueue_function(fns["spin"], _spin_cycles(ctx, 100), grid_dim=1, block_dim=1)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while not ev.query():
            ticks += 1
            await asyncio.sleep(0.001)

    t0 = time.perf_counter()
    await asyncio.gather(ev, ticker())
    assert time.perf_counter() - t0 > 0.05
    assert ticks > 20  # the loop kept running while the kernel ran


FAULT_SCRIPT = textwrap.dedent(
    r"""
    import asyncio, sys, time
    import numpy as np
    import asyncgpu as ag
    SRC = 'extern "C" __global__ void trap() { __trap(); }\n' \
          'extern "C" __global__ void spin(long long c) { long long t = clock64(); ' \
          'while (clock64() - t < c) {} }'
    ctx = ag.DeviceContext(api="cuda")
    trap = ctx.compile_function(SRC, "trap")
    spin = ctx.compile_function(SRC, "spin")
    cycles = np.int64(ctx.default_device_info.clock_rate_khz * 50)

    async def main():
        s1 = ctx.select_stream(1)
        pending = [s1.enqueue_function(spin, cycles, grid_dim=1, block_dim=1)]
        pending.append(ctx.enqueue_function(trap, grid_dim=1, block_dim=1))
        pending.append(s1.enqueue_function(spin, cycles, grid_dim=1, block_dim=1))
        t0 = time.perf_counter()
        res = await asyncio.wait_for(
            asyncio.gather(*pending, return_exceptions=True), timeout=5)
        dt = time.perf_counter() - t0
        kinds = {type(r).__name__ for r in res if isinstance(r, BaseException)}
        print("FAULT", sorted(kinds), round(dt, 3))
        assert "DeviceFaultError" in kinds, kinds
        assert dt < 1.0, dt

    asyncio.run(main())
    try:
        ctx.enqueue_create_buffer(np.float32, 4)
        ctx.enqueue_memset(ctx.enqueue_create_buffer(np.float32, 4), 1.0)
        ctx.synchronize()
        print("AFTER no error")
    except ag.AsyncGPUError as e:
        print("AFTER", type(e).__name__)
    print("OK")
    """
)


def test_device_fault_fails_every_pending_await_quickly(tmp_path):
    script = tmp_path / "fault.py"
    script.write_text(FAULT_SCRIPT)
    env = dict(os.environ, ASYNCGPU_DISABLE_HEALTHCHECK="1")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env
    )
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert "FAULT" in proc.stdout and "OK" in proc.stdout
