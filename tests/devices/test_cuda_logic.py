"""Pieces of the CUDA device that need no GPU: the PTX signature reader and the
wait that turns a module load behind held CPU work into an error, not a hang."""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest

_backend = pytest.importorskip(
    "asyncgpu._devices.cuda.backend", reason="cuda-python is not installed"
)


from _stand_in_driver import Driver, bound_stand_in, wrapped_stream  # noqa: E402

from asyncgpu import DeviceError, _config  # noqa: E402
from asyncgpu._devices.cuda import driver as _driver  # noqa: E402
from asyncgpu._devices.cuda import launch as _launch  # noqa: E402
from asyncgpu._devices.cuda import memory as _memory  # noqa: E402
from asyncgpu._devices.cuda import stream as _stream  # noqa: E402
from asyncgpu._devices.cuda.compiler import compile_cuda  # noqa: E402

SRC = r"""
struct Pair { double a; int b; };
extern "C" __global__ void four(float a, const float* x, float* y, int n) {}
extern "C" __global__ void none() {}
extern "C" __global__ void byval(Pair p, char c, short s, long long q) {}
"""


@pytest.mark.parametrize(
    ("name", "sizes"),
    [("four", (4, 8, 8, 4)), ("none", ()), ("byval", (16, 1, 2, 8))],
)
def test_kernel_signatures_are_read_from_the_ptx(name, sizes) -> None:
    ptx = compile_cuda(SRC, name, arch="sm_90", want_ptx=True).ptx
    assert ptx is not None
    assert _launch._ptx_param_sizes(ptx, name) == sizes


def test_an_unknown_entry_has_no_signature() -> None:
    ptx = compile_cuda(SRC, "four", arch="sm_90", want_ptx=True).ptx
    assert _launch._ptx_param_sizes(ptx, "missing") is None


class _HeldStream:
    """Stands in for a wrapped CudaStream (the kind that waits on the device for
    host work): ``_host_ops`` issued, ``_hostsig`` finished."""

    label = "cuda:0/s1"
    owned = False

    def __init__(self, issued: int, done: int) -> None:
        self._host_ops = issued
        self._hostsig = ctypes.c_uint64(done)


class _Backend:
    device_id = 0
    _wait_for_host_work = _backend.CudaBackend._wait_for_host_work

    def __init__(self, *streams: _HeldStream) -> None:
        self._streams = list(streams)


@pytest.fixture
def backend(monkeypatch):
    def make(*streams: _HeldStream) -> _Backend:
        b = _Backend(*streams)
        monkeypatch.setattr(_backend, "_all_streams", lambda _b: list(b._streams))
        return b

    return make


def test_loading_code_behind_unfinished_cpu_work_raises_instead_of_hanging(
    backend, monkeypatch
) -> None:
    monkeypatch.setattr(_config, "SETTINGS", _config.SETTINGS.replace(load_wait_s=0.05))
    b = backend(_HeldStream(issued=2, done=1))
    with pytest.raises(DeviceError, match=r"cuda:0/s1 .*held back for CPU work"):
        b._wait_for_host_work("loading kernel 'k'")


def test_loading_code_waits_for_cpu_work_that_finishes(backend, monkeypatch) -> None:
    monkeypatch.setattr(_config, "SETTINGS", _config.SETTINGS.replace(load_wait_s=30.0))
    held = _HeldStream(issued=1, done=0)
    b = backend(held)
    started = threading.Event()

    def finish_the_cpu_work() -> None:
        started.wait(10)
        held._hostsig.value = 1

    t = threading.Thread(target=finish_the_cpu_work)
    t.start()
    started.set()
    b._wait_for_host_work("loading kernel 'k'")  # returns once the work is done
    t.join(10)
    assert held._hostsig.value == 1


class _Impl:
    """Stands in for a loaded kernel: a name, a signature, a plan cache."""

    def __init__(self, sizes: tuple[int, ...] | None) -> None:
        self.name = "k"
        self.param_sizes = sizes
        self.plans: dict = {}


class _Cai:
    def __init__(self, ptr: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (1,), "version": 3}


def test_kernel_arguments_are_checked_once_per_type_tuple() -> None:
    import numpy as np

    impl = _Impl((4, 8, 8))
    args = (np.float32(2), _Cai(0x1000), _Cai(0x2000))
    plan = _launch._plan(impl, args)
    assert impl.last is plan and plan.foreign and plan.codes is None
    assert list(_launch._kernel_args(plan, args, None)) == [np.float32(2), 0x1000, 0x2000]
    assert len(impl.plans) == 1
    again = (np.float32(3), _Cai(0x3000), _Cai(0x4000))  # same types: the cached plan
    assert _launch._plan(impl, again) is plan
    assert list(_launch._kernel_args(plan, again, None)) == [np.float32(3), 0x3000, 0x4000]
    assert len(impl.plans) == 1
    scalars = (np.float32(1),)
    with pytest.raises(TypeError, match="takes 3 arguments, 1 given"):
        _launch._plan(impl, scalars)
    with pytest.raises(TypeError, match="argument 0 is 4 bytes, but float64 is 8 bytes"):
        _launch._plan(impl, (np.float64(1), _Cai(1), _Cai(2)))
    with pytest.raises(TypeError, match="Python float"):
        _launch._plan(impl, (1.5, _Cai(1), _Cai(2)))
    with pytest.raises(TypeError, match="pageable host memory"):
        _launch._plan(impl, (np.float32(1), np.zeros(2), _Cai(2)))
    assert len(impl.plans) == 1 and impl.last is plan  # a rejected tuple of types is not cached


