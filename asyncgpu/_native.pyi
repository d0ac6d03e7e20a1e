# The C extension asyncgpu._native (see _native.c); optional: asyncgpu runs without it.
from collections.abc import Iterator

MARKER_FAILED: int

def bind(
    launch_entry: int, write64_entry: int, record_entry: int = ..., query_entry: int = ..., /
) -> tuple[int, int, int, int]: ...
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
    """The fields of a DeviceEvent (asyncgpu._event subclasses this)."""

    def __new__(cls, stream: object = ..., seq: int = ..., keep: object = ...) -> EventCore: ...
    def _finish(self, value: object = ..., error: BaseException | None = ..., /) -> None: ...
    def _add_waiter(self, waiter: object, /) -> bool: ...

class StreamCore:
    """The bookkeeping fields of a polled stream (asyncgpu._stream subclasses this)."""

    def _launch_c(
        self, fn: object, args: tuple[object, ...], cfg: object, constant_memory: object, /
    ) -> EventCore: ...
    def _poll(self, ev: EventCore, /) -> bool: ...
    def _completed_fast(self) -> int: ...
    def _retire(self) -> bool: ...

class BufferCore:
    """The fields of a buffer (asyncgpu._buffer subclasses this)."""

    _alloc: object
    _ctx: object
    _dtype: object
    _hostbytes: object
    _owner: object
    _parent: object
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

    _ctx: object
    _impl: object
    _cfgs: dict[object, object]

class ContextCore:
    """The fields of a DeviceContext and its hot paths."""

    _state: object
    _impl: object
    _ref: object
    def enqueue_function(self, f: object, /, *args: object, **kwargs: object) -> object: ...
    def enqueue_create_buffer(self, dtype: object, size: object) -> object: ...

class EventQueue:
    """The events of a polled stream in flight, oldest first (a deque's
    append, popleft, clear, len, indexing and iteration)."""

    def append(self, ev: object, /) -> None: ...
    def popleft(self) -> object: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> object: ...
    def __iter__(self) -> Iterator[object]: ...

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
def configure_scalars(codes: bytes, samples: tuple[object, ...], /) -> bytes: ...
def set_exiting(flag: bool, /) -> None: ...
