"""The context's hot paths in C (``ContextCore``): ``enqueue_function`` and
``enqueue_create_buffer``, a dropped device buffer giving its memory back to its
stream (``BufferCore``'s finalizer), and the extension's ``RLock``, against a
stand-in driver and a CudaStream built without a GPU.

What must hold: the C path takes only the common case (a compiled function of
this context, ``grid_dim`` and ``block_dim`` alone and seen before, nothing
traced; a device buffer of memory the current stream kept, or else of a new
allocation of the backend) and does exactly what the Python method does there;
every other call reaches the Python method (``_enqueue_function``,
``_enqueue_create_buffer``) unchanged, which checks it and raises the precise
error; a dropped buffer's memory goes back to its stream only when that stream
keeps it, and to ``_release_memory`` otherwise.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _stand_in_driver import Driver, bound_stand_in
from test_native_stream import Stream

from asyncgpu import DeviceBuffer, DeviceContext, DeviceEvent, DeviceFunction, _native
from asyncgpu._core.memory import _BufferBase
from asyncgpu._core.state import _Ref
from asyncgpu._devices.cuda import memory as _memory
from asyncgpu._devices.cuda import stream as _stream


@pytest.fixture
def driver() -> Iterator[Driver]:
    with bound_stand_in(events=True) as d:
        yield d


class _Kernel:
    """What the launch reads of a compiled CUDA function (``_CudaFunction``)."""

    def __init__(self) -> None:
        self.last: Any = None
        self.handle = 0xF00


class _Backend:
    """Stands in for ``CudaBackend.alloc_device``: records each call and answers
    ``allocation(nbytes)`` (a ``_DeviceAlloc`` at 0x9000_0000), or raises ``error``."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Any]] = []
        self.error: BaseException | None = None
        self.allocation: Any = lambda nbytes: _memory._DeviceAlloc(
            None,  # type: ignore[arg-type]
            _CoreBuffer(0x9000_0000),
            None,
            nbytes,
        )

    def alloc_device(self, nbytes: int, stream: Any) -> Any:
        self.calls.append((nbytes, stream))
        if self.error is not None:
            raise self.error
        return self.allocation(nbytes)


class Setup:
    """A DeviceContext over a stand-in CUDA stream, and a compiled function of it
    whose configurations for grid 4 and grid 8 (block 256) are cached."""

    def __init__(self, driver: Driver) -> None:
        self.driver = driver
        self.stream = Stream([])
        s = self.stream.s
        s.spare = _memory._SpareBuffers(_memory._SPARE_BYTES, _memory._SPARE_PER_SIZE)
        ctx = self.ctx = object.__new__(DeviceContext)
        self.backend = _Backend()
        ctx._state = SimpleNamespace(closed=False, trace=None, backend=self.backend)
        ctx._ref = _Ref()
        ctx._impl = s
        s.state = ctx._state
        self.kernel = _Kernel()
        self.fn = DeviceFunction(ctx, "k", self.kernel)
        self.cfg4 = SimpleNamespace(dims=(4, 1, 1, 256, 1, 1, 0))
        self.cfg8 = SimpleNamespace(dims=(8, 1, 1, 256, 1, 1, 0))
        self.fn._cfgs[_native.launch_key(4, 256, None, None, ())] = self.cfg4
        self.fn._cfgs[_native.launch_key(8, 256, None, None, ())] = self.cfg8
        self.general: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def plan(self, args: tuple[Any, ...], codes: bytes) -> None:
        self.kernel.last = self.stream.plan(args, codes)
        self.driver.nargs = len(args)