def test_scalar_only_arguments_pass_through_unchanged() -> None:
    import numpy as np

    impl = _Impl(None)  # a kernel loaded from a cubin: no signature known
    args = (np.int32(1), np.int64(2))
    plan = _launch._plan(impl, args)
    assert _launch._kernel_args(plan, args, None) is args and not plan.foreign
    assert plan.codes is None  # no signature: the compiled launch does not pack (cuda.core's)


def test_plain_arguments_get_the_codes_the_compiled_launch_packs_by() -> None:
    import numpy as np

    impl = _Impl((4, 8, 4, 8, 1, 2))
    args = (np.float32(1.5), np.float64(2), np.int32(-7), np.uint64(3), np.int8(1), np.uint16(2))
    plan = _launch._plan(impl, args)
    assert plan.codes == b"fdiQbH" and plan.types == tuple(map(type, args)) and not plan.conv
    mem = _launch._ParamMemory(8 * len(args))  # a stream's memory for it: 8 bytes apart
    pointers = (ctypes.c_uint64 * 6).from_address(mem.pointers)
    assert [p - mem.addr for p in pointers] == [0, 8, 16, 24, 32, 40]


@pytest.mark.parametrize("kind", ["float16", "bool", "cai", "record"])
def test_arguments_the_compiled_launch_does_not_pack_have_no_codes(kind) -> None:
    import numpy as np

    arg = {
        "float16": np.float16(1),
        "bool": np.bool_(True),
        "cai": _Cai(0x1000),
        "record": np.zeros(1, dtype=[("a", "f8"), ("b", "i8")])[0],  # by value, 16 bytes
    }[kind]
    impl = _Impl((arg.dtype.itemsize if isinstance(arg, np.generic) else 8,))
    assert _launch._plan(impl, (arg,)).codes is None  # cuda.core's launch packs it


def test_a_driver_without_the_hot_path_entry_points_cannot_be_used(monkeypatch) -> None:
    from asyncgpu import NoDeviceError

    monkeypatch.setattr(_driver, "_native", None)
    not_found = _driver.cu.CUresult.CUDA_ERROR_NOT_FOUND
    monkeypatch.setattr(_driver.cu, "cuGetProcAddress", lambda *a: (not_found, 0, None))
    with pytest.raises(NoDeviceError, match=r"older than 12\.0.*cuLaunchKernel"):
        _backend._bind_native()
    assert _driver._native is None


class _Streamish:
    """Enough of a CudaStream for the hardware-queue count."""

    def __init__(self) -> None:
        self._eager = True


def test_more_streams_than_hardware_queues_turn_eager_markers_off(monkeypatch) -> None:
    monkeypatch.setattr(_config, "SETTINGS", _config.SETTINGS.replace(device_max_connections=2))
    monkeypatch.setattr(_stream, "_device_queues", {})
    a, b, c = _Streamish(), _Streamish(), _Streamish()
    q = _stream._join_queues(0, a)
    assert _stream._join_queues(0, b) is q
    assert q.limit == 2 and q.solo, "two streams, two queues: each has its own"
    _stream._join_queues(0, c)
    assert not q.solo
    assert not (a._eager or b._eager or c._eager), "sharing queues ends every eager stream"
    _stream._leave_queues(q, c)
    assert q.solo


@pytest.mark.parametrize(("value", "limit"), [("32", 32), ("0", 8), ("64", 8), ("x", 8)])
def test_the_queue_count_follows_the_drivers_variable(monkeypatch, value, limit) -> None:
    read = _config.read_device_max_connections({"CUDA_DEVICE_MAX_CONNECTIONS": value})
    monkeypatch.setattr(_config, "SETTINGS", _config.SETTINGS.replace(device_max_connections=read))
    assert _stream._queue_limit() == limit


# -- device buffers a stream keeps for its next allocation (``_SpareBuffers``) ----------------
# Keeping and taking are the extension's (``SpareCore``: the context's
# enqueue_create_buffer and a dropped device buffer use it without Python).


@pytest.fixture
def new_spare():
    return lambda: _memory._SpareBuffers(_memory._SPARE_BYTES, _memory._SPARE_PER_SIZE)


class _Buf:
    """Stands in for a cuda.core ``Buffer``: records the stream it was freed on."""

    def __init__(self, handle: int = 0x1000) -> None:
        self.handle = handle
        self.freed_on: object = None

    def close(self, stream: object) -> None:
        self.freed_on = stream


