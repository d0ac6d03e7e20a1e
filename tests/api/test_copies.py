"""enqueue_copy in every overload, enqueue_memset, and cross-stream ordering."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from _kernels import TIMEOUT_S, poison, random_array

from asyncgpu import DeviceContext, from_dlpack

N = 1000


def read(ctx: DeviceContext, buf) -> np.ndarray:
    out = poison(buf.dtype, len(buf))
    ctx.enqueue_copy(out, buf).synchronize()
    return out


def device_with(ctx: DeviceContext, data: np.ndarray):
    buf = ctx.enqueue_create_buffer(data.dtype, data.size)
    ctx.enqueue_copy(buf, data)
    return buf


def host_with(ctx: DeviceContext, data: np.ndarray):
    h = ctx.enqueue_create_host_buffer(data.dtype, data.size)
    ctx.enqueue_copy(h, data)
    return h


# -- the overloads ------------------------------------------------------------------------


def test_device_from_host_buffer(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.float32, N)
    h = host_with(ctx, data)
    d = device_with(ctx, poison(np.float32, N))
    ctx.enqueue_copy(d, h)
    np.testing.assert_array_equal(read(ctx, d), data)


def test_host_buffer_from_device(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.int64, N)
    d = device_with(ctx, data)
    h = host_with(ctx, poison(np.int64, N))
    ctx.enqueue_copy(h, d).synchronize()
    np.testing.assert_array_equal(h.as_numpy(), data)


def test_device_from_device(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.float64, N)
    a = device_with(ctx, data)
    b = device_with(ctx, poison(np.float64, N))
    ctx.enqueue_copy(b, a)
    np.testing.assert_array_equal(read(ctx, b), data)
    np.testing.assert_array_equal(read(ctx, a), data)  # the source is untouched


def test_host_from_host(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.int16, N)
    a = host_with(ctx, data)
    b = host_with(ctx, poison(np.int16, N))
    ctx.enqueue_copy(b, a).synchronize()
    np.testing.assert_array_equal(b.as_numpy(), data)


@pytest.mark.parametrize("kind", ["device", "host"])
def test_numpy_arrays_are_host_spans_both_ways(
    ctx: DeviceContext, rng: np.random.Generator, kind: str
) -> None:
    data = random_array(rng, np.int32, N)
    make = ctx.enqueue_create_buffer if kind == "device" else ctx.enqueue_create_host_buffer
    buf = make(np.int32, N)
    ctx.enqueue_copy(buf, data)
    out = poison(np.int32, N)
    ctx.enqueue_copy(out, buf).synchronize()
    np.testing.assert_array_equal(out, data)


def test_larger_arrays_copy_the_buffers_length(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    big = random_array(rng, np.float32, N + 37)
    buf = ctx.enqueue_create_buffer(np.float32, N)
    ctx.enqueue_copy(buf, big)  # the first N elements
    out = poison(np.float32, N + 37)
    ctx.enqueue_copy(out, buf).synchronize()  # into the first N elements
    np.testing.assert_array_equal(out[:N], big[:N])
    assert np.isnan(out[N:]).all()  # the rest of the array is left alone


def test_multidimensional_contiguous_arrays_are_spans(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    data = random_array(rng, np.float64, 120).reshape(4, 5, 6)
    buf = ctx.enqueue_create_buffer(np.float64, 120)
    ctx.enqueue_copy(buf, data)
    out = np.full((4, 5, 6), np.nan)
    ctx.enqueue_copy(out, buf).synchronize()
    np.testing.assert_array_equal(out, data)


def test_raw_addresses_with_size_and_dtype(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.float32, N)
    src = device_with(ctx, data)
    dst = device_with(ctx, poison(np.float32, N))
    ctx.enqueue_copy(dst.unsafe_ptr(), src.unsafe_ptr(), N, dtype=np.float32)
    np.testing.assert_array_equal(read(ctx, dst), data)
    # A part of it, between offset addresses.
    part = device_with(ctx, poison(np.float32, N))
    ctx.enqueue_copy(part.unsafe_ptr() + 40, src.unsafe_ptr() + 80, 100, dtype="float32")
    expect = poison(np.float32, N)
    expect[10:110] = data[20:120]
    np.testing.assert_array_equal(read(ctx, part), expect)


def test_buffer_from_an_address_and_back(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.int32, N)
    src = device_with(ctx, data)
    dst = device_with(ctx, poison(np.int32, N))
    ctx.enqueue_copy(dst, src.unsafe_ptr())  # buffer <- address: the buffer's length
    np.testing.assert_array_equal(read(ctx, dst), data)
    h = host_with(ctx, poison(np.int32, N))
    ctx.enqueue_copy(h.unsafe_ptr(), dst).synchronize()  # address <- buffer
    np.testing.assert_array_equal(h.as_numpy(), data)
    again = device_with(ctx, poison(np.int32, N))
    ctx.enqueue_copy(again, np.intp(h.unsafe_ptr()))  # a NumPy integer is an address too
    np.testing.assert_array_equal(read(ctx, again), data)


def test_address_copies_need_size_and_dtype(ctx: DeviceContext) -> None:
    a = ctx.enqueue_create_buffer(np.int32, 8)
    b = ctx.enqueue_create_buffer(np.int32, 8)
    with pytest.raises(TypeError):
        ctx.enqueue_copy(a.unsafe_ptr(), b.unsafe_ptr())
    with pytest.raises(TypeError):
        ctx.enqueue_copy(a.unsafe_ptr(), b.unsafe_ptr(), 8)
    with pytest.raises(TypeError):
        ctx.enqueue_copy(a, b.unsafe_ptr(), 8)  # with a buffer, its length is copied
    with pytest.raises(TypeError):
        ctx.enqueue_copy(a, b.unsafe_ptr(), dtype=np.float32)
    with pytest.raises(TypeError):
        ctx.enqueue_copy(a, b, 8)
    with pytest.raises(ValueError):
        ctx.enqueue_copy(a, 0)  # the null address
    with pytest.raises(TypeError):
        ctx.enqueue_copy(np.zeros(8, np.int32), b.unsafe_ptr())  # array <- address


@pytest.mark.asyncio
async def test_every_copy_is_awaitable(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.uint16, N)
    d = ctx.enqueue_create_buffer(np.uint16, N)
    assert await ctx.enqueue_copy(d, data) is None
    out = poison(np.uint16, N)
    await ctx.enqueue_copy(out, d)
    np.testing.assert_array_equal(out, data)


# -- bad copies fail at the call ------------------------------------------------------------


def test_a_source_smaller_than_the_destination_is_a_value_error(ctx: DeviceContext) -> None:
    a = ctx.enqueue_create_buffer(np.float32, 10)
    b = ctx.enqueue_create_buffer(np.float32, 11)
    h = ctx.enqueue_create_host_buffer(np.float32, 9)
    with pytest.raises(ValueError, match="source buffer has 10 elements"):
        ctx.enqueue_copy(b, a)
    with pytest.raises(ValueError, match="source buffer has 9 elements"):
        ctx.enqueue_copy(a, h)
    with pytest.raises(ValueError):
        ctx.enqueue_copy(a, np.ones(9, np.float32))  # the source array is too small
    with pytest.raises(ValueError):
        ctx.enqueue_copy(np.ones(9, np.float32), a)  # the destination array is too small


def test_a_buffer_copy_moves_the_destinations_length(ctx: DeviceContext) -> None:
    """The reference's rule: "the amount of data transferred is determined by the
    size of the destination buffer"; the rest of a longer source stays put."""
    src = ctx.enqueue_create_buffer(np.float32, 8)
    ctx.enqueue_copy(src, np.arange(8, dtype=np.float32))
    dst = ctx.enqueue_create_host_buffer(np.float32, 5)
    ctx.enqueue_copy(dst, src).synchronize()
    np.testing.assert_array_equal(dst.as_numpy(), np.arange(5, dtype=np.float32))


