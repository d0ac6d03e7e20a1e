# The C extension asyncgpu._native (see _native.c); optional: asyncgpu runs without it.
MARKER_FAILED: int

def bind(launch_entry: int, write64_entry: int, /) -> tuple[int, int]: ...
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