class _Alloc:
    """Stands in for a kept ``_DeviceAlloc``: records the stream it was freed on."""

    def __init__(self) -> None:
        self.freed_on: object = None

    def free_on(self, stream: object) -> None:
        self.freed_on = stream


def test_a_kept_allocation_goes_to_the_next_allocation_of_its_size_newest_first(
    new_spare,
) -> None:
    spare = new_spare()
    a, b = _Alloc(), _Alloc()
    assert spare.keep(a, 1024) and spare.keep(b, 1024)
    assert spare.take(2048) is None  # another size: nothing kept
    assert spare.take(1024) is b
    assert spare.take(1024) is a
    assert spare.take(1024) is None
    assert not spare.kept() and spare.room == _memory._SPARE_BYTES


def test_a_stream_keeps_at_most_four_of_a_size_and_64_mib_in_all(new_spare) -> None:
    spare = new_spare()
    assert all(spare.keep(_Alloc(), 4096) for _ in range(_memory._SPARE_PER_SIZE))
    assert not spare.keep(_Alloc(), 4096)
    assert not spare.keep(_Alloc(), _memory._SPARE_BYTES)  # more than the room left
    assert spare.take(4096) is not None
    assert spare.room == _memory._SPARE_BYTES - (_memory._SPARE_PER_SIZE - 1) * 4096


def test_a_stream_keeps_at_most_sixteen_sizes_and_nothing_of_size_zero(new_spare) -> None:
    from asyncgpu import _native

    assert _memory._SPARE_SIZES == _native.SPARE_SIZES == 16  # (the C table's size)
    spare = new_spare()
    assert all(spare.keep(_Alloc(), 64 * (i + 1)) for i in range(_memory._SPARE_SIZES))
    assert not spare.keep(_Alloc(), 4096)  # a seventeenth size
    assert spare.take(64) is not None  # the size's last one: its row is free again
    assert spare.keep(_Alloc(), 4096)
    assert not spare.keep(_Alloc(), 0)
    assert sorted(spare.bufs) == [64 * (i + 1) for i in range(1, _memory._SPARE_SIZES)] + [4096]


def test_freeing_kept_allocations_frees_them_on_the_stream_and_a_closed_stream_keeps_none(
    new_spare,
) -> None:
    spare = new_spare()
    allocs = [_Alloc() for _ in range(3)]
    for i, a in enumerate(allocs):
        spare.keep(a, 256 * (i + 1))
    stream = object()
    spare.free(stream, False)  # memory ran short: freed, and the stream goes on keeping
    assert [a.freed_on for a in allocs] == [stream] * 3
    assert not spare.bufs and spare.room == _memory._SPARE_BYTES and not spare.closed
    assert spare.keep(_Alloc(), 256)
    spare.free(stream, True)  # the stream closes
    assert spare.closed
    assert not spare.keep(_Alloc(), 256) and not spare.bufs
    assert spare.room == _memory._SPARE_BYTES


def test_a_dropped_allocation_is_kept_by_an_open_stream_and_freed_on_a_closed_one(
    new_spare,
) -> None:
    class _Backend:
        _core_device = type("Dev", (), {"default_stream": "device default stream"})()

        def make_current(self) -> None:
            pass

    class _Stream:
        def __init__(self) -> None:
            self.spare = new_spare()
            self.is_closed = False
            self.cs = "stream"

    s = _Stream()
    kept = _Buf()
    alloc = _memory._DeviceAlloc(_Backend(), kept, None, 512)
    alloc.release(s)
    # The allocation itself is kept (its cuda.core buffer still in it) and is what
    # the stream's next allocation of 512 bytes gets.
    assert kept.freed_on is None and alloc.buf is kept and s.spare.take(512) is alloc
    s.spare.keep(alloc, 512)
    s.spare.free(s.cs, True)
    assert kept.freed_on == "stream" and alloc.buf is None
    s.is_closed = True
    late = _Buf()
    _memory._DeviceAlloc(_Backend(), late, None, 512).release(s)
    assert late.freed_on == "device default stream"  # its stream is gone


class _ClosingBackend:
    _core_device = type("Dev", (), {"default_stream": "device default stream"})()

    def make_current(self) -> None:
        pass


class _ClosedStream:
    spare = None
    is_closed = True


def test_an_abandoned_allocation_is_never_freed_even_when_its_last_reference_goes() -> None:
    """At interpreter exit (and for ``take_ptr``) the cuda.core buffer gets a
    reference nobody drops: cuda.core's own free would run on the stream the
    memory was allocated on, which may be destroyed."""
    buf = _Buf()
    before = sys.getrefcount(buf)
    alloc = _memory._DeviceAlloc(_ClosingBackend(), buf, None, 512)
    alloc.abandon()
    del alloc
    assert sys.getrefcount(buf) == before + 1
    assert buf.freed_on is None
    ctypes.pythonapi.Py_DecRef(ctypes.py_object(buf))  # the test's own clean-up


