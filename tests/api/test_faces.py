"""One program, two faces: blocking calls with no event loop anywhere, and awaits.

These are the README's example, run end to end on every device: host data to the
device, a kernel, a second stream that waits for the first, the result back on
the host, and a CPU function over it.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _kernels import AXPY, SCALE, blocks_for, poison, random_array

from asyncgpu import DeviceContext

N = 1 << 14


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_blocking_face_without_any_loop(api: str, rng: np.random.Generator) -> None:
    assert not _loop_running()
    x = random_array(rng, np.float32, N)
    y = random_array(rng, np.float32, N)
    a = np.float32(2.0)
    with DeviceContext(api=api) as ctx:
        xd = ctx.create_buffer_sync(np.float32, N)
        yd = ctx.create_buffer_sync(np.float32, N)
        h = ctx.enqueue_create_host_buffer(np.float32, N)
        ctx.synchronize()
        h.as_numpy()[:] = x
        ctx.enqueue_copy(xd, h)
        ctx.enqueue_copy(yd, y)
        launched = ctx.enqueue_function(
            AXPY, a, xd, yd, np.int32(N), grid_dim=blocks_for(N), block_dim=256
        )
        assert launched.synchronize() is None
        s1 = ctx.select_stream(1)
        s1.enqueue_wait_for(ctx)
        out = poison(np.float32, N)
        s1.enqueue_copy(out, yd)
        s1.stream().synchronize()
        np.testing.assert_array_equal(out, a * x + y)
        total = s1.enqueue_cpu_function(np.sum, out, dtype=np.float64).synchronize()
        assert total == np.sum(a * x + y, dtype=np.float64)
        with yd.map_to_host() as m:
            np.testing.assert_array_equal(m.as_numpy(), a * x + y)
            m.as_numpy()[:] = x
        ev = ctx.create_event()
        ctx.enqueue_function(SCALE, yd, yd, a, np.int32(N), grid_dim=blocks_for(N), block_dim=256)
        ctx.stream().record_event(ev)
        ev.synchronize()
        ctx.enqueue_copy(out, yd).synchronize()
        np.testing.assert_array_equal(out, a * x)


@pytest.mark.asyncio
async def test_async_face(api: str, rng: np.random.Generator) -> None:
    x = random_array(rng, np.float32, N)
    y = random_array(rng, np.float32, N)
    a = np.float32(0.5)
    async with DeviceContext(api=api) as ctx:
        xd = ctx.enqueue_create_buffer(np.float32, N)
        yd = ctx.enqueue_create_buffer(np.float32, N)
        h = ctx.enqueue_create_host_buffer(np.float32, N)
        await ctx
        h.as_numpy()[:] = x
        await ctx.enqueue_copy(xd, h)
        await ctx.enqueue_copy(yd, y)
        await ctx.enqueue_function(
            AXPY, a, xd, yd, np.int32(N), grid_dim=blocks_for(N), block_dim=256
        )
        s1 = ctx.select_stream(1)
        s1.enqueue_wait_for(ctx)
        out = poison(np.float32, N)
        await s1.enqueue_copy(out, yd)
        np.testing.assert_array_equal(out, a * x + y)
        total = await s1.enqueue_cpu_function(np.sum, out, dtype=np.float64)
        assert total == np.sum(a * x + y, dtype=np.float64)
        async with yd.map_to_host() as m:
            np.testing.assert_array_equal(m.as_numpy(), a * x + y)
            m.as_numpy()[:] = x
        ev = ctx.create_event()
        ctx.enqueue_function(SCALE, yd, yd, a, np.int32(N), grid_dim=blocks_for(N), block_dim=256)
        ctx.stream().record_event(ev)
        await ev
        await ctx.enqueue_copy(out, yd)
        np.testing.assert_array_equal(out, a * x)
        await s1.stream()


@pytest.mark.asyncio
async def test_the_faces_mix(ctx: DeviceContext, rng: np.random.Generator) -> None:
    # Blocking calls still work inside a running loop (they block only this thread).
    data = random_array(rng, np.int64, 100)
    buf = ctx.create_buffer_sync(np.int64, 100)
    ctx.enqueue_copy(buf, data).synchronize()
    out = poison(np.int64, 100)
    await ctx.enqueue_copy(out, buf)
    np.testing.assert_array_equal(out, data)
    ev = ctx.enqueue_cpu_function(lambda: "both")
    assert ev.synchronize() == "both"
    assert await ev == "both"