@pytest.fixture
def setup(driver: Driver, monkeypatch: pytest.MonkeyPatch) -> Setup:
    _native.configure(
        DeviceEvent,
        [].append,
        _stream._PolledStream.MARK_EVERY,
        _stream.CudaStream,
        _memory._DeviceAlloc,
    )
    st = Setup(driver)

    def general(name: str) -> Any:
        def record(self: Any, *args: Any, **kwargs: Any) -> str:
            st.general.append((name, args, kwargs))
            return "general"

        return record

    monkeypatch.setattr(DeviceContext, "_enqueue_function", general("function"))
    monkeypatch.setattr(DeviceContext, "_enqueue_create_buffer", general("create"))
    yield st
    from asyncgpu._core.engine import watcher

    _native.configure(DeviceEvent, watcher.sweep_later, _stream._PolledStream.MARK_EVERY)


# -- enqueue_function -------------------------------------------------------------------


def test_a_launch_seen_before_goes_to_the_driver_without_the_python_method(setup: Setup) -> None:
    setup.plan((np.float32(2), np.int32(5)), b"fi")
    ev = setup.ctx.enqueue_function(setup.fn, np.float32(2), np.int32(5), grid_dim=4, block_dim=256)
    assert type(ev) is DeviceEvent and ev._seq == 1 and ev._stream is setup.stream.s
    assert setup.general == []
    ((handle, dims, stream, values, _),) = setup.driver.launches
    assert handle == 0xF00 and dims == (4, 1, 1, 256, 1, 1, 0) and stream == 0x5EA
    assert values[0][:4] == np.float32(2).tobytes() and values[1][:4] == np.int32(5).tobytes()


def test_the_configuration_follows_the_geometry_of_each_launch(setup: Setup) -> None:
    """The last configuration looked up is kept on the function: another geometry,
    or the same one in other int objects, must still find its own."""
    setup.plan((), b"")
    for grid in (4, 8, 8, int("4"), 4, 8):
        setup.ctx.enqueue_function(setup.fn, grid_dim=grid, block_dim=256)
    assert [d[0] for _, d, *_ in setup.driver.launches] == [4, 8, 8, 4, 4, 8]
    assert setup.general == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"grid_dim": 16, "block_dim": 256},  # a geometry not validated yet
        {"grid_dim": np.int32(4), "block_dim": 256},  # a NumPy integer
        {"grid_dim": True, "block_dim": 256},  # a bool (the Python method rejects it)
        {"grid_dim": 4.0, "block_dim": 256},
        {"grid_dim": 2**70, "block_dim": 256},
        {"grid_dim": 4, "block_dim": 256, "shared_mem_bytes": 0},
        {"grid_dim": 4, "block_dim": 256, "attributes": ()},
        {"grid_dim": 4},
        {"grid_dim": 4, "block": 256},
    ],
)
def test_any_other_launch_reaches_the_python_method_unchanged(setup: Setup, kwargs) -> None:
    setup.plan((), b"")
    assert setup.ctx.enqueue_function(setup.fn, np.int8(1), **kwargs) == "general"
    assert setup.general == [("function", (setup.fn, np.int8(1)), kwargs)]
    assert setup.driver.launches == []


def test_a_closed_context_or_foreign_function_goes_to_the_python_method(
    setup: Setup,
) -> None:
    setup.plan((), b"")
    ctx = setup.ctx
    ctx._state.closed = True
    ctx.enqueue_function(setup.fn, grid_dim=4, block_dim=256)
    ctx._state.closed = False
    ctx._ref.open = False  # this handle was closed, the state lives on
    ctx.enqueue_function(setup.fn, grid_dim=4, block_dim=256)
    ctx._ref.open = True
    other = object.__new__(DeviceContext)
    other._state, other._ref, other._impl = SimpleNamespace(closed=False), _Ref(), ctx._impl
    foreign = DeviceFunction(other, "k", setup.kernel)
    foreign._cfgs.update(setup.fn._cfgs)
    ctx.enqueue_function(foreign, grid_dim=4, block_dim=256)
    ctx.enqueue_function("a kernel by source", grid_dim=4, block_dim=256)
    assert [g[0] for g in setup.general] == ["function"] * 4
    assert setup.driver.launches == []