def test_an_allocation_dropped_at_exit_without_a_release_is_abandoned(monkeypatch) -> None:
    """The interpreter's teardown may free an allocation by a path that never
    released it; at exit it is then abandoned (cuda.core's own free would run on
    a stream the context's close destroyed). Before exit it is left as it was."""
    buf = _Buf()
    before = sys.getrefcount(buf)
    _memory._DeviceAlloc(_ClosingBackend(), buf, None, 512)  # dropped at once, not exiting
    assert sys.getrefcount(buf) == before
    monkeypatch.setattr(_memory._BufferBase, "_exiting", True)
    _memory._DeviceAlloc(_ClosingBackend(), buf, None, 512)
    assert sys.getrefcount(buf) == before + 1 and buf.freed_on is None
    ctypes.pythonapi.Py_DecRef(ctypes.py_object(buf))


def test_a_free_that_fails_abandons_the_buffer_rather_than_leave_it_to_cuda_core() -> None:
    class _FailingBuf(_Buf):
        def close(self, stream: object) -> None:
            raise RuntimeError("cuMemFreeAsync failed")

    buf = _FailingBuf()
    before = sys.getrefcount(buf)
    alloc = _memory._DeviceAlloc(_ClosingBackend(), buf, None, 512)
    with pytest.raises(RuntimeError, match="cuMemFreeAsync"):
        alloc.release(_ClosedStream())
    del alloc
    assert sys.getrefcount(buf) == before + 1
    ctypes.pythonapi.Py_DecRef(ctypes.py_object(buf))


def test_a_failed_allocation_frees_the_kept_buffers_and_tries_once_more() -> None:
    """``CudaBackend.alloc_device`` with a stand-in pool: a first failure frees what
    the device's streams keep and retries; a failure with nothing kept, or a second
    failure, raises DeviceError naming the size."""

    class _Pool:
        def __init__(self, failures: int) -> None:
            self.failures = failures

        def allocate(self, nbytes: int, stream: object) -> _Buf:
            if self.failures:
                self.failures -= 1
                raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY")
            return _Buf()

    class _Backend:
        device_id = 0

        def __init__(self, failures: int, kept: bool) -> None:
            self.mr = _Pool(failures)
            self.kept = kept
            self.freed = 0

        def make_current(self) -> None:
            pass

        def _free_spare_buffers(self) -> bool:
            self.freed += 1
            return self.kept

    spare = _memory._SpareBuffers(_memory._SPARE_BYTES, _memory._SPARE_PER_SIZE)
    stream = type("S", (), {"spare": spare, "cs": "stream"})()
    b = _Backend(failures=1, kept=True)
    alloc = _backend.CudaBackend.alloc_device(b, 4096, stream)
    assert alloc.nbytes == 4096 and alloc.buf is not None and b.freed == 1
    for failures, kept in ((1, False), (2, True)):
        b = _Backend(failures, kept)
        with pytest.raises(DeviceError, match="allocating 4096 bytes"):
            _backend.CudaBackend.alloc_device(b, 4096, stream)
        assert b.freed == 1


