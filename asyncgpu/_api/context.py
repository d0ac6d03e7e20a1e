"""DeviceContext: the device-independent core of the API.

A ``DeviceContext`` is a view of one device context (``_ContextState``: the
backend, its pool of streams, its caches) bound to one current stream.
``select_stream(i)`` returns another view of the same state. Everything here
validates its arguments, then hands the work to the current stream's backend
object (``_stream._StreamImpl``): the only seam between core and devices.
"""

from __future__ import annotations

import contextlib
import inspect
import numbers
import os
import threading
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .. import _config
from .._accel import native
from .._core import engine as _engine
from .._core import pool as _pool
from .._core.event import DeviceEvent, _UserEvent
from .._core.function import DeviceFunction, Kernel
from .._core.function import refuse_coroutine_function as _refuse_coroutine_function
from .._core.memory import (
    DeviceBuffer,
    HostBuffer,
    _BufferBase,
    alloc_bytes,
    as_dtype,
    check_size,
)
from .._core.ops import check_kernel_buffer, copy_operands
from .._core.ops import check_writable as _check_writable
from .._core.state import _ContextState, _open_states, _Ref
from .._core.stream import _StreamImpl
from .._core.trace import Trace
from .._core.trace_json import TraceFile, write_chrome_trace
from .._devices import backend_class, check_api, cuda_available
from .._errors import ContextClosedError, NoDeviceError, UnsupportedError
from .._types import (
    ConstantMemoryMapping,
    DeviceAttribute,
    Dim,
    DimLike,
    FuncAttribute,
    GPUInfo,
    LaunchAttribute,
    LaunchAttributeID,
    StreamPriorityRange,
    check_int,
)
from .stream import DeviceStream, await_stream

__all__ = ["DeviceContext"]


def check_options(api: object, num_streams: object) -> tuple[str | None, int | None]:
    """``(api, num_streams)`` checked as ``DeviceContext`` takes them: ``api`` is
    ``"cuda"``, ``"cpu"`` (any case) or ``None``; ``num_streams`` a positive int or
    ``None``. ``None`` stays ``None`` (the defaults are read when a context
    opens); ``TypeError`` or ``ValueError`` naming the argument otherwise."""
    if api is not None:
        if not isinstance(api, str):
            raise TypeError(f'api must be "cuda", "cpu" or None, not {api!r}')
        api = check_api(api)
    if num_streams is not None:
        num_streams = check_int(num_streams, "num_streams")
        if num_streams < 1:
            raise ValueError(f"num_streams must be at least 1, got {num_streams}")
    return api, num_streams


def default_api() -> str:
    """``$ASYNCGPU_API`` if set, else ``"cuda"`` when a usable GPU is present, else
    ``"cpu"``."""
    return _config.read_api() or ("cuda" if cuda_available() else "cpu")


