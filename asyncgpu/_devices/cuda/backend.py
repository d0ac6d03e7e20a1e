"""The CUDA device, on cuda.core (kernels, launch, memory pools) and cuda.bindings
(streams, stream memory operations, host-mapped memory, contexts, attributes).

This module holds ``CudaBackend``: one device on its primary context
(``cuDevicePrimaryCtxRetain``, made current per thread with ``cuCtxSetCurrent``
and remembered in ``_tls``), its facts (``cuDeviceGetAttribute``, cached), its
streams, allocations, staged copies, compiling and loading code (NVRTC in
``compiler``; ``cuKernelSetAttribute``), launches with attributes
(``cuLaunchKernelEx``) and timing events. ``_init_driver`` initialises the
driver (``cuInit``) and binds the C extension to it (``_bind_native``), which
needs the classes of the modules below. The registries of the process are here
too: every backend (``_backends``, ``_all_streams``), one shared backend per
device (``_shared_backend``) and the peer access enabled between devices
(``cuCtxEnablePeerAccess``).

The package's modules, each importing only those below it (the import-linter
contract in pyproject.toml): ``backend`` > ``graph`` > ``stream`` > ``launch`` |
``memory`` > ``driver`` | ``compiler``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from cuda.bindings import driver as cu

from ... import _accel, _config
from ..._core.engine import watcher
from ..._core.event import DeviceEvent
from ..._core.function import DeviceExternalFunction, DeviceFunction, Kernel
from ..._core.pool import pool_size
from ..._core.stream import _PolledStream, _StreamImpl
from ..._errors import (
    CompileError,
    DeviceError,
    HealthCheckError,
    NoDeviceError,
    UnsupportedError,
)
from ..._types import DeviceAttribute, Dim, GPUInfo, LaunchAttributeID, StreamPriorityRange
from . import driver as _driver
from .compiler import compile_cuda, dump_sass, write_dump
from .driver import _SUCCESS, _check, _entry_point, _error, _memcpy_htod, _result_of
from .graph import CudaGraph
from .launch import _CudaFunction, _LaunchCfg, load_now
from .memory import (
    _STAGE_CHUNK,
    _STAGE_SLOTS,
    _DeviceAlloc,
    _host_copy,
    _pinned,
    _PinnedAlloc,
    _StageKits,
)
from .stream import CudaStream

if TYPE_CHECKING:
    from ..._core.graph import GraphDefinition, GraphParams
    from ..._core.memory import ContextView as DeviceContext
    from ..._core.state import _ContextState
    from ..._types import ConstantMemoryMapping, FuncAttribute, LaunchAttribute

__all__ = ["CudaBackend"]

_tls = threading.local()


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


def _bind_native() -> None:
    """Bind the compiled hot path (``asyncgpu._native``) to the driver's entry
    points once, and hand it the classes it creates. Every CUDA 12+ driver has
    them (``cuGetProcAddress`` for the CUDA 12.0 API); a driver without them
    cannot run asyncgpu: ``NoDeviceError``."""
    if _driver._native is not None:
        return
    native = _accel.native
    try:
        native.bind(
            _entry_point("cuLaunchKernel"),
            _entry_point("cuStreamWriteValue64"),
            _entry_point("cuEventRecord"),
            _entry_point("cuEventQuery"),
            _entry_point("cuMemcpyAsync"),
            _entry_point("cuGraphLaunch"),
        )
    except (DeviceError, ValueError) as e:
        raise NoDeviceError(
            "the CUDA driver is older than 12.0 or incomplete: asyncgpu needs its "
            "cuLaunchKernel, cuStreamWriteValue64, cuEventRecord, cuEventQuery, "
            f"cuMemcpyAsync and cuGraphLaunch entry points (cuGetProcAddress, CUDA 12.0 API): {e}"
        ) from None
    native.configure(
        DeviceEvent, watcher.sweep_later, _PolledStream.MARK_EVERY, CudaStream, _DeviceAlloc
    )
    _driver._native = native


class CudaBackend:
    """One CUDA device, on its primary context."""

    api = "cuda"
    polled = True
    memory_is_host = False

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
            return False  # not its own peer: cuDeviceCanAccessPeer(d, d) answers 0 too
        return bool(_check(cu.cuDeviceCanAccessPeer(self.dev, other.dev), "cuDeviceCanAccessPeer"))

    def reaches(self, other: Any) -> bool:
        """Its own device's memory (every context of a device shares the primary
        context), and a peer's once ``enable_peer_access`` has enabled it here
        (peer access enabled by another library is not seen: enabling it again
        is harmless)."""
        return other.device_id == self.device_id or (
            (self.device_id, other.device_id) in _peer_enabled
        )

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

    def external_handle(self, stream: Any) -> int:
        """The ``CUstream`` of another library's stream object (``__cuda_stream__``,
        PyTorch's ``cuda_stream``, CuPy's ``ptr``) or of an int. No driver call."""
        if hasattr(stream, "__cuda_stream__"):
            return int(stream.__cuda_stream__()[1])
        if hasattr(stream, "cuda_stream"):
            return int(stream.cuda_stream)
        if hasattr(stream, "ptr") and not isinstance(stream, int):
            return int(stream.ptr)
        try:
            return int(stream)  # an address, or cuda.bindings' CUstream
        except (TypeError, ValueError):
            raise TypeError(
                "create_external_stream takes a CUstream (an int) or a stream object "
                f"(__cuda_stream__, cuda_stream or ptr), not {type(stream).__name__}"
            ) from None

    def _external_stream(self, state: _ContextState, handle: Any, index: int) -> CudaStream:
        h = self.external_handle(handle)
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
                code, name = _result_of(e)
                raise DeviceError(
                    f"allocating {nbytes} bytes on CUDA device {self.device_id}: {e}",
                    code=code,
                    name=name,
                ) from e
            try:
                buf = self.mr.allocate(nbytes, stream=cs)
            except Exception as e2:
                code, name = _result_of(e2)
                raise DeviceError(
                    f"allocating {nbytes} bytes on CUDA device {self.device_id}: {e2}",
                    code=code,
                    name=name,
                ) from e2
        return _DeviceAlloc(self, buf, None, nbytes)

    def _free_spare_buffers(self) -> bool:
        """Free the buffers every live stream of the device keeps; True if there
        were any. Each stream's are freed on it under its submission lock, and
        not once it is closing (its close frees them before it destroys the
        stream, which a free racing with it could find gone). A stream whose
        lock another thread holds is passed over rather than waited for: this
        runs under the allocating stream's lock, and two allocations failing at
        once on two streams would each wait for the other's."""
        freed = False
        for s in _all_streams(self):
            lock = s._submission_lock
            if not lock.acquire(False):
                continue
            try:
                if not s._closing and s.spare.kept():
                    freed = True
                    s.spare.free(s.cs, False)
            finally:
                lock.release()
        return freed

    def alloc_host(self, nbytes: int, stream: _StreamImpl) -> _PinnedAlloc:
        """Page-locked host memory from ``_pinned``, usable by the host at once. (Not
        a stream-ordered pinned pool: cuMemcpyAsync treats its memory as pageable
        and copies it at enqueue time.)"""
        self.make_current()
        return _PinnedAlloc(nbytes)

    def pointer_host_view(self, ptr: int, nbytes: int) -> np.ndarray | None:
        return None

    def read_device(self, ptr: int, nbytes: int) -> np.ndarray:
        """The bytes at device address ``ptr`` now (``cuMemcpyDtoH``, synchronous, on
        the legacy default stream: asyncgpu's streams are non-blocking, so it waits
        for none of them; the caller has ordered it after the writes it must see)."""
        out = np.empty(nbytes, np.uint8)
        if nbytes:
            with self.push_context():
                _check(cu.cuMemcpyDtoH(out.ctypes.data, ptr, nbytes), "cuMemcpyDtoH")
        return out

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
        load_now(impl)
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
            load_now(impl)
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
        (priority), or with arguments cuda.core cannot pass (a structured scalar:
        the parameter is its bytes)."""
        cc = cfg.cc
        grid = tuple(cc.grid) + (1,) * (3 - len(tuple(cc.grid)))
        block = tuple(cc.block) + (1,) * (3 - len(tuple(cc.block)))
        conf = cu.CUlaunchConfig()
        conf.gridDimX, conf.gridDimY, conf.gridDimZ = (int(v) for v in grid)
        conf.blockDimX, conf.blockDimY, conf.blockDimZ = (int(v) for v in block)
        conf.sharedMemBytes = int(cc.shmem_size or 0)
        conf.hStream = stream.raw
        attrs = []
        if cfg.priority is not None:  # else the stream's own priority holds
            pa = cu.CUlaunchAttribute()
            pa.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PRIORITY
            pa.value.priority = int(cfg.priority)
            attrs.append(pa)
        if cfg.coop:
            ca = cu.CUlaunchAttribute()
            ca.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
            ca.value.cooperative = 1
            attrs.append(ca)
        if attrs:
            conf.attrs = attrs
        conf.numAttrs = len(attrs)
        holders = []
        for a in kargs:
            if isinstance(a, np.generic):
                holders.append(np.array(a))  # a structured scalar: its bytes, as the struct
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

    def graph(self, definition: GraphDefinition, params: GraphParams) -> CudaGraph:
        """A finished graph definition as driver graphs, instantiated now (one per
        stage between CPU nodes: ``cuGraphCreate``, ``cuGraphAdd*Node``,
        ``cuGraphInstantiate``; blocks while the driver builds them)."""
        return CudaGraph(self, definition, params)

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