def test_memory_running_short_frees_the_kept_buffers_of_streams_neither_closing_nor_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``CudaBackend._free_spare_buffers`` (before the retry of a failed
    allocation, under the allocating stream's lock): each stream's kept buffers
    are freed on it under its own lock; a closing stream's are left to its
    close (which destroys the stream after freeing them), and a stream whose
    lock another thread holds is passed over, never waited for (two streams
    running short at once would wait for each other). The allocating stream's
    own lock is re-entrant."""
    import threading

    from asyncgpu import _native

    class _Stream:
        def __init__(self, name: str) -> None:
            self.cs = name
            self._submission_lock = _native.RLock()
            self._closing = False
            self.spare = _memory._SpareBuffers(_memory._SPARE_BYTES, _memory._SPARE_PER_SIZE)
            self.kept = _Alloc()
            assert self.spare.keep(self.kept, 256)

    mine, other, closing, busy = (_Stream(n) for n in ("mine", "other", "closing", "busy"))
    closing._closing = True
    monkeypatch.setattr(_backend, "_all_streams", lambda b: [mine, other, closing, busy])
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with busy._submission_lock:
            held.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(30)
    try:
        with mine._submission_lock:  # (as the failed allocation holds it)
            assert _backend.CudaBackend._free_spare_buffers(object())  # type: ignore[arg-type]
    finally:
        done.set()
        holder.join(30)
    assert mine.kept.freed_on == "mine" and other.kept.freed_on == "other"
    assert closing.kept.freed_on is None and closing.spare.kept()
    assert busy.kept.freed_on is None and busy.spare.kept()


# -- which marker follows an operation ---------------------------------------------------
# A counter write (cuStreamWriteValue64) right after a copy waits, in its memory fence,
# for the copy engines; that cost a 4-stream copy/kernel pipeline a tenth of its overlap
# (benchmarks/diagnostics/probe_pipeline.py). So the marker right after a copy or memset
# is a recorded driver event, and other streams wait on that event, not on the counter.


class _PythonDriver:
    """The driver calls the Python side of the markers makes (``cuda.bindings``'
    spelling): events made, waits placed. An event is an int handle that the
    extension records and queries on the stand-in driver (``c``); it finishes when
    the test adds it to the stand-in's ``finished``."""

    class CUevent_flags:  # the driver's spelling
        CU_EVENT_DISABLE_TIMING = 2

    def __init__(self, c: Driver) -> None:
        self.c = c
        self.created: list[int] = []
        self.waits: list[tuple[str, object]] = []

    def cuEventCreate(self, flags: int) -> tuple[object, int]:
        self.created.append(0xE0 + len(self.created))
        return _driver._SUCCESS, self.created[-1]

    def cuStreamWaitEvent(self, stream: object, event: int, flags: int) -> tuple[object]:
        self.waits.append(("event", event))
        return (_driver._SUCCESS,)

    def cuStreamWaitValue64(self, stream, addr, value, flags) -> tuple[object]:
        self.waits.append(("counter", value))
        return (_driver._SUCCESS,)


@pytest.fixture
def marked(monkeypatch):
    """A CudaStream's marker bookkeeping without a GPU: its Python driver calls
    on ``_PythonDriver``, the extension bound to the stand-in driver (whose
    ``cuEventRecord`` records the marker events and whose ``cuEventQuery`` the
    compiled completion, ``_completed``, asks), the counter in ordinary memory.
    ``written`` lists the counter markers."""
    with bound_stand_in(events=True) as c:
        driver = _PythonDriver(c)
        monkeypatch.setattr(_stream, "cu", driver)
        s = _stream.CudaStream.__new__(_stream.CudaStream)
        s._seq = s._marked = s._issued_mark = s._counter_mark = s._done_seq = 0
        s._events, s._pending, s._after_copy = None, None, False
        s._copy_marks, s._free_events = _stream.deque(), []
        s._marker_lock = threading.Lock()
        s._counter = ctypes.c_uint64(0)
        s.h, s.caddr = 0x5EA, ctypes.addressof(s._counter)
        s._counter_in_c = True
        s.backend = type("B", (), {"current": 0})()
        s.backend.make_current = lambda: setattr(s.backend, "current", s.backend.current + 1)
        written: list[int] = []
        s._write_marker = lambda seq: written.append(seq) or 0
        yield s, driver, written


def _submit(s, copy: bool) -> int:
    s._seq += 1
    s._after_copy = copy
    return s._seq


def test_a_marker_after_a_kernel_writes_the_counter_and_after_a_copy_records_an_event(
    marked,
) -> None:
    s, driver, written = marked
    kernel = _submit(s, copy=False)
    s._place_marker()
    copy = _submit(s, copy=True)
    s._place_marker()
    forced = _submit(s, copy=True)
    s._place_marker(counter=True)  # what a foreign stream's counter wait needs

    assert written == [kernel, forced]
    assert driver.c.records == [(0xE0, 0x5EA)]  # the copy's event, recorded on the stream
    assert s._copy_marks == _stream.deque([(copy, 0xE0)])
    assert s._counter_mark == forced and s._marked == s._issued_mark == forced


def test_a_finished_copy_marker_counts_even_after_its_event_is_reused(marked) -> None:
    s, driver, _ = marked
    _submit(s, copy=False)
    s._place_marker()
    s._counter.value = 1  # the GPU wrote the kernel's marker
    copy = _submit(s, copy=True)
    s._place_marker()

    assert s._completed() == 1  # the copy's event has not finished
    driver.c.finished.add(driver.created[0])
    assert s._completed() == copy
    assert not s._copy_marks and s._free_events == [driver.created[0]]
    assert s._completed() == copy  # the counter still says 1; the event said more

    assert s.backend.current == 1  # made current before creating (the watcher places some)
    again = _submit(s, copy=True)
    s._place_marker()
    assert driver.created == [0xE0]  # reused, not created again
    assert s._completed() == copy  # recorded again: not finished
    s._counter.value = again  # a later counter marker passed it: taken back unqueried
    assert s._completed() == again and not s._copy_marks


def test_other_streams_wait_on_the_marker_event_else_on_the_counter(marked) -> None:
    s, driver, _ = marked
    kernel = _submit(s, copy=False)
    s._place_marker()
    copy = _submit(s, copy=True)
    s._place_marker()

    s._device_wait_for("other", copy)
    s._device_wait_for("other", kernel)  # its own counter marker comes first
    assert driver.waits == [("event", 0xE0), ("counter", kernel)]

    driver.c.finished.add(0xE0)
    s._completed()  # the event finished and went back to the free list
    driver.waits.clear()
    s._device_wait_for("other", copy)
    assert driver.waits == []  # finished: nothing to wait for

    later = _submit(s, copy=False)
    s._place_marker()
    s._device_wait_for("other", copy)  # still finished, though a counter marker came since
    assert driver.waits == []
    s._device_wait_for("other", later)
    assert driver.waits == [("counter", later)]


def test_a_wait_for_a_finished_copy_never_waits_on_a_counter_marker_held_back(marked) -> None:
    """The soak deadlocked on a GPU when this was wrong: the copy's marker event
    had finished and gone back, the next counter marker sat behind held host work,
    and another stream waited on the device for that counter."""
    s, driver, written = marked
    copy = _submit(s, copy=True)
    s._place_marker()
    driver.c.finished.add(0xE0)
    s._completed()
    s._pending = _stream.deque()  # held behind host work from here on
    _submit(s, copy=False)
    s._place_marker()
    assert written == [] and s._counter_mark > copy  # the counter marker is held back

    s._device_wait_for("other", copy)

    assert driver.waits == []


# -- the streams and events of staged copies ---------------------------------------------


def test_staged_copies_get_streams_made_by_the_enqueuing_thread_at_most_one_per_pool_thread() -> (
    None
):
    """Each enqueued pageable copy reserves a kit (a stream and events) on the
    enqueuing thread, up to the pool's size; the pool thread that runs the copy
    takes one and makes none. A burst of 100 queued copies makes 4 kits, not 100
    (ab7abdf made one per queued copy, with its pinned chunks)."""
    made: list[str] = []

    def make() -> str:
        made.append(threading.current_thread().name)
        return f"kit{len(made)}"

    kits = _memory._StageKits(make, limit=4)
    for _ in range(100):
        kits.reserve()  # the event loop enqueues 100 copies
    assert len(made) == 4 and set(made) == {threading.current_thread().name}

    taken: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def run_copy() -> None:  # four pool threads, each running copies
        try:
            for _ in range(25):
                barrier.wait(10)
                kit = kits.take()
                taken.append(kit)
                barrier.wait(10)  # four copies in flight at once
                kits.give(kit)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run_copy) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(taken) == 100
    assert len(made) == 4, "a pool thread made a kit"
    assert sorted(kits.drain()) == ["kit1", "kit2", "kit3", "kit4"]