class _RecordingTrace:
    """What the launch's fast path calls of a trace: ``record``."""

    def __init__(self, fail: bool = False) -> None:
        self.records: list[tuple[Any, ...]] = []
        self.fail = fail

    def record(self, *args: Any) -> None:
        self.records.append(args)
        if self.fail:
            raise RuntimeError("the trace failed")


def test_a_traced_launch_takes_the_fast_path_and_the_trace_records_it(setup: Setup) -> None:
    setup.plan((), b"")
    ctx = setup.ctx
    ctx._state.trace = trace = _RecordingTrace()
    ev = ctx.enqueue_function(setup.fn, grid_dim=4, block_dim=256)
    assert setup.general == [] and len(setup.driver.launches) == 1
    assert trace.records == [(ctx._impl, ev, "kernel", setup.fn.name)]


def test_a_trace_that_fails_to_record_raises_from_the_launch_it_followed(setup: Setup) -> None:
    setup.plan((), b"")
    ctx = setup.ctx
    ctx._state.trace = _RecordingTrace(fail=True)
    with pytest.raises(RuntimeError, match="the trace failed"):
        ctx.enqueue_function(setup.fn, grid_dim=4, block_dim=256)
    assert len(setup.driver.launches) == 1  # (as on the general path: launched, then traced)


def test_a_buffer_of_a_closed_context_is_not_taken_for_one_of_the_launching_context(
    setup: Setup,
) -> None:
    """The launch skips the closed check of buffers of the context it has just
    found open, and only of those."""
    from test_native import Buf

    mine, theirs = Buf(0x1000), Buf(0x2000)
    mine._ctx = setup.ctx
    theirs._ctx._state.closed = True
    setup.plan((mine,), b"P")
    setup.ctx.enqueue_function(setup.fn, mine, grid_dim=4, block_dim=256)
    launched = len(setup.driver.launches)
    handed_back: list[Any] = []
    setup.stream.s._launch = lambda *a: handed_back.append(a)
    setup.ctx.enqueue_function(setup.fn, theirs, grid_dim=4, block_dim=256)
    assert launched == 1 and len(setup.driver.launches) == 1  # nothing more launched
    assert len(handed_back) == 1  # the stream's general path, which raises the error


@pytest.mark.parametrize("path", ["enqueue_function", "stream launch"])
def test_a_buffer_of_another_open_context_goes_to_the_general_path(setup: Setup, path: str) -> None:
    """A buffer of another context, open or not, is never packed: the general
    path decides by the rule for other contexts' buffers (the compiled path's
    only test is the identity of the buffer's state with the launch's), whether
    the launch comes from ``enqueue_function`` or from the stream's ``launch``
    (the general ``enqueue_function``'s way down, which packs buffers of the
    stream's own context)."""
    from test_native import Buf

    mine, theirs = Buf(0x1000), Buf(0x2000)
    mine._ctx = setup.ctx
    setup.stream.s.state = setup.ctx._state
    setup.plan((mine,), b"P")
    handed_back: list[Any] = []
    setup.stream.s._launch = lambda *a: handed_back.append(a)

    def launch(buf: Any) -> None:
        if path == "enqueue_function":
            setup.ctx.enqueue_function(setup.fn, buf, grid_dim=4, block_dim=256)
        else:
            setup.stream.s.launch(setup.fn, (buf,), setup.cfg4, ())

    launch(mine)
    launch(theirs)
    assert len(setup.driver.launches) == 1 and len(handed_back) == 1


# -- enqueue_create_buffer and dropping a buffer ----------------------------------------


class _CoreBuffer:
    """Stands in for cuda.core's Buffer."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.closed_on: object = None

    def close(self, stream: object) -> None:
        self.closed_on = stream


def _kept_alloc(setup: Setup, nbytes: int, handle: int = 0x7000_0000) -> _memory._DeviceAlloc:
    alloc = _memory._DeviceAlloc(None, _CoreBuffer(handle), None, nbytes)  # type: ignore[arg-type]
    assert setup.stream.s.spare.keep(alloc, nbytes)
    return alloc


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The buffers whose drop reached ``_release_memory``."""
    calls: list[Any] = []
    monkeypatch.setattr(_BufferBase, "_release_memory", lambda self: calls.append(self._alloc))
    return calls


