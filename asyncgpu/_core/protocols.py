"""The types the core sees of what lies above and below it.

The core never imports a device or the public face: where it needs to name one
in a hint, it names one of these protocols instead, and so does a module of the
core that names one above it. ``Backend`` is what a device module provides for
one device (``_devices`` picks the class); ``ContextState`` is what a buffer or
function reads of its context's shared state; ``LaunchedFunction`` is a function
as the stream seam launches it; ``PolledStream`` is a stream as the completion
engine polls it. (``memory.ContextView``, what a buffer or function keeps of the
``DeviceContext`` that made it, names the buffers, so it lives with them.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from .._types import DeviceAttribute, Dim, GPUInfo, LaunchAttribute, StreamPriorityRange

__all__ = ["Backend", "ContextState", "LaunchedFunction", "PolledStream"]


class Backend(Protocol):
    """One device, as the core and the public face drive it
    (``_devices.cpu.CpuBackend``, ``_devices.cuda.backend.CudaBackend``).
    Streams, events and functions appear as ``Any``: their classes live beside
    this module, and a protocol here must not import them back."""

    api: str
    # Whether every buffer of this device is host memory that the host process
    # addresses directly (the CPU device): a context of another device then
    # takes its buffers as pageable host memory in copies.
    memory_is_host: bool

    # -- facts
    def name(self) -> str: ...
    def info(self) -> GPUInfo: ...
    def api_version(self) -> int: ...
    def attribute(self, attr: DeviceAttribute) -> int: ...
    def memory_info(self) -> tuple[int, int]: ...
    def max_single_alloc_size(self) -> int: ...
    def priority_range(self) -> StreamPriorityRange: ...
    def is_compatible(self) -> bool: ...
    def healthcheck(self) -> None: ...
    def can_access(self, other: Any) -> bool: ...
    def enable_peer_access(self, other: Any) -> None: ...
    # Whether this device's kernels and memsets address the memory of ``other``,
    # a backend of the same API, in place (its own device's; a peer's once
    # peer access is enabled).
    def reaches(self, other: Any) -> bool: ...
    def supports_multicast(self) -> bool: ...

    # -- the thread's current context
    def make_current(self) -> None: ...
    def push_context(self) -> AbstractContextManager[None]: ...
    def set_as_current(self) -> None: ...

    # -- streams, memory, events
    def new_stream(self, state: Any, index: int, priority: int) -> Any: ...
    def external_stream(self, state: Any, handle: Any, index: int) -> Any: ...
    def alloc_device(self, nbytes: int, stream: Any) -> Any: ...
    def alloc_host(self, nbytes: int, stream: Any) -> Any: ...
    def pointer_host_view(self, ptr: int, nbytes: int) -> Any: ...
    def read_device(self, ptr: int, nbytes: int) -> Any: ...
    def init_user_event(
        self, ev: Any, blocking_sync: bool, disable_timing: bool, interprocess: bool
    ) -> None: ...

    # -- other libraries' streams and memory
    def stream_waits_for_stream(self, waiter: int, producer: int) -> None: ...
    def is_pinned(self, ptr: int) -> bool: ...

    # -- functions
    def compile(
        self,
        ctx: Any,
        func: Any,
        name: str | None,
        options: Any,
        func_attribute: Any,
        dump_asm: Any,
    ) -> Any: ...
    def load(self, ctx: Any, function_name: str, asm: Any, func_attribute: Any) -> Any: ...
    def make_launch_config(
        self,
        fn: Any,
        grid: Dim,
        block: Dim,
        shmem: int,
        cluster: Dim | None,
        attributes: Sequence[LaunchAttribute],
    ) -> tuple[Dim, Dim, int]: ...
    def function_attribute(self, fn: Any, attr: int) -> int: ...
    def function_occupancy(self, fn: Any, block_size: int, shmem: int) -> int: ...

    # -- device graphs: the replayable form of a finished ``graph.GraphDefinition``
    # with its first ``GraphParams``, whose ``replay(stream)`` enqueues one replay
    # and returns its event, ``update(index, op, buffers)`` changes a node for later
    # replays and ``params`` is the current version
    def graph(self, definition: Any, params: Any) -> Any: ...

    # -- timing and tracing
    def elapsed_ns(self, fn: Callable[[], Any], stream: Any) -> int: ...

    def close(self) -> None: ...


class ContextState(Protocol):
    """What buffers, functions and operand checks read of a context's shared
    state (``state._ContextState``, a module above theirs)."""

    @property
    def api(self) -> str: ...
    @property
    def device_id(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    @property
    def backend(self) -> Backend: ...
    def describe(self) -> str: ...


class LaunchedFunction(Protocol):
    """A function as a stream launches it (``function.DeviceFunction``, a module
    above the streams): its name, and its device's compiled code (a Python
    callable on the CPU device, a loaded kernel on CUDA)."""

    @property
    def name(self) -> str: ...
    @property
    def _impl(self) -> Any: ...


class PolledStream(Protocol):
    """A stream whose completions are noticed by polling (``stream._PolledStream``),
    as the completion engine (``engine``) drives it: ``_completed()`` reads the
    stream's completion counter, ``_retire()`` finishes the events it has passed,
    ``_check_fault()`` asks the driver for a sticky fault. The engine sits below
    the stream module, so it sees a stream only through this protocol."""

    _pending: Any
    _marked: int
    _issued_mark: int
    _touched: bool
    _fault: BaseException | None
    _eager: bool

    def _need(self, ev: Any, eager: bool = True, waited: bool = True) -> None: ...

    def _completed(self) -> int: ...
    def _retire(self) -> Any: ...
    def _check_fault(self) -> None: ...
    def _when_issued(self, seq: int, fn: Callable[[], None]) -> Any: ...
    def tail(self) -> Any: ...