def test_overlapping_source_and_destination_are_refused(ctx: DeviceContext) -> None:
    """cuMemcpy has no overlap rule, and the CPU device copies large ranges in
    parallel pieces: an overlapping copy raises on every device."""
    parent = ctx.enqueue_create_buffer(np.float32, 16)
    lo = parent.create_sub_buffer(np.float32, 0, 8)
    hi = parent.create_sub_buffer(np.float32, 4, 8)
    with pytest.raises(ValueError, match="overlap"):
        ctx.enqueue_copy(hi, lo)
    ctx.enqueue_copy(parent.create_sub_buffer(np.float32, 8, 8), lo).synchronize()  # disjoint


def test_dtype_mismatch_is_a_type_error(ctx: DeviceContext) -> None:
    f = ctx.enqueue_create_buffer(np.float32, 10)
    i = ctx.enqueue_create_buffer(np.int32, 10)
    with pytest.raises(TypeError):
        ctx.enqueue_copy(f, i)
    with pytest.raises(TypeError):
        ctx.enqueue_copy(f, np.ones(10, np.float64))
    with pytest.raises(TypeError):
        ctx.enqueue_copy(np.ones(10, np.int64), i)


def test_non_contiguous_arrays_are_a_value_error(ctx: DeviceContext) -> None:
    buf = ctx.enqueue_create_buffer(np.float32, 10)
    strided = np.ones(20, np.float32)[::2]
    with pytest.raises(ValueError):
        ctx.enqueue_copy(buf, strided)
    with pytest.raises(ValueError):
        ctx.enqueue_copy(strided, buf)
    with pytest.raises(ValueError):
        ctx.enqueue_copy(buf, np.ones((5, 2), np.float32).T)  # Fortran order