class DeviceContext(native.ContextCore):
    """A device context (GPU or CPU) bound to a current stream.

    ``DeviceContext(device_id=0, *, api=None)``: ``api`` is ``"cuda"`` or ``"cpu"``;
    ``None`` means ``$ASYNCGPU_API``, else CUDA when a usable GPU is present, else
    the CPU device. ``DeviceContext(copy=ctx)`` is another reference to the same
    context (released when the last reference is closed).

    Use it with ``with`` (leaving synchronizes, then releases) or ``async with``
    (leaving awaits outstanding work without blocking the loop, then releases).
    ``await ctx`` waits for all work enqueued so far on the current stream.

    Its fields (``_state``, ``_impl``, ``_ref``) are the compiled
    ``ContextCore``'s, and so are ``enqueue_function`` (a compiled function of
    this context launched with a geometry seen before, untraced, in one C call
    down to ``cuLaunchKernel``) and ``enqueue_create_buffer`` (memory the
    current CUDA stream kept): every other call goes to the general paths
    ``_enqueue_function`` and ``_enqueue_create_buffer`` below.
    """

    __slots__ = ("__weakref__",)
    _state: _ContextState
    _impl: _StreamImpl
    _ref: _Ref

    _instances_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(
        self,
        device_id: int = 0,
        *,
        api: str | None = None,
        num_streams: int | None = None,
        copy: DeviceContext | None = None,
    ) -> None:
        if copy is not None:
            if not isinstance(copy, DeviceContext):
                raise TypeError(f"copy= takes a DeviceContext, not {type(copy).__name__}")
            copy._check_open()
            with copy._state.lock:
                copy._state.refs += 1
            self._state = copy._state
            self._impl = copy._impl
            self._ref = _Ref()
            self._ref.owner = weakref.ref(self)
            return
        device_id = check_int(device_id, "device_id")
        checked_api, checked_num = check_options(api, num_streams)
        api = default_api() if checked_api is None else checked_api
        num_streams = _config.read_num_streams() if checked_num is None else checked_num
        self._state = _ContextState(api, int(device_id), num_streams, backend_class(api)(device_id))
        self._impl = self._state.stream(0)
        self._ref = _Ref()
        self._ref.owner = weakref.ref(self)
        if (trace_path := _config.read_trace()) is not None:
            state = self._state
            path = trace_path.replace("{ctx}", f"{state.api}{state.device_id}-{id(state):x}")
            # Written by close(), or once the context is freed if it is dropped.
            state.trace_file = TraceFile(state, Trace(path=path), path)
            state.trace = state.trace_file.trace

    def _view(self, impl: _StreamImpl | None) -> DeviceContext:
        """A view of this context bound to ``impl`` (a new object, so that closing
        it never closes the handle it came from; this one if it is such a view)."""
        if impl is None:
            impl = self._impl
        if impl is self._impl and self._is_view():
            return self
        v = object.__new__(DeviceContext)
        v._state = self._state
        v._impl = impl
        v._ref = self._ref
        return v

    def _check_open(self) -> None:
        if self._state.closed or not self._ref.open:
            raise ContextClosedError(f"the DeviceContext {self._state.describe()} is closed")

    # -- lifetime --------------------------------------------------------------------------

    def _is_view(self) -> bool:
        """A view (``select_stream``, ``stream.context()``, ``buffer.context()``)
        of a handle that is still alive."""
        owner = self._ref.owner
        if owner is None:
            return False
        handle = owner()
        return handle is not None and handle is not self

    def close(self) -> None:
        """Release this reference; the last one waits for all work and frees
        everything. Using the context afterwards raises ``ContextClosedError``.

        On a view, this only waits for the view's stream (its work so far): the
        context stays open until the handle it came from (or, if that handle is
        gone, a view of it) is closed."""
        ref = self._ref
        if not ref.open:
            return
        if self._is_view():
            if not self._state.closed:
                self._impl.synchronize()
            return
        running = _pool.host_work.stream
        if running is not None and running.state is self._state and self._state.refs == 1:
            # The last reference would wait for all work, this CPU function's too.
            _pool.refuse_wait_from_own_work(running)
        ref.open = False
        state = self._state
        with state.lock:
            state.refs -= 1
            last = state.refs == 0
        if last:
            state.close()
            if state.trace_file is not None:
                state.trace_file.write()
            if not _any_polled_open():
                _engine.watcher.stop()

    async def aclose(self) -> None:
        """Await all work on every stream of the context, then close it. If the
        awaiting task is cancelled, the context is still closed: a background thread
        waits for the work and releases everything, and the loop never blocks."""
        if self._is_view():  # (see close)
            if self._ref.open and not self._state.closed:
                ev = self._impl.tail()
                if ev is not None:
                    await _Wait(ev)
            return
        try:
            if self._ref.open and not self._state.closed:
                for s in self._state.all_streams():
                    ev = s.tail()
                    if ev is not None:
                        await _Wait(ev)
        except BaseException:
            threading.Thread(target=self.close, name="asyncgpu-close", daemon=True).start()
            raise
        self.close()

    def __enter__(self) -> DeviceContext:
        self._check_open()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> DeviceContext:
        self._check_open()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    def __await__(self) -> Generator[Any, None, None]:
        """``await ctx``: wait, without blocking the loop, for the work enqueued on
        the current stream so far: ``await ctx.stream()`` without making the
        ``DeviceStream`` (``await_stream``, the same compiled event await)."""
        return await_stream(self, self._impl)

    # -- facts -------------------------------------------------------------------------------

    def name(self) -> str:
        """The device's name (``cuDeviceGetName``)."""
        self._check_open()
        return self._state.backend.name()

    def api(self) -> str:
        """``"cuda"`` or ``"cpu"``."""
        return self._state.api

    def id(self) -> int:
        """The device id (ordinal)."""
        return self._state.device_id

    @property
    def default_device_info(self) -> GPUInfo:
        """What the device is, queried from the device."""
        self._check_open()
        return self._state.backend.info()

    def get_api_version(self) -> int:
        """The driver version (``cuDriverGetVersion``, e.g. 13000 for 13.0); on the CPU
        device the Python version as ``major * 1000 + minor * 10``."""
        self._check_open()
        return self._state.backend.api_version()

    def get_attribute(self, attr: DeviceAttribute) -> int:
        """A device attribute (``cuDeviceGetAttribute``). The CPU device answers the
        limits it enforces and raises ``UnsupportedError`` for the rest."""
        self._check_open()
        if not isinstance(attr, (DeviceAttribute, int)):
            raise TypeError(f"attr must be a DeviceAttribute, not {attr!r}")
        return self._state.backend.attribute(attr)

    def is_compatible(self) -> bool:
        """True if asyncgpu can run work on this device."""
        self._check_open()
        return bool(self._state.backend.is_compatible())

    def run_healthcheck(self) -> None:
        """Check the device (throttling, uncorrectable ECC errors, a memory pattern);
        raises ``HealthCheckError`` naming the failed check."""
        self._check_open()
        self._state.backend.healthcheck()

    def get_memory_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of device memory (``cuMemGetInfo``)."""
        self._check_open()
        with self.push_context():
            return self._state.backend.memory_info()

    def max_single_alloc_size(self) -> int:
        """The largest single allocation in bytes (the device's total memory)."""
        self._check_open()
        return self._state.backend.max_single_alloc_size()

    def can_access(self, peer: DeviceContext) -> bool:
        """True if this device can address ``peer``'s memory directly as a peer
        (``cuDeviceCanAccessPeer``). A device is not its own peer: for two contexts of
        the same device (``ctx.can_access(ctx)`` included) this is False, as in MAX and
        the driver, although each addresses the device's memory anyway."""
        self._check_open()
        if not isinstance(peer, DeviceContext):
            raise TypeError(f"can_access takes a DeviceContext, not {type(peer).__name__}")
        return bool(self._state.backend.can_access(peer._state.backend))

    def enable_peer_access(self, peer: DeviceContext) -> None:
        """Let this device address ``peer``'s memory (``cuCtxEnablePeerAccess``); a
        no-op when ``peer`` is a context of the same device."""
        self._check_open()
        if not isinstance(peer, DeviceContext):
            raise TypeError(f"enable_peer_access takes a DeviceContext, not {type(peer).__name__}")
        self._state.backend.enable_peer_access(peer._state.backend)

    def supports_multicast(self) -> bool:
        """Whether the device supports multicast objects (an attribute query only)."""
        self._check_open()
        return bool(self._state.backend.supports_multicast())

    @staticmethod
    def number_of_devices(*, api: str | None = None) -> int:
        """Devices available for ``api`` (default: the default api)."""
        api = (default_api() if api is None else api).lower()
        cls = backend_class(api)
        try:
            return int(cls.number_of_devices())
        except NoDeviceError:
            return 0

    @staticmethod
    def enable_all_peer_access() -> None:
        """Enable peer access between every pair of GPUs that allows it (a no-op
        with fewer than two)."""
        if cuda_available():
            backend_class("cuda").enable_all_peer_access()

    @staticmethod
    def all_peer_access_enabled() -> bool:
        """True only if every GPU can reach every other (False with fewer than two)."""
        if not cuda_available():
            return False
        return backend_class("cuda").all_peer_access_enabled()  # type: ignore[no-any-return]

    def push_context(self) -> contextlib.AbstractContextManager[None]:
        """A ``with`` block during which this device's driver context is current
        (``cuCtxPushCurrent`` / ``cuCtxPopCurrent``)."""
        self._check_open()
        return self._state.backend.push_context()

    def set_as_current(self) -> None:
        """Make this device's driver context current on this thread
        (``cuCtxSetCurrent``)."""
        self._check_open()
        self._state.backend.set_as_current()

    # -- streams and events ---------------------------------------------------------------

    def stream(self) -> DeviceStream:
        """The current stream of this view."""
        return DeviceStream(self, self._impl)

    def num_streams(self) -> int:
        """The size of the context's stream pool (``select_stream`` ids)."""
        return self._state.num_streams

    def select_stream(self, stream_id: int) -> DeviceContext:
        """A view of this context bound to stream ``stream_id`` of its pool; stream 0
        is the base stream. Raises ``IndexError`` outside ``0..num_streams()-1``."""
        self._check_open()
        n = self._state.num_streams
        stream_id = check_int(stream_id, "stream_id")
        if not 0 <= stream_id < n:
            raise IndexError(f"stream_id {stream_id} is outside 0..{n - 1}")
        return self._view(self._state.stream(stream_id))

    def stream_priority_range(self) -> StreamPriorityRange:
        """The priorities streams may have (``cuCtxGetStreamPriorityRange``)."""
        self._check_open()
        return self._state.backend.priority_range()

    def create_stream(self, *, priority: int = 0) -> DeviceStream:
        """A new stream outside the pool (``cuStreamCreateWithPriority``,
        non-blocking). ``priority`` must lie in ``stream_priority_range()``."""
        self._check_open()
        priority = check_int(priority, "priority")
        rng = self._state.backend.priority_range()
        lo, hi = sorted((rng.least, rng.greatest))
        if not lo <= priority <= hi:
            raise ValueError(f"priority {priority} is outside the device's range {lo}..{hi}")
        state = self._state
        with state.lock:
            state.refuse_if_closing()
            impl = state.backend.new_stream(state, state.take_index(), priority)
            state.extra_streams.append(impl)
        return DeviceStream(self, impl)

    def create_external_stream(self, external_stream: Any) -> DeviceStream:
        """Wrap a stream another library owns (a ``CUstream`` address, or an object
        with ``__cuda_stream__`` / ``cuda_stream``). The wrapper does not own it.

        A context wraps each handle once: wrapping the same ``CUstream`` again
        (another Python object for it, such as each ``torch.cuda.current_stream()``)
        gives a stream equal to the first (while it lives, see below), with the
        same completion bookkeeping, so wrapping per request costs a dictionary
        look-up, not a new stream. The first object wrapped is kept alive with
        its wrapper. The context keeps the wrappers of the 64 most recently
        wrapped handles (``EXTERNAL_STREAMS_KEPT``); older ones are let
        go once idle (their last operation seen finished) and released
        (``cuEventDestroy`` of their marker events; the wrapped stream itself
        is never destroyed) once nothing else holds them, so wrapping ever-new
        handles does not grow the context without bound. A stream destroyed by
        its owner must not be used through the wrapper again."""
        self._check_open()
        state = self._state
        handle = state.backend.external_handle(external_stream)
        return DeviceStream(self, state.external_stream(handle, external_stream))

    def create_event(
        self,
        *,
        blocking_sync: bool = False,
        disable_timing: bool = True,
        interprocess: bool = False,
    ) -> DeviceEvent:
        """A user event to record on streams (``cuEventCreate`` with the matching
        flags). It is done until first recorded."""
        self._check_open()
        state = self._state
        ev = _UserEvent._new((state.api, state.device_id))
        state.backend.init_user_event(ev, blocking_sync, disable_timing, interprocess)
        ev._done = True
        return ev

    def synchronize(self) -> None:
        """Block until all work enqueued on the current stream has completed
        (``cuStreamSynchronize``). A close on another thread that overtakes the
        call after its open check makes it return (the close waited for the
        work); it never reaches the destroyed stream."""
        self._check_open()
        self._impl.synchronize()

    def enqueue_wait_for(self, other: DeviceContext | DeviceStream | DeviceEvent) -> DeviceEvent:
        """Make later work on the current stream wait, on the device, for ``other``:
        a context (its current stream's work so far), a stream, or an event. The host
        never blocks (``cuStreamWaitValue64`` / ``cuStreamWaitEvent``)."""
        self._check_open()
        source: _StreamImpl | None = None
        if isinstance(other, _UserEvent):
            # The point of its latest record, as it stands now: a later record
            # does not move this wait (cuStreamWaitEvent's snapshot).
            ev: DeviceEvent | None = other._wait_point()
        elif isinstance(other, DeviceEvent):
            if other._stream is None:  # (waiting on it would hold the stream for good)
                raise ValueError("enqueue_wait_for: the event was never recorded on a stream")
            ev = other
        elif isinstance(other, DeviceContext):
            other._check_open()
            source = other._impl
            ev = source.tail()
        elif isinstance(other, DeviceStream):
            other._ctx._check_open()
            source = other._impl
            ev = source.point()
        else:
            raise TypeError(
                f"enqueue_wait_for takes a DeviceContext, DeviceStream or DeviceEvent, not "
                f"{type(other).__name__}"
            )
        impl = self._impl
        if source is impl or (ev is not None and ev._stream is impl):
            return _completed()
        out = _completed() if ev is None else impl.wait_event(ev)
        trace = self._state.trace
        if trace is not None:
            # The edge comes from what was traced last on the other stream, even when
            # that work has already finished (so nothing is left to wait for).
            waits = () if ev is None else (ev,)
            lanes = () if source is None else (source.label,)
            trace.record(impl, out, "wait", _wait_label(impl, other, source), 0, waits, lanes)
        return out

    # -- memory --------------------------------------------------------------------------------

    def _enqueue_create_buffer(self, dtype: Any, size: int) -> DeviceBuffer:
        """``enqueue_create_buffer``: a device buffer of ``size`` elements,
        allocated in stream order on the current stream from the device's memory
        pool (``cuMemAllocFromPoolAsync``). It is owned by the current stream and
        freed on it. An allocation that overlaps ``close()`` on another thread
        either ends before the close goes on (and its buffer is one of the
        closed context) or raises ``ContextClosedError``. (The general path,
        which the compiled ``ContextCore.enqueue_create_buffer`` falls back to
        where the current stream kept no memory of that size.)"""
        self._check_open()
        dt = as_dtype(dtype)
        size = check_size(size)
        alloc = self._impl.alloc_device(alloc_bytes(dt, size))
        return DeviceBuffer(self, alloc, dt, size, self._impl)

    if TYPE_CHECKING:  # ContextCore's, which takes the same arguments (the class docstring)
        enqueue_create_buffer = _enqueue_create_buffer

    def create_buffer_sync(self, dtype: Any, size: int) -> DeviceBuffer:
        """Like ``enqueue_create_buffer``, then blocks until the allocation is done
        (``cuStreamSynchronize``); ``ContextClosedError`` if the context was
        closed before the wait began (a close that overtakes the wait itself
        leaves it returning the buffer, one of the closed context)."""
        buf = self.enqueue_create_buffer(dtype, size)
        self.synchronize()
        return buf

    def enqueue_create_host_buffer(self, dtype: Any, size: int) -> HostBuffer:
        """A page-locked host buffer of ``size`` elements the device can reach (from
        the pinned pool on CUDA, ``cuMemHostAlloc`` when the pool has no block of
        that size, which blocks; plain host memory on the CPU device).
        ``ContextClosedError`` if a ``close()`` on another thread has begun
        by the time the memory is there (it is given back)."""
        self._check_open()
        dt = as_dtype(dtype)
        size = check_size(size)
        alloc = self._impl.alloc_host(alloc_bytes(dt, size))
        return HostBuffer(self, alloc, dt, size, self._impl)

    # -- copies ------------------------------------------------------------------------------

    def enqueue_copy(
        self, dst: Any, src: Any, size: int | None = None, *, dtype: Any = None
    ) -> DeviceEvent:
        """Copy between device buffers, host buffers, NumPy arrays (host spans) and raw
        addresses, on the current stream (``cuMemcpyAsync``).

        * buffer <- buffer: the same dtype; the destination's length is copied, and
          the source has at least as many elements;
        * buffer <- array / array <- buffer: the array has at least as many
          elements as the buffer; the buffer's length is copied;
        * buffer <- int address / int address <- buffer: the buffer's length;
        * int address <- int address: ``size`` elements of ``dtype``.

        Buffers owned by other streams are ordered automatically: the copy waits
        for their earlier work, and their later work waits for the copy.
        """
        return self._copy(dst, src, size, dtype, True)

    def enqueue_copy_no_cross_stream_sync(self, dst: Any, src: Any) -> DeviceEvent:
        """``enqueue_copy`` without the cross-stream ordering: the caller makes sure
        the source is ready and not reused until the copy completes."""
        return self._copy(dst, src, None, None, False)

    def _copy(self, dst: Any, src: Any, size: int | None, dtype: Any, cross: bool) -> DeviceEvent:
        # The hot path: the open check inline, one core call that checks the
        # operands, then the stream's copy (compiled on CUDA down to the driver).
        state = self._state
        if state.closed or not self._ref.open:
            raise ContextClosedError(f"the DeviceContext {state.describe()} is closed")
        d, s, nbytes = copy_operands(self, dst, src, size, dtype)
        impl = self._impl
        owners: tuple[_StreamImpl, ...] = ()
        tails: tuple[DeviceEvent, ...] = ()
        if cross:
            do, so = d._owner, s._owner
            if do is not None and do is not impl:
                owners = (do,)
            if so is not None and so is not impl and so is not do:
                owners = (*owners, so)
            if owners:
                tails = tuple(t for o in owners if (t := o.tail()) is not None)
                for t in tails:
                    if not t._done:
                        impl.wait_event(t)
        ev = impl.copy(d, s, nbytes, (dst, src))
        for o in owners:
            # (a closing owner takes no later work to order after the copy; the
            # copy's event keeps its buffer alive until the copy is done)
            with contextlib.suppress(ContextClosedError):
                o.wait_event(ev)
        if state.trace is not None:
            # The edges are the owners' work the copy was ordered after (their tails
            # before the copy, not the waits inserted behind it).
            state.trace.record(impl, ev, "copy", f"copy {s._kind}->{d._kind}", nbytes, tails)
        return ev

    def enqueue_memset(self, dst: DeviceBuffer | HostBuffer, val: Any) -> DeviceEvent:
        """Set every element of ``dst`` to ``val`` (``cuMemsetD8/16/32Async``; 64-bit
        elements through a 2-D 32-bit memset). ``val`` must fit the dtype."""
        self._check_open()
        if not isinstance(dst, _BufferBase):
            raise TypeError(f"enqueue_memset needs a DeviceBuffer or HostBuffer, not {dst!r}")
        if dst._ctx._state is not self._state or dst._alloc is None:
            check_kernel_buffer(self._state, dst, "enqueue_memset")
        _check_writable(dst)
        value = _scalar_for(dst._dtype, val)
        if dst._dtype.itemsize not in (1, 2, 4, 8):
            raise TypeError(f"memset supports 1, 2, 4 and 8-byte elements, not {dst._dtype}")
        ev = self._impl.memset(dst, value, dst._size, dst)
        if self._state.trace is not None:
            self._state.trace.record(self._impl, ev, "memset", "memset", dst._nbytes)
        return ev

    # -- functions ---------------------------------------------------------------------------

    def compile_function(
        self,
        func: Any,
        name: str | None = None,
        *,
        compile_options: str | Sequence[str] = "",
        link_options: str = "",
        func_attribute: FuncAttribute | None = None,
        dump_asm: bool | str | os.PathLike[str] = False,
        dump_sass: bool | str | os.PathLike[str] = False,
        ptxas_info_verbose: bool = False,
    ) -> DeviceFunction:
        """Compile ``func`` for this device: CUDA C++ source text (with ``name``, the
        ``extern "C"`` entry point) or a ``Kernel`` on CUDA (NVRTC, for the device's own
        architecture, cached on disk); a ``Kernel`` with a NumPy body or a Python
        function on the CPU device. ``dump_asm`` / ``dump_sass``: True keeps the PTX /
        SASS on the result (``.asm``, ``.sass``), a path writes it there. Compile
        errors raise ``CompileError`` with the compiler's log. Blocks until the
        kernel is compiled and loaded on the device (on CUDA ``cuFuncLoad``, so that
        its first launch runs beside the kernels already running rather than after
        them, as the driver's lazy loading would have it)."""
        self._check_open()
        opts = {
            "compile_options": compile_options,
            "link_options": link_options,
            "dump_sass": dump_sass,
            "ptxas_info_verbose": ptxas_info_verbose,
        }
        # A repeat of the same compile is a dictionary lookup (no compiler, no
        # module load). Dumps are written on the first compile only.
        try:
            key: Any = (
                "compile",
                func,
                name,
                compile_options if isinstance(compile_options, str) else tuple(compile_options),
                link_options,
                func_attribute,
                bool(dump_asm),
                bool(dump_sass),
                ptxas_info_verbose,
            )
            hit = self._state.compiled.get(key)
        except TypeError:  # an unhashable function object: compile every time
            key, hit = None, None
        if hit is not None:
            return hit
        fn = self._state.backend.compile(self, func, name, opts, func_attribute, dump_asm)
        if key is not None:
            self._state.compiled[key] = fn
        return fn

    def load_function(
        self, *, function_name: str, asm: str | bytes, func_attribute: FuncAttribute | None = None
    ) -> DeviceFunction:
        """Load ``function_name`` from PTX text or a cubin (``cuLibraryLoadData``,
        then ``cuFuncLoad``); blocks until it is loaded on the device."""
        self._check_open()
        return self._state.backend.load(self, function_name, asm, func_attribute)

    def _compiled(self, f: Any, func_attribute: FuncAttribute | None) -> DeviceFunction:
        if isinstance(f, DeviceFunction):
            if f._ctx._state is not self._state:
                raise ValueError("this DeviceFunction was compiled for another context")
            return f
        if not isinstance(f, (Kernel, str)) and not callable(f):
            raise TypeError(f"cannot launch {type(f).__name__}; pass a DeviceFunction")
        # Keyed by the object itself, not its id: a bound method is a new object at
        # each ``obj.method``, and a dead one's id is soon another's (an id key
        # can launch the wrong method's kernel). An unhashable one is compiled
        # each time.
        try:
            key: Any = ("launch", f, func_attribute)
            fn = self._state.compiled.get(key)
        except TypeError:
            key, fn = None, None
        if fn is None or fn._impl is None:
            fn = self.compile_function(f, func_attribute=func_attribute)
            if key is not None:
                self._state.compiled[key] = fn
        return fn

    def _enqueue_function(
        self,
        f: DeviceFunction | Kernel | Callable[..., Any],
        *args: Any,
        grid_dim: DimLike,
        block_dim: DimLike,
        cluster_dim: DimLike | None = None,
        shared_mem_bytes: int | None = None,
        attributes: Sequence[LaunchAttribute] = (),
        constant_memory: Sequence[ConstantMemoryMapping] = (),
        func_attribute: FuncAttribute | None = None,
    ) -> DeviceEvent:
        """``enqueue_function``: launch ``f`` on the current stream
        (``cuLaunchKernelEx``; on the CPU device its NumPy body runs once per block
        on the pool). Arguments: device and host buffers, NumPy scalars,
        objects with ``__cuda_array_interface__``; anything else (a Python int or
        float: give it a NumPy type; a NumPy array: copy it into a buffer) raises
        ``TypeError``, on every device alike. Returns at once; the event completes
        when the kernel has. (The general path, which the compiled
        ``ContextCore.enqueue_function`` falls back to for a function, a geometry
        or a context it has not seen, or a traced one.)"""
        state = self._state
        if state.closed or not self._ref.open:
            self._check_open()
        if type(f) is not DeviceFunction or f._ctx._state is not state:
            f = self._compiled(f, func_attribute)
        # Geometry is validated once per shape and cached on the function. Only
        # integer geometry is looked up: 256.0 or True equal 256 as dict keys, and
        # must not pass for it (validation raises TypeError for them).
        if (
            (type(grid_dim) is int or _int_dims(grid_dim))
            and (type(block_dim) is int or _int_dims(block_dim))
            and (cluster_dim is None or _int_dims(cluster_dim))
            and (shared_mem_bytes is None or type(shared_mem_bytes) is int)
        ):
            if attributes and not all(isinstance(a, LaunchAttribute) for a in attributes):
                # (raises the TypeError that names them, before they are hashed)
                self._launch_config(
                    f, grid_dim, block_dim, cluster_dim, shared_mem_bytes, attributes
                )
            # The key as the compiled enqueue_function looks it up (built in C only).
            key = native.launch_key(grid_dim, block_dim, cluster_dim, shared_mem_bytes, attributes)
            cfgs = f._cfgs
            cfg = cfgs.get(key)
            if cfg is None:
                cfg = self._launch_config(
                    f, grid_dim, block_dim, cluster_dim, shared_mem_bytes, attributes
                )
                if len(cfgs) >= MAX_LAUNCH_CONFIGS:
                    cfgs.clear()
                cfgs[key] = cfg
        else:
            cfg = self._launch_config(
                f, grid_dim, block_dim, cluster_dim, shared_mem_bytes, attributes
            )
        ev = self._impl.launch(f, args, cfg, constant_memory)
        if state.trace is not None:
            state.trace.record(self._impl, ev, "kernel", f.name)
        return ev

    if TYPE_CHECKING:  # ContextCore's, which takes the same arguments (the class docstring)
        enqueue_function = _enqueue_function

    def _launch_config(
        self,
        f: DeviceFunction,
        grid_dim: DimLike,
        block_dim: DimLike,
        cluster_dim: DimLike | None,
        shared_mem_bytes: int | None,
        attributes: Sequence[LaunchAttribute],
    ) -> Any:
        """Validate a launch geometry against the device's limits once; the backend
        turns it into its own launch configuration, cached on the function."""
        state = self._state
        grid = Dim.of(grid_dim, "grid_dim")
        block = Dim.of(block_dim, "block_dim")
        cluster = Dim.of(cluster_dim, "cluster_dim") if cluster_dim is not None else None
        for a in attributes:
            if not isinstance(a, LaunchAttribute):
                raise TypeError(f"attributes must be LaunchAttribute objects, not {a!r}")
            if a.id == LaunchAttributeID.CLUSTER_DIMENSION:
                if cluster is not None and cluster != a.value:
                    raise ValueError("cluster_dim and a CLUSTER_DIMENSION attribute disagree")
                cluster = a.value
        lim = state.limit
        threads = block.size()
        if threads > lim(DeviceAttribute.MAX_THREADS_PER_BLOCK):
            raise ValueError(
                f"block_dim {tuple(block)} has {threads} threads; the device allows "
                f"{lim(DeviceAttribute.MAX_THREADS_PER_BLOCK)} per block"
            )
        for axis, v, attr in (
            ("x", block.x, DeviceAttribute.MAX_BLOCK_DIM_X),
            ("y", block.y, DeviceAttribute.MAX_BLOCK_DIM_Y),
            ("z", block.z, DeviceAttribute.MAX_BLOCK_DIM_Z),
        ):
            if v > lim(attr):
                raise ValueError(f"block_dim.{axis}={v} exceeds the device's {lim(attr)}")
        for axis, v, attr in (
            ("x", grid.x, DeviceAttribute.MAX_GRID_DIM_X),
            ("y", grid.y, DeviceAttribute.MAX_GRID_DIM_Y),
            ("z", grid.z, DeviceAttribute.MAX_GRID_DIM_Z),
        ):
            if v > lim(attr):
                raise ValueError(f"grid_dim.{axis}={v} exceeds the device's {lim(attr)}")
        if shared_mem_bytes is None:
            shmem = 0
        elif isinstance(shared_mem_bytes, (int, np.integer)) and not isinstance(
            shared_mem_bytes, bool
        ):
            shmem = int(shared_mem_bytes)
        else:
            raise TypeError(f"shared_mem_bytes must be an int, not {shared_mem_bytes!r}")
        if shmem < 0:
            raise ValueError(f"shared_mem_bytes must not be negative, got {shmem}")
        optin = lim(DeviceAttribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        if shmem > optin:
            raise ValueError(
                f"shared_mem_bytes={shmem} exceeds the device's {optin} bytes per block"
            )
        if cluster is not None:
            if state.api != "cuda" or not lim(DeviceAttribute.CLUSTER_LAUNCH):
                raise UnsupportedError("this device has no thread-block clusters")
            for g, c in zip(grid, cluster, strict=False):
                if g % c:
                    raise ValueError(
                        f"grid_dim {tuple(grid)} is not a multiple of cluster_dim {tuple(cluster)}"
                    )
        return state.backend.make_launch_config(f, grid, block, shmem, cluster, attributes)

    def enqueue_cpu_function(
        self, func: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> DeviceEvent:
        """Run ``func(*args, **kwargs)`` on the CPU pool after everything before it on
        the current stream; later work on the stream waits for it (on CUDA, on the
        device). The event's value is ``func``'s return value; its exception is
        raised at the await, and the stream goes on with later work."""
        self._check_open()
        if not callable(func):
            raise TypeError(f"enqueue_cpu_function needs a callable, not {func!r}")
        _refuse_coroutine_function(func, "enqueue_cpu_function")
        ev = self._impl.cpu_call(func, args, kwargs)
        if self._state.trace is not None:
            self._state.trace.record(self._impl, ev, "cpu", getattr(func, "__name__", "cpu"))
        return ev

    def enqueue_cpu_range(self, func: Callable[[int], Any], count: int) -> DeviceEvent:
        """Run ``func(i)`` once for each ``i`` in ``range(count)``, in parallel over the
        CPU pool, in stream order: the range starts after earlier work on the stream
        and ends before later work starts."""
        self._check_open()
        if not callable(func):
            raise TypeError(f"enqueue_cpu_range needs a callable, not {func!r}")
        _refuse_coroutine_function(func, "enqueue_cpu_range")
        count = check_size(count)
        ev = self._impl.cpu_range(func, count)
        if self._state.trace is not None:
            self._state.trace.record(self._impl, ev, "cpu_range", f"range({count})")
        return ev

    # -- timing --------------------------------------------------------------------------------

    def execution_time(self, func: Callable[..., Any], num_iters: int) -> int:
        """Total nanoseconds of ``num_iters`` calls of ``func(ctx)`` or ``func()`` on the
        current stream (CUDA events around the loop on CUDA)."""
        call = self._adapt(func, 1)
        return self._time(lambda: [call(i) for i in range(num_iters)], num_iters)

    def execution_time_iter(self, func: Callable[..., Any], num_iters: int) -> int:
        """Like ``execution_time`` for ``func(ctx, i)`` or ``func(i)``."""
        call = self._adapt(func, 2)
        return self._time(lambda: [call(i) for i in range(num_iters)], num_iters)

    def _adapt(self, func: Callable[..., Any], full: int) -> Callable[[int], Any]:
        if not callable(func):
            raise TypeError(f"execution_time needs a callable, not {func!r}")
        try:
            params = [
                p
                for p in inspect.signature(func).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            ]
            n = len(params)
        except (TypeError, ValueError):
            n = full
        if full == 1:
            return (lambda i: func(self)) if n >= 1 else (lambda i: func())
        if n >= 2:
            return lambda i: func(self, i)
        return lambda i: func(i)

    def _time(self, body: Callable[[], Any], num_iters: int) -> int:
        self._check_open()
        num_iters = check_int(num_iters, "num_iters")
        if num_iters < 0:
            raise ValueError(f"num_iters must not be negative, got {num_iters}")
        return int(self._state.backend.elapsed_ns(body, self._impl))

    # -- tracing ---------------------------------------------------------------------------------

    def trace(
        self, path: str | os.PathLike[str] | None = None, *, device_times: bool = True
    ) -> _TraceBlock:
        """Record the dependency graph of the work enqueued inside the block
        (``with ctx.trace() as t:`` or ``async with ctx.trace() as t:``). With a
        ``path`` the Chrome/Perfetto trace JSON is written there on exit.

        ``device_times`` (CUDA): each operation is followed by a timing event
        (one ``cuEventRecord``, host time on every operation) that gives its
        device start and end; ``False`` records the host times alone, which
        skips that driver call and so adds to a launch about half of what
        device times add, or less (see the performance page).

        On exit tracing stops; with a ``path`` the exit first waits for every
        stream of the context, then writes the file. ``with`` blocks the calling
        thread for that wait (``synchronize``), which inside a coroutine stalls
        its event loop; ``async with`` awaits the streams instead, so other
        tasks run meanwhile, then writes the file with a plain write on the
        loop's thread (a file of a few thousand operations takes milliseconds).
        If the awaiting task is cancelled, the file is still written, with the
        operations not yet finished marked incomplete."""
        self._check_open()
        if type(device_times) is not bool:
            raise TypeError(f"device_times must be a bool, not {type(device_times).__name__}")
        return _TraceBlock(self, os.fspath(path) if path is not None else None, device_times)

    def __repr__(self) -> str:
        state = "closed" if self._state.closed else self._impl.label
        return f"<DeviceContext {self._state.describe()} {state}>"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DeviceContext)
            and other._state is self._state
            and other._impl is self._impl
        )

    def __hash__(self) -> int:
        return hash((id(self._state), id(self._impl)))


# The most launch geometries one function keeps validated (``_cfgs``). A program
# whose shapes follow its data (a grid per input size) would otherwise grow the
# cache for good. Full, it is cleared, not trimmed: the compiled launch reads it
# as a plain dict (an LRU would cost bookkeeping on every hit), the shapes in
# use come back at once, and one that falls out is only validated again. The
# compiled launch's copy of the last configuration stays valid: an entry is
# never changed, only dropped.
MAX_LAUNCH_CONFIGS = 1024

_SCALAR_SAMPLES = (
    np.float32(-1.2345678),
    np.float64(-1.2345678901234567e-300),
    np.int8(-101),
    np.int16(-12345),
    np.int32(-1234567891),
    np.int64(-1234567890123456789),
    np.uint8(0xA5),
    np.uint16(0xA5C3),
    np.uint32(0xA5C3E1F7),
    np.uint64(0xA5C3E1F7_1B2D4F69),
)

# What the compiled enqueue_function and enqueue_create_buffer need of Python: the
# buffer and function classes and the dtype lookup; and the NumPy scalar
# arguments whose value the launch copies from the scalar itself (each checked
# with this sample, whose every byte matters) rather than through float() or
# __index__.
native.configure_buffers(DeviceBuffer, DeviceFunction, as_dtype, np.dtype)
native.configure_scalars(b"fdbhiqBHIQ", _SCALAR_SAMPLES)


class _TraceBlock:
    """What ``DeviceContext.trace`` returns: ``with`` (blocking exit) and
    ``async with`` (awaiting exit) over one recording."""

    __slots__ = ("_ctx", "_device_times", "_path", "_prev", "_trace")

    def __init__(self, ctx: DeviceContext, path: str | None, device_times: bool) -> None:
        self._ctx, self._path, self._device_times = ctx, path, device_times
        self._trace: Trace | None = None
        self._prev: Trace | None = None

    def __enter__(self) -> Trace:
        ctx = self._ctx
        ctx._check_open()
        if self._trace is not None:
            raise RuntimeError("this ctx.trace() block was entered already")
        state = ctx._state
        t = self._trace = Trace(path=self._path, device_stamps=self._device_times)
        self._prev, state.trace = state.trace, t
        return t

    def _stop(self) -> tuple[list[_StreamImpl], Trace]:
        state, t = self._ctx._state, self._trace
        assert t is not None
        state.trace = self._prev
        return state.all_streams(), t

    def __exit__(self, *exc: Any) -> None:
        streams, t = self._stop()
        if t.path is not None:
            for s in streams:
                with contextlib.suppress(Exception):
                    s.synchronize()
            write_chrome_trace(t, t.path)

    async def __aenter__(self) -> Trace:
        return self.__enter__()

    async def __aexit__(self, *exc: Any) -> None:
        streams, t = self._stop()
        if t.path is not None:
            try:
                for s in streams:
                    with contextlib.suppress(Exception):  # (as ``synchronize`` above)
                        ev = s.point()
                        if ev is not None:
                            await _Wait(ev)
            finally:
                write_chrome_trace(t, t.path)


class _Wait:
    """Await an event's completion without its outcome (faults still raise)."""

    __slots__ = ("ev",)

    def __init__(self, ev: DeviceEvent) -> None:
        self.ev = ev

    def __await__(self) -> Generator[Any, None, None]:
        yield from self.ev._wait_async()
        self.ev._raise_fault()


def _int_dims(v: Any) -> bool:
    """True for a launch dimension made only of integers (an int, a NumPy integer,
    or a tuple or Dim of them): one whose validity its value decides."""
    if isinstance(v, tuple):
        for c in v:  # noqa: SIM110 (a loop is quicker than all() on this path)
            if type(c) is not int and not isinstance(c, np.integer):
                return False
        return True
    return isinstance(v, np.integer)


def _wait_label(impl: _StreamImpl, other: Any, source: _StreamImpl | None) -> str:
    """A traced wait's label names what it waits for: ``wait s1`` (a stream, or a
    context's current stream), ``wait s1#2`` (operation 2 of s1, or the point
    where a user event was recorded there); a stream of another device keeps
    its device (``wait cuda:1/s0``)."""
    if source is not None:
        return f"wait {_lane_name(impl, source)}"
    stream = other._stream if isinstance(other, DeviceEvent) else None
    if stream is None:
        return "wait event"
    return f"wait {_lane_name(impl, stream)}#{other._seq}"


def _lane_name(impl: _StreamImpl, stream: Any) -> str:
    """``stream``'s label, without its device where it is ``impl``'s."""
    device, _, name = stream.label.rpartition("/")
    return name if device == impl.label.rpartition("/")[0] else stream.label


def _completed() -> DeviceEvent:
    ev = DeviceEvent(None)
    ev._done = True
    return ev


def _scalar_for(dt: np.dtype[Any], val: Any) -> np.generic:
    """The memset value ``val`` as one element of ``dt``: a NumPy scalar whose bytes
    (as the backends write them) are that element. ``ValueError`` unless ``val`` is
    a single number that fits ``dt`` (no silent truncation, overflow or dropped
    imaginary part)."""
    try:
        t = type(val)
        if t is not int and t is not float:
            if isinstance(val, np.ndarray) and val.ndim == 0:
                val = val[()]
            if isinstance(val, (str, bytes)) or not isinstance(val, (numbers.Number, np.generic)):
                raise TypeError("a memset value is a single number")
            if dt.kind != "c" and isinstance(val, (complex, np.complexfloating)):
                raise TypeError("a complex value only fits a complex dtype")
        out: np.generic
        if dt.kind in "iu":
            v = int(val)
            info = np.iinfo(dt)
            if not info.min <= v <= info.max or v != val:
                raise ValueError(f"{val!r} does not fit {dt}")
            out = dt.type(v)
        elif dt.kind == "b":
            if val not in (0, 1) or isinstance(val, (complex, np.complexfloating)):
                raise ValueError(f"{val!r} does not fit {dt} (0, 1, True or False)")
            out = dt.type(bool(val))
        else:
            with np.errstate(over="raise"):  # 1e300 does not fit float32: no silent inf
                out = np.array(val, dtype=dt)[()]  # type: ignore[assignment]
    except (TypeError, OverflowError, FloatingPointError) as e:
        raise ValueError(f"{val!r} cannot be stored as {dt}: {e}") from None
    if not dt.isnative:
        # NumPy scalars are native-endian and the backends write a scalar's bytes as
        # they are: swap them, so a big-endian buffer gets big-endian elements.
        out = out.byteswap()
    return out


def _any_polled_open() -> bool:
    return any(s.api == "cuda" and not s.closed for s in list(_open_states))
