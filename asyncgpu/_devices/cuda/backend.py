"""The CUDA device, on cuda.core (kernels, launch, memory pools) and cuda.bindings
(streams, stream memory operations, host-mapped memory, contexts, attributes).

Completion: every stream owns a 64-bit counter in host-mapped pinned memory.
After an operation the stream writes the operation's sequence number into it
(``cuStreamWriteValue64``), so the host learns that work finished by reading
plain memory (see ``_engine``). Cross-stream and cross-device waits wait on the
same counters on the device (``cuStreamWaitValue64``). The exception is a
marker right after a copy or memset: that one is a recorded driver event
(``cuEventRecord``), queried by the host and waited on with
``cuStreamWaitEvent``: a counter write there has a memory fence that seems to
wait for the copy engine, which takes away part of the overlap of copies and
kernels on several streams. Host work on a stream
(CPU functions, CPU ranges, pageable copies) runs on the CPU pool once the
stream reaches it; what is enqueued behind it is held on the host and handed
to the driver when it finishes (``_PolledStream``'s held submission), so no
stream waits on the device for memory that only the host writes. Streams
wrapped from other libraries are the exception: their owner's work must wait
too, so they wait on the device on a second counter the pool thread writes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from ... import _accel, _config
from ..._core import foreign as _interop
from ..._core.engine import watcher
from ..._core.event import DeviceEvent, _UserEvent
from ..._core.function import DeviceExternalFunction, DeviceFunction, Kernel, reject_python_scalar
from ..._core.memory import DeviceBuffer, HostBuffer
from ..._core.pool import cpu_pool, fan_out, host_work, pool_size, range_work, waiting_for
from ..._core.stream import _Gate, _HardwareQueues, _HostResult, _PolledStream, _StreamImpl
from ..._errors import (
    CompileError,
    DeviceError,
    DeviceFaultError,
    HealthCheckError,
    NoDeviceError,
    UnsupportedError,
)
from ..._types import DeviceAttribute, Dim, GPUInfo, LaunchAttributeID, StreamPriorityRange
from .compiler import compile_cuda, dump_sass, write_dump

if TYPE_CHECKING:
    from ..._core.protocols import ContextView as DeviceContext
    from ..._core.state import _ContextState
    from ..._types import ConstantMemoryMapping, FuncAttribute, LaunchAttribute

from cuda.bindings import driver as cu
from cuda.core import launch as _launch

__all__ = ["CudaBackend"]

_SUCCESS = cu.CUresult.CUDA_SUCCESS
_NOT_READY = cu.CUresult.CUDA_ERROR_NOT_READY
_GEQ = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
_SHMEM_DEFAULT_LIMIT = 48 * 1024
_STAGE_CHUNK = 16 << 20
_STAGE_SLOTS = 3
# Device buffers a stream keeps for its next allocations of the same size (see
# ``_SpareBuffers``): at most this many bytes per stream, this many per size.
_SPARE_BYTES = 64 << 20
_SPARE_PER_SIZE = 4
_SPARE_SIZES = 16  # sizes a stream keeps at once (SPARE_SIZES in _native.c)
_STICKY = {
    cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,
    cu.CUresult.CUDA_ERROR_LAUNCH_FAILED,
    cu.CUresult.CUDA_ERROR_ILLEGAL_INSTRUCTION,
    cu.CUresult.CUDA_ERROR_MISALIGNED_ADDRESS,
    cu.CUresult.CUDA_ERROR_INVALID_ADDRESS_SPACE,
    cu.CUresult.CUDA_ERROR_INVALID_PC,
    cu.CUresult.CUDA_ERROR_HARDWARE_STACK_ERROR,
    cu.CUresult.CUDA_ERROR_ASSERT,
    cu.CUresult.CUDA_ERROR_ECC_UNCORRECTABLE,
    cu.CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED,
}


def _error(err: Any, what: str) -> DeviceError:
    code = int(err)
    try:
        err = cu.CUresult(code)
        name = cu.cuGetErrorName(err)[1].decode()
        desc = cu.cuGetErrorString(err)[1].decode()
    except Exception:
        name, desc = f"CUresult {code}", ""
    cls = DeviceFaultError if err in _STICKY else DeviceError
    return cls(f"{what} failed: {name} ({desc})", code=code, name=name)


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings result tuple, raising ``DeviceError`` on failure."""
    err = result[0]
    if err != _SUCCESS:
        raise _error(err, what)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


_tls = threading.local()


# The completion write of the enqueue hot path: the cuda.bindings wrapper, which
# costs the host less per call than a ctypes pointer to the driver's entry point
# (ctypes converts each argument in Python).
_write_value64 = cu.cuStreamWriteValue64


def _init_driver() -> int:
    """``cuInit`` + ``cuDeviceGetCount``; raises ``NoDeviceError`` with the reason."""
    try:
        err = cu.cuInit(0)[0]
    except RuntimeError as e:  # libcuda.so missing
        raise NoDeviceError(f"no CUDA driver: {e}") from None
    if err != _SUCCESS:
        raise NoDeviceError(f"the CUDA driver did not initialise: {_error(err, 'cuInit')}")
    _bind_native()
    return int(_check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))


def _kernel_markers() -> str:
    """What follows an eager launch on the C fast path (docs/completion.md): a
    write of the completion counter ("counter", the default) or a driver event
    ("event"), from ASYNCGPU_KERNEL_MARKERS (``_config``). The event costs the
    host less to place (``cuEventRecord`` against ``cuStreamWriteValue64``) but
    more to learn finished (a locked ``cuEventQuery`` per poll against a plain
    memory read), and an await polls more often than it places, so the counter
    is the default (see the performance page)."""
    return _config.SETTINGS.kernel_markers


# The hot path's direct driver calls (``asyncgpu._native``, a C extension): None
# where it is not built, or with ASYNCGPU_NATIVE=0; the cuda.bindings calls then.
_native: Any = None


def _entry_point(name: str) -> int:
    """The driver's entry point of ``name`` for the CUDA 12.0 API (``cuGetProcAddress``)."""
    flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    res = cu.cuGetProcAddress(name.encode(), 12000, flags)
    if res[0] != _SUCCESS or not int(res[1]):
        raise _error(res[0], f"cuGetProcAddress({name})")
    return int(res[1])


def _bind_native() -> None:
    global _native
    native = _accel.native
    if _native is not None or native is None:
        return
    try:
        native.bind(
            _entry_point("cuLaunchKernel"),
            _entry_point("cuStreamWriteValue64"),
            _entry_point("cuEventRecord"),
            _entry_point("cuEventQuery"),
        )
    except (DeviceError, ValueError):
        return  # a driver without these entry points: cuda.bindings
    native.configure(
        DeviceEvent, watcher.sweep_later, _PolledStream.MARK_EVERY, CudaStream, _DeviceAlloc
    )
    _native = native


