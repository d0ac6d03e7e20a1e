"""Kernels: one object with a CUDA source and a NumPy body runs on every device."""

from __future__ import annotations

import numpy as np
import pytest
from _kernels import (
    ADD_ONE,
    AXPY,
    FILL_INDEX,
    SCALE,
    TRAP_AND_SPIN,
    blocks_for,
    poison,
    random_array,
)

from asyncgpu import (
    ContextClosedError,
    DeviceContext,
    DeviceEvent,
    DeviceFunction,
    Dim,
    FuncAttribute,
    Kernel,
    LaunchAttribute,
    ThreadBlock,
    UnsupportedError,
    kernel,
)

N = 10_000


def device_with(ctx: DeviceContext, data: np.ndarray):
    buf = ctx.enqueue_create_buffer(data.dtype, data.size)
    ctx.enqueue_copy(buf, data)
    return buf


def read(ctx: DeviceContext, buf) -> np.ndarray:
    out = poison(buf.dtype, len(buf))
    ctx.enqueue_copy(out, buf).synchronize()
    return out


# -- running kernels --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_scale_runs_on_the_device(ctx: DeviceContext, rng: np.random.Generator) -> None:
    x = random_array(rng, np.float32, N)
    a = np.float32(rng.uniform(-3, 3))
    xd = device_with(ctx, x)
    yd = device_with(ctx, poison(np.float32, N))
    done = ctx.enqueue_function(
        SCALE, yd, xd, a, np.int32(N), grid_dim=blocks_for(N), block_dim=256
    )
    assert isinstance(done, DeviceEvent)
    assert await done is None
    np.testing.assert_array_equal(read(ctx, yd), a * x)


def test_axpy_reads_and_writes_in_place(ctx: DeviceContext, rng: np.random.Generator) -> None:
    x = random_array(rng, np.float32, N)
    y = random_array(rng, np.float32, N)
    a = np.float32(rng.choice([0.25, 0.5, 2.0, -4.0]))  # exact products: see _kernels.AXPY
    xd, yd = device_with(ctx, x), device_with(ctx, y)
    ctx.enqueue_function(AXPY, a, xd, yd, np.int32(N), grid_dim=blocks_for(N), block_dim=256)
    np.testing.assert_array_equal(read(ctx, yd), a * x + y)
    np.testing.assert_array_equal(read(ctx, xd), x)


