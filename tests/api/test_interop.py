"""Interop with other array libraries: DLPack both ways, the CUDA Array Interface,
foreign arrays as copy operands and kernel arguments, foreign streams, numba
kernels and PTX/cubin from other compilers.

The CPU half runs everywhere (NumPy is the other library). The GPU half is marked
``gpu`` and needs CuPy, PyTorch or numba-cuda where it says so (importorskip).
"""

from __future__ import annotations

import gc
import sys
import weakref

import numpy as np
import pytest
from _kernels import Gate

import asyncgpu as ag
from asyncgpu._api import interop as _api_interop
from asyncgpu._core import dlpack as _dlpack
from asyncgpu._core import foreign as _interop


def _has_cuda() -> bool:
    try:
        return ag.DeviceContext.number_of_devices(api="cuda") > 0
    except Exception:
        return False


needs_gpu = pytest.mark.skipif(not _has_cuda(), reason="no CUDA device on this machine")


async def _await(awaitable) -> None:
    await awaitable


@pytest.fixture
def cpu():
    c = ag.DeviceContext(api="cpu")
    try:
        yield c
    finally:
        c.close()


class Foreign:
    """Another library's host array: DLPack only (forwards to NumPy)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.calls: list[dict] = []

    def __dlpack__(self, **kw):
        self.calls.append(kw)
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return (1, 0)


class Legacy:
    """A consumer-side shim that asks for a legacy (unversioned) capsule."""

    def __init__(self, obj) -> None:
        self.obj = obj

    def __dlpack__(self, **kw):
        kw.pop("max_version", None)
        kw.pop("dl_device", None)
        kw.pop("copy", None)
        return self.obj.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.obj.__dlpack_device__()


def _filled_host(ctx, data):
    h = ctx.enqueue_create_host_buffer(data.dtype, data.size)
    ctx.synchronize()
    h.as_numpy()[:] = data
    return h


# -- DLPack export: host memory ---------------------------------------------------------


def test_np_from_dlpack_host_buffer_is_a_view_that_keeps_it_alive(cpu) -> None:
    h = _filled_host(cpu, np.arange(8, dtype=np.float32))
    assert h.__dlpack_device__() == (1, 0)
    a = np.from_dlpack(h)
    assert a.ctypes.data == h.unsafe_ptr() and a.dtype == np.float32 and a.shape == (8,)
    a[3] = 42
    assert h[3] == 42
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is not None  # the array keeps the buffer
    np.testing.assert_array_equal(a[:3], [0, 1, 2])
    del a
    gc.collect()
    assert ref() is None


def test_np_from_dlpack_cpu_device_buffer(cpu) -> None:
    d = cpu.enqueue_create_buffer(np.int64, 5)
    cpu.enqueue_copy(d, np.arange(5, dtype=np.int64) * 3).synchronize()
    assert d.__dlpack_device__() == (1, 0)
    b = np.from_dlpack(d)
    assert b.ctypes.data == d.unsafe_ptr()
    np.testing.assert_array_equal(b, [0, 3, 6, 9, 12])
    ref = weakref.ref(d)
    del d
    gc.collect()
    assert ref() is not None
    del b
    gc.collect()
    assert ref() is None


def test_host_export_in_a_cpu_function_of_the_owning_stream(cpu) -> None:
    """Host exports do not wait, so a CPU function can export a buffer its own
    stream owns (stream order already puts it after the writes)."""
    d = cpu.enqueue_create_buffer(np.int32, 4)
    cpu.enqueue_memset(d, 7)
    total = cpu.enqueue_cpu_function(lambda: int(np.from_dlpack(d).sum())).synchronize()
    assert total == 28
    gate = Gate()
    try:
        cpu.enqueue_cpu_function(gate)
        assert np.from_dlpack(d).ctypes.data == d.unsafe_ptr()  # returns at once
        assert d.__dlpack__(stream=-1) is not None
    finally:
        gate.open()
    cpu.synchronize()


def test_legacy_and_versioned_capsules(cpu) -> None:
    d = cpu.enqueue_create_buffer(np.float64, 3)
    cpu.enqueue_copy(d, np.array([1.5, 2.5, 3.5])).synchronize()
    assert 'capsule object "dltensor"' in repr(d.__dlpack__())
    assert 'capsule object "dltensor_versioned"' in repr(d.__dlpack__(max_version=(1, 0)))
    np.testing.assert_array_equal(np.from_dlpack(Legacy(d)), [1.5, 2.5, 3.5])
    np.testing.assert_array_equal(np.from_dlpack(d), [1.5, 2.5, 3.5])


def test_unconsumed_capsule_releases_the_buffer(cpu) -> None:
    d = cpu.enqueue_create_buffer(np.uint8, 16)
    cap = d.__dlpack__(max_version=(1, 0))
    ref = weakref.ref(d)
    del d
    gc.collect()
    assert ref() is not None
    del cap
    gc.collect()
    assert ref() is None


def test_sub_buffer_export(cpu) -> None:
    d = cpu.enqueue_create_buffer(np.int32, 10)
    cpu.enqueue_copy(d, np.arange(10, dtype=np.int32)).synchronize()
    sub = d.create_sub_buffer(np.int32, 4, 3)
    np.testing.assert_array_equal(np.from_dlpack(sub), [4, 5, 6])


@pytest.mark.parametrize(
    "dtype",
    [np.bool_, np.int8, np.uint16, np.int32, np.uint64, np.float16, np.float64, np.complex64],
)
def test_export_dtypes_round_trip(cpu, dtype) -> None:
    data = (np.arange(6) % 2).astype(dtype)
    d = cpu.enqueue_create_buffer(dtype, 6)
    cpu.enqueue_copy(d, data).synchronize()
    a = np.from_dlpack(d)
    assert a.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(a, data)


def test_export_refusals(cpu) -> None:
    d = cpu.enqueue_create_buffer(np.float32, 4)
    with pytest.raises(BufferError):
        d.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        d.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        d.__dlpack__(stream=5)  # host memory has no stream
    with pytest.raises(TypeError):
        d.__dlpack__(stream="s")
    assert d.__dlpack__(dl_device=(1, 0), copy=False) is not None
    v = cpu.enqueue_create_buffer(np.dtype("V4"), 2)
    with pytest.raises(BufferError):
        v.__dlpack__()
    cpu.close()
    with pytest.raises(ag.ContextClosedError):
        d.__dlpack__()


def test_export_as_cuda_patches_device_and_orders_streams(cpu, monkeypatch) -> None:
    """The CUDA export path, with the device and the driver calls stubbed: the
    capsule says kDLCUDA, the consumer's stream waits for the owner's, and at
    release the owner waits for the consumer's."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(_dlpack, "dlpack_device", lambda buf: (2, 0))
    monkeypatch.setattr(
        cpu._state.backend, "stream_waits_for_stream", lambda w, p: calls.append((w, p))
    )
    d = cpu.enqueue_create_buffer(np.float32, 4)
    owner = d._owner.handle()
    cap = d.__dlpack__(stream=1234, max_version=(1, 0))
    assert calls == [(1234, owner)]
    t = _dlpack._tensor_of(cap)[0]
    assert (t.device.device_type, t.device.device_id) == (2, 0)
    assert t.data == d.unsafe_ptr()
    ptr, dtype, n, device, keep, _ro = _dlpack._consume_capsule(cap)
    assert (ptr, dtype, n, device) == (d.unsafe_ptr(), np.float32, 4, (2, 0))
    del cap, keep
    gc.collect()
    assert calls == [(1234, owner), (owner, 1234)]
    calls.clear()
    d.__dlpack__(stream=None)  # the legacy default stream
    assert calls[0] == (1, owner)
    calls.clear()
    d.__dlpack__(stream=-1)
    assert calls == []
    with pytest.raises(BufferError, match="ambiguous"):
        d.__dlpack__(stream=0)