class _CounterSlab:
    """Host-mapped pinned memory holding 64-bit counters, handed out one slot at a
    time (``cuMemHostAlloc`` with DEVICEMAP | PORTABLE; with unified addressing
    the host address is also the device address)."""

    SLOTS = 512
    STRIDE = 64  # one counter per cache line

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[int] = []

    def take(self) -> int:
        with self._lock:
            if not self._free:
                nbytes = self.SLOTS * self.STRIDE
                flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
                base = int(_check(cu.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc"))
                ctypes.memset(base, 0, nbytes)
                self._free = [base + i * self.STRIDE for i in range(self.SLOTS)][::-1]
            addr = self._free.pop()
        ctypes.c_uint64.from_address(addr).value = 0
        return addr

    def give_back(self, addr: int) -> None:
        with self._lock:
            self._free.append(addr)


_slab = _CounterSlab()


# -- the driver's hardware queues ----------------------------------------------------------

_queues_lock = threading.Lock()
_device_queues: dict[int, _HardwareQueues] = {}


def _queue_limit() -> int:
    """Hardware queues the driver gives one device's streams:
    ``CUDA_DEVICE_MAX_CONNECTIONS`` (1..32), else the driver's default of 8."""
    return _config.SETTINGS.device_max_connections


def _join_queues(device_id: int, stream: CudaStream) -> _HardwareQueues:
    """Count ``stream`` among the live streams of its device. Once there are more
    than hardware queues, some streams share a queue, and no stream of the device
    places eager markers any more (``_PolledStream._need``)."""
    with _queues_lock:
        q = _device_queues.get(device_id)
        if q is None:
            q = _device_queues[device_id] = _HardwareQueues(_queue_limit())
            q.streams = weakref.WeakSet()
        q.streams.add(stream)
        if q.solo and len(q.streams) > q.limit:
            q.solo = False
            for s in list(q.streams):
                s._eager = False
    return q


def _leave_queues(q: _HardwareQueues, stream: CudaStream) -> None:
    with _queues_lock:
        q.streams.discard(stream)
        q.solo = len(q.streams) <= q.limit


class _SpareFields:
    """Where the C extension is not built, the kept buffers of ``_SpareBuffers``
    (``asyncgpu._native.SpareCore`` otherwise: the same methods, which the GIL
    makes atomic there, and which the context's ``enqueue_create_buffer`` and a
    dropped device buffer call without Python)."""

    __slots__ = ("bufs", "closed", "lock", "per_size", "room")

    def __init__(self, room: int, per_size: int) -> None:
        self.bufs: dict[int, list[Any]] = {}
        self.room = room
        self.per_size = per_size
        self.closed = False
        # Reentrant: a buffer's finalizer may run (garbage collection) while this
        # thread is inside take() or keep().
        self.lock = threading.RLock()

    def take(self, nbytes: int) -> Any:
        with self.lock:
            bufs = self.bufs.get(nbytes)
            if not bufs:
                return None
            alloc = bufs.pop()
            if not bufs:
                del self.bufs[nbytes]
            self.room += nbytes
            return alloc

    def keep(self, alloc: Any, nbytes: int) -> bool:
        with self.lock:
            if self.closed or nbytes <= 0 or nbytes > self.room:
                return False
            bufs = self.bufs.get(nbytes)
            if bufs is None:
                if len(self.bufs) >= _SPARE_SIZES:
                    return False
                bufs = self.bufs[nbytes] = []
            if len(bufs) >= self.per_size:
                return False
            bufs.append(alloc)
            self.room -= nbytes
            return True

    def _take_all(self, close: bool) -> list[Any]:
        with self.lock:
            self.closed = self.closed or close
            allocs = [a for group in self.bufs.values() for a in group]
            self.room += sum(len(group) * n for n, group in self.bufs.items())
            self.bufs.clear()
            return allocs


if TYPE_CHECKING:
    _SpareBase = _SpareFields
else:
    _SpareBase = _accel.c_base("SpareCore", _SpareFields)


class _SpareBuffers(_SpareBase):
    """Device allocations of a stream, released and kept for the stream's next
    allocation of the same size, so that a buffer created and dropped again and
    again costs no driver call and no new allocation object: at most ``per_size``
    of one size, ``_SPARE_SIZES`` sizes and ``room`` bytes in all
    (``_SpareBuffers(room, per_size)``; a stream keeps ``_SPARE_BYTES`` and
    ``_SPARE_PER_SIZE``). ``bufs`` is what is kept, ``{nbytes: [allocation, ...]}``.

    Safe for the same reason the driver's stream-ordered pool is: an allocation
    comes here only once the device has finished every operation that used it
    (each operation keeps its buffers alive until then), and it is handed out
    again only on the stream that owned it, after everything already submitted
    there. Kept allocations are freed (``cuMemFreeAsync``) when the stream
    closes, at exit, and when an allocation of the device fails for lack of
    memory."""

    __slots__ = ()

    def kept(self) -> bool:
        """Whether any allocation is kept."""
        return bool(self.bufs)

    def free(self, cs: Any, close: bool) -> None:
        """Free every kept allocation on ``cs`` (the owning stream, still alive);
        with ``close``, keep none from now on."""
        for alloc in self._take_all(close):
            with contextlib.suppress(Exception):
                alloc.free_on(cs)


def _free_spare(spare: _SpareBuffers, backend: CudaBackend, cs: Any) -> None:
    with contextlib.suppress(Exception):
        backend.make_current()
    spare.free(cs, True)


class _DeviceAlloc:
    """Device memory from the device's pool (``cuMemAllocFromPoolAsync``), freed in
    stream order on the owning stream (``cuMemFreeAsync``), or kept by that stream
    for its next allocation of the same size (``_SpareBuffers``)."""

    __slots__ = ("backend", "buf", "host", "nbytes", "ptr")

    def __init__(
        self, backend: CudaBackend, buf: Any, host: np.ndarray | None, nbytes: int = 0
    ) -> None:
        self.backend = backend
        self.buf = buf
        self.ptr = int(buf.handle) if buf is not None else 0
        self.host = host
        self.nbytes = nbytes

    def release(self, stream: _StreamImpl) -> None:
        buf = self.buf
        if buf is not None:
            spare = getattr(stream, "spare", None)
            if spare is not None and spare.keep(self, self.nbytes):
                return
            self.buf = None
            try:
                self.backend.make_current()
                if getattr(stream, "is_closed", True):
                    buf.close(self.backend._core_device.default_stream)
                else:
                    buf.close(stream.cs)  # type: ignore[attr-defined]
            except BaseException:
                # Not freed: left to itself, cuda.core would free it on the stream
                # it was allocated on, which may be gone.
                self.buf = buf
                self.abandon()
                raise

    def free_on(self, cs: Any) -> None:
        """Free the memory on the stream ``cs`` (a kept allocation, at its stream's
        close or when memory runs short)."""
        buf, self.buf = self.buf, None
        if buf is not None:
            buf.close(cs)

    def detach(self) -> None:
        """``take_ptr``: the memory is the caller's from now on, so cuda.core must
        never free it (``abandon``)."""
        self.abandon()

    def abandon(
        self, _incref: Any = ctypes.pythonapi.Py_IncRef, _obj: Any = ctypes.py_object
    ) -> None:
        """Never free this memory. cuda.core has no way to give a buffer up, so its
        Buffer gets a reference that is never dropped, which also keeps it out of
        the interpreter's teardown: freed there, it is freed on the stream it was
        allocated on, and ``cuMemFreeAsync`` on a destroyed stream can crash the
        process. The ctypes functions are
        bound as defaults so that this works while the module is torn down."""
        buf, self.buf = self.buf, None
        if buf is not None:
            _incref(_obj(buf))

    def set_owner(self, stream: _StreamImpl) -> None:
        cs = getattr(stream, "cs", None)
        if self.buf is not None and cs is not None:
            self.buf.set_deallocation_stream(cs)


class _KernelFields:
    """The field of a ``_CudaFunction`` that every launch reads: the argument plan
    of its last launch (in ``asyncgpu._native.KernelCore`` where the extension is
    built, which the C launch reads directly)."""

    __slots__ = ("last",)


if TYPE_CHECKING:
    _KernelBase = _KernelFields
else:
    _KernelBase = _accel.c_base("KernelCore", _KernelFields)


class _CudaFunction(_KernelBase):
    """The loaded kernel and what is cached for launching it."""

    __slots__ = (
        "fn",
        "handle",
        "kernel",
        "library",
        "name",
        "param_sizes",
        "plans",
        "raw",
        "shmem_optin",
    )

    def __init__(self, objcode: Any, name: str, ptx: str | None = None) -> None:
        self.library = objcode
        self.kernel = objcode.get_kernel(name)
        self.name = name
        self.raw = cu.CUkernel(int(self.kernel.handle))
        self.fn = cu.CUfunction(int(self.kernel.handle))  # what cuLaunchKernel takes
        self.handle = int(self.kernel.handle)
        # The signature comes from the PTX, not from the driver: asking the driver
        # (cuda.core's Kernel.arguments_info) can block while a stream of the
        # context is held back for host work.
        self.param_sizes: tuple[int, ...] | None = _ptx_param_sizes(ptx, name) if ptx else None
        self.plans: dict[tuple[type, ...], _ArgPlan] = {}
        self.last: _ArgPlan | None = None  # the plan of the last launch (the fast path's)
        self.shmem_optin = _SHMEM_DEFAULT_LIMIT


_PTX_TYPE = re.compile(r"\.(?:b|s|u|f)(8|16|32|64)\b")


def _ptx_param_sizes(ptx: str, name: str) -> tuple[int, ...] | None:
    """Byte sizes of the parameters of ``.entry name`` in PTX text (None if the
    entry or a parameter's type cannot be read)."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(([^)]*)\)", ptx)
    if m is None:
        return () if re.search(r"\.entry\s+" + re.escape(name) + r"\b", ptx) else None
    sizes = []
    for decl in m.group(1).split(","):
        decl = decl.strip()
        if not decl:
            continue
        t = _PTX_TYPE.search(decl)
        if t is None:
            return None
        count = re.search(r"\[(\d+)\]", decl)
        sizes.append(int(t.group(1)) // 8 * (int(count.group(1)) if count else 1))
    return tuple(sizes)


class _LaunchCfg:
    """A validated launch geometry: cuda.core's LaunchConfig, and for plain
    launches (no cluster, cooperation or priority) the seven numbers
    ``cuLaunchKernel`` takes."""

    __slots__ = ("cc", "coop", "dims", "priority")

    def __init__(
        self, cc: Any, coop: bool, priority: int | None, dims: tuple[int, ...] | None = None
    ) -> None:
        self.cc = cc
        self.coop = coop
        self.priority = priority
        self.dims = dims


class CudaStream(_PolledStream):
    """A CUDA stream with a completion counter and a host-work counter."""

    def __init__(
        self,
        state: _ContextState,
        index: int,
        priority: int,
        backend: CudaBackend,
        external: int | None = None,
        external_owner: Any = None,
    ) -> None:
        super().__init__(state, index, priority)
        from cuda.core import Stream

        self.backend = backend
        backend.make_current()
        if external is None:
            flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
            raw = _check(cu.cuStreamCreateWithPriority(flags, priority), "cuStreamCreate")
            self.owned = True
        else:
            raw = cu.CUstream(external)
            self.owned = False
            self.priority = int(_check(cu.cuStreamGetPriority(raw), "cuStreamGetPriority"))
        self.raw = raw
        self.h = int(raw)
        self._queues = _join_queues(state.device_id, self)
        self.cs = Stream.from_handle(self.h)
        self.caddr = _slab.take()
        self.saddr = _slab.take()
        self._counter = ctypes.c_uint64.from_address(self.caddr)
        self._counter_in_c = True  # the C fast path may read the counter at caddr
        # The marker right after an eager launch: the counter write, or a driver
        # event recorded in C with ASYNCGPU_KERNEL_MARKERS=event (_kernel_markers).
        self._kernel_event_markers = _kernel_markers() == "event"
        self._hostsig = ctypes.c_uint64.from_address(self.saddr)
        self._marker_lock = _accel.hot_lock()
        self._free_events: list[Any] = []
        self._done_seq = 0  # the last marker event seen finished
        # Counter completion: the markers placed right after a copy or memset are
        # driver events all the same, (seq, CUevent) in order (see the module doc).
        self._copy_marks: deque[tuple[int, Any]] = deque()
        self._after_copy = False  # the last operation submitted was a copy or memset
        self._counter_mark = 0  # the last sequence number a counter marker covers
        if backend.completion == "event":
            self._events: deque[tuple[int, Any]] | None = deque()
            self._completed_slow = self._completed_events
        else:
            self._events = None
            self._completed_slow = self._completed_counter
        # In C where the extension is built (the counter read there), else the above.
        self._completed = getattr(self, "_completed_fast", self._completed_slow)  # type: ignore[method-assign]
        self._host_ops = 0
        # Per plan, the memory its launches pack into. An entry is made once and
        # never replaced: the extension's launch keeps the last one it found.
        self._param_mem: dict[_ArgPlan, _ParamMemory] = {}
        if _native is not None:
            self._write_marker: Callable[[int], Any] = partial(_native.write64, self.h, self.caddr)
        else:
            self._write_marker = partial(_write_bindings, raw, self.caddr)
        self.external_owner = external_owner
        self.is_closed = False
        self.label = f"cuda:{state.device_id}/s{index}"
        self.spare = _SpareBuffers(_SPARE_BYTES, _SPARE_PER_SIZE)
        # Kept buffers are freed on this stream while it lives: at close, or at
        # interpreter exit (before cuda.core's teardown) if it is never closed.
        self._free_spare = weakref.finalize(self, _free_spare, self.spare, backend, self.cs)

    def handle(self) -> int:
        return self.h

    def point(self) -> DeviceEvent | None:
        if self.owned:
            return self.tail()
        # A wrapped stream: its owner's work is invisible to tail(), so an empty
        # operation of ours now stands for it too.
        return _interop._fence(self)

    # -- the hot path ------------------------------------------------------------------

    def _mark(self, keep: Any) -> DeviceEvent:
        """The event of the operation just submitted (call with ``_submit_lock``
        held, after ``_before_submit`` and the driver call)."""
        seq = self._seq = self._seq + 1
        ev = DeviceEvent(self, seq, keep)
        self._inflight.append(ev)
        if self._eager:
            self._place_marker()
        return ev

    # -- markers: a counter the GPU writes, or driver events -----------------------------

    def _place_marker(self, counter: bool = False) -> None:
        """A marker for everything submitted so far: the counter, or a driver event
        after a copy or memset (``counter`` forces the counter, which other
        streams can wait on with ``cuStreamWaitValue64``)."""
        seq = self._seq
        event = self._events is not None or (self._after_copy and not counter)
        if not event:
            self._counter_mark = seq
        if self._pending is not None:
            self._pending.append((0, partial(self._issue_marker, seq, event)))
        elif not event:
            err = self._write_marker(seq)
            if err:
                raise _error(err, "cuStreamWriteValue64")
            self._issued_mark = seq
        else:
            self._issue_marker(seq, True)
        self._marked = seq

    def _issue_marker(self, seq: int, event: bool) -> None:
        if not event:
            err = self._write_marker(seq)
            if err:
                raise _error(err, "cuStreamWriteValue64")
        else:
            marks = self._events if self._events is not None else self._copy_marks
            with self._marker_lock:
                free = self._free_events
                e = free.pop() if free else self._new_marker_event()
                err = cu.cuEventRecord(e, self.raw)[0]
                if err != _SUCCESS:
                    free.append(e)
                    raise _error(err, "cuEventRecord")
                marks.append((seq, e))
        self._issued_mark = seq

    def _new_marker_event(self) -> Any:
        """A new driver event for a marker. Any thread may place a marker (the
        watcher does for idle streams), and creating an event needs the context
        current."""
        self.backend.make_current()
        flags = cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return _check(cu.cuEventCreate(flags), "cuEventCreate")

    def _driver_error(self, err: int, what: str) -> None:
        """Raise the error of a driver call the C fast path made."""
        raise _error(err, what)

    def _drain_prepare(self) -> None:
        self.backend.make_current()

    def _completed_counter(self) -> int:
        c = self._counter.value
        if self._copy_marks:
            self._query_copy_marks(c)
        d = self._done_seq
        return d if d > c else c

    def _query_copy_marks(self, counter: int) -> None:
        """Retire the copy markers that finished (in order), or that the counter
        has passed, into ``_done_seq``; their events are reused."""
        ms = self._copy_marks
        with self._marker_lock:
            while ms and (ms[0][0] <= counter or cu.cuEventQuery(ms[0][1])[0] == _SUCCESS):
                seq, e = ms.popleft()
                if seq > self._done_seq:
                    self._done_seq = seq
                self._free_events.append(e)

    def _completed_events(self) -> int:
        ms = self._events
        if ms:
            with self._marker_lock:
                if ms:
                    seq, e = ms[-1]
                    if cu.cuEventQuery(e)[0] == _SUCCESS:
                        self._done_seq = seq
                        self._free_events.extend(x[1] for x in ms)
                        ms.clear()
                    else:
                        while ms and cu.cuEventQuery(ms[0][1])[0] == _SUCCESS:
                            seq, e = ms.popleft()
                            self._done_seq = seq
                            self._free_events.append(e)
        return self._done_seq

    def _device_wait_for(self, waiter: Any, seq: int) -> None:
        """Make the stream ``waiter`` wait, on the device, until this stream has
        finished ``seq`` (a marker covering it has been issued): on the counter when
        a counter marker comes first at or after ``seq``, else on the marker event
        (``cuStreamWaitEvent``), under ``_marker_lock`` so that a finished event is
        not recorded again before the wait is placed. Never blocks the host."""
        with self._marker_lock:
            for s, e in self._events if self._events is not None else self._copy_marks:
                if s >= seq:
                    if self._events is None and seq <= self._counter_mark < s:
                        break  # a counter marker comes first
                    _check(cu.cuStreamWaitEvent(waiter, e, 0), "cuStreamWaitEvent")
                    return
            else:
                # No marker event at or after ``seq`` is left: either its event
                # finished and was taken back (nothing to wait for; the next counter
                # marker may still be held back behind host work, so never wait on
                # the counter then), or a counter marker covers ``seq``.
                if self._events is not None or self._done_seq >= seq or self._counter.value >= seq:
                    return
        _check(cu.cuStreamWaitValue64(waiter, self.caddr, seq, _GEQ), "cuStreamWaitValue64")

    def _prune(self) -> None:
        """Retire what has finished (releasing what it kept alive) and have the
        watcher sweep this stream later."""
        inflight = self._inflight
        # Counters cost a memory read; driver events a query, so check those rarely.
        if (
            inflight
            and (self._events is None or len(inflight) >= 64)
            and inflight[0]._seq <= self._completed()
        ):
            self._retire()
        if not self._touched:
            self._touched = True
            watcher.sweep_later(self)

    def launch(
        self,
        fn: DeviceFunction,
        args: tuple[Any, ...],
        cfg: Any,
        constant_memory: Sequence[ConstantMemoryMapping],
    ) -> DeviceEvent:
        """Launch ``fn``: through ``_launch`` here, where the C extension is not
        built. With it, this is ``StreamCore._launch_c``: the function's last plan
        checked, packed and launched in one C call (under the submit lock, the
        marker rules of ``_before_submit``, ``cuLaunchKernel`` with the counter
        marker when the stream is eager, the event, then ``_prune``), and
        ``_launch`` for every launch it cannot take."""
        return self._launch(fn, fn._impl, args, cfg, constant_memory)

    if not TYPE_CHECKING and _accel.native is not None:
        launch = _accel.native.StreamCore._launch_c  # (the docstring above)

    def _launch_failed(self, err: int, seq: int, args: tuple[Any, ...]) -> None:
        if err < _accel.native.MARKER_FAILED:
            raise _error(err, "cuLaunchKernel")
        self._seq = seq  # the kernel went in; its marker did not
        self._after_copy = False
        self._inflight.append(DeviceEvent(self, seq, args))
        raise _error(err - _accel.native.MARKER_FAILED, "cuStreamWriteValue64")

    def _launch(
        self,
        fn: DeviceFunction,
        impl: _CudaFunction | None,
        args: tuple[Any, ...],
        cfg: Any,
        constant_memory: Sequence[ConstantMemoryMapping],
    ) -> DeviceEvent:
        """Every launch the fast path does not take."""
        if impl is None:
            raise UnsupportedError(f"{fn!r} was released")
        kargs, plan = _kernel_args(impl, args, self.state)
        if constant_memory:
            self.backend.write_constants(impl, constant_memory, self)
        if plan.foreign and self._pending is not None:
            self._settle()  # the other library's stream will wait for this launch
        with self._submit_lock:
            self._before_submit()
            # Arrays of other libraries (CuPy, PyTorch): order the launch after
            # their producer stream, and that stream after the launch.
            waits = _interop.launch_streams(self, args) if plan.foreign else ()
            if self._pending is not None:
                self._pending.append((self._seq + 1, partial(self._launch_now, impl, cfg, kargs)))
            elif cfg.dims is not None and plan.packer is not None:
                # The fast path: the arguments packed into this stream's parameter
                # memory for the plan (the driver copies them at the call).
                mem = self._param_mem.get(plan)
                if mem is None:
                    mem = self._param_mem[plan] = _ParamMemory(plan.packer.size)
                plan.packer.pack_into(mem.data, 0, *kargs)
                err = _cuLaunchKernel(impl.fn, *cfg.dims, self.raw, mem.pointers, 0)[0]
                if err != _SUCCESS:
                    raise _error(err, "cuLaunchKernel")
            else:
                self._launch_now(impl, cfg, kargs)
            self._after_copy = False
            ev = self._mark(args)
            if waits:
                _interop.launch_done(self, waits)
        self._prune()
        return ev

    def _launch_now(self, impl: _CudaFunction, cfg: _LaunchCfg, kargs: Sequence[Any]) -> None:
        """A launch through cuda.core (or ``cuLaunchKernelEx`` for a priority)."""
        if cfg.priority is None:
            _launch(self.cs, cfg.cc, impl.kernel, *kargs)
        else:
            self.backend.launch_raw(self, impl, cfg, kargs)

    def copy(self, dst: Any, src: Any, nbytes: int, keep: Any) -> DeviceEvent:
        if nbytes and (dst._kind == "pageable" or src._kind == "pageable"):
            return self._staged_copy(dst, src, nbytes, keep)
        with self._submit_lock:
            self._before_submit()
            if nbytes:
                self._issue(self._seq + 1, _memcpy, dst._ptr, src._ptr, nbytes, self.raw)
                self._after_copy = True
            ev = self._mark(keep)
        self._prune()
        return ev

    def memset(self, dst: Any, value: np.generic, count: int, keep: Any) -> DeviceEvent:
        self._prune()
        if isinstance(dst, HostBuffer):
            assert dst._hostbytes is not None
            view = dst._hostbytes.view(value.dtype)

            def fill(finish: Callable[[Any, BaseException | None], None]) -> None:
                view[...] = value
                finish(None, None)

            return self._host_op(_in_pool(fill), keep)
        size = value.dtype.itemsize
        bits = int(value.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]))
        with self._submit_lock:
            self._before_submit()
            if count:
                self._issue(self._seq + 1, _memset, dst._ptr, size, bits, count, self.raw)
                self._after_copy = True
            return self._mark(keep)

    def wait_event(self, ev: DeviceEvent) -> DeviceEvent:
        other = ev._stream
        if ev._done or other is self or ev.query():
            with self._submit_lock:
                self._before_submit()
                return self._mark(None)
        if isinstance(other, CudaStream):
            other._need(ev)
            seq = ev._seq
            gate: _Gate | None = None
            if other._pending is not None and other._issued_mark < seq:
                if not self.owned:
                    # A wrapped stream: its owner's work must wait too, so the wait
                    # is on the device, once ``other``'s held work (the CPU work)
                    # has reached the driver: this blocks until then.
                    other.order_handle_after(self.h)
                    with self._submit_lock:
                        self._before_submit()
                        return self._mark(ev)
                # ``other`` holds ``ev`` back behind host work: hold this stream too,
                # until ``other`` hands the driver a marker covering ``ev``.
                gate = _Gate()
                if not other._when_issued(seq, partial(self._open, gate)):
                    gate = None
            with self._submit_lock:
                self._before_submit()
                if gate is not None and not gate.open:
                    self._hold(gate)
                self._issue(self._seq + 1, self._wait_now, other, seq)
                return self._mark(ev)

        # An event of a push-completed stream (the CPU device): host work that ends
        # when the event does.
        def when_done(finish: Callable[[Any, BaseException | None], None]) -> None:
            ev.add_done_callback(lambda _e: finish(None, None))

        return self._host_op(when_done, ev, after_prev=False)

    def _wait_now(self, other: CudaStream, seq: int) -> None:
        """This stream waits, on the device, until ``other`` has finished ``seq``."""
        other._device_wait_for(self.raw, seq)

    # -- ordering with streams of other libraries (``_core.foreign``) ---------------------------

    def wait_for_handle(self, producer: int) -> None:
        """Later work here waits, on the device, for what the foreign stream
        ``producer`` has been given so far (an event recorded on it now)."""
        with self._submit_lock:
            if self._pending is None:
                super().wait_for_handle(producer)
                return
            self.backend.make_current()
            e = _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            try:
                _check(cu.cuEventRecord(e, cu.CUstream(producer)), "cuEventRecord")
            except BaseException:
                cu.cuEventDestroy(e)
                raise
            self._pending.append((0, partial(_wait_event_once, self.raw, e)))

    def order_handle_after(self, waiter: int, settle: bool = True) -> None:
        """The foreign stream ``waiter`` waits, on the device, for everything
        enqueued here so far. If this stream holds work behind CPU work, this first
        blocks until that work has reached the driver (``settle``): a device-side
        wait for it would be a stream waiting on memory that only finishing host
        work lets the GPU write, and the driver can then block other calls (a
        synchronous copy of the other library's) until it ends, which can deadlock.
        Called with this stream's submit lock held
        (``settle=False``), a stream still held falls back to that counter wait."""
        if settle:
            self._settle()
        with self._submit_lock:
            if self._pending is None:
                super().order_handle_after(waiter)
                return
            seq = self._seq
            if self._events is not None:
                self._pending.append((0, partial(_write_counter, self.raw, self.caddr, seq)))
            elif self._counter_mark < seq:
                self._place_marker(counter=True)  # a counter the foreign stream can wait on
            _check(
                cu.cuStreamWaitValue64(cu.CUstream(waiter), self.caddr, seq, _GEQ),
                "cuStreamWaitValue64",
            )

    # -- host work on the stream -------------------------------------------------------------

    def _host_op(
        self,
        start: Callable[[Callable[[Any, BaseException | None], None]], None],
        keep: Any,
        after_prev: bool = True,
        seq_to: list[int] | None = None,
    ) -> DeviceEvent:
        """Enqueue host work: ``start(finish)`` is called once the stream has reached
        this point (at once with ``after_prev=False``) and must call ``finish(value,
        error)`` when done; later work on the stream waits until then (held on the
        host; on the device for a wrapped stream). ``seq_to[0]`` gets the
        operation's sequence number before ``start`` can run."""
        gate: _Gate | None = None
        k = 0
        with self._submit_lock:
            self._before_submit()
            prev = self.tail() if after_prev else None
            if prev is not None and prev._seq > self._marked:
                # The host work starts when ``prev`` is seen to finish, so ``prev``
                # needs a marker *before* the hold: one placed later would wait
                # for that very work (a deadlock).
                self._place_marker()
            if self.owned:
                gate = self._hold()
            else:
                k = self._host_ops = self._host_ops + 1
                _check(cu.cuStreamWaitValue64(self.raw, self.saddr, k, _GEQ), "cuStreamWaitValue64")
            ev = self._mark(keep)
            if seq_to is not None:
                seq_to[0] = ev._seq
            # The result waits here until the event is retired in order: a fault
            # may fail the event first, and must not be overwritten by it.
            ev._value = result = _HostResult()

        def finish(value: Any, error: BaseException | None) -> None:
            after = result.end(value, error)
            if gate is not None:
                self._open(gate)
            else:
                self._hostsig.value = k
            if after is not None:
                after()  # the host work right behind this one

        def begin(_e: DeviceEvent | None = None) -> None:
            try:
                start(finish)
            except BaseException as e:  # pragma: no cover - start itself broke
                finish(None, e)

        before = prev._value if prev is not None else None
        if prev is None:
            begin()
        elif type(before) is _HostResult:
            # Host work right before this (nothing between them on the stream):
            # start when it ends, as the host sees it.
            if not before.follow(begin):
                begin()
        elif prev.query():
            begin()
        else:
            prev.add_done_callback(begin)
        return ev

    def cpu_call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> DeviceEvent:
        op = [0]  # (this operation's sequence number, for host_work)

        def start(finish: Callable[[Any, BaseException | None], None]) -> None:
            def run() -> None:
                host_work.stream, host_work.seq = self, op[0]
                value, error = None, None
                try:
                    value = fn(*args, **kwargs)
                except BaseException as e:
                    error = e
                host_work.stream = None
                finish(value, error)

            cpu_pool().submit(run)

        self._prune()
        return self._host_op(start, (fn, args, kwargs), seq_to=op)

    def cpu_range(self, fn: Callable[[int], Any], count: int) -> DeviceEvent:
        op = [0]  # (this operation's sequence number, for host_work)

        def start(finish: Callable[[Any, BaseException | None], None]) -> None:
            fan_out(self, op[0], count, range_work(fn), finish)

        self._prune()
        return self._host_op(start, fn, seq_to=op)

    def _staged_copy(self, dst: Any, src: Any, nbytes: int, keep: Any) -> DeviceEvent:
        """A copy to or from pageable host memory: a pool thread moves it through
        pinned staging buffers, overlapping its memcpy with the DMA of the chunk
        before, so the event loop never blocks in the driver."""
        backend = self.backend
        to_device = src._kind == "pageable"

        backend._stage_kits.reserve()  # (here, on the enqueuing thread: see _StageKits)
        # A wrapped stream waits on the device for this very copy, so its pinned
        # chunks are taken here too (a page-locked allocation on the pool thread
        # could wait for that wait). An owned stream holds its work on the host
        # instead, and its copy takes them when it runs, as few as run at once.
        chunks = None if self.owned else backend.stage_chunks(nbytes)

        def work() -> None:
            backend.make_current()
            backend.staged_copy(dst, src, nbytes, to_device, chunks)

        try:
            return self._host_op(_in_pool_value(work), keep)
        except BaseException:
            for block in chunks or ():
                _pinned.give(block)
            raise

    # -- user events, sync, faults -----------------------------------------------------------

    def record(self, ev: _UserEvent) -> None:
        with self._submit_lock:
            if ev._handle is not None:
                self._issue(0, _record, ev._handle, self.raw)
            if not self.owned:
                # Another library submits to this stream too: an operation of ours
                # now stands for its work so far as well.
                self._before_submit()
                self._mark(None)
            seq = self._seq
            point: DeviceEvent | None = None
            if seq and self._completed() < seq:
                if self._marked < seq:
                    self._place_marker()
                # The in-flight queue gets a point of the stream's own, which
                # finishes the user event only while it is still recorded here. (Not
                # the user event itself: recorded again, on another stream or later
                # on this one, it would carry its new sequence number into this
                # queue, and the queue's retirement would stop there: later awaits
                # on this stream could hang.)
                point = DeviceEvent(self, seq, None)
                point._add_waiter(_RecordReached(ev, self, seq))
            ev._repoint(self, seq, point)
            if point is not None:
                self._inflight.append(point)
        if point is None:
            ev._finish_at(self, seq, None)
        elif ev._waiters:
            # Callback waits (the watcher's) made for an earlier record follow
            # the event here.
            watcher.watch(self, seq)

    device_clock = True

    def trace_stamp(self) -> Any:
        """A timing event recorded here (``cuEventRecord``, in stream order, held
        or not): where the device was when the operation just enqueued ended.
        Read back with ``CudaBackend.stamp_ns``; never blocks."""
        backend = self.backend
        free = backend._free_stamps
        e = free.pop() if free else backend.new_stamp()
        with self._submit_lock:  # (record_raw and _issue inlined: a traced op's hot path)
            if self._pending is None:
                err = cu.cuEventRecord(e, self.raw)[0]
                if err != _SUCCESS:
                    free.append(e)
                    raise _error(err, "cuEventRecord")
            else:
                self._pending.append((0, partial(_record, e, self.raw)))
        return e

    def record_raw(self, e: Any) -> None:
        """``cuEventRecord`` of a driver event here, in stream order (held or not)."""
        with self._submit_lock:
            self._issue(0, _record, e, self.raw)

    def _block(self, ev: DeviceEvent) -> None:
        if ev._handle is not None and ev._stream is self:
            self._settle()  # the record may still be held
            err = cu.cuEventSynchronize(ev._handle)[0]
            if err != _SUCCESS:
                self._raise_fault(err, "cuEventSynchronize")
            self._retire()
            if not ev._done:
                super()._block(ev)
            return
        if self.owned and ev._seq == self._seq and self._pending is None:
            # The stream's last operation: block in the driver, which wakes as soon
            # as the stream drains (polling with back-off would notice late).
            self._need(ev, eager=False)
            err = cu.cuStreamSynchronize(self.raw)[0]
            if err != _SUCCESS:
                self._raise_fault(err, "cuStreamSynchronize")
            self._retire()
            if ev._done:
                return
        super()._block(ev)

    def synchronize(self) -> None:
        with waiting_for(self):
            self._settle()  # cuStreamSynchronize sees only what the driver was given
            tail = self.tail()
            if tail is not None:
                self._need(tail, eager=False)
            err = cu.cuStreamSynchronize(self.raw)[0]
            if err != _SUCCESS:
                self._raise_fault(err, "cuStreamSynchronize")
            # Host work may still be finishing its completion write: let it land.
            super().synchronize()

    def _raise_fault(self, err: Any, what: str) -> None:
        e = _error(err, what)
        if isinstance(e, DeviceFaultError) or err in _STICKY:
            self.state.fail_all(e)
        raise e

    def _query_fault(self) -> BaseException | None:
        err = cu.cuStreamQuery(self.raw)[0]
        if err in (_SUCCESS, _NOT_READY):
            return None
        e = _error(err, f"work on {self.label}")
        return (
            e
            if isinstance(e, DeviceFaultError)
            else DeviceFaultError(str(e), code=e.code, name=e.name)
        )

    def _elapsed_ms(self, start: DeviceEvent, end: DeviceEvent) -> float:
        if start._handle is None or end._handle is None or not (start._timing and end._timing):
            raise ValueError("elapsed_time needs events created with disable_timing=False")
        return float(
            _check(cu.cuEventElapsedTime(start._handle, end._handle), "cuEventElapsedTime")
        )

    def close(self) -> None:
        watcher.forget(self)
        self._free_spare()
        self.is_closed = True
        _leave_queues(self._queues, self)
        with self._marker_lock:
            marks = [*(self._events or ()), *self._copy_marks]
            for e in [*self._free_events, *(x[1] for x in marks)]:
                cu.cuEventDestroy(e)
            self._free_events.clear()
            self._copy_marks.clear()
        if self.owned:
            cu.cuStreamDestroy(self.raw)
        _slab.give_back(self.caddr)
        _slab.give_back(self.saddr)


# -- driver calls that a held stream runs later (``_PolledStream._drain``) -----------------


def _memcpy(dst: int, src: int, nbytes: int, stream: Any) -> None:
    err = cu.cuMemcpyAsync(dst, src, nbytes, stream)[0]
    if err != _SUCCESS:
        raise _error(err, "cuMemcpyAsync")


def _memcpy_htod(dst: int, src: int, nbytes: int, stream: Any) -> None:
    _check(cu.cuMemcpyHtoDAsync(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")


def _memset(ptr: int, size: int, bits: int, count: int, stream: Any) -> None:
    if size == 1:
        r = cu.cuMemsetD8Async(ptr, bits, count, stream)
    elif size == 2:
        r = cu.cuMemsetD16Async(ptr, bits, count, stream)
    elif size == 4:
        r = cu.cuMemsetD32Async(ptr, bits, count, stream)
    else:
        r = cu.cuMemsetD2D32Async(ptr, 8, bits & 0xFFFFFFFF, 1, count, stream)
        if r[0] == _SUCCESS:
            r = cu.cuMemsetD2D32Async(ptr + 4, 8, bits >> 32, 1, count, stream)
    _check(r, "cuMemsetAsync")


def _record(e: Any, stream: Any) -> None:
    _check(cu.cuEventRecord(e, stream), "cuEventRecord")


def _wait_event_once(stream: Any, e: Any) -> None:
    try:
        _check(cu.cuStreamWaitEvent(stream, e, 0), "cuStreamWaitEvent")
    finally:
        cu.cuEventDestroy(e)


def _write_counter(stream: Any, addr: int, value: int) -> None:
    _check(_write_value64(stream, addr, value, 0), "cuStreamWriteValue64")


def _write_bindings(stream: Any, addr: int, value: int) -> Any:
    """A completion marker through cuda.bindings (where ``_native`` is not built)."""
    return _write_value64(stream, addr, value, 0)[0]


def _in_pool(
    body: Callable[[Callable[[Any, BaseException | None], None]], None],
) -> Callable[[Callable[[Any, BaseException | None], None]], None]:
    def start(finish: Callable[[Any, BaseException | None], None]) -> None:
        def run() -> None:
            try:
                body(finish)
            except BaseException as e:
                finish(None, e)

        cpu_pool().submit(run)

    return start


def _in_pool_value(
    fn: Callable[[], Any],
) -> Callable[[Callable[[Any, BaseException | None], None]], None]:
    def body(finish: Callable[[Any, BaseException | None], None]) -> None:
        finish(fn(), None)

    return _in_pool(body)


class _ArgPlan:
    """How one tuple of argument types is passed to one kernel: the positions to
    convert (``_BUFFER``: a buffer's address; ``_CAI``: the address in a
    ``__cuda_array_interface__``), whether any is another library's array, and,
    when every parameter is a scalar or pointer of at most 8 bytes whose size the
    signature confirms, a ``struct`` packer that lays the arguments out 8 bytes
    apart for ``cuLaunchKernel``. ``types`` and ``codes`` are what ``_native``
    packs by (None where it cannot: another library's arrays, float16, bool)."""

    __slots__ = ("codes", "conv", "foreign", "packer", "types")

    def __init__(
        self,
        conv: tuple[tuple[int, int], ...],
        packer: struct.Struct | None,
        types: tuple[type, ...] = (),
        codes: bytes | None = None,
    ) -> None:
        self.conv = conv
        self.foreign = any(kind == _CAI for _, kind in conv)
        self.packer = packer
        self.types = types
        self.codes = codes if _native is not None and packer is not None else None


_BUFFER, _CAI = 0, 1
# struct codes of NumPy scalar kinds and sizes (little-endian, no padding: '<').
_PACK_CODES = {
    ("f", 2): "e", ("f", 4): "f", ("f", 8): "d", ("b", 1): "?",
    ("i", 1): "b", ("i", 2): "h", ("i", 4): "i", ("i", 8): "q",
    ("u", 1): "B", ("u", 2): "H", ("u", 4): "I", ("u", 8): "Q",
}  # fmt: skip


class _ParamMemory:
    """A stream's parameter memory for one plan: 8 bytes per argument and the
    array of pointers to them that ``cuLaunchKernel`` reads (used under the
    stream's submit lock; the driver copies the values during the call)."""

    __slots__ = ("_ptrs", "addr", "data", "pointers")

    def __init__(self, nbytes: int) -> None:
        n = max(nbytes // 8, 1)
        self.data = (ctypes.c_uint64 * n)()
        base = self.addr = ctypes.addressof(self.data)
        self._ptrs = (ctypes.c_uint64 * n)(*(base + 8 * i for i in range(n)))
        self.pointers = ctypes.addressof(self._ptrs) if nbytes else 0


_cuLaunchKernel = cu.cuLaunchKernel


def _kernel_args(
    impl: _CudaFunction, args: tuple[Any, ...], state: _ContextState
) -> tuple[Sequence[Any], _ArgPlan]:
    """The launch arguments: buffers become their addresses. What each position
    needs is worked out, and the kernel's signature checked, once per tuple of
    argument types (``_arg_plan``); a repeat costs a dictionary lookup."""
    key = tuple(map(type, args))
    plan = impl.plans.get(key)
    if plan is None:
        plan = impl.plans[key] = _arg_plan(impl, args)
    impl.last = plan
    if not plan.conv:
        return args, plan
    out = list(args)
    for i, kind in plan.conv:
        a = out[i]
        if kind == _BUFFER:
            if a._alloc is None or a._ctx._state.closed:
                a._check()
            out[i] = a._ptr
        else:
            out[i] = int(a.__cuda_array_interface__["data"][0])
    return out, plan


def _arg_plan(impl: _CudaFunction, args: tuple[Any, ...]) -> _ArgPlan:
    """Validate one tuple of argument types and plan how to pass it."""
    conv: list[tuple[int, int]] = []
    sizes: list[int] = []
    codes: list[str] | None = []
    native: bytes | None = b""
    for n, a in enumerate(args):
        t = type(a)
        if t is DeviceBuffer or t is HostBuffer:
            conv.append((n, _BUFFER))
            sizes.append(8)
            code: str | None = "Q"
            native_code: bytes | None = b"P"
        elif isinstance(a, np.generic):
            sizes.append(a.dtype.itemsize)
            code = _PACK_CODES.get((a.dtype.kind, a.dtype.itemsize))
            native_code = code.encode() if code is not None and code in "fdbhiqBHIQ" else None
        elif t in (int, float, bool, complex):
            reject_python_scalar(n, a)
        elif isinstance(a, np.ndarray):
            raise TypeError(
                f"kernel argument {n} is a NumPy array in pageable host memory; copy it "
                "into a DeviceBuffer or HostBuffer first"
            )
        elif getattr(a, "__cuda_array_interface__", None) is not None:
            conv.append((n, _CAI))
            sizes.append(8)
            code = "Q"
            native_code = None
        elif hasattr(a, "handle") and t.__module__.startswith("cuda.core"):
            sizes.append(8)
            code = native_code = None  # cuda.core's launch knows its own objects
        else:
            raise TypeError(f"kernel argument {n} of type {t.__name__} is not supported")
        native = None if native is None or native_code is None else native + native_code
        if codes is not None:
            if code is None:
                codes = None
            else:
                codes.append(code + (f"{8 - sizes[-1]}x" if sizes[-1] < 8 else ""))
    want = impl.param_sizes
    if want is not None:
        if len(args) != len(want):
            raise TypeError(f"kernel {impl.name} takes {len(want)} arguments, {len(args)} given")
        for n, (got, w) in enumerate(zip(sizes, want, strict=True)):
            if got != w:
                raise TypeError(
                    f"kernel {impl.name} argument {n} is {w} bytes, but "
                    f"{type(args[n]).__name__} is {got} bytes"
                )
    packer = struct.Struct("<" + "".join(codes)) if codes is not None and want is not None else None
    return _ArgPlan(tuple(conv), packer, tuple(map(type, args)), native)


class _RecordReached:
    """The waiter on a record's point in a stream's in-flight queue: finishes the
    user event there unless it has been recorded again since."""

    __slots__ = ("event", "seq", "stream")

    def __init__(self, event: _UserEvent, stream: _StreamImpl, seq: int) -> None:
        self.event = event
        self.stream = stream
        self.seq = seq

    def __call__(self, point: DeviceEvent) -> None:
        self.event._finish_at(self.stream, self.seq, point._error)


class _StageKits:
    """The streams and events of staged (pageable) copies, made on the threads
    that enqueue the copies and handed to the pool threads that run them.

    Never on the pool thread: while a stream waits on host memory (a wrapped
    stream's ``cuStreamWaitValue64`` behind host work) the driver may hold calls
    such as ``cuStreamCreate`` in other threads until that wait ends, which
    would then be never (a pool thread's ``cuStreamCreate`` hangs so, as
    ``test_external_cupy_stream[cuda]`` checks). At most ``limit`` kits
    are made (the CPU pool's size: no more copies run at once), so a burst of
    queued copies does not make a stream each. ``take`` finds one made for it,
    or, if another enqueuing thread is still making the last one, makes one
    itself."""

    def __init__(self, make: Callable[[], Any], limit: int) -> None:
        self._make = make
        self._limit = limit
        self._made = 0
        self._free: list[Any] = []
        self._lock = threading.Lock()

    def reserve(self) -> None:
        """On the enqueuing thread, before the copy is queued: make sure a kit will
        be there when the copy runs."""
        with self._lock:
            if self._made >= self._limit:
                return
            self._made += 1
        try:
            kit = self._make()
        except BaseException:
            with self._lock:
                self._made -= 1
            raise
        self._free.append(kit)

    def take(self) -> Any:
        try:
            return self._free.pop()
        except IndexError:  # (the race in the class docstring)
            with self._lock:
                self._made += 1
            return self._make()

    def give(self, kit: Any) -> None:
        self._free.append(kit)

    def drain(self) -> list[Any]:
        """Every kit not in use, for destruction (the context is closing)."""
        with self._lock:
            kits, self._free = self._free, []
            self._made -= len(kits)
        return kits


class CudaBackend:
    """One CUDA device, on its primary context."""

    api = "cuda"
    polled = True

    def __init__(self, device_id: int) -> None:
        count = _init_driver()
        if count == 0:
            raise NoDeviceError("the CUDA driver reports no devices")
        if not 0 <= device_id < count:
            raise IndexError(f"CUDA device {device_id} does not exist (there are {count})")
        self.device_id = device_id
        self.completion = _config.SETTINGS.completion
        self.dev = _check(cu.cuDeviceGet(device_id), "cuDeviceGet")
        self.ctx = _check(cu.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        self.make_current()
        _backends.add(self)
        self._attr_cache: dict[int, int] = {}
        self._free_stamps: list[Any] = []  # timing events tracing has read back
        self._clock_stream: Any = None  # where tracing maps the device's clock
        self._stage_kits = _StageKits(self._make_stage_kit, pool_size())
        self._streams: weakref.WeakSet[CudaStream] = weakref.WeakSet()
        self._info: GPUInfo | None = None
        cc = (
            self.attribute(DeviceAttribute.COMPUTE_CAPABILITY_MAJOR),
            self.attribute(DeviceAttribute.COMPUTE_CAPABILITY_MINOR),
        )
        self.cc = cc
        self.arch = f"sm_{cc[0]}{cc[1]}"
        if not self.attribute(DeviceAttribute.CAN_USE_64_BIT_STREAM_MEM_OPS):
            raise UnsupportedError(
                f"CUDA device {device_id} lacks 64-bit stream memory operations, which "
                "asyncgpu's completion engine needs"
            )
        from cuda.core import Device, DeviceMemoryResource

        self._core_device = Device(device_id)
        self._core_device.set_current()
        self.mr = DeviceMemoryResource(device_id)
        self._keep_pool_memory()
        if not _config.SETTINGS.disable_healthcheck:
            self.healthcheck()

    # -- context -------------------------------------------------------------------------

    def make_current(self) -> None:
        ctx = self.ctx
        if getattr(_tls, "ctx", None) is not ctx:
            _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
            _tls.ctx = ctx

    # -- other libraries' memory and streams ------------------------------------------

    def stream_waits_for_stream(self, waiter: int, producer: int) -> None:
        """``waiter`` waits on the device for all work submitted to ``producer`` so
        far: a CUDA event recorded on one (``cuEventRecord``) and waited for on the
        other (``cuStreamWaitEvent``). Neither call blocks the host."""
        self.make_current()
        e = _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        try:
            _check(cu.cuEventRecord(e, cu.CUstream(producer)), "cuEventRecord")
            _check(cu.cuStreamWaitEvent(cu.CUstream(waiter), e, 0), "cuStreamWaitEvent")
        finally:
            cu.cuEventDestroy(e)

    def is_pinned(self, ptr: int) -> bool:
        """True if a host address is page-locked memory CUDA knows (pinned or
        registered), by ``cuPointerGetAttribute``."""
        self.make_current()
        err, kind = cu.cuPointerGetAttribute(
            cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, cu.CUdeviceptr(ptr)
        )
        return bool(err == _SUCCESS and int(kind) == int(cu.CUmemorytype.CU_MEMORYTYPE_HOST))

    @staticmethod
    def pointer_device(ptr: int) -> int | None:
        """The device ordinal of a CUDA address (None when the driver cannot say),
        by ``cuPointerGetAttribute``."""
        err, dev = cu.cuPointerGetAttribute(
            cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, cu.CUdeviceptr(ptr)
        )
        return int(dev) if err == _SUCCESS else None

    @contextlib.contextmanager
    def push_context(self) -> Iterator[None]:
        _check(cu.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")
        prev = getattr(_tls, "ctx", None)
        _tls.ctx = self.ctx
        try:
            yield
        finally:
            _check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")
            _tls.ctx = prev

    def set_as_current(self) -> None:
        _check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        _tls.ctx = self.ctx

    def _keep_pool_memory(self) -> None:
        """Let the device pool keep freed memory (release threshold = max), so that
        allocations after the first come from the pool, not the driver."""
        pool = _check(cu.cuDeviceGetDefaultMemPool(self.dev), "cuDeviceGetDefaultMemPool")
        attr = cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
        _check(
            cu.cuMemPoolSetAttribute(pool, attr, cu.cuuint64_t(2**64 - 1)), "cuMemPoolSetAttribute"
        )

    # -- facts -------------------------------------------------------------------------------

    @staticmethod
    def number_of_devices() -> int:
        try:
            return _init_driver()
        except NoDeviceError:
            return 0

    def name(self) -> str:
        raw = _check(cu.cuDeviceGetName(256, self.dev), "cuDeviceGetName")
        return bytes(raw).split(b"\0", 1)[0].decode()

    def attribute(self, attr: DeviceAttribute | int) -> int:
        a = int(attr)
        v = self._attr_cache.get(a)
        if v is None:
            try:
                cattr = cu.CUdevice_attribute(a)
            except ValueError:
                raise UnsupportedError(f"unknown device attribute {attr!r}") from None
            v = int(_check(cu.cuDeviceGetAttribute(cattr, self.dev), "cuDeviceGetAttribute"))
            self._attr_cache[a] = v
        return v

    def info(self) -> GPUInfo:
        if self._info is None:
            A = DeviceAttribute
            at = self.attribute
            total = int(_check(cu.cuDeviceTotalMem(self.dev), "cuDeviceTotalMem"))
            self._info = GPUInfo(
                name=self.name(),
                api="cuda",
                vendor="NVIDIA",
                arch=self.arch,
                compute_capability=self.cc,
                sm_count=at(A.MULTIPROCESSOR_COUNT),
                warp_size=at(A.WARP_SIZE),
                threads_per_block=at(A.MAX_THREADS_PER_BLOCK),
                max_block_dim=(at(A.MAX_BLOCK_DIM_X), at(A.MAX_BLOCK_DIM_Y), at(A.MAX_BLOCK_DIM_Z)),
                max_grid_dim=(at(A.MAX_GRID_DIM_X), at(A.MAX_GRID_DIM_Y), at(A.MAX_GRID_DIM_Z)),
                shared_memory_per_block=at(A.MAX_SHARED_MEMORY_PER_BLOCK),
                shared_memory_per_block_optin=at(A.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
                total_memory=total,
                clock_rate_khz=at(A.CLOCK_RATE),
                memory_clock_rate_khz=at(A.MEMORY_CLOCK_RATE),
                l2_cache_size=at(A.L2_CACHE_SIZE),
                extra={
                    "pci_bus_id": self._pci_bus_id(),
                    "memory_bus_width": at(A.GLOBAL_MEMORY_BUS_WIDTH),
                    "max_threads_per_multiprocessor": at(A.MAX_THREADS_PER_MULTIPROCESSOR),
                    "driver_version": self.api_version(),
                },
            )
        return self._info

    def _pci_bus_id(self) -> str:
        raw = _check(cu.cuDeviceGetPCIBusId(32, self.dev), "cuDeviceGetPCIBusId")
        return bytes(raw).split(b"\0", 1)[0].decode() if not isinstance(raw, str) else raw

    def api_version(self) -> int:
        return int(_check(cu.cuDriverGetVersion(), "cuDriverGetVersion"))

    def memory_info(self) -> tuple[int, int]:
        free, total = _check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def max_single_alloc_size(self) -> int:
        return int(_check(cu.cuDeviceTotalMem(self.dev), "cuDeviceTotalMem"))

    def priority_range(self) -> StreamPriorityRange:
        self.make_current()
        least, greatest = _check(cu.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
        return StreamPriorityRange(int(least), int(greatest))

    def is_compatible(self) -> bool:
        return self.cc >= (7, 0) and bool(self.attribute(DeviceAttribute.UNIFIED_ADDRESSING))

    def can_access(self, other: Any) -> bool:
        if not isinstance(other, CudaBackend):
            return False
        if other.device_id == self.device_id:
            return True
        return bool(_check(cu.cuDeviceCanAccessPeer(self.dev, other.dev), "cuDeviceCanAccessPeer"))

    def enable_peer_access(self, other: Any) -> None:
        if not isinstance(other, CudaBackend):
            raise UnsupportedError("peer access is between CUDA devices")
        if other.device_id == self.device_id:
            return
        if not self.can_access(other):
            raise UnsupportedError(
                f"CUDA device {self.device_id} cannot access device {other.device_id}"
            )
        with self.push_context():
            err = cu.cuCtxEnablePeerAccess(other.ctx, 0)[0]
        if err not in (_SUCCESS, cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED):
            raise _error(err, "cuCtxEnablePeerAccess")
        _peer_enabled.add((self.device_id, other.device_id))

    @staticmethod
    def enable_all_peer_access() -> None:
        n = CudaBackend.number_of_devices()
        if n < 2:
            return
        backends = [_shared_backend(i) for i in range(n)]
        for a in backends:
            for b in backends:
                if a is not b and a.can_access(b):
                    a.enable_peer_access(b)

    @staticmethod
    def all_peer_access_enabled() -> bool:
        n = CudaBackend.number_of_devices()
        if n < 2:
            return False
        return all((i, j) in _peer_enabled for i in range(n) for j in range(n) if i != j)

    def supports_multicast(self) -> bool:
        return bool(self.attribute(DeviceAttribute.MULTICAST_SUPPORTED))

    def healthcheck(self) -> None:
        """Throttling and uncorrectable ECC errors through NVML (when nvidia-ml-py is
        installed), then a write/read pattern through device memory."""
        self._nvml_checks()
        self.make_current()
        n = 1 << 20
        pattern = (np.arange(n, dtype=np.uint32) * np.uint32(2654435761)) ^ np.uint32(0xA5A5A5A5)
        back = np.empty_like(pattern)
        dptr = int(_check(cu.cuMemAlloc(pattern.nbytes), "cuMemAlloc"))
        try:
            _check(cu.cuMemcpyHtoD(dptr, pattern.ctypes.data, pattern.nbytes), "cuMemcpyHtoD")
            _check(cu.cuMemcpyDtoH(back.ctypes.data, dptr, back.nbytes), "cuMemcpyDtoH")
            ok = np.array_equal(back, pattern)
            _check(cu.cuMemsetD32(dptr, 0x5A5A5A5A, n), "cuMemsetD32")
            _check(cu.cuMemcpyDtoH(back.ctypes.data, dptr, back.nbytes), "cuMemcpyDtoH")
            ok = ok and bool((back == 0x5A5A5A5A).all())
        finally:
            cu.cuMemFree(dptr)
        if not ok:
            raise HealthCheckError(
                f"CUDA device {self.device_id}: device memory did not hold a test pattern "
                "(stuck memory)",
                check="memory",
            )

    def _nvml_checks(self) -> None:
        try:
            import pynvml as nv
        except ImportError:
            return
        try:
            nv.nvmlInit()
        except Exception:
            return
        try:
            h = nv.nvmlDeviceGetHandleByPciBusId(self._pci_bus_id())
            try:
                reasons = nv.nvmlDeviceGetCurrentClocksEventReasons(h)
            except AttributeError:  # older nvidia-ml-py
                reasons = nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)
            bad = {
                "hardware slowdown": 0x8,
                "software thermal slowdown": 0x20,
                "hardware thermal slowdown": 0x40,
                "hardware power brake slowdown": 0x80,
            }
            found = [name for name, bit in bad.items() if reasons & bit]
            if found:
                raise HealthCheckError(
                    f"CUDA device {self.device_id} is throttled: {', '.join(found)}",
                    check="throttling",
                )
            try:
                ecc = nv.nvmlDeviceGetTotalEccErrors(
                    h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
                )
            except nv.NVMLError:
                ecc = 0  # ECC not supported or disabled
            if ecc:
                raise HealthCheckError(
                    f"CUDA device {self.device_id} has {ecc} uncorrectable ECC errors",
                    check="ecc",
                )
        except nv.NVMLError:
            return
        finally:
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()

    # -- streams and memory ---------------------------------------------------------------------

    def new_stream(self, state: _ContextState, index: int, priority: int) -> CudaStream:
        s = CudaStream(state, index, priority, self)
        self._streams.add(s)
        return s

    def _wait_for_host_work(self, what: str) -> None:
        """Loading a module waits, inside the driver, for streams that wait on the
        device for host work (with eager and lazy module loading alike). If that
        host work waits for this thread, the process
        deadlocks. Only wrapped streams still wait so (asyncgpu's own hold later
        work on the host); for them, wait here first, for at most
        ``ASYNCGPU_LOAD_WAIT_S`` (default 30 s), and raise a clear error instead of
        hanging."""
        limit = _config.SETTINGS.load_wait_s
        t0 = time.monotonic()
        delay = 0.0001
        while True:
            held = [
                s
                for s in list(_all_streams(self))
                if not s.owned and s._host_ops > s._hostsig.value
            ]
            if not held:
                return
            if time.monotonic() - t0 > limit:
                names = ", ".join(s.label for s in held)
                raise DeviceError(
                    f"{what}: streams {names} are held back for CPU work that has not "
                    f"finished after {limit:g} s; the CUDA driver cannot load code until it "
                    "does. Compile and load kernels before enqueuing CPU functions that wait "
                    "for this thread."
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def external_stream(self, state: _ContextState, handle: Any, index: int) -> CudaStream:
        s = self._external_stream(state, handle, index)
        self._streams.add(s)
        return s

    def _external_stream(self, state: _ContextState, handle: Any, index: int) -> CudaStream:
        if hasattr(handle, "__cuda_stream__"):
            h = int(handle.__cuda_stream__()[1])
        elif hasattr(handle, "cuda_stream"):
            h = int(handle.cuda_stream)
        elif hasattr(handle, "ptr") and not isinstance(handle, int):
            h = int(handle.ptr)
        else:
            h = int(handle)
        # The other library's stream object stays alive while we may use its handle
        # (buffers allocated on it are freed on it, possibly much later).
        owner = None if isinstance(handle, int) else handle
        return CudaStream(state, index, 0, self, external=h, external_owner=owner)

    def alloc_device(self, nbytes: int, stream: _StreamImpl) -> _DeviceAlloc:
        if nbytes == 0:
            return _DeviceAlloc(self, None, None)
        kept = stream.spare.take(nbytes)  # type: ignore[attr-defined]
        if kept is not None:
            return kept  # type: ignore[no-any-return]
        self.make_current()
        cs = stream.cs  # type: ignore[attr-defined]
        try:
            buf = self.mr.allocate(nbytes, stream=cs)
        except Exception as e:
            # Out of memory, perhaps: give back what every stream of the device
            # keeps, then try once more.
            if not self._free_spare_buffers():
                raise DeviceError(
                    f"allocating {nbytes} bytes on CUDA device {self.device_id}: {e}"
                ) from e
            try:
                buf = self.mr.allocate(nbytes, stream=cs)
            except Exception as e2:
                raise DeviceError(
                    f"allocating {nbytes} bytes on CUDA device {self.device_id}: {e2}"
                ) from e2
        return _DeviceAlloc(self, buf, None, nbytes)

    def _free_spare_buffers(self) -> bool:
        """Free the buffers every live stream of the device keeps; True if there
        were any."""
        freed = False
        for s in _all_streams(self):
            if s.spare.kept():
                freed = True
                s.spare.free(s.cs, False)
        return freed

    def alloc_host(self, nbytes: int, stream: _StreamImpl) -> _PinnedAlloc:
        """Page-locked host memory from ``_pinned``, usable by the host at once. (Not
        a stream-ordered pinned pool: cuMemcpyAsync treats its memory as pageable
        and copies it at enqueue time.)"""
        self.make_current()
        return _PinnedAlloc(nbytes)

    def pointer_host_view(self, ptr: int, nbytes: int) -> np.ndarray | None:
        return None

    def _make_stage_kit(self) -> tuple[Any, list[Any]]:
        """A stream and ``_STAGE_SLOTS`` events for one staged copy
        (``cuStreamCreate``, ``cuEventCreate``)."""
        self.make_current()
        stream = _check(
            cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate"
        )
        events = [
            _check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
            for _ in range(_STAGE_SLOTS)
        ]
        return stream, events

    def _destroy_stage_kit(self, kit: tuple[Any, list[Any]]) -> None:
        stream, events = kit
        for e in events:
            cu.cuEventDestroy(e)
        cu.cuStreamDestroy(stream)

    def stage_chunks(self, nbytes: int) -> list[Any]:
        """The pinned chunks a staged copy of ``nbytes`` moves its data through."""
        chunk = min(_STAGE_CHUNK, nbytes)
        nslots = min(_STAGE_SLOTS, (nbytes + chunk - 1) // chunk)
        self.make_current()
        slots: list[Any] = []
        try:
            for _ in range(nslots):
                slots.append(_pinned.take(chunk))
        except BaseException:
            for block in slots:
                _pinned.give(block)
            raise
        return slots

    def staged_copy(
        self, dst: Any, src: Any, nbytes: int, to_device: bool, chunks: list[Any] | None
    ) -> None:
        """Copy between pageable host memory and device memory through pinned chunks
        (``chunks``, or taken now; runs on a pool thread and blocks that thread
        only), with a stream and events that an enqueuing thread made
        (``_StageKits``). Gives the chunks back."""
        slots = chunks or []
        kit = None
        try:
            kit = self._stage_kits.take()
            if chunks is None:
                slots = self.stage_chunks(nbytes)
            stage_stream, events = kit
            chunk = min(_STAGE_CHUNK, nbytes)
            nslots = len(slots)
            host = src._hostbytes if to_device else dst._hostbytes
            pending: list[tuple[int, int, int] | None] = [None] * nslots
            off = 0
            k = 0
            while off < nbytes:
                n = min(chunk, nbytes - off)
                slot = k % nslots
                ptr, view = slots[slot].ptr, slots[slot].view
                if pending[slot] is not None:
                    _check(cu.cuEventSynchronize(events[slot]), "cuEventSynchronize")
                    if not to_device:
                        p_off, p_n, _ = pending[slot]  # type: ignore[misc]
                        _host_copy(host[p_off : p_off + p_n], view[:p_n])
                    pending[slot] = None
                if to_device:
                    _host_copy(view[:n], host[off : off + n])
                    _check(
                        cu.cuMemcpyHtoDAsync(dst._ptr + off, ptr, n, stage_stream),
                        "cuMemcpyHtoDAsync",
                    )
                else:
                    _check(
                        cu.cuMemcpyDtoHAsync(ptr, src._ptr + off, n, stage_stream),
                        "cuMemcpyDtoHAsync",
                    )
                _check(cu.cuEventRecord(events[slot], stage_stream), "cuEventRecord")
                pending[slot] = (off, n, slot)
                off += n
                k += 1
            for j in range(k, k + nslots):
                slot = j % nslots
                if pending[slot] is None:
                    continue
                _check(cu.cuEventSynchronize(events[slot]), "cuEventSynchronize")
                if not to_device:
                    p_off, p_n, _ = pending[slot]  # type: ignore[misc]
                    _host_copy(host[p_off : p_off + p_n], slots[slot].view[:p_n])
                pending[slot] = None
        finally:
            for block in slots:
                _pinned.give(block)
            if kit is not None:
                self._stage_kits.give(kit)

    def init_user_event(
        self, ev: DeviceEvent, blocking_sync: bool, disable_timing: bool, interprocess: bool
    ) -> None:
        flags = 0
        if blocking_sync:
            flags |= int(cu.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        if disable_timing:
            flags |= int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if interprocess:
            if not disable_timing:
                raise ValueError("interprocess events need disable_timing=True")
            flags |= int(cu.CUevent_flags.CU_EVENT_INTERPROCESS)
        self.make_current()
        ev._handle = _check(cu.cuEventCreate(flags), "cuEventCreate")
        ev._timing = not disable_timing

    # -- functions -------------------------------------------------------------------------------

    def compile(
        self,
        ctx: DeviceContext,
        func: Any,
        name: str | None,
        options: dict[str, Any],
        func_attribute: FuncAttribute | None,
        dump_asm: Any,
    ) -> DeviceFunction:
        if isinstance(func, Kernel):
            if func.cuda is None:
                raise UnsupportedError(
                    f"kernel {func.name!r} has no CUDA source; it can only run on the CPU device"
                )
            source, entry = func.cuda, func.name
            opts = _join_options(func.compile_options, options.get("compile_options"))
        elif isinstance(func, str):
            if not name:
                raise TypeError('compile_function(source, name): name the extern "C" kernel')
            source, entry = func, name
            opts = _join_options(options.get("compile_options"))
        else:
            raise TypeError(
                f"the CUDA device compiles CUDA C++ source or a Kernel, not {type(func).__name__}"
            )
        if options.get("ptxas_info_verbose"):
            opts.append("--ptxas-options=-v")
        mod = compile_cuda(source, entry, arch=self.arch, options=opts, want_ptx=True)
        from cuda.core import ObjectCode

        self.make_current()
        self._wait_for_host_work(f"loading kernel {entry!r}")
        impl = _CudaFunction(ObjectCode.from_cubin(mod.cubin, name=entry), entry, mod.ptx)
        asm = write_dump(mod.ptx or "", dump_asm, ".ptx", name=entry) if dump_asm else None
        sass = None
        if options.get("dump_sass"):
            text = dump_sass(mod.cubin)
            if text is None:
                raise UnsupportedError("no SASS disassembler (cuobjdump or nvdisasm) was found")
            sass = write_dump(text, options["dump_sass"], ".sass", name=entry)
        fn = DeviceFunction(ctx, entry, impl, asm=asm, sass=sass, log=mod.log)
        if func_attribute is not None:
            self.set_function_attribute(impl, func_attribute)
        return fn

    def load(
        self, ctx: DeviceContext, function_name: str, asm: Any, func_attribute: FuncAttribute | None
    ) -> DeviceFunction:
        from cuda.core import ObjectCode

        self.make_current()
        self._wait_for_host_work(f"loading {function_name!r}")
        data = asm.encode() if isinstance(asm, str) else bytes(asm)
        try:
            if data[:4] == b"\x7fELF":
                code = ObjectCode.from_cubin(data, name=function_name)
                ptx = None
            else:
                code = ObjectCode.from_ptx(data, name=function_name)
                ptx = data.decode(errors="replace")
            impl = _CudaFunction(code, function_name, ptx)
        except Exception as e:
            raise CompileError(f"loading {function_name!r} failed: {e}") from e
        fn = DeviceExternalFunction(ctx, function_name, impl)
        if func_attribute is not None:
            self.set_function_attribute(impl, func_attribute)
        return fn

    def set_function_attribute(self, impl: _CudaFunction, fa: FuncAttribute) -> None:
        attr = cu.CUfunction_attribute(int(fa.attribute))
        _check(
            cu.cuKernelSetAttribute(attr, int(fa.value), impl.raw, self.dev), "cuKernelSetAttribute"
        )
        if int(fa.attribute) == 8:
            impl.shmem_optin = max(impl.shmem_optin, int(fa.value))

    def make_launch_config(
        self,
        fn: DeviceFunction,
        grid: Dim,
        block: Dim,
        shmem: int,
        cluster: Dim | None,
        attributes: Sequence[LaunchAttribute],
    ) -> Any:
        from cuda.core import LaunchConfig

        impl: _CudaFunction = fn._impl
        coop = False
        priority = None
        for a in attributes:
            if a.id == LaunchAttributeID.COOPERATIVE:
                coop = bool(a.value)
            elif a.id == LaunchAttributeID.PRIORITY:
                priority = int(a.value)
        if coop and not self.attribute(DeviceAttribute.COOPERATIVE_LAUNCH):
            raise UnsupportedError("this device has no cooperative launches")
        if shmem > impl.shmem_optin:
            from ..._types import FuncAttribute

            self.set_function_attribute(impl, FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(shmem))
        if cluster is not None:
            cgrid = (grid.x // cluster.x, grid.y // cluster.y, grid.z // cluster.z)
            cc = LaunchConfig(
                grid=cgrid,
                cluster=tuple(cluster),
                block=tuple(block),
                shmem_size=shmem,
                is_cooperative=coop,
            )
        else:
            cc = LaunchConfig(
                grid=tuple(grid), block=tuple(block), shmem_size=shmem, is_cooperative=coop
            )
        dims = None
        if cluster is None and not coop and priority is None:
            dims = (*tuple(grid), *tuple(block), int(shmem))
        return _LaunchCfg(cc, coop, priority, dims)

    def launch_raw(
        self, stream: CudaStream, impl: _CudaFunction, cfg: _LaunchCfg, kargs: Sequence[Any]
    ) -> None:
        """``cuLaunchKernelEx`` with launch attributes cuda.core's LaunchConfig lacks
        (priority)."""
        cc = cfg.cc
        grid = tuple(cc.grid) + (1,) * (3 - len(tuple(cc.grid)))
        block = tuple(cc.block) + (1,) * (3 - len(tuple(cc.block)))
        conf = cu.CUlaunchConfig()
        conf.gridDimX, conf.gridDimY, conf.gridDimZ = (int(v) for v in grid)
        conf.blockDimX, conf.blockDimY, conf.blockDimZ = (int(v) for v in block)
        conf.sharedMemBytes = int(cc.shmem_size or 0)
        conf.hStream = stream.raw
        attrs = []
        pa = cu.CUlaunchAttribute()
        pa.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PRIORITY
        pa.value.priority = int(cfg.priority or 0)
        attrs.append(pa)
        if cfg.coop:
            ca = cu.CUlaunchAttribute()
            ca.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            ca.value.cooperative = 1
            attrs.append(ca)
        conf.attrs = attrs
        conf.numAttrs = len(attrs)
        holders = []
        for a in kargs:
            if isinstance(a, np.generic):
                holders.append(np.array(a))
            else:
                holders.append(
                    np.array(int(a.handle) if hasattr(a, "handle") else int(a), dtype=np.uint64)
                )
        ptrs = np.array([h.ctypes.data for h in holders], dtype=np.uint64)
        _check(
            cu.cuLaunchKernelEx(conf, cu.CUfunction(int(impl.raw)), ptrs.ctypes.data, 0),
            "cuLaunchKernelEx",
        )

    def write_constants(
        self, impl: _CudaFunction, mappings: Sequence[ConstantMemoryMapping], stream: CudaStream
    ) -> None:
        lib = impl.library.handle
        for m in mappings:
            dptr, size = _check(cu.cuLibraryGetGlobal(lib, m.name.encode()), "cuLibraryGetGlobal")
            data = m.as_bytes()
            if len(data) > int(size):
                raise ValueError(
                    f"constant {m.name!r} holds {int(size)} bytes; {len(data)} were given"
                )
            staging = np.frombuffer(data, np.uint8).copy()
            with stream._submit_lock:
                stream._before_submit()
                stream._issue(
                    stream._seq + 1, _memcpy_htod, dptr, staging.ctypes.data, len(data), stream.raw
                )
                stream._after_copy = True
                stream._mark(staging)

    def function_attribute(self, fn: DeviceFunction, attr: int) -> int:
        impl: _CudaFunction = fn._impl
        return int(
            _check(
                cu.cuKernelGetAttribute(cu.CUfunction_attribute(attr), impl.raw, self.dev),
                "cuKernelGetAttribute",
            )
        )

    def function_occupancy(self, fn: DeviceFunction, block_size: int, shmem: int) -> int:
        impl: _CudaFunction = fn._impl
        return int(impl.kernel.occupancy.max_active_blocks_per_multiprocessor(block_size, shmem))

    def elapsed_ns(self, body: Callable[[], Any], stream: _StreamImpl) -> int:
        """Device time of what ``body`` enqueues, between two timing events."""
        s: CudaStream = stream  # type: ignore[assignment]
        self.make_current()
        start = _check(cu.cuEventCreate(0), "cuEventCreate")
        end = _check(cu.cuEventCreate(0), "cuEventCreate")
        try:
            s.record_raw(start)
            body()
            s.record_raw(end)
            s._settle()
            _check(cu.cuEventSynchronize(end), "cuEventSynchronize")
            ms = float(_check(cu.cuEventElapsedTime(start, end), "cuEventElapsedTime"))
        finally:
            cu.cuEventDestroy(start)
            cu.cuEventDestroy(end)
        s._retire()
        return round(ms * 1e6)

    # -- device timestamps for tracing ----------------------------------------------------

    def new_stamp(self) -> Any:
        """A timing event for ``CudaStream.trace_stamp`` (``cuEventCreate``, or one
        the trace has read back already)."""
        free = self._free_stamps
        if free:
            return free.pop()
        self.make_current()
        return _check(cu.cuEventCreate(0), "cuEventCreate")

    def trace_clock(self) -> tuple[Any, int]:
        """The origin that maps this device's timestamps to the host's
        ``perf_counter_ns``: a timing event recorded on a stream of its own that
        nothing else uses (not the default stream, which other libraries' work
        may occupy) and waited for (``cuEventSynchronize``, some microseconds),
        with the host time halfway through that wait."""
        self.make_current()
        if self._clock_stream is None:
            self._clock_stream = _check(
                cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate"
            )
        e = _check(cu.cuEventCreate(0), "cuEventCreate")
        t0 = time.perf_counter_ns()
        _check(cu.cuEventRecord(e, self._clock_stream), "cuEventRecord")
        _check(cu.cuEventSynchronize(e), "cuEventSynchronize")
        return e, (t0 + time.perf_counter_ns()) // 2

    def stamp_ns(self, origin: Any, stamp: Any) -> int | None:
        """Nanoseconds from ``origin`` to ``stamp`` (``cuEventElapsedTime``, about
        0.5 µs resolution), or None while the device has not passed ``stamp``.
        Never blocks. Once read, ``stamp`` goes back to this device's free list."""
        err, ms = cu.cuEventElapsedTime(origin, stamp)
        if err != _SUCCESS:
            return None
        self.drop_stamp(stamp)
        return round(float(ms) * 1e6)

    def drop_stamp(self, stamp: Any) -> None:
        """A stamp tracing no longer reads: back to the free list (up to 1024),
        else ``cuEventDestroy`` (which the driver defers while the stream has
        not reached it)."""
        if len(self._free_stamps) < 1024:
            self._free_stamps.append(stamp)
        else:
            cu.cuEventDestroy(stamp)

    def close(self) -> None:
        # The primary context stays retained for the process: other contexts of the
        # same device share it, and buffers dropped later still go back to the pool
        # (on the device's default stream once their own stream is gone). Tracing's
        # clock stream and its spare timing events go.
        if self._clock_stream is not None:
            self.make_current()
            cu.cuStreamDestroy(self._clock_stream)
            self._clock_stream = None
        while self._free_stamps:
            cu.cuEventDestroy(self._free_stamps.pop())
        for kit in self._stage_kits.drain():
            self._destroy_stage_kit(kit)


def _join_options(*parts: Any) -> list[str]:
    import shlex

    out: list[str] = []
    for p in parts:
        if not p:
            continue
        out.extend(shlex.split(p) if isinstance(p, str) else list(p))
    return out


def _all_streams(backend: CudaBackend) -> list[CudaStream]:
    """Every live stream of ``backend``'s device (all contexts share the primary
    context, so one held stream blocks module loads for all of them)."""
    out: list[CudaStream] = []
    for b in list(_backends):
        if b.device_id == backend.device_id:
            out.extend(s for s in list(b._streams) if not s.is_closed)
    return out


_backends: weakref.WeakSet[CudaBackend] = weakref.WeakSet()
_peer_enabled: set[tuple[int, int]] = set()
_shared: dict[int, CudaBackend] = {}


def _shared_backend(i: int) -> CudaBackend:
    b = _shared.get(i)
    if b is None:
        b = _shared[i] = CudaBackend(i)
    return b


class _PinnedBlock:
    __slots__ = ("nbytes", "ptr", "size_class", "view")

    def __init__(self, ptr: int, size_class: int) -> None:
        self.ptr = ptr
        self.size_class = size_class
        self.nbytes = size_class
        self.view = np.ctypeslib.as_array((ctypes.c_uint8 * size_class).from_address(ptr))


class _PinnedPool:
    """Page-locked host memory (``cuMemHostAlloc``, PORTABLE | DEVICEMAP) kept in
    size classes and handed out again, since pinning is slow. A block comes back
    only when its buffer is gone, and a buffer is gone only after every operation
    that used it has finished, so a block is never reused while the device still
    reads or writes it. Up to ``MAX_CACHED`` bytes are kept."""

    MAX_CACHED = 2 << 30

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[_PinnedBlock]] = {}
        self._cached = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        if nbytes <= 4096:
            return 4096
        if nbytes <= 64 << 20:
            return 1 << (nbytes - 1).bit_length()
        step = 64 << 20
        return (nbytes + step - 1) // step * step

    def take(self, nbytes: int) -> _PinnedBlock:
        cls = self.size_class(nbytes)
        with self._lock:
            free = self._free.get(cls)
            if free:
                self._cached -= cls
                return free.pop()
        flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
        ptr = int(_check(cu.cuMemHostAlloc(cls, flags), "cuMemHostAlloc"))
        return _PinnedBlock(ptr, cls)

    def give(self, block: _PinnedBlock) -> None:
        with self._lock:
            if self._cached + block.size_class <= self.MAX_CACHED:
                self._free.setdefault(block.size_class, []).append(block)
                self._cached += block.size_class
                return
        cu.cuMemFreeHost(block.ptr)

    def cached_bytes(self) -> int:
        return self._cached


_pinned = _PinnedPool()


class _PinnedAlloc:
    """A host buffer's block of the pinned pool."""

    __slots__ = ("block", "host", "ptr")

    def __init__(self, nbytes: int) -> None:
        self.block: _PinnedBlock | None = _pinned.take(max(nbytes, 1))
        self.ptr = self.block.ptr
        self.host = self.block.view[:nbytes]

    def release(self, stream: _StreamImpl) -> None:
        block, self.block = self.block, None
        if block is not None:
            _pinned.give(block)

    def detach(self) -> None:
        self.block = None  # the caller owns the pinned memory now (cuMemFreeHost)

    def set_owner(self, stream: _StreamImpl) -> None:
        pass


_COPY_PART = 2 << 20
_COPY_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
_copy_pool: Any = None
_copy_pool_lock = threading.Lock()


def _host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto`` of bytes between pageable and pinned memory, split over up to
    ``_COPY_THREADS`` threads (NumPy releases the GIL while it copies): one
    thread's memcpy, not the DMA, limits a staged copy. Its own threads, not the
    CPU pool's, which the staged copy itself may be running on."""
    n = dst.nbytes
    parts = min(_COPY_THREADS, n // _COPY_PART)
    if parts < 2:
        np.copyto(dst, src)
        return
    global _copy_pool
    if _copy_pool is None:
        with _copy_pool_lock:
            if _copy_pool is None:
                from concurrent.futures import ThreadPoolExecutor

                _copy_pool = ThreadPoolExecutor(
                    _COPY_THREADS - 1, thread_name_prefix="asyncgpu-copy"
                )
    bounds = [n * i // parts for i in range(parts + 1)]
    futures = [
        _copy_pool.submit(np.copyto, dst[bounds[i] : bounds[i + 1]], src[bounds[i] : bounds[i + 1]])
        for i in range(1, parts)
    ]
    np.copyto(dst[: bounds[1]], src[: bounds[1]])
    for f in futures:
        f.result()
