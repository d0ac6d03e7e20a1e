"""A stand-in for the driver entry points that ``asyncgpu._native`` calls
(``cuLaunchKernel``, ``cuStreamWriteValue64``; with ``events``, also
``cuEventRecord``, ``cuEventQuery``, ``cuMemcpyAsync`` and ``cuGraphLaunch``):
C-callable ctypes functions that record what they were given and answer what
the test says."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from asyncgpu import _native

_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    *(ctypes.c_uint,) * 7,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.c_void_p,
)
_WRITE64 = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint
)
_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
_MEMCPY = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
)
_GRAPH_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
NOT_READY = 600  # CUDA_ERROR_NOT_READY


@dataclass
class Driver:
    """What the stand-in driver saw, and what it answers."""

    nargs: int = 0
    launches: list[tuple[Any, ...]] = field(default_factory=list)
    writes: list[tuple[int, int, int]] = field(default_factory=list)
    launch_result: int = 0
    write_result: int = 0
    records: list[tuple[int, int]] = field(default_factory=list)  # (event, stream)
    finished: set[int] = field(default_factory=set)  # events cuEventQuery calls finished
    record_result: int = 0
    copies: list[tuple[int, int, int, int]] = field(default_factory=list)  # (dst, src, n, stream)
    copy_result: int = 0
    graph_launches: list[tuple[int, int]] = field(default_factory=list)  # (exec, stream)
    graph_launch_result: int = 0


@contextmanager
def bound_stand_in(events: bool = False) -> Iterator[Driver]:
    """Bind ``_native`` to a new stand-in driver (with ``events``, for
    ``cuEventRecord`` and ``cuEventQuery`` too); the previous binding after."""
    d = Driver()

    def launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        # Read every argument through the pointer array, as the driver does.
        values = [ctypes.string_at(params[i], 8) for i in range(d.nargs)] if params else []
        d.launches.append((f, (gx, gy, gz, bx, by, bz, shmem), stream, values, extra))
        return d.launch_result

    def write64(stream, addr, value, flags):
        d.writes.append((stream, addr, value))
        return d.write_result

    def record(event, stream):
        d.finished.discard(event)  # recorded again: not finished
        d.records.append((event, stream))
        return d.record_result

    def query(event):
        return 0 if event in d.finished else NOT_READY

    def memcpy(dst, src, nbytes, stream):
        d.copies.append((dst, src, nbytes, stream or 0))
        return d.copy_result

    def graph_launch(exe, stream):
        d.graph_launches.append((exe or 0, stream or 0))
        return d.graph_launch_result

    fns = [_LAUNCH(launch), _WRITE64(write64)]
    if events:
        fns += [_RECORD(record), _QUERY(query), _MEMCPY(memcpy), _GRAPH_LAUNCH(graph_launch)]
    prev = _native.bind(*(ctypes.cast(f, ctypes.c_void_p).value for f in fns))
    try:
        yield d
    finally:
        if prev[0]:
            _native.bind(*prev)  # the real driver's, where this process bound it
        else:
            _kept.append(fns)  # still bound: must outlive the process's last call


_kept: list[Any] = []


def wrapped_stream(handle: int = 0x5EA) -> Any:
    """A wrapped ``CudaStream`` (another library's: ``owned`` false) with the
    whole polled-stream bookkeeping and no GPU: its counter in ordinary memory,
    its markers through the extension (bind a stand-in with ``events`` first),
    counter writes recorded in ``written``. The caller patches the stream
    module's ``cu`` for the marker events it creates (``cuEventCreate``) and
    configures the extension with ``CudaStream``."""
    import threading
    from collections import deque
    from types import SimpleNamespace

    from asyncgpu._core.stream import _PolledStream
    from asyncgpu._devices.cuda.stream import CudaStream, _HandleUse

    s = CudaStream.__new__(CudaStream)
    state = SimpleNamespace(api="cuda", device_id=0, describe=lambda: "cuda:0")
    _PolledStream.__init__(s, state, 9, 0)
    s.owned = False
    s._handle_use = _HandleUse()
    s._counter_mark = s._done_seq = 0
    s._events, s._after_copy = None, False
    s._copy_marks, s._free_events = deque(), []
    s._marker_lock = threading.Lock()
    s._counter = ctypes.c_uint64(0)
    s.h = s.raw = handle
    s.caddr = ctypes.addressof(s._counter)
    s._counter_in_c = True
    s.backend = SimpleNamespace(make_current=lambda: None)
    s.written = []
    s._write_marker = lambda seq: s.written.append(seq) or 0
    return s