# -- DLPack import --------------------------------------------------------------------------


def test_from_dlpack_numpy_on_cpu_is_zero_copy(cpu) -> None:
    x = np.arange(10, dtype=np.float64)
    buf = ag.from_dlpack(x, cpu)
    assert isinstance(buf, ag.DeviceBuffer)
    assert len(buf) == 10 and buf.dtype == np.float64 and buf.unsafe_ptr() == x.ctypes.data
    cpu.enqueue_copy(buf, np.full(10, 3.0)).synchronize()
    np.testing.assert_array_equal(x, 3.0)  # written in place
    x[:] = 5
    out = np.zeros(10)
    cpu.enqueue_copy(out, buf).synchronize()
    np.testing.assert_array_equal(out, 5.0)


def test_from_dlpack_keeps_the_producer_alive(cpu) -> None:
    x = np.arange(4, dtype=np.int32)
    ref = weakref.ref(x)
    buf = ag.from_dlpack(x, cpu)
    del x
    gc.collect()
    assert ref() is not None
    out = np.empty(4, np.int32)
    cpu.enqueue_copy(out, buf).synchronize()
    np.testing.assert_array_equal(out, [0, 1, 2, 3])
    del buf
    gc.collect()
    assert ref() is None


def test_from_dlpack_shapes(cpu) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert len(ag.from_dlpack(x, cpu)) == 6  # C-contiguous N-D: flat
    with pytest.raises(ValueError, match="C-contiguous"):
        ag.from_dlpack(x.T, cpu)
    assert len(ag.from_dlpack(np.array(3.0, dtype=np.float32), cpu)) == 1
    assert len(ag.from_dlpack(np.empty(0, np.int8), cpu)) == 0
    with pytest.raises(TypeError):
        ag.from_dlpack([1, 2, 3], cpu)