@pytest.mark.parametrize("dtype", [np.float32, "float32", np.dtype("float32")])
def test_a_buffer_on_kept_memory_is_what_the_python_method_would_make(
    setup: Setup, dtype: Any
) -> None:
    alloc = _kept_alloc(setup, 4096)
    b = setup.ctx.enqueue_create_buffer(dtype, 1024)
    assert type(b) is DeviceBuffer and setup.general == []
    assert b._alloc is alloc and b.unsafe_ptr() == 0x7000_0000
    assert (b.dtype, len(b), b.nbytes, b._owns, b._parent, b._hostbytes) == (
        np.dtype(np.float32),
        1024,
        4096,
        True,
        None,
        None,
    )
    assert b._owner is setup.stream.s and b._ctx is setup.ctx
    assert setup.stream.s.spare.room == _memory._SPARE_BYTES


def test_a_dropped_buffer_gives_its_memory_back_to_its_stream(
    setup: Setup, released: list[Any]
) -> None:
    alloc = _kept_alloc(setup, 4096)
    b = setup.ctx.enqueue_create_buffer(np.uint8, 4096)
    del b
    assert released == [] and setup.stream.s.spare.take(4096) is alloc
    assert alloc.buf is not None and alloc.buf.closed_on is None  # kept, not freed


def test_a_buffer_its_stream_cannot_keep_goes_to_release_memory(
    setup: Setup, released: list[Any]
) -> None:
    spare = setup.stream.s.spare
    for i in range(2):
        _kept_alloc(setup, 256, 0x1000 * (i + 1))
    bufs = [setup.ctx.enqueue_create_buffer(np.uint8, 256) for _ in range(2)]
    for i in range(_memory._SPARE_PER_SIZE):
        _kept_alloc(setup, 256, 0x9000 + 0x1000 * i)  # as many of this size as it keeps
    first = bufs[0]._alloc
    del bufs[0]
    assert released == [first]
    spare.free("stream", True)  # the stream closes: it keeps nothing from now on
    second = bufs[0]._alloc
    del bufs[0]
    assert released == [first, second] and not spare.kept()


def test_sub_buffers_taken_pointers_and_the_exit_give_nothing_to_the_stream(
    setup: Setup, released: list[Any]
) -> None:
    spare = setup.stream.s.spare
    _kept_alloc(setup, 1024)
    b = setup.ctx.enqueue_create_buffer(np.uint8, 1024)
    sub = b.create_sub_buffer(np.uint8, 16, 32)
    del sub  # owns nothing
    assert released == [] and not spare.kept()
    b._alloc, real = None, b._alloc  # as take_ptr leaves it
    del b
    assert released == [] and not spare.kept()
    spare.keep(real, 1024)
    b = setup.ctx.enqueue_create_buffer(np.uint8, 1024)
    _native.set_exiting(True)
    try:
        del b
    finally:
        _native.set_exiting(False)
    assert released == [real] and not spare.kept()


@pytest.mark.parametrize(
    ("dtype", "size"),
    [
        (np.uint8, 0),
        (np.uint8, -1),
        (np.uint8, True),
        (np.uint8, np.int64(8)),
        (np.uint8, 8.0),
        (np.uint8, 2**70),
        ([1], 8),  # not a dtype argument the cache takes
    ],
)
def test_any_other_creation_reaches_the_python_method_unchanged(
    setup: Setup, dtype: Any, size: Any
) -> None:
    _kept_alloc(setup, 512)
    assert setup.ctx.enqueue_create_buffer(dtype, size) == "general"
    assert setup.general == [("create", (dtype, size), {})]
    assert setup.stream.s.spare.kept()  # nothing taken
    assert setup.backend.calls == []  # nothing allocated


