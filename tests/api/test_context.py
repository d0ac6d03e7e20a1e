"""DeviceContext: choosing a device, its lifetime, and the facts it reports."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from _kernels import ADD_ONE, TIMEOUT_S, Gate, cuda_device_count, random_array

import asyncgpu
from asyncgpu import (
    ContextClosedError,
    DeviceAttribute,
    DeviceContext,
    GPUInfo,
    NoDeviceError,
    UnsupportedError,
)

# -- choosing the device --------------------------------------------------------------------


def test_explicit_cpu_api_gives_the_cpu_device() -> None:
    with DeviceContext(api="cpu") as ctx:
        assert ctx.api() == "cpu"
        assert ctx.id() == 0


@pytest.mark.parametrize("value", ["cpu", "CPU", " cpu "])
def test_asyncgpu_api_env_var_picks_the_default(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("ASYNCGPU_API", value)
    assert asyncgpu.default_api() == "cpu"
    with DeviceContext() as ctx:
        assert ctx.api() == "cpu"
    assert DeviceContext.number_of_devices() == 1


def test_explicit_api_wins_over_the_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCGPU_API", "cuda")
    with DeviceContext(api="cpu") as ctx:
        assert ctx.api() == "cpu"


def test_without_env_var_the_default_is_cuda_only_with_a_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ASYNCGPU_API", raising=False)
    assert asyncgpu.default_api() == ("cuda" if cuda_device_count() > 0 else "cpu")


def test_unknown_api_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="api"):
        DeviceContext(api="metal")


def test_cuda_where_there_is_none_raises_no_device_error() -> None:
    if cuda_device_count() > 0:
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(NoDeviceError):
        DeviceContext(api="cuda")
    assert DeviceContext.number_of_devices(api="cuda") == 0


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"api": 5}, "api"),
        ({"api": "cpu", "num_streams": 2.5}, "num_streams"),
        ({"api": "cpu", "num_streams": "4"}, "num_streams"),
        ({"api": "cpu", "num_streams": True}, "num_streams"),
        ({"copy": "x"}, "copy"),
    ],
    ids=["api", "num_streams=2.5", "num_streams='4'", "num_streams=True", "copy"],
)
def test_arguments_of_the_wrong_type_are_a_type_error_naming_them(kwargs: dict, names: str) -> None:
    with pytest.raises(TypeError, match=names):
        DeviceContext(**kwargs)


def test_cpu_device_has_only_id_zero() -> None:
    with pytest.raises(IndexError):
        DeviceContext(1, api="cpu")


@pytest.mark.parametrize("bad", ["0", 0.0, True, None])
def test_device_id_must_be_an_int(bad: object) -> None:
    with pytest.raises(TypeError):
        DeviceContext(bad, api="cpu")  # type: ignore[arg-type]


def test_device_id_out_of_range(api: str) -> None:
    with pytest.raises(IndexError):
        DeviceContext(DeviceContext.number_of_devices(api=api), api=api)


def test_num_streams_sizes_the_pool(api: str) -> None:
    with DeviceContext(api=api, num_streams=3) as ctx:
        assert ctx.num_streams() == 3
        ctx.select_stream(2)
        with pytest.raises(IndexError):
            ctx.select_stream(3)
    with pytest.raises(ValueError):
        DeviceContext(api=api, num_streams=0)


# -- lifetime ---------------------------------------------------------------------------------


def test_with_synchronizes_then_closes(api: str) -> None:
    g = Gate()
    opener = threading.Thread(target=lambda: g.entered.wait(TIMEOUT_S) and g.open())
    opener.start()
    with DeviceContext(api=api) as ctx:
        held = ctx.enqueue_cpu_function(g)
        after = ctx.enqueue_cpu_function(lambda: "after")
    opener.join()
    # Leaving the block waited for the gate and for what came after it.
    assert held.query() and after.query()
    assert held.synchronize() == "opened"
    assert after.synchronize() == "after"
    with pytest.raises(ContextClosedError):
        ctx.enqueue_cpu_function(print)


@pytest.mark.asyncio
async def test_async_with_awaits_outstanding_work_without_blocking_the_loop(api: str) -> None:
    g = Gate()
    async with DeviceContext(api=api) as ctx:
        held = ctx.enqueue_cpu_function(g)
        after = ctx.enqueue_cpu_function(lambda: "after")
        # Opened by the loop itself, so only a non-blocking exit can get there.
        asyncio.get_running_loop().call_soon(g.open)
    assert held.query() and after.query()
    assert held.synchronize() == "opened"  # the loop ran while the exit waited
    assert await after == "after"
    with pytest.raises(ContextClosedError):
        ctx.enqueue_cpu_function(print)


@pytest.mark.asyncio
async def test_aclose_is_the_async_close(api: str) -> None:
    ctx = DeviceContext(api=api)
    done = ctx.enqueue_cpu_function(lambda: 5)
    await ctx.aclose()
    assert done.query()
    with pytest.raises(ContextClosedError):
        ctx.select_stream(0)
    await ctx.aclose()  # twice is fine


def test_close_waits_for_outstanding_work(api: str) -> None:
    ctx = DeviceContext(api=api)
    g = Gate()
    held = ctx.enqueue_cpu_function(g)
    opener = threading.Thread(target=lambda: g.entered.wait(TIMEOUT_S) and g.open())
    opener.start()
    ctx.close()
    opener.join()
    assert held.query()
    assert held.synchronize() == "opened"


def test_copy_is_another_reference_to_the_same_context(api: str, rng: np.random.Generator) -> None:
    ctx = DeviceContext(api=api)
    other = DeviceContext(copy=ctx)
    assert other.api() == ctx.api() and other.id() == ctx.id()
    buf = ctx.enqueue_create_buffer(np.int32, 64)
    data = random_array(rng, np.int32, 64)
    ctx.enqueue_copy(buf, data)
    ctx.close()
    # The copy keeps the context alive: ctx's buffer is still usable through it.
    with pytest.raises(ContextClosedError):
        ctx.enqueue_create_buffer(np.int32, 1)
    out = np.full(64, -1, np.int32)
    other.enqueue_copy(out, buf).synchronize()
    np.testing.assert_array_equal(out, data)
    other.close()
    with pytest.raises(ContextClosedError):
        other.enqueue_create_buffer(np.int32, 1)
    with pytest.raises(ContextClosedError):
        buf.unsafe_ptr()


def test_copy_of_a_closed_context_raises(api: str) -> None:
    ctx = DeviceContext(api=api)
    ctx.close()
    with pytest.raises(ContextClosedError):
        DeviceContext(copy=ctx)


def test_double_close_is_fine(api: str) -> None:
    ctx = DeviceContext(api=api)
    ctx.close()
    ctx.close()
    with DeviceContext(api=api) as c2:
        c2.close()  # closing inside `with`, then leaving it, is fine too


_USES = {
    "enqueue_create_buffer": lambda c, b, h: c.enqueue_create_buffer(np.int32, 4),
    "create_buffer_sync": lambda c, b, h: c.create_buffer_sync(np.int32, 4),
    "enqueue_create_host_buffer": lambda c, b, h: c.enqueue_create_host_buffer(np.int32, 4),
    "enqueue_copy": lambda c, b, h: c.enqueue_copy(b, h),
    "enqueue_copy_no_cross_stream_sync": lambda c, b, h: c.enqueue_copy_no_cross_stream_sync(h, b),
    "enqueue_memset": lambda c, b, h: c.enqueue_memset(b, 1),
    "enqueue_function": lambda c, b, h: c.enqueue_function(
        ADD_ONE, b, np.int32(4), grid_dim=1, block_dim=4
    ),
    "enqueue_cpu_function": lambda c, b, h: c.enqueue_cpu_function(print),
    "enqueue_cpu_range": lambda c, b, h: c.enqueue_cpu_range(print, 2),
    "enqueue_wait_for": lambda c, b, h: c.enqueue_wait_for(c),
    "select_stream": lambda c, b, h: c.select_stream(1),
    "synchronize": lambda c, b, h: c.synchronize(),
    "create_event": lambda c, b, h: c.create_event(),
    "create_stream": lambda c, b, h: c.create_stream(),
    "stream().synchronize": lambda c, b, h: c.stream().synchronize(),
    "name": lambda c, b, h: c.name(),
    "get_attribute": lambda c, b, h: c.get_attribute(DeviceAttribute.WARP_SIZE),
    "compile_function": lambda c, b, h: c.compile_function(ADD_ONE),
    "execution_time": lambda c, b, h: c.execution_time(lambda: None, 1),
    "buffer.unsafe_ptr": lambda c, b, h: b.unsafe_ptr(),
    "buffer.enqueue_fill": lambda c, b, h: b.enqueue_fill(3),
    "buffer.create_sub_buffer": lambda c, b, h: b.create_sub_buffer(np.int32, 0, 1),
    "buffer.map_to_host": lambda c, b, h: b.map_to_host(),
    "host_buffer.unsafe_ptr": lambda c, b, h: h.unsafe_ptr(),
    "host_buffer.as_numpy": lambda c, b, h: h.as_numpy(),
    "host_buffer[0]": lambda c, b, h: h[0],
    "stream view": lambda c, b, h: c.select_stream(0).enqueue_cpu_function(print),
}


@pytest.mark.parametrize("use", list(_USES), ids=list(_USES))
def test_every_use_after_close_raises_context_closed_error(api: str, use: str) -> None:
    ctx = DeviceContext(api=api)
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    host = ctx.enqueue_create_host_buffer(np.int32, 4)
    ctx.close()
    with pytest.raises(ContextClosedError):
        _USES[use](ctx, buf, host)


def test_a_view_made_before_close_is_closed_too(api: str) -> None:
    ctx = DeviceContext(api=api)
    view = ctx.select_stream(1)
    ctx.close()
    with pytest.raises(ContextClosedError):
        view.enqueue_cpu_function(print)


_VIEWS = {
    "with select_stream": lambda c: c.select_stream(1),
    "select_stream": lambda c: c.select_stream(2),
    "select_stream(0)": lambda c: c.select_stream(0),
    "buffer.context": lambda c: c.enqueue_create_buffer(np.int32, 4).context(),
    "stream().context": lambda c: c.stream().context(),
}


@pytest.mark.parametrize("view", list(_VIEWS), ids=list(_VIEWS))
def test_closing_a_view_leaves_the_context_open(ctx: DeviceContext, view: str) -> None:
    """A view (of a handle still alive) shares the handle's reference: closing it
    used to close the context under the handle."""
    v = _VIEWS[view](ctx)
    if view.startswith("with"):
        with v as entered:
            assert entered.enqueue_cpu_function(lambda: 1).synchronize() == 1
    else:
        v.close()
    v.close()  # twice is fine too
    assert ctx.enqueue_cpu_function(lambda: "open").synchronize() == "open"
    ctx.close()  # the context itself still closes its views
    with pytest.raises(ContextClosedError):
        v.enqueue_cpu_function(print)
    with pytest.raises(ContextClosedError):
        ctx.enqueue_cpu_function(print)


def test_closing_a_view_waits_for_its_own_streams_work(ctx: DeviceContext, gate) -> None:
    view = ctx.select_stream(1)
    mine, other = gate(), gate()
    held = view.enqueue_cpu_function(mine)
    elsewhere = ctx.select_stream(2).enqueue_cpu_function(other)
    opener = threading.Thread(target=lambda: mine.entered.wait(TIMEOUT_S) and mine.open())
    opener.start()
    view.close()
    opener.join()
    assert held.query()  # the view's stream, waited for ...
    assert not elsewhere.query()  # ... and only that one
    other.open()
    assert elsewhere.synchronize() == "opened"
    assert view.enqueue_cpu_function(lambda: "open").synchronize() == "open"


@pytest.mark.asyncio
async def test_leaving_async_with_on_a_view_awaits_its_stream_and_leaves_the_context_open(
    ctx: DeviceContext, gate
) -> None:
    g = gate()
    async with ctx.select_stream(1) as view:
        held = view.enqueue_cpu_function(g)
        asyncio.get_running_loop().call_soon(g.open)  # only a non-blocking exit gets there
    assert held.query()
    assert await asyncio.wait_for(ctx.enqueue_cpu_function(lambda: "open"), TIMEOUT_S) == "open"
    assert await asyncio.wait_for(view.enqueue_cpu_function(lambda: "v"), TIMEOUT_S) == "v"


@pytest.mark.asyncio
async def test_awaiting_a_closed_context_raises(api: str) -> None:
    ctx = DeviceContext(api=api)
    ctx.close()
    with pytest.raises(ContextClosedError):
        await ctx


# -- facts ------------------------------------------------------------------------------------


def test_name_api_id(ctx: DeviceContext, api: str) -> None:
    assert isinstance(ctx.name(), str) and ctx.name()
    assert ctx.api() == api
    assert ctx.id() == 0


def test_the_cpu_device_is_named_cpu(ctx: DeviceContext, api: str) -> None:
    # MAX's tests require "cpu" in the CPU device's name; the processor is in the extras.
    if api == "cpu":
        assert "cpu" in ctx.name()
        assert ctx.default_device_info.name == ctx.name()
        processor = ctx.default_device_info.extra["processor"]
        assert isinstance(processor, str) and processor
    else:
        assert "cpu" not in ctx.name().lower()


def test_get_api_version(ctx: DeviceContext) -> None:
    v = ctx.get_api_version()
    assert isinstance(v, int)
    # CUDA: the driver version (13000 for 13.0); CPU: Python's major*1000 + minor*10.
    assert v >= 3000


def test_default_device_info_describes_the_device(ctx: DeviceContext, api: str) -> None:
    info = ctx.default_device_info
    assert isinstance(info, GPUInfo)
    assert info.api == api
    assert info.name == ctx.name()
    A = DeviceAttribute
    assert info.warp_size == ctx.get_attribute(A.WARP_SIZE)
    assert info.threads_per_block == ctx.get_attribute(A.MAX_THREADS_PER_BLOCK)
    assert info.max_block_dim == tuple(
        ctx.get_attribute(a) for a in (A.MAX_BLOCK_DIM_X, A.MAX_BLOCK_DIM_Y, A.MAX_BLOCK_DIM_Z)
    )
    assert info.max_grid_dim == tuple(
        ctx.get_attribute(a) for a in (A.MAX_GRID_DIM_X, A.MAX_GRID_DIM_Y, A.MAX_GRID_DIM_Z)
    )
    assert info.sm_count == ctx.get_attribute(A.MULTIPROCESSOR_COUNT) >= 1
    assert info.shared_memory_per_block == ctx.get_attribute(A.MAX_SHARED_MEMORY_PER_BLOCK)
    assert info.shared_memory_per_block_optin == ctx.get_attribute(
        A.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    )
    assert info.total_memory == ctx.get_memory_info()[1] > 0
    assert info.target() == info.arch
    if api == "cpu":
        assert info.arch == "cpu"
        assert info.compute_capability is None
        assert info.warp_size == 1
    else:
        major, minor = info.compute_capability
        assert info.arch == f"sm_{major}{minor}"
        assert (major, minor) == (
            ctx.get_attribute(A.COMPUTE_CAPABILITY_MAJOR),
            ctx.get_attribute(A.COMPUTE_CAPABILITY_MINOR),
        )
        assert info.warp_size == 32


def test_get_attribute_answers_launch_limits(ctx: DeviceContext) -> None:
    for attr in (
        DeviceAttribute.MAX_THREADS_PER_BLOCK,
        DeviceAttribute.MAX_BLOCK_DIM_X,
        DeviceAttribute.MAX_GRID_DIM_X,
        DeviceAttribute.WARP_SIZE,
        DeviceAttribute.MULTIPROCESSOR_COUNT,
    ):
        v = ctx.get_attribute(attr)
        assert isinstance(v, int) and v >= 1, attr
    assert ctx.get_attribute(DeviceAttribute.MAX_THREADS_PER_BLOCK) == 1024
    # A plain int with CUDA's numbering works as well as the enum.
    assert ctx.get_attribute(1) == 1024


@pytest.mark.parametrize("api", ["cpu"])
def test_cpu_device_refuses_attributes_it_has_no_answer_for(ctx: DeviceContext) -> None:
    with pytest.raises(UnsupportedError):
        ctx.get_attribute(DeviceAttribute.CLOCK_RATE)
    with pytest.raises(UnsupportedError):
        ctx.get_attribute(9999)
    with pytest.raises(TypeError):
        ctx.get_attribute("WARP_SIZE")  # type: ignore[arg-type]


def test_memory_info(ctx: DeviceContext) -> None:
    free, total = ctx.get_memory_info()
    assert isinstance(free, int) and isinstance(total, int)
    assert 0 < free <= total
    assert 0 < ctx.max_single_alloc_size() <= total


def test_is_compatible_and_healthcheck(ctx: DeviceContext) -> None:
    assert ctx.is_compatible() is True
    assert ctx.run_healthcheck() is None


@pytest.mark.parametrize("priority", ["high", None, 0.0])
def test_create_stream_priority_of_the_wrong_type_is_a_type_error(
    ctx: DeviceContext, priority: object
) -> None:
    with pytest.raises(TypeError, match="priority"):
        ctx.create_stream(priority=priority)  # type: ignore[arg-type]


def test_peer_access_needs_a_context(ctx: DeviceContext) -> None:
    with pytest.raises(TypeError, match="can_access"):
        ctx.can_access("x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="enable_peer_access"):
        ctx.enable_peer_access("x")  # type: ignore[arg-type]


def test_launch_attributes_that_are_not_launch_attributes_are_a_type_error_naming_them(
    ctx: DeviceContext,
) -> None:
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    for attributes in ([[1]], [1], ["cooperative"]):
        with pytest.raises(TypeError, match="LaunchAttribute"):
            ctx.enqueue_function(
                ADD_ONE, buf, np.int32(4), grid_dim=1, block_dim=4, attributes=attributes
            )


@pytest.mark.parametrize("api", ["cpu"])  # (a CUDA kernel needs its source)
def test_bound_methods_of_one_object_launch_their_own_kernels(ctx: DeviceContext) -> None:
    """The compiled-function cache was keyed by ``id(f)``: ``obj.method`` is a new
    object at each access, and a freed one's id is soon another's, so a launch of
    one method could run the kernel compiled for the other."""

    class Kernels:
        def one(self, b, x):
            x[...] = 1

        def two(self, b, x):
            x[...] = 2

    k = Kernels()
    host = ctx.enqueue_create_host_buffer(np.int32, 4)
    seen = []
    for _ in range(50):
        ctx.enqueue_function(k.one, host, grid_dim=1, block_dim=1)
        one = ctx.enqueue_cpu_function(lambda: int(host[0]))
        ctx.enqueue_function(k.two, host, grid_dim=1, block_dim=1)
        two = ctx.enqueue_cpu_function(lambda: int(host[0]))
        seen.append((one.synchronize(), two.synchronize()))
    assert seen == [(1, 2)] * 50


def test_a_device_is_not_its_own_peer(ctx: DeviceContext, api: str) -> None:
    # As in MAX, and as cuDeviceCanAccessPeer(d, d) answers.
    assert ctx.can_access(ctx) is False
    assert ctx.can_access(ctx.select_stream(1)) is False
    with DeviceContext(api=api) as same_device:
        assert ctx.can_access(same_device) is False and same_device.can_access(ctx) is False
        ctx.enable_peer_access(same_device)  # a no-op, not an error
        same_device.enable_peer_access(ctx)
    ctx.enable_peer_access(ctx)


def test_the_cpu_device_has_no_peers(ctx: DeviceContext, api: str) -> None:
    if cuda_device_count() == 0:
        pytest.skip("needs a CUDA device beside the CPU device")
    with DeviceContext(api="cpu" if api == "cuda" else "cuda") as other:
        assert ctx.can_access(other) is False and other.can_access(ctx) is False
        cpu, gpu = (ctx, other) if api == "cpu" else (other, ctx)
        with pytest.raises(asyncgpu.UnsupportedError):
            cpu.enable_peer_access(gpu)
        with pytest.raises(asyncgpu.UnsupportedError):
            gpu.enable_peer_access(cpu)


def test_two_gpus_peer_access() -> None:
    if cuda_device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    with DeviceContext(0, api="cuda") as a, DeviceContext(1, api="cuda") as b:
        if a.can_access(b):
            a.enable_peer_access(b)


def test_multicast(ctx: DeviceContext, api: str) -> None:
    value = ctx.supports_multicast()
    assert isinstance(value, bool)
    if api == "cpu":
        assert value is False


def test_number_of_devices(api: str) -> None:
    n = DeviceContext.number_of_devices(api=api)
    assert isinstance(n, int) and n >= 1
    if api == "cpu":
        assert n == 1


def test_all_peer_access(api: str) -> None:
    assert DeviceContext.enable_all_peer_access() is None
    enabled = DeviceContext.all_peer_access_enabled()
    assert isinstance(enabled, bool)
    if cuda_device_count() < 2:
        assert enabled is False


def test_push_context_and_set_as_current(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.float32, 32)
    with ctx.push_context():
        buf = ctx.enqueue_create_buffer(np.float32, 32)
        ctx.enqueue_copy(buf, data)
    assert ctx.set_as_current() is None
    out = np.full(32, np.nan, np.float32)
    ctx.enqueue_copy(out, buf).synchronize()
    np.testing.assert_array_equal(out, data)


def test_repr_and_equality(ctx: DeviceContext) -> None:
    assert ctx.api() in repr(ctx)
    assert ctx.select_stream(0) == ctx
    assert ctx.select_stream(1) == ctx.select_stream(1)
    assert ctx.select_stream(1) != ctx
    assert len({ctx, ctx.select_stream(0), ctx.select_stream(1)}) == 2