def test_a_read_only_destination_array_is_a_value_error(ctx: DeviceContext) -> None:
    buf = ctx.enqueue_create_buffer(np.float32, 10)
    out = np.ones(10, np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError):
        ctx.enqueue_copy(out, buf)


@pytest.mark.parametrize("api", ["cpu"])  # (host memory is a CPU device's buffer)
def test_a_buffer_of_read_only_memory_cannot_be_written(ctx: DeviceContext) -> None:
    """A wrapped read-only array (DLPack's read-only flag) used to be written, or
    to fail only at the await."""
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    buf = from_dlpack(ro, ctx)
    with pytest.raises(ValueError, match="read-only"):
        ctx.enqueue_copy(buf, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="read-only"):
        ctx.enqueue_copy_no_cross_stream_sync(buf, ctx.enqueue_create_buffer(np.float32, 4))
    with pytest.raises(ValueError, match="read-only"):
        buf.enqueue_copy_from(np.ones(4, np.float32))
    with pytest.raises(ValueError, match="read-only"):
        ctx.enqueue_memset(buf, 3.0)
    with pytest.raises(ValueError, match="read-only"):
        buf.enqueue_fill(np.float32(3))
    out = np.full(4, np.nan, np.float32)
    ctx.enqueue_copy(out, buf).synchronize()  # reading it is fine
    np.testing.assert_array_equal(out, np.zeros(4, np.float32))
    np.testing.assert_array_equal(ro, np.zeros(4, np.float32))


@pytest.mark.parametrize("bad", [[1.0, 2.0], b"abcd", "x", 3.5, None])
def test_operands_that_are_not_memory_are_a_type_error(ctx: DeviceContext, bad: object) -> None:
    buf = ctx.enqueue_create_buffer(np.float32, 2)
    with pytest.raises(TypeError):
        ctx.enqueue_copy(buf, bad)


def test_two_numpy_arrays_are_not_a_copy(ctx: DeviceContext) -> None:
    with pytest.raises(TypeError):
        ctx.enqueue_copy(np.ones(3), np.ones(3))


# -- memset ---------------------------------------------------------------------------------

MEMSET_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.float32, np.float64, np.uint8]