def test_a_size_the_stream_keeps_nothing_of_is_allocated_by_the_backend_in_c(
    setup: Setup,
) -> None:
    """The Python method's allocation, ``backend.alloc_device(nbytes, stream)``,
    called from C, and the buffer built there as on kept memory."""
    kept = _kept_alloc(setup, 512)
    b = setup.ctx.enqueue_create_buffer(np.float64, 512)
    assert type(b) is DeviceBuffer and setup.general == []
    assert setup.backend.calls == [(4096, setup.stream.s)]
    assert b._alloc is not kept and b.unsafe_ptr() == 0x9000_0000
    assert (b.dtype, len(b), b.nbytes, b._owns, b._parent, b._hostbytes) == (
        np.dtype(np.float64),
        512,
        4096,
        True,
        None,
        None,
    )
    assert b._owner is setup.stream.s and b._ctx is setup.ctx
    assert setup.stream.s.spare.take(512) is kept  # the kept one of another size stays


def test_a_new_allocation_goes_back_to_its_stream_when_dropped(
    setup: Setup, released: list[Any]
) -> None:
    b = setup.ctx.enqueue_create_buffer(np.uint8, 4096)
    alloc = b._alloc
    del b
    assert released == [] and setup.stream.s.spare.take(4096) is alloc


def test_the_backends_allocation_error_reaches_the_caller(setup: Setup) -> None:
    """More bytes than any memory: the backend's ``DeviceError`` (what the Python
    method raises there too), nothing kept taken."""
    from asyncgpu import DeviceError

    _kept_alloc(setup, 512)
    setup.backend.error = DeviceError("allocating 4611686018427387904 bytes: out of memory")
    with pytest.raises(DeviceError, match="allocating 4611686018427387904 bytes"):
        setup.ctx.enqueue_create_buffer(np.uint8, 2**62)
    assert setup.general == [] and setup.stream.s.spare.kept()


def test_a_new_allocation_of_another_kind_is_built_by_the_buffer_class(setup: Setup) -> None:
    """An allocation that is not a ``_DeviceAlloc`` goes to ``DeviceBuffer(...)``,
    which reads its address and host memory itself."""
    other = SimpleNamespace(ptr=0x5000, host=None)
    setup.backend.allocation = lambda nbytes: other
    b = setup.ctx.enqueue_create_buffer(np.uint8, 64)
    assert type(b) is DeviceBuffer and b._alloc is other and b.unsafe_ptr() == 0x5000
    assert setup.general == [] and len(b) == 64
    b._owns = False  # (nothing to release: the stand-in has no release)


def test_kept_memory_of_another_kind_or_address_is_left_to_the_python_method(
    setup: Setup,
) -> None:
    """Only a ``_DeviceAlloc`` of a known address is made into a buffer in C; what
    else a stream keeps stays kept, for the Python method to hand out."""
    spare = setup.stream.s.spare
    other = SimpleNamespace(ptr=0x5000)
    no_address = _memory._DeviceAlloc(None, None, None, 256)  # type: ignore[arg-type]
    assert spare.keep(other, 128) and spare.keep(no_address, 256)
    assert setup.ctx.enqueue_create_buffer(np.uint8, 128) == "general"
    assert setup.ctx.enqueue_create_buffer(np.uint8, 256) == "general"
    assert spare.take(128) is other and spare.take(256) is no_address


def test_a_bad_dtype_raises_the_python_methods_error(setup: Setup) -> None:
    _kept_alloc(setup, 512)
    with pytest.raises(TypeError, match="is not a dtype NumPy knows"):
        setup.ctx.enqueue_create_buffer("no such dtype", 8)
    with pytest.raises(TypeError, match="cannot live in device memory"):
        setup.ctx.enqueue_create_buffer(object, 8)
    assert setup.stream.s.spare.kept()