def test_from_dlpack_without_context_and_round_trip(cpu) -> None:
    x = np.arange(3, dtype=np.int16)
    buf = ag.from_dlpack(x)  # the process-wide CPU context
    assert buf.context().api() == "cpu"
    d = cpu.enqueue_create_buffer(np.int16, 3)
    cpu.enqueue_copy(d, x).synchronize()
    again = ag.from_dlpack(d, cpu)  # our own export, consumed again
    assert again.unsafe_ptr() == d.unsafe_ptr()
    with pytest.raises(ValueError, match="take_ptr"):
        again.take_ptr()


def test_consume_capsule_dtypes_and_errors() -> None:
    for dt in (np.bool_, np.int8, np.uint32, np.int64, np.float16, np.float32, np.complex128):
        a = np.zeros(3, dt)
        for cap in (a.__dlpack__(), a.__dlpack__(max_version=(1, 0))):
            ptr, dtype, n, device, keep, ro = _dlpack._consume_capsule(cap)
            assert (ptr, dtype, n, device, ro) == (a.ctypes.data, np.dtype(dt), 3, (1, 0), False)
            del keep
    ro = np.zeros(2)
    ro.flags.writeable = False
    assert _dlpack._consume_capsule(ro.__dlpack__(max_version=(1, 0)))[5] is True
    cap = np.zeros(2, np.float32).__dlpack__()
    _dlpack._tensor_of(cap)[0].dtype.lanes = 4
    with pytest.raises(BufferError, match="lanes"):
        _dlpack._consume_capsule(cap)
    with pytest.raises(BufferError):
        _dlpack._consume_capsule(object())


def test_copies_from_and_to_cpu_dlpack_objects(cpu) -> None:
    buf = cpu.enqueue_create_buffer(np.float64, 10)
    src = Foreign(np.arange(10, dtype=np.float64) + 100)
    cpu.enqueue_copy(buf, src).synchronize()
    assert src.calls  # went through __dlpack__
    dst = Foreign(np.zeros(10))
    cpu.enqueue_copy(dst, buf).synchronize()
    np.testing.assert_array_equal(dst.a, np.arange(10) + 100)
    ro = np.zeros(10)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        cpu.enqueue_copy(Foreign(ro), buf)
    with pytest.raises(TypeError):
        cpu.enqueue_copy(buf, object())


def test_cuda_array_interface_on_the_cpu_device_is_refused(cpu) -> None:
    class Cai:
        __cuda_array_interface__ = {  # noqa: RUF012
            "shape": (4,),
            "typestr": "<f4",
            "data": (0x1000, False),
            "version": 3,
        }

    buf = cpu.enqueue_create_buffer(np.float32, 4)
    with pytest.raises(ValueError, match="CUDA"):
        cpu.enqueue_copy(buf, Cai())
    with pytest.raises(ValueError, match="CUDA"):
        ag.from_cuda_array_interface(Cai(), cpu)


