"""Several device contexts side by side (issue 8).

What one device allows runs everywhere: two contexts of the same device, waits
and copies between them, one loop awaiting both. What needs two GPUs is written
out too and skips, with the reason, on machines with fewer.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _kernels import ADD_ONE, cuda_device_count

import asyncgpu as ag
from asyncgpu import DeviceContext

N = 4096


@pytest.fixture
def pair(api: str):
    """Two contexts of the same device (device 0)."""
    a = DeviceContext(api=api)
    b = DeviceContext(api=api)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_two_contexts_of_one_device_order_work_between_them(pair, gate, rng) -> None:
    a, b = pair
    data = rng.integers(-1000, 1000, N, dtype=np.int32)
    src = a.enqueue_create_buffer(np.int32, N)
    g = gate()
    a.enqueue_cpu_function(g)  # hold context a's stream
    a.enqueue_copy(src, data)
    b.enqueue_wait_for(a)  # b's later work waits, on the device, for a's work so far
    out = np.full(N, -7, np.int32)
    done = b.enqueue_copy(out, src)
    assert not done.query()  # held back by a's gate
    g.open()
    done.synchronize()
    np.testing.assert_array_equal(out, data)


@pytest.mark.asyncio
async def test_one_loop_awaits_work_of_both_contexts(pair, rng) -> None:
    a, b = pair
    xs = [rng.integers(0, 100, N, dtype=np.int32) for _ in range(2)]

    async def run(ctx: DeviceContext, x: np.ndarray) -> np.ndarray:
        buf = ctx.enqueue_create_buffer(np.int32, N)
        await ctx.enqueue_copy(buf, x)
        await ctx.enqueue_function(ADD_ONE, buf, np.int32(N), grid_dim=N // 256, block_dim=256)
        out = np.full(N, -1, np.int32)
        await ctx.enqueue_copy(out, buf)
        return out

    outs = await asyncio.gather(run(a, xs[0]), run(b, xs[1]))
    for out, x in zip(outs, xs, strict=True):
        np.testing.assert_array_equal(out, x + 1)


def test_contexts_of_one_device_reach_each_other(pair) -> None:
    a, b = pair
    # One device is not its own peer (MAX, cuDeviceCanAccessPeer(d, d)), yet each
    # context addresses the device's memory: enabling is a no-op, not an error.
    assert not a.can_access(b) and not b.can_access(a)
    a.enable_peer_access(b)


def test_peer_access_answers_are_true_on_this_machine(api: str) -> None:
    n = DeviceContext.number_of_devices(api=api)
    assert n >= 1
    if n < 2:
        assert DeviceContext.all_peer_access_enabled() is False
        DeviceContext.enable_all_peer_access()  # a no-op with fewer than two GPUs


needs_two_gpus = pytest.mark.skipif(
    cuda_device_count() < 2,
    reason=f"needs two CUDA GPUs; this machine has {cuda_device_count()} "
    "(run on nvidia-h200-x2, issue 8)",
)


@pytest.mark.gpu
@needs_two_gpus
def test_peer_copy_and_cross_device_wait(rng) -> None:
    d0, d1 = DeviceContext(0, api="cuda"), DeviceContext(1, api="cuda")
    try:
        assert DeviceContext.number_of_devices(api="cuda") >= 2
        if d0.can_access(d1):
            d0.enable_peer_access(d1)
        data = rng.standard_normal(N).astype(np.float32)
        x0 = d0.enqueue_create_buffer(np.float32, N)
        d0.enqueue_copy(x0, data)
        x1 = d1.enqueue_create_buffer(np.float32, N)
        d1.enqueue_wait_for(d0)  # device 1 waits for device 0, on the devices
        d1.enqueue_copy(x1, x0)  # peer copy
        out = np.full(N, np.nan, np.float32)
        d1.enqueue_copy(out, x1).synchronize()
        np.testing.assert_array_equal(out, data)
    finally:
        d0.close()
        d1.close()


@pytest.mark.gpu
@needs_two_gpus
def test_a_peer_buffer_in_a_kernel_or_memset_needs_peer_access_enabled_first() -> None:
    """Another GPU's buffer in a kernel or memset is a ``ValueError`` until this
    device has enabled peer access to it (the kernel would fault the device);
    then it is used in place. (Skips the refusal where an earlier test of the
    process has enabled it already: peer access lasts for the process.)"""
    from asyncgpu._devices.cuda.backend import _peer_enabled

    d0, d1 = DeviceContext(0, api="cuda"), DeviceContext(1, api="cuda")
    try:
        x0 = d0.enqueue_create_buffer(np.int32, N)
        d0.enqueue_memset(x0, 0).synchronize()
        if (1, 0) not in _peer_enabled:
            with pytest.raises(ValueError, match="enable peer access first"):
                d1.enqueue_function(ADD_ONE, x0, np.int32(N), grid_dim=N // 256, block_dim=256)
            with pytest.raises(ValueError, match="enable peer access first"):
                d1.enqueue_memset(x0, 7)
        if not d1.can_access(d0):
            pytest.skip("these GPUs cannot reach each other's memory")
        d1.enable_peer_access(d0)
        d1.enqueue_memset(x0, 7)
        d1.enqueue_function(ADD_ONE, x0, np.int32(N), grid_dim=N // 256, block_dim=256)
        d0.enqueue_wait_for(d1)
        out = np.full(N, -1, np.int32)
        d0.enqueue_copy(out, x0).synchronize()
        np.testing.assert_array_equal(out, np.full(N, 8, np.int32))
    finally:
        d0.close()
        d1.close()


@pytest.mark.gpu
@needs_two_gpus
def test_a_graph_takes_a_peer_buffer_once_peer_access_is_enabled() -> None:
    """A graph's kernel and memset nodes take another GPU's buffer by the
    launches' rule: a ``ValueError`` until this device has enabled peer access
    to it, then used in place at every replay. (Skips the refusal where an
    earlier test of the process has enabled it already.)"""
    from asyncgpu._devices.cuda.backend import _peer_enabled

    d0, d1 = DeviceContext(0, api="cuda"), DeviceContext(1, api="cuda")
    try:
        x0 = d0.enqueue_create_buffer(np.int32, N)
        d0.enqueue_memset(x0, 0).synchronize()

        def build(b: ag.DeviceGraphBuilder) -> None:
            s = b.add_memset(x0, 7)
            b.add_function(
                ADD_ONE, x0, np.int32(N), grid_dim=N // 256, block_dim=256, dependencies=[s]
            )

        if (1, 0) not in _peer_enabled:
            with pytest.raises(ValueError, match="enable peer access first"):
                ag.DeviceGraph.create(d1, build)
        if not d1.can_access(d0):
            pytest.skip("these GPUs cannot reach each other's memory")
        d1.enable_peer_access(d0)
        graph = ag.DeviceGraph.create(d1, build)
        for _ in range(2):
            graph.replay()
        d0.enqueue_wait_for(d1)
        out = np.full(N, -1, np.int32)
        d0.enqueue_copy(out, x0).synchronize()
        np.testing.assert_array_equal(out, np.full(N, 8, np.int32))
    finally:
        d0.close()
        d1.close()


@pytest.mark.gpu
@needs_two_gpus
def test_kernel_on_one_device_reads_a_peer_buffer(rng) -> None:
    d0, d1 = DeviceContext(0, api="cuda"), DeviceContext(1, api="cuda")
    try:
        if not d1.can_access(d0):
            pytest.skip("these GPUs cannot reach each other's memory")
        d1.enable_peer_access(d0)
        data = rng.integers(0, 1000, N, dtype=np.int32)
        x0 = d0.enqueue_create_buffer(np.int32, N)
        d0.enqueue_copy(x0, data)
        d1.enqueue_wait_for(d0)
        d1.enqueue_function(ADD_ONE, x0, np.int32(N), grid_dim=N // 256, block_dim=256)
        d0.enqueue_wait_for(d1)
        out = np.full(N, -1, np.int32)
        d0.enqueue_copy(out, x0).synchronize()
        np.testing.assert_array_equal(out, data + 1)
    finally:
        d0.close()
        d1.close()


def test_multicast_is_an_attribute_query(api: str) -> None:
    with DeviceContext(api=api) as ctx:
        assert isinstance(ctx.supports_multicast(), bool)
        if api == "cpu":
            assert ctx.supports_multicast() is False
        assert isinstance(ag.DeviceAttribute.MULTICAST_SUPPORTED, int)