def test_a_copy_that_finds_no_kit_yet_makes_one_rather_than_fail() -> None:
    """Another enqueuing thread may still be making the kit that the count
    already promised; the copy then makes its own."""
    kits = _memory._StageKits(lambda: object(), limit=1)
    kits._made = 1  # promised by a reserve() still running in another thread
    assert kits.take() is not None


# -- waiting for a held stream's markers to reach the driver --------------------------


def test_issue_waiters_are_called_once_a_marker_covers_them_lowest_first() -> None:
    """Another stream's held wait (``_when_issued``) is called back by the drain
    that hands the driver a marker covering its operation: those covered, in the
    order of their operations (ties: first come first), the others kept."""
    s = _stream.CudaStream.__new__(_stream.CudaStream)
    s._submit_lock = threading.RLock()
    s._issue_waiters = []
    s._issued_mark = 2
    called: list[str] = []
    assert not s._when_issued(2, lambda: called.append("covered already"))
    for seq, name in [(7, "7"), (4, "4a"), (9, "9"), (4, "4b"), (3, "3")]:
        assert s._when_issued(seq, lambda name=name: called.append(name))
    s._issued_mark = 5
    for cb in s._take_issue_waiters():
        cb()
    assert called == ["3", "4a", "4b"]
    assert s._take_issue_waiters() == []  # nothing new is covered
    s._issued_mark = 9
    for cb in s._take_issue_waiters():
        cb()
    assert called == ["3", "4a", "4b", "7", "9"] and s._issue_waiters == []


def test_host_work_starts_the_host_work_behind_it_when_it_ends() -> None:
    """The result of host work on a polled stream hands over to the host work
    enqueued right behind it: ``follow`` before the end, and ``end`` returns what
    to start; after the end ``follow`` says no, and the caller starts it."""
    from asyncgpu._core.stream import _HostResult

    r = _HostResult()
    started: list[str] = []
    assert r.follow(lambda: started.append("next"))
    after = r.end(42, None)
    assert (r.value, r.error, r.ended) == (42, None, True) and started == []
    assert after is not None
    after()
    assert started == ["next"]
    assert not r.follow(lambda: started.append("too late"))
    assert started == ["next"]


# -- awaiting another library's stream (a wrapped stream's fence) -------------------------


@pytest.fixture
def wrapped(monkeypatch):
    """A wrapped CudaStream (another library's, ``owned`` false) with the whole
    polled-stream bookkeeping, its driver calls on the stand-in and
    ``_PythonDriver`` as in ``marked``; ``written`` lists its counter markers."""
    from asyncgpu import DeviceEvent, _accel
    from asyncgpu._core.engine import watcher
    from asyncgpu._core.stream import _PolledStream

    sweeps: list[object] = []  # (the watcher's sweeps this stream asks for)
    _accel.native.configure(
        DeviceEvent,
        sweeps.append,
        _PolledStream.MARK_EVERY,
        _stream.CudaStream,
        _memory._DeviceAlloc,
    )
    with bound_stand_in(events=True) as c:
        driver = _PythonDriver(c)
        monkeypatch.setattr(_stream, "cu", driver)
        monkeypatch.setattr(_driver, "cu", driver)
        s = wrapped_stream(0x5EA)
        written = s.written
        try:
            yield s, driver, written
        finally:
            _accel.native.configure(DeviceEvent, watcher.sweep_later, _PolledStream.MARK_EVERY)