def test_parse_cuda_array_interface() -> None:
    base = {"shape": (2, 3), "typestr": "<f4", "data": (4096, False), "version": 3}
    assert _interop._parse_cai(base) == (4096, np.dtype("<f4"), 6, False)
    assert _interop._parse_cai({**base, "strides": (12, 4)})[2] == 6
    assert _interop._parse_cai({**base, "data": (4096, True), "version": 2})[3] is True
    with pytest.raises(ValueError, match="C-contiguous"):
        _interop._parse_cai({**base, "strides": (4, 8)})
    with pytest.raises(ValueError, match="mask"):
        _interop._parse_cai({**base, "mask": object()})
    with pytest.raises(ValueError, match="malformed"):
        _interop._parse_cai({"shape": (2,)})
    assert _interop.producer_stream(object(), {**base, "stream": 0}) == 1
    assert _interop.producer_stream(object(), {**base, "stream": 77}) == 77
    assert _interop.producer_stream(object(), base) is None


class HostCai:
    """A CUDA Array Interface over host memory, with a producer stream: stands in
    for a CuPy array in the stubbed tests below."""

    def __init__(self, a: np.ndarray, stream: int | None) -> None:
        self.a = a
        self.cai = {
            "shape": a.shape,
            "typestr": a.dtype.str,
            "data": (a.ctypes.data, False),
            "version": 3,
            "strides": None,
            "stream": stream,
        }

    @property
    def __cuda_array_interface__(self) -> dict:
        return self.cai


def test_copy_ordering_with_a_known_producer_stream(cpu, monkeypatch) -> None:
    """The CUDA copy-operand path with the driver stubbed (the CPU device copies
    the memory): the copy's stream waits for the producer's stream first, and the
    producer's stream waits for the copy after."""
    calls: list[tuple[int, int]] = []
    with monkeypatch.context() as m:
        m.setattr(cpu._state, "api", "cuda")
        m.setattr(cpu._state.backend, "stream_waits_for_stream", lambda w, p: calls.append((w, p)))
        m.setattr(_api_interop, "pointer_device", lambda ptr: 0)
        ours = cpu._impl.handle()
        src = HostCai(np.arange(8, dtype=np.float32), stream=77)
        out = np.zeros(8, np.float32)
        cpu.enqueue_copy(out, src).synchronize()
        np.testing.assert_array_equal(out, np.arange(8))
        assert calls == [(ours, 77), (77, ours)]
        calls.clear()
        dst = HostCai(np.zeros(8, np.float32), stream=None)  # unknown stream: no ordering
        cpu.enqueue_copy(dst, out).synchronize()
        np.testing.assert_array_equal(dst.a, np.arange(8))
        assert calls == []
        ro = HostCai(np.zeros(8, np.float32), stream=None)
        ro.cai["data"] = (ro.a.ctypes.data, True)
        with pytest.raises(ValueError, match="read-only"):
            cpu.enqueue_copy(ro, out)
        # a long-lived wrap: ordered once, at wrap time
        buf = ag.from_cuda_array_interface(HostCai(np.ones(8, np.float32), stream=5), cpu)
        assert calls == [(ours, 5)] and len(buf) == 8 and buf.dtype == np.float32
        calls.clear()
        # kernel arguments (the hooks the CUDA backend's launch calls)
        args = (HostCai(np.zeros(2), 9), np.int32(3), buf, HostCai(np.zeros(2), 9))
        assert _interop.launch_streams(cpu._impl, args) == [9]
        _interop.launch_done(cpu._impl, [9])
        assert calls == [(ours, 9), (9, ours)]
        del buf
        cpu.synchronize()


# -- HostBuffer and NumPy / the buffer protocol -------------------------------------------


def test_np_asarray_of_a_device_buffer_says_to_copy_or_map(ctx) -> None:
    buf = ctx.enqueue_create_buffer(np.float32, 4)
    for convert in (np.asarray, np.array, lambda b: np.asarray(b, dtype=np.float64)):
        with pytest.raises(TypeError, match=r"enqueue_copy.*map_to_host"):
            convert(buf)
    with buf.map_to_host() as h:  # the way the message names works
        assert np.asarray(h).shape == (4,)
    ctx.synchronize()


def test_host_buffer_np_asarray_is_zero_copy_and_keeps_it_alive(cpu) -> None:
    h = _filled_host(cpu, np.full(4, 7, np.int32))
    v = np.asarray(h)
    assert v.ctypes.data == h.unsafe_ptr() and v.dtype == np.int32
    v[0] = 1
    assert h[0] == 1
    assert not np.shares_memory(np.array(h), v)  # np.array copies
    np.testing.assert_array_equal(np.asarray(h, dtype=np.float64), [1, 7, 7, 7])
    with pytest.raises(ValueError):
        h.__array__(np.float64, copy=False)
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is not None
    del v
    gc.collect()
    assert ref() is None


