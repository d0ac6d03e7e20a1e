"""Memory of the CUDA device, and when each kind goes back.

* ``_CounterSlab`` (``_slab``): host-mapped pinned memory for the streams'
  64-bit completion counters, one cache line each (``cuMemHostAlloc`` with
  DEVICEMAP | PORTABLE, once per ``SLOTS`` counters; taking and giving back a
  slot is a list operation).
* ``_DeviceAlloc``: device memory from the device's stream-ordered pool
  (cuda.core's ``DeviceMemoryResource``: ``cuMemAllocFromPoolAsync``), freed in
  stream order on its stream (``cuMemFreeAsync``); neither blocks the host.
* ``_SpareBuffers``: the device allocations a stream keeps for its next
  allocation of the same size (no driver call at all), freed at the stream's
  close (``_free_spare``).
* ``_PinnedPool`` (``_pinned``) and ``_PinnedAlloc``: page-locked host memory in
  size classes (``cuMemHostAlloc``, slow and blocking, hence the pool;
  ``cuMemFreeHost`` beyond ``MAX_CACHED``).
* Staged copies between pageable host memory and the device: the stream and
  events each one uses (``_StageKits``), the size and number of its pinned
  chunks (``_STAGE_CHUNK``, ``_STAGE_SLOTS``) and the host side's memcpy on
  several threads (``_host_copy``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from cuda.bindings import driver as cu

from ... import _accel
from ..._core.memory import _BufferBase
from ..._core.stream import _StreamImpl
from .driver import _check


class _Device(Protocol):
    """What memory needs of its device (``backend.CudaBackend``, a module above)."""

    _core_device: Any

    def make_current(self) -> None: ...


_STAGE_CHUNK = 16 << 20
_STAGE_SLOTS = 3
# Device buffers a stream keeps for its next allocations of the same size (see
# ``_SpareBuffers``): at most this many bytes per stream, this many per size.
_SPARE_BYTES = 64 << 20
_SPARE_PER_SIZE = 4
_SPARE_SIZES = _accel.native.SPARE_SIZES  # sizes a stream keeps at once (a table in C)


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


class _SpareBuffers(_accel.native.SpareCore):
    """Device allocations of a stream, released and kept for the stream's next
    allocation of the same size, so that a buffer created and dropped again and
    again costs no driver call and no new allocation object: at most ``per_size``
    of one size, ``_SPARE_SIZES`` sizes and ``room`` bytes in all
    (``_SpareBuffers(room, per_size)``; a stream keeps ``_SPARE_BYTES`` and
    ``_SPARE_PER_SIZE``). ``bufs`` is what is kept, ``{nbytes: [allocation, ...]}``.

    Keeping and taking are the C type's (``asyncgpu._native.SpareCore``: ``take``,
    ``keep``, ``_take_all``, ``room``, ``closed``, ``bufs``), which the context's
    ``enqueue_create_buffer`` and a dropped device buffer call without Python; the
    GIL makes each atomic (a buffer's finalizer may keep memory from any thread,
    even inside a ``take`` of this one). Freeing what is kept is here.

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
        allocs: list[Any] = self._take_all(close)  # (_DeviceAlloc objects)
        for alloc in allocs:
            with contextlib.suppress(Exception):
                alloc.free_on(cs)


def _free_spare(spare: _SpareBuffers, backend: _Device, cs: Any) -> None:
    with contextlib.suppress(Exception):
        backend.make_current()
    spare.free(cs, True)


class _DeviceAlloc:
    """Device memory from the device's pool (``cuMemAllocFromPoolAsync``), freed in
    stream order on the owning stream (``cuMemFreeAsync``), or kept by that stream
    for its next allocation of the same size (``_SpareBuffers``)."""

    __slots__ = ("backend", "buf", "host", "nbytes", "ptr")

    def __init__(
        self, backend: _Device, buf: Any, host: np.ndarray | None, nbytes: int = 0
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

    def __del__(self, _base: Any = _BufferBase) -> None:
        # Dropped at interpreter exit still holding its memory, by a path that gave
        # nothing back (an object the teardown frees without its finalizer): left
        # to itself, cuda.core would free the memory on the stream it was allocated
        # on, which a closed context has destroyed, and cuMemFreeAsync on a
        # destroyed stream crashes the process inside the driver. The end of the
        # process frees it instead. (``_base`` is bound as a default so that this
        # works while the module is torn down.)
        if self.buf is not None and _base._exiting:
            self.abandon()

    def set_owner(self, stream: _StreamImpl) -> None:
        cs = getattr(stream, "cs", None)
        if self.buf is not None and cs is not None:
            self.buf.set_deallocation_stream(cs)


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
