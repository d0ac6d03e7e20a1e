# The C extension asyncgpu._native (see _native.c); optional: asyncgpu runs without it.
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
def configure(event_type: type[EventCore], sweep_later: object, mark_every: int, /) -> None: ...

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
    """The fields of a buffer that a launch reads (asyncgpu._buffer subclasses this)."""

    _alloc: object
    _ctx: object
    _ptr: int