def test_only_the_first_n_elements_are_touched(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    data = random_array(rng, np.int32, 1000)
    buf = device_with(ctx, data)
    ctx.enqueue_function(ADD_ONE, buf, np.int32(700), grid_dim=4, block_dim=256)  # 1024 threads
    expect = data.copy()
    expect[:700] += 1
    np.testing.assert_array_equal(read(ctx, buf), expect)


def test_kernels_in_a_row_run_in_order(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.int32, N) // 2
    buf = device_with(ctx, data)
    for _ in range(10):
        ctx.enqueue_function(ADD_ONE, buf, np.int32(N), grid_dim=blocks_for(N), block_dim=256)
    np.testing.assert_array_equal(read(ctx, buf), data + 10)


def test_kernel_on_a_host_buffer(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.int32, 300) // 2
    h = ctx.enqueue_create_host_buffer(np.int32, 300)
    ctx.enqueue_copy(h, data)
    ctx.enqueue_function(ADD_ONE, h, np.int32(300), grid_dim=2, block_dim=256).synchronize()
    np.testing.assert_array_equal(h.as_numpy(), data + 1)


def test_kernel_on_a_sub_buffer(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.int32, 500) // 2
    buf = device_with(ctx, data)
    sub = buf.create_sub_buffer(np.int32, 100, 200)
    ctx.enqueue_function(ADD_ONE, sub, np.int32(200), grid_dim=1, block_dim=256)
    expect = data.copy()
    expect[100:300] += 1
    np.testing.assert_array_equal(read(ctx, buf), expect)


def test_compile_function_gives_a_reusable_device_function(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    f = ctx.compile_function(ADD_ONE)
    assert isinstance(f, DeviceFunction)
    assert f.name == "add_one"
    assert f.context() == ctx
    s1 = ctx.select_stream(1)
    data = random_array(rng, np.int32, 64) // 2
    buf0, buf1 = device_with(ctx, data), device_with(s1, data)
    ctx.enqueue_function(f, buf0, np.int32(64), grid_dim=1, block_dim=64)
    ctx.enqueue_function(f, buf0, np.int32(64), grid_dim=1, block_dim=64)
    s1.enqueue_function(f, buf1, np.int32(64), grid_dim=1, block_dim=64)  # one function, any stream
    np.testing.assert_array_equal(read(ctx, buf0), data + 2)
    np.testing.assert_array_equal(read(s1, buf1), data + 1)
    assert "add_one" in repr(f)


def test_stream_enqueue_function(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.int32, 128) // 2
    s = ctx.select_stream(2)
    buf = device_with(s, data)
    s.stream().enqueue_function(ADD_ONE, buf, np.int32(128), grid_dim=1, block_dim=128)
    np.testing.assert_array_equal(read(s, buf), data + 1)


def test_a_function_of_another_context_is_refused(ctx: DeviceContext, api: str) -> None:
    with DeviceContext(api=api) as other:
        f = other.compile_function(ADD_ONE)
        buf = ctx.enqueue_create_buffer(np.int32, 4)
        with pytest.raises(ValueError):
            ctx.enqueue_function(f, buf, np.int32(4), grid_dim=1, block_dim=4)


# -- launch geometry --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grid, block",
    [
        (40, 256),
        ((40,), (256,)),
        (Dim(40), Dim(256)),
        ((5, 4, 2), (8, 4, 8)),
        (Dim(3, 3, 3), Dim(16, 8, 2)),
        ((2, 7), (32, 9)),
        (np.int32(40), 256),
    ],
    ids=["int", "1-tuple", "Dim", "3-D tuple", "3-D Dim", "2-D tuple", "numpy int"],
)
def test_grid_and_block_as_int_tuple_or_dim(
    ctx: DeviceContext, grid: object, block: object
) -> None:
    g = Dim.of(grid) if not isinstance(grid, np.integer) else Dim(int(grid))
    b = Dim.of(block)
    n = g.size() * b.size()
    out = device_with(ctx, poison(np.int32, n + 10))
    ctx.enqueue_function(FILL_INDEX, out, np.int32(n), grid_dim=grid, block_dim=block)
    expect = np.arange(n + 10, dtype=np.int32)
    expect[n:] = poison(np.int32, 10)
    np.testing.assert_array_equal(read(ctx, out), expect)  # each thread wrote its own index


@pytest.mark.parametrize(
    "grid, block",
    [(0, 32), (1, 0), (-1, 32), (1, -32), ((1, 0), 32), (1, (32, 1, 0)), (Dim(1, 1, 0), 1)],
)
def test_zero_or_negative_dims_are_a_value_error(
    ctx: DeviceContext, grid: object, block: object
) -> None:
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    with pytest.raises(ValueError):
        ctx.enqueue_function(FILL_INDEX, buf, np.int32(4), grid_dim=grid, block_dim=block)


@pytest.mark.parametrize(
    "grid, block", [(1.0, 32), (1, "32"), ((1, 2, 3, 4), 1), (1, [32]), (True, 1), (None, 1)]
)
def test_dims_that_are_not_integers_are_a_type_error(
    ctx: DeviceContext, grid: object, block: object
) -> None:
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    with pytest.raises(TypeError, match=r"grid_dim|block_dim"):  # names the culprit
        ctx.enqueue_function(FILL_INDEX, buf, np.int32(4), grid_dim=grid, block_dim=block)


@pytest.mark.parametrize(
    "block", [1025, (32, 33), (16, 16, 8), (2048, 1, 1), (1, 1, 65), (1, 1025)], ids=str
)
def test_too_many_threads_per_block_is_a_value_error(ctx: DeviceContext, block: object) -> None:
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    with pytest.raises(ValueError):
        ctx.enqueue_function(FILL_INDEX, buf, np.int32(4), grid_dim=1, block_dim=block)


def test_grid_beyond_the_device_limit_is_a_value_error(ctx: DeviceContext) -> None:
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    with pytest.raises(ValueError):
        ctx.enqueue_function(FILL_INDEX, buf, np.int32(4), grid_dim=(1, 65536), block_dim=1)


def test_negative_shared_memory_is_a_value_error(ctx: DeviceContext) -> None:
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    with pytest.raises(ValueError):
        ctx.enqueue_function(
            FILL_INDEX, buf, np.int32(4), grid_dim=1, block_dim=4, shared_mem_bytes=-1
        )


@pytest.mark.parametrize("arg", [7, 7.0, True, 1j], ids=["int", "float", "bool", "complex"])
def test_python_scalars_as_kernel_arguments_are_a_type_error(
    ctx: DeviceContext, arg: object
) -> None:
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    with pytest.raises(TypeError, match=r"(?i)numpy"):  # and says what to pass instead
        ctx.enqueue_function(ADD_ONE, buf, arg, grid_dim=1, block_dim=4)


_LONG = np.longdouble(1) if np.dtype(np.longdouble).itemsize not in (2, 4, 8) else np.bytes_(b"x")


@pytest.mark.parametrize(
    ("arg", "named"),
    [
        ("4", "str"),
        (None, "NoneType"),
        ([4], "list"),
        ({"n": 4}, "dict"),
        (object(), "object"),
        (np.zeros(4, np.int32), "NumPy array"),
        (_LONG, type(_LONG).__name__),
    ],
    ids=["str", "None", "list", "dict", "object", "ndarray", "longdouble"],
)
def test_an_argument_cuda_refuses_is_refused_on_every_device(
    ctx: DeviceContext, arg: object, named: str
) -> None:
    """The CPU device used to hand such arguments to the NumPy body: a program
    checked there failed on CUDA. Both launch paths: a ``Kernel`` (the general
    one) and a compiled function with a geometry seen before."""
    f = ctx.compile_function(ADD_ONE)
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    buf.enqueue_fill(0)
    ctx.enqueue_function(f, buf, np.int32(4), grid_dim=1, block_dim=4)  # caches the geometry
    for k in (ADD_ONE, f):
        with pytest.raises(TypeError, match=rf"argument 1\b.*{named}|{named}.*argument 1\b"):
            ctx.enqueue_function(k, buf, arg, grid_dim=1, block_dim=4)
    np.testing.assert_array_equal(read(ctx, buf), np.ones(4, np.int32))  # nothing else ran


def test_a_buffer_that_cannot_be_used_is_refused_at_the_launch(
    ctx: DeviceContext, api: str
) -> None:
    """The CPU device used to hand a kernel a taken buffer's memory, or a closed
    context's, as a NumPy view (and failed, if at all, at the await). Both launch
    paths are checked: the general one (a Kernel) and the C fast path (a
    DeviceFunction with a geometry seen before)."""
    f = ctx.compile_function(ADD_ONE)
    ok = ctx.enqueue_create_buffer(np.int32, 4)
    ok.enqueue_fill(0)
    ctx.enqueue_function(f, ok, np.int32(4), grid_dim=1, block_dim=4)  # caches the geometry
    taken = ctx.enqueue_create_buffer(np.int32, 4)
    taken.take_ptr()
    with DeviceContext(api=api) as other:
        foreign = other.enqueue_create_buffer(np.int32, 4)
    for k in (ADD_ONE, f):
        with pytest.raises(ValueError, match="take_ptr"):
            ctx.enqueue_function(k, taken, np.int32(4), grid_dim=1, block_dim=4)
        with pytest.raises(ContextClosedError):
            ctx.enqueue_function(k, foreign, np.int32(4), grid_dim=1, block_dim=4)
    np.testing.assert_array_equal(read(ctx, ok), np.ones(4, np.int32))


def test_a_buffer_of_another_context_of_the_device_is_used_in_place(
    ctx: DeviceContext, api: str
) -> None:
    """Two contexts of one device share its memory (on CUDA, the device's
    primary context): a kernel and a memset of one take the other's buffers,
    on both launch paths (a Kernel, and a DeviceFunction with a geometry seen
    before, whose compiled launch hands such a buffer to the general path), as
    copies do. Once the other context is closed, its buffer is
    ``ContextClosedError`` in both."""
    f = ctx.compile_function(ADD_ONE)
    mine = ctx.enqueue_create_buffer(np.int32, 4)
    ctx.enqueue_memset(mine, 0)
    ctx.enqueue_function(f, mine, np.int32(4), grid_dim=1, block_dim=4)  # caches the geometry
    with DeviceContext(api=api) as other:
        theirs = other.enqueue_create_buffer(np.int32, 4)
        other.synchronize()  # (the allocation is another stream's work)
        ctx.enqueue_memset(theirs, 5)
        ctx.enqueue_function(f, theirs, np.int32(4), grid_dim=1, block_dim=4)
        ctx.enqueue_function(ADD_ONE, theirs, np.int32(4), grid_dim=1, block_dim=4)
        ctx.synchronize()
        np.testing.assert_array_equal(read(other, theirs), np.full(4, 7, np.int32))
    for use in (
        lambda: ctx.enqueue_memset(theirs, 0),
        lambda: ctx.enqueue_function(f, theirs, np.int32(4), grid_dim=1, block_dim=4),
        lambda: ctx.enqueue_function(ADD_ONE, theirs, np.int32(4), grid_dim=1, block_dim=4),
    ):
        with pytest.raises(ContextClosedError, match="closed context"):
            use()
    np.testing.assert_array_equal(read(ctx, mine), np.ones(4, np.int32))


def test_a_buffer_of_another_device_is_refused_by_kernels_and_memsets() -> None:
    """Without a GPU: a second CPU context whose ``api`` is renamed stands in
    for another device (the rule is the core's, by API and by what the
    backend's ``reaches`` says, never by a device's name). Its buffers in a
    kernel (both launch paths) or a memset of the first context are a
    ``ValueError`` at the call naming both contexts, and nothing runs; a
    context of the same API whose memory the device does not address (another
    GPU without peer access) likewise, with the way out in the message."""
    with DeviceContext(api="cpu") as cpu, DeviceContext(api="cpu") as other:
        f = cpu.compile_function(ADD_ONE)
        mine = cpu.enqueue_create_buffer(np.int32, 4)
        cpu.enqueue_memset(mine, 0)
        cpu.enqueue_function(f, mine, np.int32(4), grid_dim=1, block_dim=4)  # (seen)
        theirs = other.enqueue_create_buffer(np.int32, 4)
        other.enqueue_memset(theirs, 3)
        uses = {
            "memset": lambda: cpu.enqueue_memset(theirs, 0),
            "compiled launch": lambda: cpu.enqueue_function(
                f, theirs, np.int32(4), grid_dim=1, block_dim=4
            ),
            "general launch": lambda: cpu.enqueue_function(
                ADD_ONE, theirs, np.int32(4), grid_dim=1, block_dim=4
            ),
        }
        other._state.api = "other"
        try:
            for what, use in uses.items():
                name = "enqueue_memset" if what == "memset" else "kernel argument 0"
                with pytest.raises(
                    ValueError,
                    match=rf"{name}: a DeviceBuffer of the other:0 context cannot be used by "
                    r"the cpu:0 context.*enqueue_copy",
                ):
                    use()
        finally:
            other._state.api = "cpu"
        backend = cpu._state.backend
        backend.reaches = lambda peer: False  # (an instance attribute: this context only)
        try:
            for use in uses.values():
                with pytest.raises(ValueError, match="enable peer access first"):
                    use()
        finally:
            del backend.reaches
        np.testing.assert_array_equal(read(other, theirs), np.full(4, 3, np.int32))
        np.testing.assert_array_equal(read(cpu, mine), np.ones(4, np.int32))


def test_a_cpu_context_buffer_in_a_cuda_kernel_or_memset_is_refused(
    ctx: DeviceContext, api: str
) -> None:
    """The real mix of devices: a CPU context's buffers (pageable host memory)
    in a CUDA context's kernel or memset, and a CUDA context's buffers (device
    or pinned host) in a CPU context's, are ``ValueError`` naming both; the
    same buffers do take part in copies across (see test_copies)."""
    if api == "cpu":
        pytest.skip("needs a CUDA context beside the CPU one")
    f = ctx.compile_function(ADD_ONE)
    mine = ctx.enqueue_create_buffer(np.int32, 4)
    ctx.enqueue_memset(mine, 0)
    ctx.enqueue_function(f, mine, np.int32(4), grid_dim=1, block_dim=4)  # (seen)
    with DeviceContext(api="cpu") as cpu:
        g = cpu.compile_function(ADD_ONE)
        for theirs in (
            cpu.enqueue_create_buffer(np.int32, 4),
            cpu.enqueue_create_host_buffer(np.int32, 4),
        ):
            with pytest.raises(ValueError, match="of the cpu:0 context cannot be used by"):
                ctx.enqueue_memset(theirs, 0)
            for k in (f, ADD_ONE):  # (the compiled launch and the general one)
                with pytest.raises(ValueError, match="of the cpu:0 context cannot be used by"):
                    ctx.enqueue_function(k, theirs, np.int32(4), grid_dim=1, block_dim=4)
        for theirs in (mine, ctx.enqueue_create_host_buffer(np.int32, 4)):
            with pytest.raises(ValueError, match="cannot be used by the cpu:0 context"):
                cpu.enqueue_memset(theirs, 0)
            with pytest.raises(ValueError, match="cannot be used by the cpu:0 context"):
                cpu.enqueue_function(g, theirs, np.int32(4), grid_dim=1, block_dim=4)
    np.testing.assert_array_equal(read(ctx, mine), np.ones(4, np.int32))


@pytest.mark.parametrize("api", ["cpu"])  # (CUDA reads the count from the PTX)
@pytest.mark.parametrize("args", [1, 3], ids=["too few", "too many"])
def test_a_cpu_kernel_with_the_wrong_number_of_arguments_fails_at_the_launch(
    ctx: DeviceContext, args: int
) -> None:
    """It used to fail in every block, at the await."""
    f = ctx.compile_function(ADD_ONE)
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    buf.enqueue_fill(0)
    ctx.enqueue_function(f, buf, np.int32(4), grid_dim=1, block_dim=4)  # caches the geometry
    launch = (buf, np.int32(4), np.int32(5))[:args]
    for k in (ADD_ONE, f):
        with pytest.raises(TypeError, match="add_one"):
            ctx.enqueue_function(k, *launch, grid_dim=1, block_dim=4)
    np.testing.assert_array_equal(read(ctx, buf), np.ones(4, np.int32))  # nothing else ran


def test_func_attribute_numbers_are_cudas() -> None:
    """``FuncAttribute`` is numbered as CUDA's ``CUfunction_attribute``:
    NON_PORTABLE_CLUSTER_SIZE_ALLOWED was 12 (CUDA's REQUIRED_CLUSTER_HEIGHT)."""
    drv = pytest.importorskip("cuda.bindings.driver")
    assert FuncAttribute.NON_PORTABLE_CLUSTER_SIZE_ALLOWED(1) == (14, 1)
    names = [
        n for n, v in vars(FuncAttribute).items() if isinstance(v, staticmethod) and n.isupper()
    ]
    assert "MAX_DYNAMIC_SHARED_SIZE_BYTES" in names  # (the constructors were found)
    for name in names:
        cuda_number = int(getattr(drv.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}"))
        assert getattr(FuncAttribute, name)(1).attribute == cuda_number, name


def test_a_compiled_kernels_first_launch_runs_beside_running_kernels(
    api: str, ctx: DeviceContext
) -> None:
    """``compile_function`` loads the kernel on the device: its first launch does
    not wait, as the driver's lazy loading would have it, for the kernels
    already running on other streams (here a 2 s spin) to finish."""
    if api != "cuda":
        pytest.skip("the CPU device runs each stream's work in order on its pool")
    spin = ctx.compile_function(TRAP_AND_SPIN, "spin")
    fresh = ctx.compile_function(
        f'extern "C" __global__ void fresh_{id(ctx):x}(int *p) {{ *p = 1; }}', f"fresh_{id(ctx):x}"
    )
    out = ctx.enqueue_create_buffer(np.int32, 1)
    ctx.synchronize()
    khz = ctx.default_device_info.clock_rate_khz
    running = ctx.create_stream().enqueue_function(
        spin, np.int64(khz * 2000), grid_dim=1, block_dim=1
    )
    ctx.enqueue_function(fresh, out, grid_dim=1, block_dim=1).synchronize()
    assert not running.query()  # the spin is still running
    running.synchronize()
    assert read(ctx, out)[0] == 1


@pytest.mark.parametrize("api", ["cpu"])
def test_cpu_device_has_no_clusters_or_cooperative_launches(ctx: DeviceContext) -> None:
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    with pytest.raises(UnsupportedError):
        ctx.enqueue_function(ADD_ONE, buf, np.int32(4), grid_dim=2, block_dim=2, cluster_dim=2)
    with pytest.raises(UnsupportedError):
        ctx.enqueue_function(
            ADD_ONE,
            buf,
            np.int32(4),
            grid_dim=2,
            block_dim=2,
            attributes=[LaunchAttribute.cooperative()],
        )


@pytest.mark.parametrize("api", ["cpu"])
def test_cpu_device_needs_a_numpy_body(ctx: DeviceContext) -> None:
    cuda_only = Kernel("k", cuda='extern "C" __global__ void k() {}')
    with pytest.raises(UnsupportedError):
        ctx.compile_function(cuda_only)
    with pytest.raises(UnsupportedError):
        ctx.compile_function('extern "C" __global__ void k() {}', "k")


@pytest.mark.parametrize("api", ["cpu"])
def test_cpu_kernel_errors_come_back_at_the_await(ctx: DeviceContext) -> None:
    def broken(b, out):
        raise ArithmeticError("bad block")

    buf = ctx.enqueue_create_buffer(np.int32, 4)
    ev = ctx.enqueue_function(broken, buf, grid_dim=3, block_dim=1)
    with pytest.raises(ArithmeticError, match="bad block"):
        ev.synchronize()
    ctx.enqueue_function(ADD_ONE, buf, np.int32(4), grid_dim=1, block_dim=4).synchronize()


@pytest.mark.parametrize("api", ["cpu"])
def test_cpu_kernels_see_the_launch_geometry(ctx: DeviceContext) -> None:
    seen: list[tuple] = []

    @kernel()
    def geometry(b, out):
        seen.append((tuple(b.grid_dim), tuple(b.block_dim), tuple(b.block_idx)))
        assert b.thread_idx.x.shape == (b.block_dim.size(),)
        assert b.shared.nbytes == 16

    buf = ctx.enqueue_create_buffer(np.int32, 1)
    ctx.enqueue_function(
        geometry, buf, grid_dim=(2, 3), block_dim=(4, 2), shared_mem_bytes=16
    ).synchronize()
    assert sorted(seen) == sorted(
        ((2, 3, 1), (4, 2, 1), (x, y, 0)) for x in range(2) for y in range(3)
    )


# -- timing -----------------------------------------------------------------------------------


def _launch(ctx: DeviceContext, buf) -> None:
    ctx.enqueue_function(ADD_ONE, buf, np.int32(len(buf)), grid_dim=4, block_dim=256)


def test_execution_time_with_and_without_the_context(ctx: DeviceContext) -> None:
    buf = ctx.enqueue_create_buffer(np.int32, 1024)
    buf.enqueue_fill(0)
    t1 = ctx.execution_time(lambda c: _launch(c, buf), 5)
    t2 = ctx.execution_time(lambda: _launch(ctx, buf), 5)
    for t in (t1, t2):
        assert isinstance(t, int) and t > 0
    np.testing.assert_array_equal(read(ctx, buf), np.full(1024, 10, np.int32))


def test_execution_time_iter_passes_the_iteration(ctx: DeviceContext) -> None:
    buf = ctx.enqueue_create_buffer(np.int32, 1024)
    buf.enqueue_fill(0)
    seen: list[int] = []

    def with_ctx(c: DeviceContext, i: int) -> None:
        seen.append(i)
        _launch(c, buf)

    def without_ctx(i: int) -> None:
        seen.append(i)
        _launch(ctx, buf)

    t1 = ctx.execution_time_iter(with_ctx, 3)
    t2 = ctx.execution_time_iter(without_ctx, 4)
    for t in (t1, t2):
        assert isinstance(t, int) and t > 0
    assert seen == [0, 1, 2, 0, 1, 2, 3]
    np.testing.assert_array_equal(read(ctx, buf), np.full(1024, 7, np.int32))


def test_execution_time_arguments(ctx: DeviceContext) -> None:
    with pytest.raises(TypeError):
        ctx.execution_time(42, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ctx.execution_time(lambda: None, -1)
    with pytest.raises(TypeError, match="num_iters"):
        ctx.execution_time(lambda: None, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="num_iters"):
        ctx.execution_time_iter(lambda i: None, True)


def test_execution_time_takes_a_numpy_integer_count(ctx: DeviceContext) -> None:
    seen: list[int] = []
    assert ctx.execution_time_iter(seen.append, np.int64(3)) >= 0
    assert seen == [0, 1, 2]


def test_occupancy_answers_for_a_valid_block_and_refuses_the_rest(ctx: DeviceContext) -> None:
    f = ctx.compile_function(ADD_ONE)
    assert f.occupancy(256) >= 1
    assert f.occupancy(np.int32(128), shared_mem_bytes=1024) >= 1
    with pytest.raises(TypeError, match="block_size"):
        f.occupancy(2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="shared_mem_bytes"):
        f.occupancy(256, shared_mem_bytes="0")  # type: ignore[arg-type]
    for bad in (0, -32, 1025):
        with pytest.raises(ValueError, match="block_size"):
            f.occupancy(bad)
    with pytest.raises(ValueError, match="shared_mem_bytes"):
        f.occupancy(256, shared_mem_bytes=-1)


# -- structured scalars (C structs) by value; arguments that cannot be passed ---------------

AFFINE_T = np.dtype([("scale", "<f4"), ("shift", "<i4"), ("bias", "<f8")], align=True)


def _affine_cpu(b: ThreadBlock, out: np.ndarray, p: np.void, n: np.int32) -> None:
    i = b.block_idx.x * b.block_dim.x + b.thread_idx.x
    i = i[i < n]
    out[i] = p["scale"] * i + p["shift"] + p["bias"]


AFFINE = Kernel(
    "affine",
    cuda=r"""
struct Affine { float scale; int shift; double bias; };
extern "C" __global__ void affine(double* out, Affine p, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = p.scale * i + p.shift + p.bias;
}
""",
    cpu=_affine_cpu,
)


def test_a_structured_scalar_is_passed_by_value(ctx: DeviceContext) -> None:
    assert AFFINE_T.itemsize == 16  # the C struct's size and layout
    p = np.array((0.5, 3, 0.25), AFFINE_T)[()]
    assert isinstance(p, np.void)
    n = 64
    out = ctx.enqueue_create_buffer(np.float64, n)
    ctx.enqueue_function(AFFINE, out, p, np.int32(n), grid_dim=1, block_dim=n)
    got = np.empty(n, np.float64)
    ctx.enqueue_copy(got, out).synchronize()
    np.testing.assert_array_equal(got, 0.5 * np.arange(n) + 3 + 0.25)


def test_a_structured_scalar_of_the_wrong_size_is_a_type_error(
    ctx: DeviceContext, api: str
) -> None:
    if api == "cpu":
        pytest.skip("a NumPy body has no C signature to check sizes against")
    small = np.array((0.5, 3), np.dtype([("scale", "<f4"), ("shift", "<i4")]))[()]
    out = ctx.enqueue_create_buffer(np.float64, 4)
    with pytest.raises(TypeError, match="16 bytes"):
        ctx.enqueue_function(AFFINE, out, small, np.int32(4), grid_dim=1, block_dim=4)


@pytest.mark.parametrize(
    "arg",
    [
        np.str_("x"),
        np.bytes_(b"xy"),
        np.timedelta64(1, "s"),
        np.array((1, None), np.dtype([("a", "<i4"), ("o", "O")]))[()],
    ],
    ids=["str", "bytes", "timedelta", "struct-with-object"],
)
def test_an_argument_that_cannot_be_passed_is_our_type_error_at_the_call(
    ctx: DeviceContext, arg: object
) -> None:
    out = ctx.enqueue_create_buffer(np.float64, 4)
    with pytest.raises(TypeError, match="no C parameter type"):
        ctx.enqueue_function(AFFINE, out, arg, np.int32(4), grid_dim=1, block_dim=4)
    ctx.synchronize()
