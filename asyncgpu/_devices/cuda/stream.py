"""A CUDA stream (``CudaStream``): submission, completion markers, waits
between streams, host work on a stream, faults.

Completion: every stream owns a 64-bit counter in host-mapped pinned memory.
After an operation the stream writes the operation's sequence number into it
(``cuStreamWriteValue64``), so the host learns that work finished by reading
plain memory (see ``asyncgpu._core.engine``). Cross-stream and cross-device waits wait on the
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

A stream is made with ``cuStreamCreateWithPriority``, counted among its
device's hardware queues (``_join_queues``) and destroyed at ``close``
(``cuStreamDestroy``), or wraps another library's handle (neither counted nor
destroyed). Only
``synchronize`` and a blocking wait for an event (``_block``) wait in the
driver (``cuStreamSynchronize``, ``cuEventSynchronize``); the other driver
calls here enqueue and return. A call on the stream's handle from a thread
that may race with ``close`` (a wait, a fault check) goes through
``_HandleUse``, which the close waits on before it destroys the stream.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from cuda.bindings import driver as cu
from cuda.core import launch as _launch

from ... import _accel, _config
from ..._core import foreign as _interop
from ..._core.engine import watcher
from ..._core.event import DeviceEvent, _UserEvent
from ..._core.function import DeviceFunction
from ..._core.memory import HostBuffer
from ..._core.pool import cpu_pool, fan_out, host_work, range_work, start_chained, waiting_for
from ..._core.stream import _Gate, _HardwareQueues, _HostResult, _PolledStream, _StreamImpl
from ..._errors import ContextClosedError, DeviceFaultError, UnsupportedError
from .driver import (
    _GEQ,
    _NOT_READY,
    _STICKY,
    _SUCCESS,
    _check,
    _error,
    _memcpy,
    _memset,
    _record,
    _wait_event,
    _wait_event_once,
    _write_counter,
)
from .launch import _ArgPlan, _CudaFunction, _kernel_args, _LaunchCfg, _ParamMemory, _plan
from .memory import (
    _SPARE_BYTES,
    _SPARE_PER_SIZE,
    _Device,
    _free_spare,
    _pinned,
    _slab,
    _SpareBuffers,
    _StageKits,
)

if TYPE_CHECKING:
    from ..._core.state import _ContextState
    from ..._types import ConstantMemoryMapping

__all__ = ["CudaStream"]


class _StreamDevice(_Device, Protocol):
    """What a stream needs of its device (``backend.CudaBackend``, a module above)."""

    completion: str
    _stage_kits: _StageKits
    _free_stamps: list[Any]

    def write_constants(
        self, impl: _CudaFunction, mappings: Sequence[ConstantMemoryMapping], stream: CudaStream
    ) -> None: ...

    def launch_raw(
        self, stream: CudaStream, impl: _CudaFunction, cfg: _LaunchCfg, kargs: Sequence[Any]
    ) -> None: ...

    def stage_chunks(self, nbytes: int) -> list[Any]: ...

    def staged_copy(
        self, dst: Any, src: Any, nbytes: int, to_device: bool, chunks: list[Any] | None
    ) -> None: ...

    def new_stamp(self) -> Any: ...


def _kernel_markers() -> str:
    """What follows an eager launch on the C fast path (docs/completion.md): a
    write of the completion counter ("counter", the default) or a driver event
    ("event"), from ASYNCGPU_KERNEL_MARKERS (``_config``). The event costs the
    host less to place (``cuEventRecord`` against ``cuStreamWriteValue64``) but
    more to learn finished (a locked ``cuEventQuery`` per poll against a plain
    memory read), and an await polls more often than it places, so the counter
    is the default (see the performance page)."""
    return _config.SETTINGS.kernel_markers


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


class _HandleUse:
    """The threads inside a driver call on one stream's handle
    (``cuStreamSynchronize``, which blocks until the stream's work is done, and
    ``cuStreamQuery``), counted so that the stream's close destroys the handle
    only once they have left, and lets none in from then on (``end``).

    A thread may pass the context's open check (``synchronize()``,
    ``create_buffer_sync``, an event's ``synchronize()``, the fault checks of
    an await) just before another thread closes the context, and reach its
    driver call only after. Through ``enter`` it either gets in before the
    close ends the handle's use, and the close waits for it (not for long: the
    close has already waited for the stream's work, and no new work goes in),
    or finds the use ended and makes no call: the stream's work is done, since
    the close waited for it. Only the driver call itself is inside: a done
    callback that retiring runs may close the context, and the close must not
    wait for the thread that runs it."""

    __slots__ = ("_cond", "_inside", "ended")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inside = 0
        self.ended = False

    def enter(self) -> bool:
        """Count the calling thread in (False, and nothing counted: ended)."""
        with self._cond:
            if self.ended:
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._inside -= 1
            if not self._inside:
                self._cond.notify_all()

    def end(self) -> None:
        """Let no thread in from now on, and block until those inside have left."""
        with self._cond:
            self.ended = True
            while self._inside:
                self._cond.wait()


class CudaStream(_PolledStream):
    """A CUDA stream with a completion counter and a host-work counter."""

    def __init__(
        self,
        state: _ContextState,
        index: int,
        priority: int,
        backend: _StreamDevice,
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
        if self.owned:
            # (A wrapped stream adds no stream to the device: its owner's streams
            # hold their queues whether asyncgpu wraps them or not.)
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
        # The extension's RLock: the compiled completion and launch take it without
        # a Python call.
        self._marker_lock = _accel.native.RLock()
        self._free_events: list[Any] = []
        self._done_seq = 0  # the last marker event seen finished
        # Counter completion: the markers placed right after a copy or memset are
        # driver events all the same, (seq, CUevent) in order (see the module doc).
        self._copy_marks: deque[tuple[int, Any]] = deque()
        self._after_copy = False  # the last operation submitted was a copy or memset
        self._counter_mark = 0  # the last sequence number a counter marker covers
        # Event completion (ASYNCGPU_COMPLETION=event): every marker is a driver
        # event, (seq, CUevent) in order, which the compiled _completed queries.
        self._events: deque[tuple[int, Any]] | None = (
            deque() if backend.completion == "event" else None
        )
        self._host_ops = 0
        # Per plan, the memory its launches pack into. An entry is made once and
        # never replaced: the extension's launch keeps the last one it found.
        self._param_mem: dict[_ArgPlan, _ParamMemory] = {}
        self._write_marker: Callable[[int], Any] = partial(
            _accel.native.write64, self.h, self.caddr
        )
        self.external_owner = external_owner
        self.is_closed = False
        self._handle_use = _HandleUse()
        self.label = f"cuda:{state.device_id}/s{index}"
        self.spare = _SpareBuffers(_SPARE_BYTES, _SPARE_PER_SIZE)
        # Kept buffers are freed on this stream while it lives: at close, or at
        # interpreter exit (before cuda.core's teardown) if it is never closed.
        self._free_spare = weakref.finalize(self, _free_spare, self.spare, backend, self.cs)
        # What the driver gave this stream goes back at close, or, for a stream of
        # a context dropped without close, once the stream is collected: that is
        # only after its work has finished (work in flight keeps the stream
        # reachable, from the watcher's sweep or the CPU pool). Not at
        # interpreter exit, which may still wait for the stream's work: the
        # process's end frees it then.
        self._release = weakref.finalize(
            self,
            _release_stream,
            self.spare,
            backend,
            self.cs,
            raw if self.owned else None,
            (self.caddr, self.saddr),
            self._marker_lock,
            self._free_events,
            self._copy_marks,
            self._events,
        )
        self._release.atexit = False

    def handle(self) -> int:
        return self.h

    def point(self) -> DeviceEvent | None:
        if self.owned:
            return self.tail()
        # A wrapped stream: its owner's work is invisible to tail(), so an empty
        # operation of ours now stands for it too.
        return self.fence()

    # Whether a wrapped stream's fence is marked by a driver event (``fence``);
    # False: by the counter, as other operations (benchmarks compare the two).
    _fence_event_marker = True

    def fence(self) -> DeviceEvent:
        """An empty operation of ours (no driver call of its own): its event stands
        for everything submitted to the stream so far, by asyncgpu or, on a wrapped
        stream, by the library that owns it. Its marker, placed now when the stream
        is eager, else by the first await or query, is on a wrapped stream a driver
        event from the stream's own pool (``cuEventRecord``), which the completion
        asks with ``cuEventQuery``: the owner's last work is most often a copy (a
        result coming back to the host), after which a counter write's memory fence
        waits for the copy engine, and a recorded event costs the host less to
        place. A fence of an owned stream follows the usual marker rules. Never
        blocks; it makes no Python object but its event (and, once marked, the
        marker's entry)."""
        with self._submit_lock:
            self._before_submit()
            if not self.owned and self._fence_event_marker:
                self._after_copy = True  # (what _place_marker reads: a driver event)
            ev = self._mark(None)
        self._prune()
        return ev

    def wait_for_event_handle(self, handle: int) -> None:
        """Later work here waits, on the device, for another library's driver event
        (``cuStreamWaitEvent``: the event's latest record when this is called; one
        never recorded orders nothing). Enqueues and returns; a stream held behind
        host work queues the wait."""
        with self._submit_lock:
            self._issue(0, _wait_event, self.raw, cu.CUevent(handle))

    # -- the hot path ------------------------------------------------------------------

    if TYPE_CHECKING:

        def _mark(self, keep: Any) -> DeviceEvent:
            """The event of the operation just submitted, keeping ``keep`` alive
            (call with ``_submit_lock`` held, after ``_before_submit`` and the
            driver call); the marker too when the stream is eager."""
            ...
    else:
        # The compiled one, which the compiled copy runs too.
        _mark = _accel.native.StreamCore._mark_c

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
        """Hand the marker for ``seq`` to the driver: the counter write
        (``cuStreamWriteValue64``), or a driver event recorded in C
        (``StreamCore._record_marker_c``: ``cuEventRecord``, under
        ``_marker_lock``). Both enqueue and return."""
        if not event:
            err = self._write_marker(seq)
            if err:
                raise _error(err, "cuStreamWriteValue64")
        else:
            self._record_marker_c(seq)
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

    if not TYPE_CHECKING:
        # The compiled completion (``_counter_in_c``): the counter read in C, and
        # the marker events (after copies; every one with event completion)
        # queried there (``cuEventQuery``, under ``_marker_lock``; their events
        # are reused). Chosen here, for every stream of the class, not per stream.
        _completed = _accel.native.StreamCore._completed_fast

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

    # Retire what has finished (releasing what it kept alive) and have the watcher
    # sweep this stream later: the compiled prune, which the compiled launch and
    # copy run too.
    _prune = _accel.native.StreamCore._prune_c

    # ``launch`` (the seam's, ``_StreamImpl.launch``) is the compiled launch,
    # ``StreamCore._launch_c``: with a plain geometry, no constant memory and the
    # function's last plan (``last``) matching the arguments' types, it checks,
    # packs and launches in one C call (under the submit lock, the marker rules of
    # ``_before_submit``, ``cuLaunchKernel`` with the counter marker when the
    # stream is eager, the event, then ``_prune``); every other launch it hands to
    # ``_launch``.
    if not TYPE_CHECKING:
        launch = _accel.native.StreamCore._launch_c

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
        """The general launch: every launch the compiled one (``launch``) hands
        back, and the only implementation of those. It makes what the compiled
        launch lacked (the plan of these argument types, which it checks against
        the kernel's signature, and this stream's parameter memory for it) and
        writes constant memory, then gives the launch back to the compiled one;
        handed back again with nothing new to make, it launches here: a stream
        held behind host work (the launch queued), a cluster, cooperative or
        priority launch, arguments the compiled launch does not pack (another
        library's arrays, ordered with its streams; cuda.core objects, float16,
        bool, a kernel without a signature): through cuda.core's ``launch``
        (``_launch_now``). A buffer that cannot be used raises here."""
        if impl is None:
            raise UnsupportedError(f"{fn!r} was released")
        last = impl.last
        plan = _plan(impl, args)
        if constant_memory:
            self.backend.write_constants(impl, constant_memory, self)
        if plan.codes is not None and cfg.dims is not None and self._pending is None:
            ready = plan is last and not constant_memory
            mems = self._param_mem
            if plan not in mems:
                # (made once and never replaced: the compiled launch keeps the
                # last one it found)
                mems.setdefault(plan, _ParamMemory(8 * len(plan.types)))
                ready = False
            if not ready:
                return self.launch(fn, args, cfg, ())
        if plan.structs and getattr(cfg.cc, "cluster", None):
            raise TypeError(
                "a cluster launch cannot take a structured scalar argument: pass the "
                "struct's fields instead"
            )
        kargs = _kernel_args(plan, args, self.state)
        if plan.foreign and self._pending is not None:
            self._settle()  # the other library's stream will wait for this launch
        with self._submit_lock:
            self._before_submit()
            # Arrays of other libraries (CuPy, PyTorch): order the launch after
            # their producer stream, and that stream after the launch.
            waits = _interop.launch_streams(self, args) if plan.foreign else ()
            raw = plan.structs
            if self._pending is not None:
                self._pending.append(
                    (self._seq + 1, partial(self._launch_now, impl, cfg, kargs, raw))
                )
            else:
                self._launch_now(impl, cfg, kargs, raw)
            self._after_copy = False
            ev = self._mark(args)
            if waits:
                _interop.launch_done(self, waits)
        self._prune()
        return ev

    def _launch_now(
        self, impl: _CudaFunction, cfg: _LaunchCfg, kargs: Sequence[Any], raw: bool = False
    ) -> None:
        """A launch through cuda.core (or ``cuLaunchKernelEx`` for a priority, or
        for structured scalars, which cuda.core cannot pass)."""
        if cfg.priority is None and not raw:
            _launch(self.cs, cfg.cc, impl.kernel, *kargs)
        else:
            self.backend.launch_raw(self, impl, cfg, kargs)

    def copy(self, dst: Any, src: Any, nbytes: int, keep: Any) -> DeviceEvent:
        """``cuMemcpyAsync`` between device or page-locked memory (never blocks the
        host), in one compiled call (``StreamCore._copy_c``: the marker rules,
        the driver call, the event, the prune, under the submit lock); pageable
        memory is staged through pinned buffers by host work. A stream held
        behind host work queues the copy here instead."""
        if nbytes and (dst._kind == "pageable" or src._kind == "pageable"):
            return self._staged_copy(dst, src, nbytes, keep)
        ev = self._copy_c(dst._ptr, src._ptr, nbytes, keep)
        if ev is not None:
            return ev  # type: ignore[return-value]
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

    def graph_launch(self, graph: Any, exe: Any, handle: int, params: Any) -> DeviceEvent:
        """``cuGraphLaunch`` of the instantiated graph ``exe`` (a ``CUgraphExec``,
        ``handle`` as an int) of the device graph ``graph`` with the parameters
        ``params``, in stream order: it starts after the stream's earlier work,
        and later work waits for all of it. Never blocks the host; a stream held
        behind host work queues the launch. ``graph`` and ``params`` live until
        the launch is seen to finish. In one compiled call
        (``StreamCore._graph_c``: the marker rules, the driver call under the
        graph's lock, the event, the prune) while the driver graph holds
        ``params``; else the graph makes the call (``CudaGraph.launch``, which
        sets them first)."""
        keep = (graph, params)
        ev = self._graph_c(handle, graph.lock, graph.applied, params.serials, keep)
        if ev is not None:
            return ev  # type: ignore[return-value]
        self.backend.make_current()
        with self._submit_lock:
            self._before_submit()
            self._issue(self._seq + 1, graph.launch, exe, params, self.raw)
            self._after_copy = False
            ev = self._mark(keep)
        self._prune()
        return ev

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
                # The host work right behind this one; in a loop, not nested (an
                # empty range finishes inside its start).
                start_chained(_call, after)

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
            prev.add_done_callback(lambda _e: start_chained(begin, None))
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
            if self._closing:
                self._refuse_closed()
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
            err = self._on_handle(cu.cuStreamSynchronize)
            if err is not None:  # (None: closed meanwhile, its work done)
                if err != _SUCCESS:
                    self._raise_fault(err, "cuStreamSynchronize")
                self._retire()
            if ev._done:
                return
        super()._block(ev)

    def synchronize(self) -> None:
        """Block until the stream's work is done (``cuStreamSynchronize``, after
        held work has been handed to the driver). A close on another thread that
        overtakes this call before the driver call makes it return as if it had
        come first (the close waited for the work), never call the driver on the
        destroyed stream (``_HandleUse``)."""
        with waiting_for(self):
            self._settle()  # cuStreamSynchronize sees only what the driver was given
            tail = self.tail()
            if tail is not None:
                self._need(tail, eager=False)
            err = self._on_handle(cu.cuStreamSynchronize)
            if err is not None and err != _SUCCESS:
                self._raise_fault(err, "cuStreamSynchronize")
            # Host work may still be finishing its completion write: let it land.
            super().synchronize()

    def _on_handle(self, call: Callable[[Any], tuple[Any, ...]]) -> Any:
        """``call(handle)``'s error code (a driver call on this stream's handle),
        or None, and no call, once the stream's close has begun destroying it; the
        close waits for the call to return (``_HandleUse``)."""
        use = self._handle_use
        if not use.enter():
            return None
        try:
            return call(self.raw)[0]
        finally:
            use.leave()

    def _raise_fault(self, err: Any, what: str) -> None:
        e = _error(err, what)
        if isinstance(e, DeviceFaultError) or err in _STICKY:
            self.state.fail_all(e)
        raise e

    def _query_fault(self) -> BaseException | None:
        err = self._on_handle(cu.cuStreamQuery)  # (None: closed; its work was waited for)
        if err is None or err in (_SUCCESS, _NOT_READY):
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
        """Give back what the driver gave the stream (``_release_stream``:
        ``cuStreamDestroy`` where it owns the stream), once the threads inside a
        driver call on its handle have left; none enters after (``_HandleUse``).
        The context's close calls it after it has waited for the stream's work,
        so those calls return promptly. The release holds the submission lock, so
        a marker being placed (an await's, the watcher's) reaches the driver
        before the stream goes; one placed after finds its operation done and
        places nothing."""
        watcher.forget(self)
        self._free_spare.detach()
        self.is_closed = True
        if self.owned:
            _leave_queues(self._queues, self)
        if self._inflight:
            self._retire()  # (while the counter is still this stream's)
        self._handle_use.end()
        with self._submit_lock:
            self._release()
        if self._inflight:
            # Work whose end the close's wait did not see (that wait failed
            # without failing the stream): nothing can learn it any more, so it
            # fails now rather than leave a blocking wait polling for good.
            self._fail(ContextClosedError(f"{self.label} was closed before its work ended"))


def _release_stream(
    spare: Any,
    backend: _StreamDevice,
    cs: Any,
    raw: Any,
    counters: tuple[int, int],
    marker_lock: Any,
    free_events: list[Any],
    copy_marks: deque[tuple[int, Any]],
    events: deque[tuple[int, Any]] | None,
) -> None:
    """Give back what the driver gave a stream: the buffers it kept (freed on it
    first), its marker events, the stream itself (``cuStreamDestroy``, where it
    owns it) and its counter slots. Called once: at the stream's close, or when
    a stream nobody closed is collected. (Holds nothing of the stream object,
    which a finalizer must not.)"""
    _free_spare(spare, backend, cs)
    with marker_lock:
        marks = [*(events or ()), *copy_marks]
        for e in [*free_events, *(x[1] for x in marks)]:
            cu.cuEventDestroy(e)
        free_events.clear()
        copy_marks.clear()
    if raw is not None:
        cu.cuStreamDestroy(raw)
    for addr in counters:
        _slab.give_back(addr)


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


def _call(fn: Callable[[], None]) -> None:
    fn()
