"""The CPU device: a full backend whose memory is host memory and whose streams
are ordered queues over the process's CPU thread pool.

Each operation becomes a task that starts once its stream's previous operation
(and anything the stream was told to wait for) has finished; copies and
memsets are NumPy operations, CPU ranges and kernels fan out over the pool.
Completion is pushed: the pool thread that finishes an operation finishes its
event.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import os
import platform
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from .._core.event import DeviceEvent, _UserEvent
from .._core.function import (
    DeviceFunction,
    Kernel,
    ThreadBlock,
    kernel_arg_kind,
    refuse_coroutine_function,
)
from .._core.graph import COPY, CPU, KERNEL, MEMSET, GraphDefinition, GraphParams
from .._core.memory import _BufferBase
from .._core.ops import check_kernel_buffer
from .._core.pool import cpu_pool, fan_out, host_work, pool_size, range_work, start_chained
from .._core.stream import _StreamImpl
from .._errors import CompileError, DeviceError, UnsupportedError
from .._types import DeviceAttribute, Dim, GPUInfo, LaunchAttributeID, StreamPriorityRange

if TYPE_CHECKING:
    from .._core.memory import ContextView as DeviceContext
    from .._core.protocols import LaunchedFunction
    from .._core.state import _ContextState
    from .._types import ConstantMemoryMapping, LaunchAttribute

__all__ = ["CpuBackend"]

# The limits the CPU device enforces on launches, chosen to match CUDA's so that a
# program checked on one device is checked the same way on the other.
_LIMITS: dict[DeviceAttribute, int] = {
    DeviceAttribute.MAX_THREADS_PER_BLOCK: 1024,
    DeviceAttribute.MAX_BLOCK_DIM_X: 1024,
    DeviceAttribute.MAX_BLOCK_DIM_Y: 1024,
    DeviceAttribute.MAX_BLOCK_DIM_Z: 64,
    DeviceAttribute.MAX_GRID_DIM_X: 2**31 - 1,
    DeviceAttribute.MAX_GRID_DIM_Y: 65535,
    DeviceAttribute.MAX_GRID_DIM_Z: 65535,
    DeviceAttribute.MAX_SHARED_MEMORY_PER_BLOCK: 48 * 1024,
    DeviceAttribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: 1024 * 1024,
    DeviceAttribute.WARP_SIZE: 1,
    DeviceAttribute.INTEGRATED: 1,
    DeviceAttribute.CAN_MAP_HOST_MEMORY: 1,
    DeviceAttribute.UNIFIED_ADDRESSING: 1,
    DeviceAttribute.CONCURRENT_KERNELS: 1,
    DeviceAttribute.STREAM_PRIORITIES_SUPPORTED: 0,
    DeviceAttribute.COOPERATIVE_LAUNCH: 0,
    DeviceAttribute.CLUSTER_LAUNCH: 0,
    DeviceAttribute.MULTICAST_SUPPORTED: 0,
    DeviceAttribute.MEMORY_POOLS_SUPPORTED: 0,
    DeviceAttribute.PAGEABLE_MEMORY_ACCESS: 1,
    DeviceAttribute.MANAGED_MEMORY: 0,
    DeviceAttribute.ECC_ENABLED: 0,
}


def _host_memory() -> tuple[int, int]:
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 0, 0


def _raw_bytes(ptr: int, nbytes: int) -> np.ndarray:
    """A uint8 view of raw host memory (the pointer overloads on the CPU device)."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class _HostAlloc:
    """Host memory owned by a buffer (a NumPy array keeps it)."""

    __slots__ = ("array", "host", "ptr")

    def __init__(self, nbytes: int) -> None:
        # 64-byte aligned, like a cache line, whatever NumPy's default is.
        try:
            raw = np.empty(nbytes + 64, np.uint8)
        except (MemoryError, ValueError):
            # The CUDA device's error for the same request, so one handler serves both.
            raise DeviceError(
                f"cannot allocate {nbytes} bytes of host memory",
                code=_CUDA_ERROR_OUT_OF_MEMORY,
                name="CUDA_ERROR_OUT_OF_MEMORY",
            ) from None
        start = (-raw.ctypes.data) % 64
        self.array = raw
        self.host = raw[start : start + nbytes]
        self.ptr = self.host.ctypes.data

    def release(self, stream: _StreamImpl) -> None:
        pass  # NumPy frees it once nothing refers to it

    def detach(self) -> None:
        # The caller now owns the address; keep the memory alive for the process.
        _detached.append(self.array)

    def set_owner(self, stream: _StreamImpl) -> None:
        pass


