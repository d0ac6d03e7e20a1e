"""A stand-in for the two driver entry points that ``asyncgpu._native`` calls
(``cuLaunchKernel``, ``cuStreamWriteValue64``): C-callable ctypes functions that
record what they were given and answer what the test says."""

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


@dataclass
class Driver:
    """What the stand-in driver saw, and what it answers."""

    nargs: int = 0
    launches: list[tuple[Any, ...]] = field(default_factory=list)
    writes: list[tuple[int, int, int]] = field(default_factory=list)
    launch_result: int = 0
    write_result: int = 0


@contextmanager
def bound_stand_in() -> Iterator[Driver]:
    """Bind ``_native`` to a new stand-in driver; the previous binding after."""
    d = Driver()

    def launch(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
        # Read every argument through the pointer array, as the driver does.
        values = [ctypes.string_at(params[i], 8) for i in range(d.nargs)] if params else []
        d.launches.append((f, (gx, gy, gz, bx, by, bz, shmem), stream, values, extra))
        return d.launch_result

    def write64(stream, addr, value, flags):
        d.writes.append((stream, addr, value))
        return d.write_result

    cl, cw = _LAUNCH(launch), _WRITE64(write64)
    as_addr = ctypes.cast
    prev = _native.bind(as_addr(cl, ctypes.c_void_p).value, as_addr(cw, ctypes.c_void_p).value)
    try:
        yield d
    finally:
        if prev[0]:
            _native.bind(*prev)  # the real driver's, where this process bound it
        else:
            _kept.append((cl, cw))  # still bound: must outlive the process's last call


_kept: list[Any] = []