def test_a_closed_context_creates_nothing_from_kept_memory(setup: Setup) -> None:
    _kept_alloc(setup, 512)
    setup.ctx._state.closed = True
    assert setup.ctx.enqueue_create_buffer(np.uint8, 512) == "general"
    assert setup.stream.s.spare.kept()


def test_a_closing_stream_creates_nothing_from_kept_memory(setup: Setup) -> None:
    """Once ``close()`` has begun on the stream (``_closing``, while the context's
    own open check still passes), the C path neither takes kept memory nor
    allocates: the Python method raises ``ContextClosedError``."""
    _kept_alloc(setup, 512)
    setup.stream.s._closing = True
    assert setup.ctx.enqueue_create_buffer(np.uint8, 512) == "general"
    assert setup.ctx.enqueue_create_buffer(np.uint8, 64) == "general"
    assert setup.stream.s.spare.kept() and setup.backend.calls == []


def test_a_new_allocation_in_c_is_the_streams_under_its_submit_lock(setup: Setup) -> None:
    """The C path's allocation is the stream's ``alloc_device``: made while the
    submit lock is held (the lock ``close()`` sets the closing flag under)."""
    held: list[bool] = []
    lock = setup.stream.s._submit_lock
    setup.backend.allocation = lambda nbytes: (
        held.append(lock._is_owned()),
        _memory._DeviceAlloc(None, _CoreBuffer(0x9000_0000), None, nbytes),  # type: ignore[arg-type]
    )[1]
    b = setup.ctx.enqueue_create_buffer(np.uint8, 64)
    assert type(b) is DeviceBuffer and held == [True]


# -- the extension's RLock ------------------------------------------------------------


def test_the_rlock_is_re_entrant_and_only_its_holder_releases_it() -> None:
    lock = _native.RLock()
    with lock, lock:
        assert lock._is_owned()
        errors: list[BaseException] = []

        def other() -> None:
            try:
                assert not lock.acquire(blocking=False)
                assert not lock.acquire(timeout=0.01)
                lock.release()
            except BaseException as e:
                errors.append(e)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert not lock._is_owned()
    with pytest.raises(RuntimeError, match="un-acquired"):
        lock.release()
    with pytest.raises(ValueError):
        lock.acquire(blocking=False, timeout=1)


def test_the_rlock_excludes_other_threads() -> None:
    """Threads that increment a counter under the lock lose no increment, though
    each gives up the GIL inside (``time.sleep(0)``)."""
    import time

    lock = _native.RLock()
    count = [0]

    def work() -> None:
        for _ in range(2000):
            with lock:
                n = count[0]
                time.sleep(0)
                count[0] = n + 1

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert count[0] == 8000


def test_a_thread_waiting_for_the_rlock_takes_it_once_the_holder_lets_go() -> None:
    """A free RLock is taken without an OS lock (the GIL guards it), so waiting
    goes through a wake-up that the release gives: the waiter gets the lock, and
    a waiter that timed out in between leaves nothing that confuses the next."""
    lock = _native.RLock()
    lock.acquire()
    started = threading.Event()
    got: list[bool] = []

    def waiter() -> None:
        started.set()
        got.append(lock.acquire())
        got.append(lock._is_owned())
        lock.release()

    t = threading.Thread(target=waiter)
    t.start()
    started.wait()
    gave_up: list[bool] = []
    quitter = threading.Thread(target=lambda: gave_up.append(lock.acquire(timeout=0.05)))
    quitter.start()
    quitter.join()
    assert gave_up == [False] and lock._is_owned()
    lock.release()
    t.join(30)
    assert got == [True, True] and not t.is_alive()
    assert lock.acquire(blocking=False)
    lock.release()


def test_a_stream_s_locks_are_the_extension_s() -> None:
    s = _stream._PolledStream(SimpleNamespace(api="cuda", device_id=0), 0, 0)
    assert type(s._submit_lock) is _native.RLock and type(s._retire_lock) is _native.RLock
    gc.collect()