_detached: list[np.ndarray] = []
_CUDA_ERROR_OUT_OF_MEMORY = 2
_PARALLEL_COPY_BYTES = 16 << 20


class CpuStream(_StreamImpl):
    """An ordered queue of work over the CPU pool."""

    def __init__(self, state: _ContextState, index: int, priority: int) -> None:
        super().__init__(state, index, priority)
        self._lock = threading.Lock()
        self._tail: DeviceEvent | None = None
        self._seq = 0

    # -- the queue -------------------------------------------------------------------

    def _enqueue(
        self,
        start: Callable[[DeviceEvent], None],
        keep: Any = None,
        extra: DeviceEvent | None = None,
    ) -> DeviceEvent:
        """Append an operation; ``start(ev)`` runs once everything before it on the
        stream (and ``extra``) has finished, and must finish ``ev`` eventually."""
        ev = DeviceEvent(self, 0, keep)
        with self._lock:
            if self._closing:
                self._refuse_closed()
            self._seq += 1
            ev._seq = self._seq
            prev = self._tail
            self._tail = ev
        deps = [d for d in (prev, extra) if d is not None and not d._done]
        if not deps:
            start(ev)
        elif len(deps) == 1:
            deps[0].add_done_callback(lambda _d: start_chained(start, ev))
        else:
            left = [len(deps)]
            lock = threading.Lock()

            def one_done(_d: DeviceEvent) -> None:
                with lock:
                    left[0] -= 1
                    ready = left[0] == 0
                if ready:
                    start_chained(start, ev)

            for d in deps:
                d.add_done_callback(one_done)
        return ev

    def _on_pool(self, fn: Callable[[], Any]) -> Callable[[DeviceEvent], None]:
        def start(ev: DeviceEvent) -> None:
            cpu_pool().submit(_run, ev, fn)

        return start

    def _fanout(self, n: int, work: Callable[[int, int], None]) -> Callable[[DeviceEvent], None]:
        """Run ``work(lo, hi)`` over [0, n) in chunks on the pool; the event finishes
        when every chunk has, with the first error raised, if any."""

        def start(ev: DeviceEvent) -> None:
            w = work if self.state.trace is None else _stamping_start(ev, work)
            fan_out(self, ev._seq, n, w, ev._finish)

        return start

    # -- submission ----------------------------------------------------------------

    def copy(self, dst: Any, src: Any, nbytes: int, keep: Any) -> DeviceEvent:
        d = dst._hostbytes if dst._hostbytes is not None else _raw_bytes(dst._ptr, nbytes)
        s = src._hostbytes if src._hostbytes is not None else _raw_bytes(src._ptr, nbytes)
        if nbytes < _PARALLEL_COPY_BYTES:
            return self._enqueue(self._on_pool(lambda: np.copyto(d[:nbytes], s[:nbytes])), keep)
        # Large copies: pieces of at least 4 MiB on several pool threads at once.
        pieces = max(1, min(pool_size(), nbytes // (4 << 20)))

        def piece(lo: int, hi: int) -> None:
            for j in range(lo, hi):
                a, b = nbytes * j // pieces, nbytes * (j + 1) // pieces
                np.copyto(d[a:b], s[a:b])

        return self._enqueue(self._fanout(pieces, piece), keep)

    def memset(self, dst: Any, value: np.generic, count: int, keep: Any) -> DeviceEvent:
        return self._enqueue(self._on_pool(partial(_fill, dst, value, count)), keep)

    def cpu_call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> DeviceEvent:
        return self._enqueue(self._on_pool(lambda: fn(*args, **kwargs)), (fn, args, kwargs))

    def cpu_range(self, fn: Callable[[int], Any], count: int) -> DeviceEvent:
        return self._enqueue(self._fanout(count, range_work(fn)), fn)

    def launch(
        self,
        fn: LaunchedFunction,
        args: tuple[Any, ...],
        cfg: Any,
        constant_memory: Sequence[ConstantMemoryMapping],
    ) -> DeviceEvent:
        if constant_memory:
            raise UnsupportedError("the CPU device has no __constant__ memory")
        count, work = _kernel_work(fn, args, cfg, self.state)
        return self._enqueue(self._fanout(count, work), (fn, args))

    def wait_event(self, ev: DeviceEvent) -> DeviceEvent:
        return self._enqueue(_finish_now, None, extra=ev)

    def tail(self) -> DeviceEvent | None:
        return self._tail

    @property
    def _submission_lock(self) -> Any:
        return self._lock

    def record(self, ev: _UserEvent) -> None:
        with self._lock:
            if self._closing:
                self._refuse_closed()
            prev = self._tail
            seq = self._seq
        ev._repoint(self, seq, prev)

        def stamp(_d: DeviceEvent | None = None) -> None:
            if ev._stream is not self or ev._seq != seq:
                return  # recorded again since: that record finishes it
            if ev._timing is not False:
                ev._timing = time.perf_counter_ns()
            ev._finish_at(self, seq, None)

        if prev is None or prev._done:
            stamp()
        else:
            prev.add_done_callback(stamp)


class CpuGraph:
    """A device graph on the CPU device: each replay is one operation of the
    stream it is replayed on, which runs the nodes on the pool in dependency
    order (independent nodes at the same time), each as soon as the nodes it
    depends on have finished, and finishes when the last node has (with the
    first error a node raised, after every node has run).

    ``current`` is what each node does, made from the parameters current now
    (``GraphParams``); an update makes a new one, and a replay runs the one
    current when it was enqueued, holding it (and so its buffers) until it
    has finished."""

    def __init__(self, definition: GraphDefinition, params: GraphParams) -> None:
        self.definition = definition
        self.params = params
        self._succ = definition.successors()
        self._indeg = [len(n._deps) for n in definition.nodes]
        self._roots = [i for i, d in enumerate(self._indeg) if d == 0]
        self._kinds = [n.kind for n in definition.nodes]
        self._lock = threading.Lock()
        # (checked here, at DeviceGraph.create: a bad kernel argument raises there)
        work = tuple(_node_work(k, op) for k, op in zip(self._kinds, params.ops, strict=True))
        self.current: tuple[tuple[tuple[int, Any], ...], GraphParams] = (work, params)

    def replay(self, stream: CpuStream) -> DeviceEvent:
        """Enqueue one replay on ``stream`` with the parameters current now; never
        blocks."""
        current = self.current
        return stream._enqueue(partial(self._start, stream, current[0]), current)

    def update(self, index: int, op: Any, buffers: Sequence[Any]) -> None:
        """Make node ``index`` do ``op`` in the replays enqueued from now on,
        checked as the node was when the graph was made (a kernel's arguments
        against its body); replays enqueued before keep what they had."""
        node_work = _node_work(self._kinds[index], op)
        with self._lock:
            work, params = self.current
            new = params.replaced(index, op, buffers)
            works = list(work)
            works[index] = node_work
            self.params = new
            self.current = (tuple(works), new)

    def _start(self, stream: CpuStream, work: tuple[tuple[int, Any], ...], ev: DeviceEvent) -> None:
        succ = self._succ
        if not work:
            ev._finish(None, None)
            return
        left = list(self._indeg)
        remaining = [len(work)]
        errors: list[BaseException] = []
        lock = threading.Lock()
        seq = ev._seq

        def done(i: int, error: BaseException | None) -> None:
            ready = []
            with lock:
                if error is not None:
                    errors.append(error)
                remaining[0] -= 1
                last = remaining[0] == 0
                for j in succ[i]:
                    left[j] -= 1
                    if left[j] == 0:
                        ready.append(j)
            for j in ready:
                # (in a loop, not nested: a chain of empty nodes finishes inside
                # the starts)
                start_chained(start, j)
            if last:
                ev._finish(None, errors[0] if errors else None)

        def run(i: int, fn: Callable[[], Any]) -> None:
            host_work.stream, host_work.seq = stream, seq
            error = None
            try:
                fn()
            except BaseException as e:
                error = e
            host_work.stream = None
            done(i, error)

        def start(i: int) -> None:
            kind, payload = work[i]
            if kind == _NODE_EMPTY:
                done(i, None)
            elif kind == _NODE_FAN:
                count, body = payload
                fan_out(stream, seq, count, body, lambda _v, e: done(i, e))
            else:
                cpu_pool().submit(run, i, payload)

        for r in self._roots:
            start_chained(start, r)


_NODE_EMPTY, _NODE_FAN, _NODE_CALL = range(3)


def _node_work(kind: str, op: Any) -> tuple[int, Any]:
    """What a graph node of ``kind`` doing ``op`` does on the CPU device: nothing
    (a join), a fan-out over the pool (a kernel's blocks) or one call on the
    pool."""
    if kind == KERNEL:
        return _NODE_FAN, _kernel_work(op.fn, op.args, op.cfg, op.fn._ctx._state)
    if kind == COPY:
        d, s, n = op.dst._hostbytes, op.src._hostbytes, op.nbytes
        return _NODE_CALL, partial(np.copyto, d[:n], s[:n])
    if kind == MEMSET:
        return _NODE_CALL, partial(_fill, op.dst, op.value, op.count)
    if kind == CPU:
        return _NODE_CALL, partial(op.fn, *op.args)
    return _NODE_EMPTY, None


def _kernel_work(
    fn: LaunchedFunction, args: tuple[Any, ...], cfg: Any, state: Any
) -> tuple[int, Callable[[int, int], None]]:
    """A CPU kernel launch of ``state``'s context, checked (what CUDA would
    refuse is refused here too) and ready to run: its block count and
    ``work(lo, hi)``, which runs blocks ``lo..hi-1`` of the NumPy body."""
    grid, block, shmem = cfg
    for n, a in enumerate(args):
        kernel_arg_kind(n, a)
    body = fn._impl
    _check_arity(body, fn.name, len(args))
    host_args = tuple(_kernel_arg(state, n, a) for n, a in enumerate(args))
    tidx = ThreadBlock.thread_indices(block)
    gx, gy = grid.x, grid.y

    def work(lo: int, hi: int) -> None:
        for b in range(lo, hi):
            bidx = Dim(b % gx, (b // gx) % gy, b // (gx * gy))
            body(ThreadBlock(grid, block, bidx, tidx, shmem), *host_args)

    return grid.size(), work


def _fill(dst: Any, value: np.generic, count: int) -> None:
    """Set ``count`` elements of ``dst`` (a memory operand) to ``value``."""
    nbytes = count * value.dtype.itemsize
    d = dst._hostbytes if dst._hostbytes is not None else _raw_bytes(dst._ptr, nbytes)
    d[:nbytes].view(value.dtype)[...] = value


def _run(ev: DeviceEvent, fn: Callable[[], Any]) -> None:
    host_work.stream, host_work.seq = ev._stream, ev._seq
    node = ev._node
    if node is not None:  # traced: the span starts when a pool thread starts it
        node.start_ns = time.perf_counter_ns()
    value, error = None, None
    try:
        value = fn()
    except BaseException as e:
        error = e
    host_work.stream = None
    ev._finish(value, error)


def _stamping_start(
    ev: DeviceEvent, work: Callable[[int, int], None]
) -> Callable[[int, int], None]:
    """``work`` for ``fan_out`` that stamps the traced operation's start when the
    first of its chunks starts on a pool thread."""

    def chunk(lo: int, hi: int) -> None:
        node = ev._node
        if node is not None and node.start_ns is None:
            node.start_ns = time.perf_counter_ns()
        work(lo, hi)

    return chunk


def _finish_now(ev: DeviceEvent) -> None:
    ev._finish(None, None)


# Per function, per argument count: the error, if any. Weakly keyed, so that a
# kernel body (a closure and what it holds) is not kept alive by the cache.
_arity: weakref.WeakKeyDictionary[Any, dict[int, str | None]] = weakref.WeakKeyDictionary()


def _check_arity(body: Any, name: str, nargs: int) -> None:
    """``TypeError`` at the launch, not once per block at the await, when the
    kernel body cannot take ``nargs`` arguments after its thread block (checked
    once per function and count; a bound method is keyed by its function, so
    the objects it is bound to are not kept alive, and no function is kept alive
    by being checked)."""
    func = getattr(body, "__func__", None)
    target, bound = (func, 1) if func is not None else (body, 0)
    try:
        known = _arity.get(target)
    except TypeError:  # (not weakly referable or unhashable: checked each time)
        known = None
    if known is not None and nargs in known:
        err = known[nargs]
    else:
        try:
            inspect.signature(target).bind(*range(bound + 1 + nargs))
            err = None
        except TypeError as e:
            err = f"kernel {name!r} takes other arguments than the {nargs} given: {e}"
        except ValueError:  # no signature to read (a builtin): the launch tells
            err = None
        if known is not None:
            known[nargs] = err
        else:
            with contextlib.suppress(TypeError):
                _arity[target] = {nargs: err}
    if err is not None:
        raise TypeError(err)


def _kernel_arg(state: Any, n: int, a: Any) -> Any:
    """Kernel argument ``n`` of a launch of ``state``'s context as the CPU kernel
    body sees it: a buffer (after the checks every use of a buffer makes: its
    context open, its memory not taken, and one of another context only where
    ``check_kernel_buffer`` allows it) becomes a NumPy view of its memory."""
    if isinstance(a, _BufferBase) and (
        a._ctx._state is not state or a._alloc is None or state.closed
    ):
        check_kernel_buffer(state, a, f"kernel argument {n}")
    hostbytes = getattr(a, "_hostbytes", None)
    if hostbytes is not None:
        return hostbytes.view(a._dtype)
    return a


class CpuBackend:
    """The host as a device."""

    api = "cpu"
    polled = False
    memory_is_host = True  # (a CUDA context copies to and from its buffers)

    def __init__(self, device_id: int) -> None:
        if device_id != 0:
            raise IndexError(f"the CPU device has one device, id 0; got device_id={device_id}")
        self.device_id = 0
        self._info: GPUInfo | None = None

    def make_current(self) -> None:
        """Nothing to do: the host has no device context to make current."""

    def stream_waits_for_stream(self, waiter: int, producer: int) -> None:
        raise UnsupportedError("the CPU device has no native streams to order")

    def is_pinned(self, ptr: int) -> bool:
        return False

    # -- facts -----------------------------------------------------------------------

    @staticmethod
    def number_of_devices() -> int:
        return 1

    def name(self) -> str:
        # MAX names its host device "cpu"; the processor is in the info's extras.
        return "cpu"

    def info(self) -> GPUInfo:
        if self._info is None:
            total = _host_memory()[1]
            self._info = GPUInfo(
                name=self.name(),
                api="cpu",
                vendor="host",
                arch="cpu",
                compute_capability=None,
                sm_count=pool_size(),
                warp_size=1,
                threads_per_block=_LIMITS[DeviceAttribute.MAX_THREADS_PER_BLOCK],
                max_block_dim=(1024, 1024, 64),
                max_grid_dim=(2**31 - 1, 65535, 65535),
                shared_memory_per_block=_LIMITS[DeviceAttribute.MAX_SHARED_MEMORY_PER_BLOCK],
                shared_memory_per_block_optin=_LIMITS[
                    DeviceAttribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
                ],
                total_memory=total,
                clock_rate_khz=0,
                memory_clock_rate_khz=0,
                l2_cache_size=0,
                extra={
                    "processor": platform.processor() or platform.machine() or "unknown",
                    "cores": os.cpu_count() or 1,
                    "pool_threads": pool_size(),
                },
            )
        return self._info

    def api_version(self) -> int:
        major, minor, *_ = platform.python_version_tuple()
        return int(major) * 1000 + int(minor) * 10

    def attribute(self, attr: DeviceAttribute) -> int:
        if attr == DeviceAttribute.MULTIPROCESSOR_COUNT:
            return pool_size()
        try:
            return _LIMITS[DeviceAttribute(attr)]
        except (KeyError, ValueError):
            raise UnsupportedError(
                f"the CPU device has no value for {DeviceAttribute(attr).name}"
                if attr in DeviceAttribute._value2member_map_
                else f"unknown device attribute {attr!r}"
            ) from None

    def memory_info(self) -> tuple[int, int]:
        return _host_memory()

    def max_single_alloc_size(self) -> int:
        return _host_memory()[1]

    def priority_range(self) -> StreamPriorityRange:
        return StreamPriorityRange(0, 0)

    def is_compatible(self) -> bool:
        return True

    def healthcheck(self) -> None:
        """The CPU device is healthy when its pool runs work and its memory holds a
        pattern; both are checked."""
        probe = np.arange(4096, dtype=np.uint32) * np.uint32(2654435761)
        out = cpu_pool().call(np.copy, probe).result(timeout=30)
        if not np.array_equal(out, probe):  # pragma: no cover - broken host
            from .._errors import HealthCheckError

            raise HealthCheckError("host memory did not hold a test pattern", check="memory")

    def can_access(self, other: Any) -> bool:
        # Every CPU context is the one host device, and a device is not its own peer
        # (as in MAX, and as cuDeviceCanAccessPeer(d, d) answers).
        return False

    def reaches(self, other: Any) -> bool:
        return True  # (every CPU context is the one host: its memory is all one)

    def enable_peer_access(self, other: Any) -> None:
        if getattr(other, "api", None) != "cpu":
            raise UnsupportedError("the CPU device can only reach other CPU contexts")
        # The same device: its memory is already addressable; nothing to enable.

    def supports_multicast(self) -> bool:
        return False

    @contextlib.contextmanager
    def push_context(self) -> Iterator[None]:
        yield

    def set_as_current(self) -> None:
        pass

    # -- streams and memory ------------------------------------------------------------

    def new_stream(self, state: _ContextState, index: int, priority: int) -> CpuStream:
        return CpuStream(state, index, priority)

    def external_handle(self, stream: Any) -> int:
        raise UnsupportedError("the CPU device has no external streams to wrap")

    def external_stream(self, state: _ContextState, handle: Any, index: int) -> CpuStream:
        raise UnsupportedError("the CPU device has no external streams to wrap")

    def alloc_device(self, nbytes: int, stream: _StreamImpl) -> _HostAlloc:
        return _HostAlloc(nbytes)

    def alloc_host(self, nbytes: int, stream: _StreamImpl) -> _HostAlloc:
        return _HostAlloc(nbytes)

    def pointer_host_view(self, ptr: int, nbytes: int) -> np.ndarray | None:
        return _raw_bytes(ptr, nbytes)

    def read_device(self, ptr: int, nbytes: int) -> np.ndarray:
        """The bytes at ``ptr`` now (device memory is host memory here)."""
        return _raw_bytes(ptr, nbytes).copy()

    def init_user_event(
        self, ev: DeviceEvent, blocking_sync: bool, disable_timing: bool, interprocess: bool
    ) -> None:
        if interprocess:
            raise UnsupportedError("interprocess events need the CUDA device")
        ev._timing = not disable_timing and 0

    # -- functions ---------------------------------------------------------------------

    def compile(
        self,
        ctx: DeviceContext,
        func: Any,
        name: str | None,
        options: Any,
        func_attribute: Any,
        dump_asm: Any,
    ) -> DeviceFunction:
        if isinstance(func, Kernel):
            if func.cpu is None:
                raise UnsupportedError(
                    f"kernel {func.name!r} has only a CUDA source; the CPU device needs a "
                    "NumPy body (Kernel(..., cpu=fn))"
                )
            return DeviceFunction(ctx, func.name, func.cpu)
        if callable(func):
            refuse_coroutine_function(func, "a CPU kernel")
            return DeviceFunction(ctx, str(name or getattr(func, "__name__", "kernel")), func)
        if isinstance(func, str):
            raise UnsupportedError(
                "the CPU device cannot run CUDA C++ source; pass a Kernel with a NumPy body "
                "or a Python function"
            )
        raise TypeError(f"cannot compile {type(func).__name__}")

    def load(
        self, ctx: DeviceContext, function_name: str, asm: Any, func_attribute: Any
    ) -> DeviceFunction:
        raise CompileError("the CPU device cannot load PTX or cubin code")

    def make_launch_config(
        self,
        fn: DeviceFunction,
        grid: Dim,
        block: Dim,
        shmem: int,
        cluster: Dim | None,
        attributes: Sequence[LaunchAttribute],
    ) -> tuple[Dim, Dim, int]:
        for a in attributes:
            if a.id == LaunchAttributeID.COOPERATIVE and a.value:
                raise UnsupportedError("the CPU device has no cooperative launches")
        return grid, block, shmem

    def function_attribute(self, fn: DeviceFunction, attr: int) -> int:
        if attr == 0:
            return _LIMITS[DeviceAttribute.MAX_THREADS_PER_BLOCK]
        raise UnsupportedError(f"the CPU device has no value for function attribute {attr}")

    def function_occupancy(self, fn: DeviceFunction, block_size: int, shmem: int) -> int:
        return 1

    def close(self) -> None:
        pass

    def graph(self, definition: GraphDefinition, params: GraphParams) -> CpuGraph:
        """The CPU device's replayable form of a finished graph definition."""
        return CpuGraph(definition, params)

    def elapsed_ns(self, fn: Callable[[], Any], stream: _StreamImpl) -> int:
        """Host nanoseconds from before the first call until the stream has finished
        the work the calls enqueued."""
        t0 = time.perf_counter_ns()
        fn()
        stream.synchronize()
        return time.perf_counter_ns() - t0