def test_a_wrapped_streams_fence_is_marked_by_a_pooled_driver_event(wrapped) -> None:
    """The await of another library's stream enqueues one empty operation of ours
    (no driver call), whose marker is a driver event recorded on that stream: its
    owner's last work is most often a copy, after which a counter write would
    wait for the copy engine. The completion asks the event (``cuEventQuery``),
    and the next fence records the same event again."""
    s, driver, written = wrapped
    first = s.fence()
    assert first._seq == 1 and s.tail() is first
    assert driver.c.records == []  # lazy: nothing marks it until it is waited for

    assert not first.query()  # the wait places the marker: the event
    assert driver.c.records == [(0xE0, 0x5EA)] and written == []
    driver.c.finished.add(0xE0)
    assert first.query()
    assert s._free_events == [0xE0]

    second = s.fence()  # the stream is eager now (its fences are awaited)
    assert second._seq == 2
    assert driver.c.records == [(0xE0, 0x5EA), (0xE0, 0x5EA)]  # recorded again
    assert driver.created == [0xE0] and written == []  # one event, reused; no counter
    assert not second.query()
    driver.c.finished.add(0xE0)
    assert second.query() and not s._inflight


def test_a_context_keeps_a_wrapper_whose_fence_is_pending(wrapped, monkeypatch) -> None:
    """The context's bound on the wrappers it keeps (``create_external_stream``),
    on the CUDA device's wrapper: past the bound, a wrapper whose fence's event
    has not finished is kept; once that event is seen finished, the next new
    handle lets it go (the context's table keeps it no more)."""
    import weakref
    from collections import OrderedDict
    from types import SimpleNamespace

    from asyncgpu._core import state as _state

    s, driver, _ = wrapped
    monkeypatch.setattr(_state, "EXTERNAL_STREAMS_KEPT", 1)
    made = iter([s, wrapped_stream(0x5EB), wrapped_stream(0x5EC)])
    table = SimpleNamespace(
        kept_external=OrderedDict(),
        external_streams=weakref.WeakValueDictionary(),
        lock=threading.RLock(),
        refuse_if_closing=lambda: None,
        take_index=lambda: 9,
        backend=SimpleNamespace(external_stream=lambda state, stream, index: next(made)),
    )

    def wrap(handle: int) -> object:
        return _state._ContextState.external_stream(table, handle, handle)  # type: ignore[arg-type]

    assert wrap(0x5EA) is s and wrap(0x5EA) is s
    fence = s.fence()
    assert not fence.query()  # (its marker, the driver event, recorded)
    other = wrap(0x5EB)
    assert list(table.kept_external) == [0x5EA, 0x5EB]  # one past the bound
    driver.c.finished.add(0xE0)
    assert fence.query()
    wrap(0x5EC)
    assert list(table.kept_external) == [0x5EC]
    assert other is not s


def test_a_fence_marked_by_the_counter_when_the_benchmarks_ask(wrapped, monkeypatch) -> None:
    """(``_fence_event_marker``: the serving benchmark compares the two markers.)"""
    s, driver, written = wrapped
    monkeypatch.setattr(_stream.CudaStream, "_fence_event_marker", False)
    ev = s.fence()
    assert not ev.query()
    assert written == [ev._seq] and driver.c.records == []
    s._counter.value = ev._seq
    assert ev.query()


def test_a_fence_stands_for_everything_before_it_and_orders_nothing_after() -> None:
    """The point of a wrapped stream is a new fence each time (its owner's work
    is invisible to asyncgpu); an owned stream's point is its last operation."""
    wrapped_point = _stream.CudaStream.point
    s = type(
        "S", (), {"owned": False, "fence": lambda self: "fence", "tail": lambda self: "tail"}
    )()
    assert wrapped_point(s) == "fence"
    s.owned = True
    assert wrapped_point(s) == "tail"


def test_waiting_for_another_librarys_event_is_a_device_wait_on_it(wrapped) -> None:
    """``wait_for_event_handle`` places ``cuStreamWaitEvent`` for the given event
    (its latest record); the fence after it then stands for that event too."""
    s, driver, _ = wrapped
    monkey_event = 0xCAFE
    driver.CUevent = int  # (cuda.bindings' CUevent of an address)
    s.wait_for_event_handle(monkey_event)
    assert driver.waits == [("event", monkey_event)]
    ev = s.fence()
    assert ev._seq == 1