@pytest.mark.parametrize("dtype", MEMSET_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("target", ["device", "host"])
def test_memset_sets_every_element(
    ctx: DeviceContext, rng: np.random.Generator, dtype: type, target: str
) -> None:
    dt = np.dtype(dtype)
    # A value whose bytes all differ, so a memset of the wrong width shows.
    value = random_array(rng, dt, 1)[0]
    while len(set(value.tobytes())) < dt.itemsize:
        value = random_array(rng, dt, 1)[0]
    make = ctx.enqueue_create_buffer if target == "device" else ctx.enqueue_create_host_buffer
    buf = make(dt, 333)
    ctx.enqueue_copy(buf, poison(dt, 333))
    ctx.enqueue_memset(buf, value)
    np.testing.assert_array_equal(read(ctx, buf), np.full(333, value, dt))


@pytest.mark.parametrize(
    "dtype, value",
    [
        (np.int8, -128),
        (np.int8, 127),
        (np.int16, -32768),
        (np.int32, 2**31 - 1),
        (np.int64, -(2**63)),
        (np.int64, 0x1234_5678_9ABC_DEF0),
        (np.uint8, 255),
        (np.float32, -0.0),
        (np.float32, np.inf),
        (np.float64, 1e300),
    ],
)
def test_memset_edge_values(ctx: DeviceContext, dtype: type, value: object) -> None:
    buf = ctx.enqueue_create_buffer(dtype, 17)
    ctx.enqueue_copy(buf, poison(dtype, 17))
    ctx.enqueue_memset(buf, value)
    out = read(ctx, buf)
    np.testing.assert_array_equal(out.view(np.uint8), np.full(17, value, dtype).view(np.uint8))


@pytest.mark.parametrize(
    "dtype, value",
    [
        (np.int8, 128),
        (np.int8, -129),
        (np.int16, 40000),
        (np.int32, 2**31),
        (np.int64, 2**63),
        (np.uint8, -1),
        (np.int32, 1.5),
        (np.int32, "seven"),
        (np.float32, 1e300),
        (np.float32, "x"),
        (np.float64, None),
    ],
)
def test_memset_values_that_do_not_fit_are_a_value_error(
    ctx: DeviceContext, dtype: type, value: object
) -> None:
    buf = ctx.enqueue_create_buffer(dtype, 4)
    with pytest.raises(ValueError):
        ctx.enqueue_memset(buf, value)


def test_memset_of_a_bool_buffer_takes_0_and_1_only(ctx: DeviceContext) -> None:
    """``bool(value)`` used to make any nonzero value True (2, 0.5, even nan)."""
    buf = ctx.enqueue_create_buffer(np.bool_, 9)
    for value in (2, 0.5, float("nan"), -1, 1j):
        with pytest.raises(ValueError):
            ctx.enqueue_memset(buf, value)
    for value in (0, 1, True, False, np.True_):
        ctx.enqueue_copy(buf, np.full(9, not value, np.bool_))
        ctx.enqueue_memset(buf, value)
        out = np.full(9, not value, np.bool_)
        ctx.enqueue_copy(out, buf).synchronize()
        np.testing.assert_array_equal(out, np.full(9, bool(value)), err_msg=repr(value))


def test_memset_of_a_sub_buffer_touches_only_it(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    data = random_array(rng, np.int16, 100)
    buf = device_with(ctx, data)
    ctx.enqueue_memset(buf.create_sub_buffer(np.int16, 33, 21), 77)
    expect = data.copy()
    expect[33:54] = 77
    np.testing.assert_array_equal(read(ctx, buf), expect)


def test_memset_needs_a_buffer(ctx: DeviceContext) -> None:
    with pytest.raises(TypeError):
        ctx.enqueue_memset(np.zeros(4, np.int32), 1)


# -- cross-stream ordering ------------------------------------------------------------------


def test_copy_on_another_stream_waits_for_the_owners_earlier_work(
    ctx: DeviceContext, rng: np.random.Generator, gate
) -> None:
    s1, s2 = ctx.select_stream(1), ctx.select_stream(2)
    first, second = random_array(rng, np.float32, N), random_array(rng, np.float32, N)
    buf = s1.enqueue_create_buffer(np.float32, N)  # owned by stream 1
    s1.enqueue_copy(buf, first)
    g = gate()
    s1.enqueue_cpu_function(g)  # hold stream 1 ...
    s1.enqueue_copy(buf, second)  # ... before this write
    out = poison(np.float32, N)
    copied = s2.enqueue_copy(out, buf)  # on stream 2: must come after `second`
    assert g.entered.wait(TIMEOUT_S)
    assert not copied.query()
    assert np.isnan(out).all()
    g.open()
    copied.synchronize()
    np.testing.assert_array_equal(out, second)


def test_the_owner_waits_for_a_cross_stream_copy_before_reusing_the_source(
    ctx: DeviceContext, rng: np.random.Generator, gate
) -> None:
    s1, s2 = ctx.select_stream(1), ctx.select_stream(2)
    data = random_array(rng, np.int32, N)
    buf = s1.enqueue_create_buffer(np.int32, N)
    s1.enqueue_copy(buf, data)
    g = gate()
    s2.enqueue_cpu_function(g)  # hold the copying stream
    out = poison(np.int32, N)
    copied = s2.enqueue_copy(out, buf)
    overwrite = s1.enqueue_memset(buf, 5)  # the owner's later work waits for the copy
    assert not overwrite.query()
    g.open()
    overwrite.synchronize()
    assert copied.query()
    np.testing.assert_array_equal(out, data)
    np.testing.assert_array_equal(read(ctx, buf), np.full(N, 5, np.int32))


def test_device_to_device_across_streams(
    ctx: DeviceContext, rng: np.random.Generator, gate
) -> None:
    s1, s2, s3 = (ctx.select_stream(i) for i in (1, 2, 3))
    data = random_array(rng, np.float64, N)
    src = s1.enqueue_create_buffer(np.float64, N)
    dst = s2.enqueue_create_buffer(np.float64, N)
    g = gate()
    s1.enqueue_cpu_function(g)
    s1.enqueue_copy(src, data)
    s2.enqueue_memset(dst, 0.25)
    copied = s3.enqueue_copy(dst, src)  # waits for both owners
    assert not copied.query()
    g.open()
    copied.synchronize()
    np.testing.assert_array_equal(read(s2, dst), data)


@pytest.mark.asyncio
async def test_no_cross_stream_sync_does_not_wait_for_the_owner(
    ctx: DeviceContext, rng: np.random.Generator, gate
) -> None:
    s1, s2 = ctx.select_stream(1), ctx.select_stream(2)
    data = random_array(rng, np.float32, N)
    buf = s1.enqueue_create_buffer(np.float32, N)
    s1.enqueue_copy(buf, data).synchronize()
    g = gate()
    held = s1.enqueue_cpu_function(g)  # the owner is held ...
    out = poison(np.float32, N)
    # ... and the unsynchronized copy on stream 2 completes anyway.
    await asyncio.wait_for(s2.enqueue_copy_no_cross_stream_sync(out, buf), TIMEOUT_S)
    assert not held.query()
    np.testing.assert_array_equal(out, data)
    g.open()
    await held


def test_no_cross_stream_sync_copies_device_to_device(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    data = random_array(rng, np.int8, N)
    a = device_with(ctx, data)
    b = device_with(ctx, poison(np.int8, N))
    ctx.enqueue_copy_no_cross_stream_sync(b, a)
    np.testing.assert_array_equal(read(ctx, b), data)
    with pytest.raises(ValueError):
        ctx.enqueue_copy_no_cross_stream_sync(b, ctx.enqueue_create_buffer(np.int8, N - 1))


# -- the hot path ---------------------------------------------------------------------------


def test_a_buffer_copy_reaches_the_stream_in_three_python_calls(ctx: DeviceContext) -> None:
    """``enqueue_copy`` -> ``_copy`` -> ``copy_operands`` (one core check of both
    buffers, inline), then the stream's ``copy``: on CUDA that is one compiled
    call down to ``cuMemcpyAsync`` (``tests/native/test_native_stream.py``), so a
    copy reaches the driver in four Python frames."""
    import gc
    import sys

    src = ctx.enqueue_create_buffer(np.float32, 64)
    dst = ctx.enqueue_create_buffer(np.float32, 64)
    copy = type(ctx._impl).copy.__code__
    called: list[str] = []

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and called[-1:] != ["<stream copy>"]:
            called.append("<stream copy>" if frame.f_code is copy else frame.f_code.co_name)

    gc.disable()  # (a collection here would run other libraries' gc callbacks)
    sys.setprofile(profile)
    try:
        ev = ctx.enqueue_copy(dst, src)
    finally:
        sys.setprofile(None)
        gc.enable()
    ev.synchronize()
    assert called == ["enqueue_copy", "_copy", "copy_operands", "<stream copy>"]


@pytest.mark.parametrize("kind", ["host", "device"])
def test_a_cpu_context_buffer_takes_part_in_a_cuda_copy(
    ctx: DeviceContext, api: str, kind: str
) -> None:
    """As in MAX, a buffer of a CPU context (host or "device": both are host
    memory) is pageable host memory to a CUDA context's copies, both ways; the
    CPU context's later work on it (here, reading it back) waits for the copy."""
    if api == "cpu":
        pytest.skip("needs a CUDA context beside the CPU one")
    data = np.arange(8, dtype=np.float32)
    with DeviceContext(api="cpu") as cpu:
        make = cpu.enqueue_create_host_buffer if kind == "host" else cpu.enqueue_create_buffer
        src = make(np.float32, 8)
        cpu.enqueue_copy(src, data)
        dev = ctx.enqueue_create_buffer(np.float32, 8)
        ctx.enqueue_copy(dev, src)
        np.testing.assert_array_equal(read(ctx, dev), data)
        dst = make(np.float32, 8)
        cpu.enqueue_memset(dst, 0)
        ctx.enqueue_copy(dst, dev)
        out = poison(np.float32, 8)
        cpu.enqueue_copy(out, dst).synchronize()  # (ordered after the CUDA copy)
        np.testing.assert_array_equal(out, data)


def test_a_cuda_copy_of_a_cpu_context_buffer_waits_for_the_cpu_work_that_writes_it(
    ctx: DeviceContext, api: str, gate
) -> None:
    """The copy starts only after the work pending on the buffer's CPU stream (a
    copy held behind a gate) has written it, and keeps the buffer alive though
    the program dropped it."""
    if api == "cpu":
        pytest.skip("needs a CUDA context beside the CPU one")
    import gc

    data = np.arange(1, 65, dtype=np.int32)
    with DeviceContext(api="cpu") as cpu:
        g = gate()
        host = cpu.enqueue_create_host_buffer(np.int32, 64)
        cpu.enqueue_cpu_function(g)
        cpu.enqueue_copy(host, data)
        dev = ctx.enqueue_create_buffer(np.int32, 64)
        ev = ctx.enqueue_copy(dev, host)
        del host
        gc.collect()
        assert not ev.query()
        g.open()
        ev.synchronize()
        np.testing.assert_array_equal(read(ctx, dev), data)


def test_other_mixes_of_devices_in_a_copy_are_refused(ctx: DeviceContext, api: str) -> None:
    """Only the CPU device's buffers cross over, and only into a copy with the
    other device's memory: a CUDA buffer (device or pinned host) in a CPU
    context's copy, or two CPU-context buffers in a CUDA copy, is a
    ``ValueError`` at the call."""
    if api == "cpu":
        pytest.skip("needs a CUDA context beside the CPU one")
    with DeviceContext(api="cpu") as cpu:
        a = cpu.enqueue_create_host_buffer(np.float32, 8)
        b = cpu.enqueue_create_buffer(np.float32, 8)
        for theirs in (
            ctx.enqueue_create_buffer(np.float32, 8),
            host_with(ctx, np.zeros(8, np.float32)),
        ):
            with pytest.raises(ValueError, match="cannot be used by the cpu:0 context"):
                cpu.enqueue_copy(a, theirs)
            with pytest.raises(ValueError, match="cannot be used by the cpu:0 context"):
                cpu.enqueue_copy(theirs, b)
        with pytest.raises(ValueError, match="copy them there"):
            ctx.enqueue_copy(a, b)


def test_the_crossing_rules_on_two_cpu_contexts_one_standing_in_for_another_device() -> None:
    """The rules above without a GPU: a second CPU context whose ``api`` is
    renamed stands in for another device (the core decides by the api and by
    whether the buffer's device has host memory, never by a device's name). The
    copy waits for the gated CPU work that writes the buffer and keeps the
    dropped buffer alive; the owner's later read waits for the copy."""
    import gc

    from _kernels import Gate

    data = np.arange(1, 65, dtype=np.int32)
    with DeviceContext(api="cpu") as cpu, DeviceContext(api="cpu") as other:
        other._state.api = "other"
        try:
            gate = Gate()
            host = cpu.enqueue_create_host_buffer(np.int32, 64)
            cpu.enqueue_cpu_function(gate)
            cpu.enqueue_copy(host, data)
            dev = other.enqueue_create_buffer(np.int32, 64)
            ev = other.enqueue_copy(dev, host)
            del host
            gc.collect()
            assert not ev.query()
            gate.open()
            np.testing.assert_array_equal(read(other, dev), data)
            dst = cpu.enqueue_create_buffer(np.int32, 64)
            cpu.enqueue_memset(dst, 0)
            other.enqueue_copy(dst, dev)
            np.testing.assert_array_equal(read(cpu, dst), data)  # (after the copy)
            for second in (cpu.enqueue_create_host_buffer(np.int32, 64), dst):
                with pytest.raises(ValueError, match="copy them there"):
                    other.enqueue_copy(dst, second)
        finally:
            other._state.api = "cpu"