@pytest.mark.skipif(
    sys.version_info < (3, 12), reason="Python classes get the buffer protocol in 3.12"
)
def test_host_buffer_memoryview(cpu) -> None:
    h = _filled_host(cpu, np.arange(4, dtype=np.uint8))
    m = memoryview(h)
    assert m.nbytes == 4 and bytes(m) == b"\x00\x01\x02\x03"
    m[0] = 9
    assert h[0] == 9


# -- GPU: CuPy ------------------------------------------------------------------------------

SPIN_WRITE = r"""
extern "C" __global__ void spin_write(float* out, float value, int n, long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}
"""
SPIN_CYCLES = np.int64(200_000_000)  # ~0.1 s at a data-center GPU's clock: far longer than a launch


@pytest.fixture
def cuda():
    c = ag.DeviceContext(api="cuda")
    try:
        yield c
    finally:
        c.close()


@pytest.mark.gpu
@needs_gpu
class TestCuPy:
    def test_copy_source_destination_and_kernel_argument(self, cuda) -> None:
        cp = pytest.importorskip("cupy")
        n = 1000
        x = cp.arange(n, dtype=cp.float32)
        buf = cuda.enqueue_create_buffer(np.float32, n)
        cuda.enqueue_copy(buf, x)  # source
        y = cp.zeros(n, dtype=cp.float32)
        cuda.enqueue_copy(y, buf)  # destination
        np.testing.assert_array_equal(cp.asnumpy(y), np.arange(n, dtype=np.float32))
        f = cuda.compile_function(
            'extern "C" __global__ void twice(float* y, int n) {'
            " int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] *= 2; }",
            "twice",
        )
        cp.cuda.get_current_stream().synchronize()
        cuda.enqueue_function(f, y, np.int32(n), grid_dim=(n + 255) // 256, block_dim=256)
        cuda.synchronize()
        np.testing.assert_array_equal(cp.asnumpy(y), 2 * np.arange(n, dtype=np.float32))

    def test_copy_is_ordered_with_cupys_stream(self, cuda) -> None:
        cp = pytest.importorskip("cupy")
        n = 4096
        spin = cp.RawKernel(SPIN_WRITE, "spin_write")
        with cp.cuda.Stream(non_blocking=True) as s:
            x = cp.zeros(n, dtype=cp.float32)
            spin(((n + 255) // 256,), (256,), (x, cp.float32(3), cp.int32(n), SPIN_CYCLES))
            out = np.zeros(n, np.float32)
            cuda.enqueue_copy(out, x).synchronize()  # waits for the spin on s
            np.testing.assert_array_equal(out, 3)
            # And CuPy's later work waits for our copy into its array.
            buf = cuda.enqueue_create_buffer(np.float32, n)
            fill = cuda.compile_function(SPIN_WRITE, "spin_write")
            cuda.enqueue_function(
                fill, buf, np.float32(5), np.int32(n), SPIN_CYCLES, grid_dim=n // 256, block_dim=256
            )
            cuda.enqueue_copy(x, buf)
            total = float(x.sum())  # on s, which waits for the copy
            s.synchronize()
        assert total == 5 * n

    def test_cupy_asarray_of_a_device_buffer(self, cuda) -> None:
        cp = pytest.importorskip("cupy")
        buf = cuda.enqueue_create_buffer(np.int32, 64)
        cuda.enqueue_copy(buf, np.arange(64, dtype=np.int32))
        a = cp.asarray(buf)  # CUDA Array Interface, ordered on buf's stream
        assert a.data.ptr == buf.unsafe_ptr()
        np.testing.assert_array_equal(cp.asnumpy(a), np.arange(64))
        b = cp.from_dlpack(buf)
        assert b.data.ptr == buf.unsafe_ptr()
        b[0] = 99
        out = np.empty(64, np.int32)
        cp.cuda.get_current_stream().synchronize()
        cuda.enqueue_copy(out, buf).synchronize()
        assert out[0] == 99

    def test_from_cuda_array_interface_and_dlpack(self, cuda) -> None:
        cp = pytest.importorskip("cupy")
        x = cp.arange(10, dtype=cp.float64)
        for wrap in (ag.from_cuda_array_interface, ag.from_dlpack):
            buf = wrap(x, cuda)
            assert isinstance(buf, ag.DeviceBuffer)
            assert buf.unsafe_ptr() == x.data.ptr and len(buf) == 10
            out = np.empty(10)
            cuda.enqueue_copy(out, buf).synchronize()
            np.testing.assert_array_equal(out, np.arange(10))
        with pytest.raises(ValueError, match="C-contiguous"):
            ag.from_cuda_array_interface(cp.zeros((4, 4))[:, 1], cuda)

    def test_external_cupy_stream(self, cuda) -> None:
        cp = pytest.importorskip("cupy")
        s = cp.cuda.Stream(non_blocking=True)
        ext = cuda.create_external_stream(s)
        assert ext.handle == s.ptr
        buf = ext.context().enqueue_create_buffer(np.float32, 8)
        ext.context().enqueue_copy(buf, np.ones(8, np.float32))
        ext.synchronize()
        ours = cuda.create_stream()
        # Ours in CuPy: through the CUDA stream protocol (``__cuda_stream__``),
        # CuPy 14's ``Stream.from_external``; older CuPy wraps the handle.
        from_external = getattr(cp.cuda.Stream, "from_external", None)
        if from_external is not None:
            theirs = from_external(ours)
        else:
            theirs = cp.cuda.ExternalStream(ours.handle)
        assert theirs.ptr == ours.handle
        with theirs:
            x = cp.arange(8, dtype=cp.float32)
        ours.context().enqueue_copy(buf, x)
        out = np.empty(8, np.float32)
        ours.context().enqueue_copy(out, buf).synchronize()
        np.testing.assert_array_equal(out, np.arange(8, dtype=np.float32))


# -- GPU: PyTorch ---------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
class TestTorch:
    def test_copy_source_destination_and_kernel_argument(self, cuda) -> None:
        torch = pytest.importorskip("torch")
        n = 777
        t = torch.arange(n, dtype=torch.float32, device="cuda")
        buf = cuda.enqueue_create_buffer(np.float32, n)
        cuda.enqueue_copy(buf, t)
        u = torch.zeros(n, dtype=torch.float32, device="cuda")
        cuda.enqueue_copy(u, buf)
        np.testing.assert_array_equal(u.cpu().numpy(), np.arange(n, dtype=np.float32))
        f = cuda.compile_function(
            'extern "C" __global__ void twice(float* y, int n) {'
            " int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] *= 2; }",
            "twice",
        )
        torch.cuda.synchronize()
        cuda.enqueue_function(f, u, np.int32(n), grid_dim=(n + 255) // 256, block_dim=256)
        cuda.synchronize()
        np.testing.assert_array_equal(u.cpu().numpy(), 2 * np.arange(n, dtype=np.float32))
        # CPU tensors are host spans (np.from_dlpack)
        host = torch.zeros(n, dtype=torch.float32)
        cuda.enqueue_copy(host, buf).synchronize()
        np.testing.assert_array_equal(host.numpy(), np.arange(n, dtype=np.float32))

    def test_copies_are_ordered_with_torchs_current_stream(self, cuda) -> None:
        torch = pytest.importorskip("torch")
        n = 1 << 20
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            t = torch.zeros(n, dtype=torch.float32, device="cuda")
            torch.cuda._sleep(100_000_000)
            t.fill_(4)
            out = np.zeros(n, np.float32)
            cuda.enqueue_copy(out, t).synchronize()  # after the sleep and the fill
            np.testing.assert_array_equal(out, 4)
            buf = cuda.enqueue_create_buffer(np.float32, n)
            fill = cuda.compile_function(SPIN_WRITE, "spin_write")
            cuda.enqueue_function(
                fill, buf, np.float32(6), np.int32(n), SPIN_CYCLES, grid_dim=n // 256, block_dim=256
            )
            cuda.enqueue_copy(t, buf)
            total = float(t.sum())  # torch's stream waits for our copy
        assert total == 6 * n

    def test_torch_from_dlpack_is_zero_copy_both_ways(self, cuda) -> None:
        torch = pytest.importorskip("torch")
        n = 256
        buf = cuda.enqueue_create_buffer(np.float32, n)
        cuda.enqueue_copy(buf, np.arange(n, dtype=np.float32))
        t = torch.from_dlpack(buf)  # torch's stream waits for the copy
        assert t.data_ptr() == buf.unsafe_ptr() and t.device.type == "cuda"
        np.testing.assert_array_equal(t.cpu().numpy(), np.arange(n, dtype=np.float32))
        t.mul_(2)
        out = np.empty(n, np.float32)
        cuda.enqueue_copy(out, t).synchronize()  # ordered after mul_ on torch's stream
        np.testing.assert_array_equal(out, 2 * np.arange(n, dtype=np.float32))
        ref = weakref.ref(buf)
        del buf
        gc.collect()
        assert ref() is not None  # the tensor keeps it
        del t
        gc.collect()
        assert ref() is None

    def test_from_dlpack_of_a_torch_tensor(self, cuda) -> None:
        torch = pytest.importorskip("torch")
        t = torch.arange(12, dtype=torch.int64, device="cuda").reshape(3, 4)
        buf = ag.from_dlpack(t, cuda)
        assert buf.unsafe_ptr() == t.data_ptr() and len(buf) == 12 and buf.dtype == np.int64
        ref = weakref.ref(t)
        del t
        gc.collect()
        out = np.empty(12, np.int64)
        cuda.enqueue_copy(out, buf).synchronize()
        np.testing.assert_array_equal(out, np.arange(12))
        del buf
        gc.collect()
        assert ref() is None
        pinned = torch.arange(5, dtype=torch.float32).pin_memory()
        h = ag.from_dlpack(pinned, cuda)
        assert isinstance(h, ag.HostBuffer) and h.unsafe_ptr() == pinned.data_ptr()
        with pytest.raises(ValueError, match="pageable"):
            ag.from_dlpack(torch.zeros(3), cuda)

    def test_host_buffer_to_torch(self, cuda) -> None:
        torch = pytest.importorskip("torch")
        h = cuda.enqueue_create_host_buffer(np.float32, 4)
        cuda.synchronize()
        h[:] = 3
        t = torch.from_dlpack(h)
        assert t.device.type == "cpu" and t.data_ptr() == h.unsafe_ptr()
        assert t.sum().item() == 12

    def test_external_torch_stream(self, cuda) -> None:
        torch = pytest.importorskip("torch")
        s = torch.cuda.Stream()
        ext = cuda.create_external_stream(s)
        assert ext.handle == s.cuda_stream
        ours = cuda.create_stream()
        assert ours.__cuda_stream__() == (0, ours.handle)
        theirs = torch.cuda.ExternalStream(ours.handle)
        assert theirs.cuda_stream == ours.handle
        t = torch.zeros(16, device="cuda")
        with torch.cuda.stream(theirs):
            t.fill_(1)
        buf = ours.context().enqueue_create_buffer(np.float32, 16)
        ours.context().enqueue_copy(buf, t)  # same stream: plain stream order
        out = np.empty(16, np.float32)
        ours.context().enqueue_copy(out, buf).synchronize()
        np.testing.assert_array_equal(out, 1)

    def test_a_wrapped_stream_stands_for_its_owners_work(self, cuda) -> None:
        """``await``, ``enqueue_wait_for`` and ``record_event`` of a wrapped stream
        cover what its owner submitted there, not only asyncgpu's own work: each
        first enqueues an empty operation of ours on it. PyTorch's work here is a
        spin of 10**8 GPU cycles and then a fill, with no work of asyncgpu's
        after it on that stream."""
        import asyncio

        torch = pytest.importorskip("torch")
        n = 1 << 12
        s = torch.cuda.Stream()
        ext = cuda.create_external_stream(s)
        t = torch.zeros(n, device="cuda")
        torch.cuda.synchronize()

        def torch_work(value: float) -> None:
            with torch.cuda.stream(s):
                torch.cuda._sleep(100_000_000)
                t.fill_(value)

        # await the stream
        torch_work(1)
        asyncio.run(_await(ext))
        assert s.query()

        # another stream waits for it on the device, then copies what it wrote
        torch_work(2)
        other = cuda.create_stream()
        other.enqueue_wait_for(ext)
        buf = other.context().enqueue_create_buffer(np.float32, n)
        other.context().enqueue_copy(buf, t)
        out = np.empty(n, np.float32)
        other.context().enqueue_copy(out, buf).synchronize()
        np.testing.assert_array_equal(out, 2)

        # an event recorded there finishes after the owner's work
        torch_work(3)
        ev = cuda.create_event()
        ext.record_event(ev)
        asyncio.run(_await(ev))
        assert s.query()
        assert float(t[0]) == 3

    def test_kernel_argument_is_ordered_with_torchs_stream(self, cuda) -> None:
        torch = pytest.importorskip("torch")
        n = 1 << 16
        f = cuda.compile_function(
            'extern "C" __global__ void twice(float* y, int n) {'
            " int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] *= 2; }",
            "twice",
        )
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            t = torch.zeros(n, device="cuda")
            torch.cuda._sleep(100_000_000)
            t.fill_(1)
            cuda.enqueue_function(f, t, np.int32(n), grid_dim=n // 256, block_dim=256)
            total = float(t.sum())
        assert total == 2 * n


# -- GPU: cuda.core streams, kernels from elsewhere -------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_cuda_stream_protocol_with_cuda_core(cuda) -> None:
    from cuda.core import Device

    ours = cuda.create_stream()
    s = Device(cuda.id()).create_stream(ours)
    assert int(s.handle) == ours.handle


@pytest.mark.gpu
@needs_gpu
def test_cubin_from_another_compiler(cuda) -> None:
    from cuda.core import Device, Program, ProgramOptions

    Device(cuda.id()).set_current()
    major, minor = cuda.default_device_info.compute_capability
    src = (
        'extern "C" __global__ void axpy(float a, const float* x, float* y, int n) {'
        " int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = a * x[i] + y[i]; }"
    )
    opts = ProgramOptions(arch=f"sm_{major}{minor}")
    for kind in ("cubin", "ptx"):
        code = Program(src, "c++", options=opts).compile(kind).code
        f = cuda.load_function(function_name="axpy", asm=code)
        n = 300
        x = cuda.enqueue_create_buffer(np.float32, n)
        y = cuda.enqueue_create_buffer(np.float32, n)
        cuda.enqueue_copy(x, np.arange(n, dtype=np.float32))
        cuda.enqueue_memset(y, 1.0)
        cuda.enqueue_function(f, np.float32(2), x, y, np.int32(n), grid_dim=2, block_dim=256)
        out = np.empty(n, np.float32)
        cuda.enqueue_copy(out, y).synchronize()
        np.testing.assert_array_equal(out, 2 * np.arange(n, dtype=np.float32) + 1)


@pytest.mark.gpu
@needs_gpu
def test_numba_kernel(cuda, monkeypatch) -> None:
    if not hasattr(np, "row_stack"):
        # numba-cuda 0.30.4 overloads np.row_stack at import; NumPy 2.5 removed it.
        monkeypatch.setattr(np, "row_stack", np.vstack, raising=False)
    nb = pytest.importorskip("numba.cuda")

    @nb.jit
    def axpy(a, x, y):
        i = nb.grid(1)
        if i < x.size:
            y[i] = a * x[i] + y[i]

    @nb.jit
    def add_rows(m, out):
        i = nb.grid(1)
        if i < m.shape[0]:
            s = 0.0
            for j in range(m.shape[1]):
                s += m[i, j]
            out[i] = s

    k = ag.load_numba_kernel(cuda, axpy, "void(float32, float32[::1], float32[::1])")
    n = 1000
    x = cuda.enqueue_create_buffer(np.float32, n)
    y = cuda.enqueue_create_buffer(np.float32, n)
    cuda.enqueue_copy(x, np.arange(n, dtype=np.float32))
    cuda.enqueue_memset(y, 1.0)
    cuda.enqueue_function(k.function, *k.args(2.0, x, y), grid_dim=4, block_dim=256)
    out = np.empty(n, np.float32)
    cuda.enqueue_copy(out, y).synchronize()
    np.testing.assert_array_equal(out, 2 * np.arange(n, dtype=np.float32) + 1)

    r = ag.load_numba_kernel(cuda, add_rows, "void(float64[:, ::1], float64[::1])")
    m = cuda.enqueue_create_buffer(np.float64, 12)
    cuda.enqueue_copy(m, np.arange(12, dtype=np.float64))
    rows = cuda.enqueue_create_buffer(np.float64, 3)
    r.enqueue(cuda, (m, (3, 4)), rows, grid_dim=1, block_dim=32)
    res = np.empty(3)
    cuda.enqueue_copy(res, rows).synchronize()
    np.testing.assert_array_equal(res, np.arange(12.0).reshape(3, 4).sum(axis=1))
    with pytest.raises(TypeError, match="dtype"):
        k.args(2.0, rows, y)


def test_load_numba_kernel_needs_cuda(cpu) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        ag.load_numba_kernel(cpu, object(), "void()")