@pytest.mark.parametrize(
    ("obj", "handle"),
    [
        (0x1234, 0x1234),
        (type("Torch", (), {"cuda_stream": 0x55})(), 0x55),
        (type("CuPy", (), {"ptr": 0x66})(), 0x66),
        (type("Proto", (), {"__cuda_stream__": lambda self: (0, 0x77)})(), 0x77),
    ],
)
def test_the_handle_of_another_librarys_stream_is_read_without_a_driver_call(obj, handle):
    assert _backend.CudaBackend.external_handle(None, obj) == handle


def test_a_stream_that_is_not_one_is_a_type_error_at_the_wrap() -> None:
    with pytest.raises(TypeError, match="create_external_stream takes a CUstream"):
        _backend.CudaBackend.external_handle(None, object())


# -- a close racing threads that use the stream's handle ------------------------------------


@pytest.fixture
def closable(wrapped):
    """The wrapped stand-in stream, closable: its release (``cuStreamDestroy`` on
    a stream it owns) recorded in ``calls``, as are the driver calls on its
    handle (``cuStreamSynchronize``, ``cuStreamQuery``); ``hold`` makes the
    next ``cuStreamSynchronize`` wait, inside the driver, until ``go`` is set."""
    import weakref
    from types import SimpleNamespace

    s, driver, _ = wrapped
    calls: list[tuple[str, int]] = []
    t = SimpleNamespace(calls=calls, hold=False, inside=threading.Event(), go=threading.Event())

    def synchronize(stream):
        calls.append(("cuStreamSynchronize", stream))
        if t.hold:
            t.hold = False
            t.inside.set()
            assert t.go.wait(30)
        return (_driver._SUCCESS,)

    driver.cuStreamSynchronize = synchronize
    driver.cuStreamQuery = lambda stream: (
        calls.append(("cuStreamQuery", stream)) or (_driver._SUCCESS,)
    )
    s._free_spare = weakref.finalize(s, int)
    s._release = lambda: calls.append(("released", s.raw))
    yield s, t


def _in_thread(fn):
    """Run ``fn`` on a daemon thread; returns the thread and its outcome list (its
    value or the exception it raised)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def test_a_close_that_overtakes_a_synchronize_leaves_it_no_driver_call(closable) -> None:
    """A ``synchronize()`` held up after the context's open check, before its
    ``cuStreamSynchronize`` (here in ``_settle``), while another thread closes
    the stream: the close does not wait for it (it is not in the driver), and
    once the stream is released the synchronize makes no call on the
    destroyed handle and returns, as it would have before the close (which
    waited for the work). Fault checks of the closed stream (an await's, the
    watcher's) make no call either."""
    s, t = closable
    settling, go = threading.Event(), threading.Event()

    def held_settle() -> None:
        settling.set()
        assert go.wait(30)

    s._settle = held_settle
    syncer, out = _in_thread(s.synchronize)
    assert settling.wait(30)
    s.close()  # (on this thread: it waits for nobody)
    assert t.calls == [("released", 0x5EA)]
    go.set()
    syncer.join(30)
    assert out == [None]
    assert s._query_fault() is None
    assert t.calls == [("released", 0x5EA)]  # no driver call after the release


def test_a_close_waits_for_a_synchronize_inside_the_driver_before_releasing(
    closable,
) -> None:
    """A ``synchronize()`` inside ``cuStreamSynchronize`` when another thread
    closes the stream: the close releases the stream (``cuStreamDestroy``) only
    once that call has returned, and lets no new call in meanwhile."""
    s, t = closable
    t.hold = True
    use = s._handle_use
    use._cond = seen = _SeenWait()
    syncer, out = _in_thread(s.synchronize)
    assert t.inside.wait(30)
    closer, closed = _in_thread(s.close)
    assert seen.waiting.wait(30)  # the close waits for the handle's users...
    assert t.calls == [("cuStreamSynchronize", 0x5EA)]  # ...and released nothing
    assert not use.enter()  # nor lets a new call in
    t.go.set()
    syncer.join(30)
    closer.join(30)
    assert out == [None] and closed == [None]
    assert t.calls == [("cuStreamSynchronize", 0x5EA), ("released", 0x5EA)]


class _SeenWait(threading.Condition):
    """The condition of a stream's ``_HandleUse``, saying when a close waits on it
    (the use has ended then: no thread gets in any more)."""

    def __init__(self) -> None:
        super().__init__(threading.Lock())
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def test_work_whose_end_the_close_did_not_see_fails_at_the_close(closable) -> None:
    """The close waits for a stream's work before releasing it; work still in
    flight after that wait (one that failed without failing the stream) can
    never be seen to end once the stream is gone, so the close fails it:
    a blocking wait for it raises instead of polling for good."""
    from asyncgpu import DeviceFaultError

    s, t = closable
    ev = s.fence()  # (its marker never passes: the counter stays at 0)
    s.close()
    assert ev._done and not s._inflight
    with pytest.raises(DeviceFaultError, match="closed before its work ended"):
        ev.synchronize()
    assert t.calls == [("released", 0x5EA)]
