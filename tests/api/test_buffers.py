"""DeviceBuffer and HostBuffer: creation, views, host mapping and ownership."""

from __future__ import annotations

import numpy as np
import pytest
from _kernels import poison, random_array

from asyncgpu import ContextClosedError, DeviceBuffer, DeviceContext, HostBuffer

DTYPES = [np.int8, np.uint16, np.int32, np.int64, np.float32, np.float64]


def read(ctx: DeviceContext, buf: DeviceBuffer | HostBuffer) -> np.ndarray:
    """The buffer's contents, copied to a fresh (poisoned) host array."""
    out = poison(buf.dtype, len(buf))
    ctx.enqueue_copy(out, buf).synchronize()
    return out


# -- creation -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_enqueue_create_buffer_has_len_dtype_nbytes(ctx: DeviceContext, dtype: type) -> None:
    buf = ctx.enqueue_create_buffer(dtype, 100)
    assert isinstance(buf, DeviceBuffer)
    assert len(buf) == 100
    assert buf.dtype == np.dtype(dtype)
    assert buf.nbytes == 100 * np.dtype(dtype).itemsize
    assert buf.context() == ctx
    assert isinstance(buf.unsafe_ptr(), int) and buf.unsafe_ptr() != 0


def test_dtype_is_anything_numpy_accepts(ctx: DeviceContext) -> None:
    for spec in ("float32", "<i8", np.dtype(np.uint8), np.complex64):
        assert ctx.enqueue_create_buffer(spec, 3).dtype == np.dtype(spec)


