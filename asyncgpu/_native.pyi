# The C extension asyncgpu._native (see _native.c): the compiled hot path asyncgpu needs.
from collections.abc import Callable, Generator, Iterator, Sequence
from contextvars import Context
from typing import Any

MARKER_FAILED: int
SPARE_SIZES: int

def bind(
    launch_entry: int,
    write64_entry: int,
    record_entry: int = ...,
    query_entry: int = ...,
    memcpy_entry: int = ...,
    graph_launch_entry: int = ...,
    /,
) -> tuple[int, int, int, int, int, int]: ...
def write64(stream: int, addr: int, value: int, /) -> int: ...
def launch(
    func: int,
    dims: tuple[int, int, int, int, int, int, int],
    stream: int,
    types: tuple[type, ...],
    codes: bytes,
    args: tuple[object, ...],
    data: int,
    pointers: int,
    counter: int = ...,
    value: int = ...,
    /,
) -> int: ...
def configure(
    event_type: type[EventCore],
    sweep_later: object,
    mark_every: int,
    cuda_stream_type: type = ...,
    device_alloc_type: type = ...,
    /,
) -> None: ...

class EventCore:
    """The fields of a DeviceEvent (asyncgpu._core.event subclasses this)."""

    _stream: Any
    _seq: int
    _done: bool
    _value: Any
    _error: BaseException | None
    _waiters: list[Any] | None
    _keep: Any
    _lock: Any
    _node: Any
    _handle: Any
    _timing: Any
    def __new__(cls, stream: object = ..., seq: int = ..., keep: object = ...) -> EventCore: ...
    def _finish(self, value: object = ..., error: BaseException | None = ..., /) -> None: ...
    def _add_waiter(self, waiter: object, /) -> bool: ...
    def __await__(self) -> Generator[object, None, object]: ...

class StreamCore:
    """The bookkeeping fields of a polled stream (asyncgpu._core.stream subclasses this)."""

    _inflight: Any
    _pending: Any
    _submit_lock: Any
    _param_mem: Any
    _events: Any
    _copy_marks: Any
    _seq: int
    _marked: int
    _awaited: int
    _issued_mark: int
    _counter_mark: int
    _done_seq: int
    h: int
    caddr: int
    _eager: bool
    _touched: bool
    _after_copy: bool
    _retire_lock: Any
    _counter_in_c: bool
    _marker_lock: Any
    _free_events: Any
    _kernel_event_markers: bool
    _closing: bool
    spare: Any
    state: Any
    def _launch_c(
        self, fn: object, args: tuple[object, ...], cfg: object, constant_memory: object, /
    ) -> EventCore: ...
    def _copy_c(self, dst: int, src: int, nbytes: int, keep: object, /) -> EventCore | None: ...
    def _graph_c(
        self, exe: int, lock: RLock, applied: list[Any], want: object, keep: object, /
    ) -> EventCore | None: ...
    def _poll(self, ev: Any, /) -> bool: ...
    def _completed_fast(self) -> int: ...
    def _retire(self) -> bool: ...
    def _before_submit(self) -> None: ...
    def _mark_c(self, keep: object, /) -> EventCore: ...
    def _prune_c(self) -> None: ...
    def _record_marker_c(self, seq: int, /) -> None: ...
    def _alloc_device_c(self, nbytes: int, /) -> Any: ...

class BufferCore:
    """The fields of a buffer (asyncgpu._core.memory subclasses this)."""

    _alloc: Any
    _ctx: Any
    _dtype: Any
    _hostbytes: Any
    _owner: Any
    _parent: Any
    _ptr: int
    _size: int
    _nbytes: int
    _owns: bool

class SpareCore:
    """SpareCore(room, per_size): the device buffers a stream keeps."""

    bufs: dict[int, list[object]]
    room: int
    per_size: int
    closed: bool
    def __new__(cls, room: int, per_size: int) -> SpareCore: ...
    def take(self, nbytes: int, /) -> object | None: ...
    def keep(self, allocation: object, nbytes: int, /) -> bool: ...
    def _take_all(self, close: bool, /) -> list[object]: ...

class KernelCore:
    """The argument plan of a compiled CUDA function's last launch."""

    last: object

class FunctionCore:
    """The fields of a DeviceFunction that a launch reads."""

    _ctx: Any
    _impl: Any
    _cfgs: dict[Any, Any]

class ContextCore:
    """The fields of a DeviceContext and its hot paths."""

    _state: Any
    _impl: Any
    _ref: Any
    # (DeviceContext declares their full signatures)
    def enqueue_function(self, *args: Any, **kwargs: Any) -> Any: ...
    def enqueue_create_buffer(self, *args: Any, **kwargs: Any) -> Any: ...

class StateCore:
    """The fields of a context state that the C hot paths read."""

    closed: bool
    trace: Any

class RefCore:
    """Whether a reference to a context state is open."""

    open: bool

class EventQueue:
    """The events of a polled stream in flight, oldest first (a deque's
    append, popleft, clear, len, indexing and iteration)."""

    def append(self, ev: object, /) -> None: ...
    def popleft(self) -> Any: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> Any: ...
    def __iter__(self) -> Iterator[Any]: ...

class DirectFuture:
    """DirectFuture(loop): the future of one awaited operation of a polled stream,
    with asyncio's future protocol; wake() finishes it and runs its awaiting
    task's step at once (only from a plain loop callback)."""

    _asyncio_future_blocking: bool
    _loop: object
    def __new__(cls, loop: object) -> DirectFuture: ...
    def wake(self) -> None: ...
    def set_result(self, value: object, /) -> None: ...
    def result(self) -> object: ...
    def exception(self) -> BaseException | None: ...
    def done(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def cancel(self, msg: object = ...) -> bool: ...
    def add_done_callback(
        self, fn: Callable[[DirectFuture], object], /, *, context: Context | None = ...
    ) -> None: ...
    def remove_done_callback(self, fn: Callable[[DirectFuture], object], /) -> int: ...
    def __await__(self) -> Generator[DirectFuture, None, object]: ...
    def __iter__(self) -> Generator[DirectFuture, None, object]: ...

class RLock:
    """A re-entrant lock (threading.RLock's methods) the C hot paths take directly."""

    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...
    def release(self) -> None: ...
    def __enter__(self) -> bool: ...
    def __exit__(self, *exc: object) -> None: ...
    def _is_owned(self) -> bool: ...

def configure_buffers(
    device_buffer_type: type, function_type: type, as_dtype: object, numpy_dtype: type, /
) -> None: ...
def launch_key(
    grid: object,
    block: object,
    cluster: object,
    shared_mem: object,
    attributes: Sequence[object],
    /,
) -> tuple[object, ...]: ...
def configure_scalars(codes: bytes, samples: tuple[object, ...], /) -> bytes: ...
def configure_futures(
    copy_context: Callable[[], Context], cancelled_error: type, invalid_state_error: type, /
) -> None: ...
def configure_await(
    get_running_loop: Callable[[], object],
    await_event: Callable[[Any], Iterator[object]],
    await_future: Callable[[Any, Any], Iterator[object]],
    /,
) -> None: ...
def set_exiting(flag: bool, /) -> None: ...