def test_create_buffer_sync_is_ready_on_return(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    buf = ctx.create_buffer_sync(np.float64, 50)
    assert len(buf) == 50 and buf.dtype == np.float64
    data = random_array(rng, np.float64, 50)
    ctx.enqueue_copy(buf, data)
    np.testing.assert_array_equal(read(ctx, buf), data)


def test_enqueue_create_host_buffer(ctx: DeviceContext, rng: np.random.Generator) -> None:
    h = ctx.enqueue_create_host_buffer(np.int16, 40)
    assert isinstance(h, HostBuffer)
    assert len(h) == 40 and h.dtype == np.int16 and h.nbytes == 80
    ctx.synchronize()
    data = random_array(rng, np.int16, 40)
    h.as_numpy()[:] = data
    np.testing.assert_array_equal(np.asarray(h), data)
    assert h.as_numpy().ctypes.data == h.unsafe_ptr()  # a view, not a copy


def test_zero_length_buffers(ctx: DeviceContext) -> None:
    buf = ctx.enqueue_create_buffer(np.float32, 0)
    h = ctx.enqueue_create_host_buffer(np.float32, 0)
    assert len(buf) == 0 and len(h) == 0 and buf.nbytes == 0
    ctx.enqueue_copy(h, buf).synchronize()
    assert h.as_numpy().shape == (0,)


@pytest.mark.parametrize("bad", ["not-a-dtype", object, np.dtype("O"), "V0"])
def test_bad_dtype_is_a_type_error(ctx: DeviceContext, bad: object) -> None:
    with pytest.raises(TypeError):
        ctx.enqueue_create_buffer(bad, 4)
    with pytest.raises(TypeError):
        ctx.enqueue_create_host_buffer(bad, 4)


def test_a_subarray_dtype_is_a_type_error(ctx: DeviceContext) -> None:
    """``np.dtype(("i2", (2,)))`` has an itemsize of 4 but elements of 2 bytes: a
    buffer of it made memsets and copies fail at the await, or write half."""
    sub = np.dtype(("i2", (2,)))
    with pytest.raises(TypeError, match="subarray"):
        ctx.enqueue_create_buffer(sub, 4)
    with pytest.raises(TypeError, match="subarray"):
        ctx.enqueue_create_host_buffer(sub, 4)


def test_negative_size_is_a_value_error(ctx: DeviceContext) -> None:
    with pytest.raises(ValueError):
        ctx.enqueue_create_buffer(np.float32, -1)
    with pytest.raises(ValueError):
        ctx.enqueue_create_host_buffer(np.float32, -1)
    with pytest.raises(ValueError):
        ctx.create_buffer_sync(np.float32, -5)


@pytest.mark.parametrize("bad", [2.0, "3", None, True])
def test_non_integer_size_is_a_type_error(ctx: DeviceContext, bad: object) -> None:
    with pytest.raises(TypeError):
        ctx.enqueue_create_buffer(np.float32, bad)


# -- sub-buffers ------------------------------------------------------------------------------


def test_sub_buffer_is_a_window_of_the_parent(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.float32, 100)
    buf = ctx.enqueue_create_buffer(np.float32, 100)
    ctx.enqueue_copy(buf, data)
    sub = buf.create_sub_buffer(np.float32, 10, 30)
    assert len(sub) == 30 and sub.dtype == np.float32
    assert sub.unsafe_ptr() == buf.unsafe_ptr() + 10 * 4
    np.testing.assert_array_equal(read(ctx, sub), data[10:40])
    # Writing the window changes the parent there and only there.
    sub.enqueue_fill(np.float32(-7.5))
    expect = data.copy()
    expect[10:40] = -7.5
    np.testing.assert_array_equal(read(ctx, buf), expect)


def test_sub_buffer_reinterprets_the_bytes(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.float32, 64)
    buf = ctx.enqueue_create_buffer(np.float32, 64)
    ctx.enqueue_copy(buf, data)
    as_int = buf.create_sub_buffer(np.int32, 8, 16)  # offset counted in int32 elements
    assert as_int.dtype == np.int32
    np.testing.assert_array_equal(read(ctx, as_int), data.view(np.int32)[8:24])
    as_bytes = buf.create_sub_buffer(np.uint8, 5, 11)
    np.testing.assert_array_equal(read(ctx, as_bytes), data.view(np.uint8)[5:16])
    as_f64 = buf.create_sub_buffer(np.float64, 3, 4)
    np.testing.assert_array_equal(read(ctx, as_f64), data.view(np.float64)[3:7])


def test_sub_buffer_of_a_sub_buffer(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.int32, 50)
    buf = ctx.enqueue_create_buffer(np.int32, 50)
    ctx.enqueue_copy(buf, data)
    inner = buf.create_sub_buffer(np.int32, 10, 30).create_sub_buffer(np.int32, 5, 10)
    np.testing.assert_array_equal(read(ctx, inner), data[15:25])


def test_a_sub_buffer_outlives_its_parents_take_ptr_as_a_view_of_the_callers_memory(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    data = rng.integers(0, 1000, 64).astype(np.int32)
    buf = ctx.enqueue_create_buffer(np.int32, 64)
    ctx.enqueue_copy(buf, data)
    sub = buf.create_sub_buffer(np.int32, 16, 8)
    ptr = buf.take_ptr()
    assert sub.unsafe_ptr() == ptr + 16 * 4
    out = np.zeros(8, np.int32)
    ctx.enqueue_copy(out, sub).synchronize()
    np.testing.assert_array_equal(out, data[16:24])
    with pytest.raises(ValueError, match="take_ptr"):
        buf.unsafe_ptr()
    with pytest.raises(ValueError, match="sub-buffer"):
        sub.take_ptr()


def test_sub_buffer_of_a_host_buffer(ctx: DeviceContext, rng: np.random.Generator) -> None:
    h = ctx.enqueue_create_host_buffer(np.int64, 20)
    ctx.synchronize()
    data = random_array(rng, np.int64, 20)
    h.as_numpy()[:] = data
    sub = h.create_sub_buffer(np.int64, 4, 6)
    assert isinstance(sub, HostBuffer)
    np.testing.assert_array_equal(sub.as_numpy(), data[4:10])


@pytest.mark.parametrize(
    "dtype, offset, size",
    [
        (np.float32, 0, 101),
        (np.float32, 95, 6),
        (np.float32, 100, 1),
        (np.float32, -1, 2),
        (np.float64, 0, 51),
        (np.float64, 50, 1),
        (np.uint8, 399, 2),
    ],
)
def test_sub_buffer_outside_the_parent_is_an_index_error(
    ctx: DeviceContext, dtype: type, offset: int, size: int
) -> None:
    buf = ctx.enqueue_create_buffer(np.float32, 100)  # 400 bytes
    with pytest.raises(IndexError):
        buf.create_sub_buffer(dtype, offset, size)


def test_sub_buffer_at_the_very_end_is_fine(ctx: DeviceContext) -> None:
    buf = ctx.enqueue_create_buffer(np.float32, 100)
    assert len(buf.create_sub_buffer(np.uint8, 399, 1)) == 1
    assert len(buf.create_sub_buffer(np.float32, 100, 0)) == 0


# -- copies through the buffer's own methods ------------------------------------------------


def test_enqueue_copy_to_and_from(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.float64, 300)
    a = ctx.enqueue_create_buffer(np.float64, 300)
    b = ctx.enqueue_create_buffer(np.float64, 300)
    b.enqueue_fill(np.nan)
    a.enqueue_copy_from(data)
    a.enqueue_copy_to(b)
    out = poison(np.float64, 300)
    b.enqueue_copy_to(out).synchronize()
    np.testing.assert_array_equal(out, data)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_enqueue_fill_sets_every_element(
    ctx: DeviceContext, rng: np.random.Generator, dtype: type
) -> None:
    value = random_array(rng, dtype, 1)[0]
    buf = ctx.enqueue_create_buffer(dtype, 257)
    buf.enqueue_copy_from(poison(dtype, 257))
    buf.enqueue_fill(value)
    np.testing.assert_array_equal(read(ctx, buf), np.full(257, value, dtype))


# -- mapping to the host ----------------------------------------------------------------------


def test_map_to_host_with(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.int32, 128)
    buf = ctx.enqueue_create_buffer(np.int32, 128)
    ctx.enqueue_copy(buf, data)
    with buf.map_to_host() as h:
        assert isinstance(h, HostBuffer)
        assert len(h) == 128 and h.dtype == np.int32
        np.testing.assert_array_equal(h.as_numpy(), data)  # the device's contents, on the host
        h[::2] = -h.as_numpy()[::2]
        h[1] = 12345
    expect = data.copy()
    expect[::2] = -expect[::2]
    expect[1] = 12345
    np.testing.assert_array_equal(read(ctx, buf), expect)  # the host's change, on the device


@pytest.mark.asyncio
async def test_map_to_host_async_with(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.float32, 500)
    buf = ctx.enqueue_create_buffer(np.float32, 500)
    ctx.enqueue_copy(buf, data)
    async with buf.map_to_host() as h:
        np.testing.assert_array_equal(h.as_numpy(), data)
        h.as_numpy()[:] *= 2
    out = poison(np.float32, 500)
    await ctx.enqueue_copy(out, buf)
    np.testing.assert_array_equal(out, data * 2)


def test_map_to_host_waits_for_earlier_work(
    ctx: DeviceContext, rng: np.random.Generator, gate
) -> None:
    import threading

    data = random_array(rng, np.int64, 64)
    buf = ctx.enqueue_create_buffer(np.int64, 64)
    buf.enqueue_fill(1)
    g = gate()
    ctx.enqueue_cpu_function(g)
    ctx.enqueue_copy(buf, data)  # runs only after the gate
    opener = threading.Thread(target=lambda: g.entered.wait(30) and g.open())
    opener.start()
    with buf.map_to_host() as h:
        np.testing.assert_array_equal(h.as_numpy(), data)
    opener.join()


def test_host_buffer_map_to_host_is_itself(ctx: DeviceContext, rng: np.random.Generator) -> None:
    h = ctx.enqueue_create_host_buffer(np.float32, 16)
    data = random_array(rng, np.float32, 16)
    ctx.enqueue_copy(h, data)
    with h.map_to_host() as m:
        assert m is h
        np.testing.assert_array_equal(m.as_numpy(), data)


# -- host buffers ---------------------------------------------------------------------------


def test_host_buffer_indexing(ctx: DeviceContext, rng: np.random.Generator) -> None:
    h = ctx.enqueue_create_host_buffer(np.float64, 10)
    ctx.synchronize()
    data = random_array(rng, np.float64, 10)
    for i, v in enumerate(data):
        h[i] = v
    assert [h[i] for i in range(10)] == list(data)
    assert h[-1] == data[-1]
    np.testing.assert_array_equal(h[2:5], data[2:5])
    h[2:5] = 0.5
    np.testing.assert_array_equal(h.as_numpy()[2:5], [0.5, 0.5, 0.5])
    with pytest.raises(IndexError):
        h[10]
    # And the device sees what the host wrote.
    d = ctx.enqueue_create_buffer(np.float64, 10)
    ctx.enqueue_copy(d, h)
    np.testing.assert_array_equal(read(ctx, d), h.as_numpy())


# -- ownership ------------------------------------------------------------------------------


def test_take_ptr_hands_over_the_memory(ctx: DeviceContext, rng: np.random.Generator) -> None:
    data = random_array(rng, np.int32, 32)
    buf = ctx.enqueue_create_buffer(np.int32, 32)
    ctx.enqueue_copy(buf, data)
    addr = buf.unsafe_ptr()
    ptr = buf.take_ptr()
    assert ptr == addr
    with pytest.raises(ValueError):
        buf.unsafe_ptr()  # the buffer gave its memory away
    with pytest.raises(ValueError):
        buf.take_ptr()
    # The memory is still there, now reachable only by address.
    other = ctx.enqueue_create_buffer(np.int32, 32)
    ctx.enqueue_copy(other, ptr)
    np.testing.assert_array_equal(read(ctx, other), data)


@pytest.mark.asyncio
async def test_mapping_a_buffer_whose_pointer_was_taken_is_a_value_error(
    ctx: DeviceContext,
) -> None:
    buf = ctx.enqueue_create_buffer(np.float32, 4)
    mapping = buf.map_to_host()  # made before the memory was given away
    buf.take_ptr()
    with pytest.raises(ValueError, match="take_ptr"), mapping:
        pass
    with pytest.raises(ValueError, match="take_ptr"):
        async with mapping:
            pass
    with pytest.raises(ValueError, match="take_ptr"):
        buf.map_to_host()


def test_take_ptr_of_a_sub_buffer_is_refused(ctx: DeviceContext) -> None:
    buf = ctx.enqueue_create_buffer(np.int32, 32)
    with pytest.raises(ValueError):
        buf.create_sub_buffer(np.int32, 0, 4).take_ptr()


def test_reassign_ownership_moves_the_buffer_to_another_stream(
    ctx: DeviceContext, rng: np.random.Generator, gate
) -> None:
    data = random_array(rng, np.float32, 64)
    s1 = ctx.select_stream(1)
    buf = ctx.enqueue_create_buffer(np.float32, 64)
    assert buf.context() == ctx
    g = gate()
    ctx.enqueue_cpu_function(g)
    ctx.enqueue_copy(buf, data)  # on stream 0, held behind the gate
    buf.reassign_ownership_to(s1)
    assert buf.context() == s1
    out = poison(np.float32, 64)
    # On the new owner's stream, which first waits for the old owner's work.
    done = buf.enqueue_copy_to(out)
    assert not done.query()
    g.open()
    done.synchronize()
    np.testing.assert_array_equal(out, data)


def test_reassign_ownership_to_another_context_is_refused(ctx: DeviceContext, api: str) -> None:
    buf = ctx.enqueue_create_buffer(np.float32, 4)
    with DeviceContext(api=api) as other, pytest.raises(ValueError):
        buf.reassign_ownership_to(other)


def test_reassign_ownership_needs_an_open_context(ctx: DeviceContext) -> None:
    """A stream, or any other object, used to be taken and break the buffer at its
    next use; a closed reference was taken too."""
    buf = ctx.enqueue_create_buffer(np.float32, 4)
    with pytest.raises(TypeError, match=r"stream\.context"):
        buf.reassign_ownership_to(ctx.select_stream(1).stream())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        buf.reassign_ownership_to("stream 1")  # type: ignore[arg-type]
    ref = DeviceContext(copy=ctx.select_stream(1))
    ref.close()
    with pytest.raises(ContextClosedError):
        buf.reassign_ownership_to(ref)
    assert buf.context() == ctx  # still owned where it was, and usable
    buf.enqueue_fill(np.float32(1.5))
    np.testing.assert_array_equal(read(ctx, buf), np.full(4, 1.5, np.float32))


def test_buffers_keep_working_after_the_python_array_they_came_from_is_gone(
    ctx: DeviceContext, rng: np.random.Generator
) -> None:
    buf = ctx.enqueue_create_buffer(np.int64, 1000)
    data = random_array(rng, np.int64, 1000)
    ctx.enqueue_copy(buf, data.copy())  # the temporary copy dies at once; the op keeps it
    np.testing.assert_array_equal(read(ctx, buf), data)


def test_repr_names_dtype_and_stream(ctx: DeviceContext) -> None:
    r = repr(ctx.select_stream(2).enqueue_create_buffer(np.float32, 7))
    assert "float32[7]" in r and "s2" in r


# -- printing: str() is MAX's form (the values), repr() describes the buffer ---------------


def _finished(ev, timeout_s: float = 30.0):
    """``ev``'s value, failing (not hanging) if it does not finish in time."""
    import time

    end = time.monotonic() + timeout_s
    while not ev.query():
        assert time.monotonic() < end, "the operation did not finish: a print waited for itself"
        time.sleep(0.005)
    return ev.synchronize()


def test_str_of_a_host_buffer_is_its_values(ctx: DeviceContext) -> None:
    h = ctx.enqueue_create_host_buffer(np.uint16, 15)
    ctx.enqueue_copy(h, np.arange(15, dtype=np.uint16)).synchronize()
    assert str(h) == "HostBuffer([" + ", ".join(str(i) for i in range(15)) + "])"
    assert repr(h).startswith("<HostBuffer uint16[15] on ") and " at 0x" in repr(h)
    f = ctx.enqueue_create_host_buffer(np.float32, 3)
    ctx.enqueue_copy(f, np.array([0.5, 1, -2], np.float32)).synchronize()
    assert str(f) == "HostBuffer([0.5, 1.0, -2.0])"
    assert str(ctx.enqueue_create_host_buffer(np.int8, 0)) == "HostBuffer([])"


def test_str_of_a_long_buffer_is_elided_in_the_middle(ctx: DeviceContext) -> None:
    h = ctx.enqueue_create_host_buffer(np.float32, 1001)
    ctx.enqueue_copy(h, np.arange(1001, dtype=np.float32)).synchronize()
    assert str(h) == "HostBuffer([0.0, 1.0, 2.0, ..., 998.0, 999.0, 1000.0])"
    with np.printoptions(threshold=2000):
        assert str(h).count(", ") == 1000 and "..." not in str(h)
    with np.printoptions(edgeitems=1):
        assert str(h) == "HostBuffer([0.0, ..., 1000.0])"


def test_str_of_a_device_buffer_waits_for_its_stream_and_copies_to_the_host(
    ctx: DeviceContext,
) -> None:
    buf = ctx.enqueue_create_buffer(np.int32, 1001)
    ctx.enqueue_copy(buf, np.arange(1001, dtype=np.int32))  # not awaited: str waits
    assert str(buf) == "DeviceBuffer([0, 1, 2, ..., 998, 999, 1000])"
    assert repr(buf).startswith("<DeviceBuffer int32[1001] on ")


def test_str_of_a_device_buffer_in_a_cpu_function_of_its_own_stream(ctx: DeviceContext) -> None:
    buf = ctx.enqueue_create_buffer(np.float32, 4)
    ctx.enqueue_copy(buf, np.array([1, 2, 3, 4], np.float32))
    # The owning stream's earlier work has finished: the print reads, it does not wait.
    printed = ctx.enqueue_cpu_function(lambda: str(buf))
    ctx.enqueue_memset(buf, 0.0)  # later work does not show
    assert _finished(printed) == "DeviceBuffer([1.0, 2.0, 3.0, 4.0])"
    # From another stream's CPU function it waits for the owning stream.
    ctx.enqueue_copy(buf, np.array([5, 6, 7, 8], np.float32))
    other = ctx.select_stream(1).enqueue_cpu_function(lambda: str(buf))
    assert _finished(other) == "DeviceBuffer([5.0, 6.0, 7.0, 8.0])"
    ctx.synchronize()
