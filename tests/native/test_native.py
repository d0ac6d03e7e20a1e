"""asyncgpu._native, the C extension behind the CUDA launch fast path, against a
stand-in driver: two C-callable functions (ctypes) that record what they were
given. What must hold: the arguments land in the parameter memory exactly as
the kernel reads them, the launch geometry and stream reach the driver as
given, an argument that is not the plan's launches nothing, and a marker
follows a launch only when asked for and only when the launch succeeded.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _stand_in_driver import Driver, bound_stand_in

from asyncgpu import _native


@pytest.fixture
def driver() -> Iterator[Driver]:
    with bound_stand_in() as d:
        yield d


class _State:
    closed = False


class _Ctx:
    def __init__(self) -> None:
        self._state = _State()


class Buf:
    """Has what the extension reads of a buffer: _alloc, _ctx._state.closed, _ptr."""

    def __init__(self, ptr: int) -> None:
        self._ptr = ptr
        self._alloc = object()
        self._ctx = _Ctx()


class Memory:
    """Parameter memory: 8 bytes per argument and the pointer array into it."""

    def __init__(self, n: int) -> None:
        self.data = (ctypes.c_uint64 * max(n, 1))()
        self.addr = ctypes.addressof(self.data)
        self.ptrs = (ctypes.c_uint64 * max(n, 1))(*(self.addr + 8 * i for i in range(n)))
        self.pointers = ctypes.addressof(self.ptrs)


DIMS = (4, 2, 1, 256, 1, 1, 1024)


def launch(driver: Driver, args: tuple[Any, ...], codes: bytes, *marker: int) -> int:
    driver.nargs = len(args)
    mem = Memory(len(args))
    types = tuple(map(type, args))
    return _native.launch(0xF00, DIMS, 0x5EA, types, codes, args, mem.addr, mem.pointers, *marker)


def test_arguments_are_packed_as_the_kernel_reads_them(driver: Driver) -> None:
    x, y = Buf(0x7F00_0000_1000), Buf(0x7F00_0000_2000)
    args = (np.float32(1.5), x, y, np.int32(-7), np.uint64(2**64 - 1), np.float64(0.25))
    assert launch(driver, args, b"fPPiQd") == 0
    ((f, dims, stream, values, extra),) = driver.launches
    assert (f, dims, stream, extra) == (0xF00, DIMS, 0x5EA, None)
    assert values == [
        struct.pack("<f4x", 1.5),
        struct.pack("<Q", x._ptr),
        struct.pack("<Q", y._ptr),
        struct.pack("<i4x", -7),
        struct.pack("<Q", 2**64 - 1),
        struct.pack("<d", 0.25),
    ]
    assert driver.writes == []  # no marker unless asked for


@pytest.mark.parametrize(
    ("value", "code", "packed"),
    [
        (np.int8(-2), b"b", struct.pack("<b7x", -2)),
        (np.uint8(250), b"B", struct.pack("<B7x", 250)),
        (np.int16(-300), b"h", struct.pack("<h6x", -300)),
        (np.uint16(65000), b"H", struct.pack("<H6x", 65000)),
        (np.uint32(4_000_000_000), b"I", struct.pack("<I4x", 4_000_000_000)),
        (np.int64(-(2**40)), b"q", struct.pack("<q", -(2**40))),
    ],
)
def test_every_integer_width_is_packed_little_endian(
    driver: Driver, value: np.generic, code: bytes, packed: bytes
) -> None:
    assert launch(driver, (value,), code) == 0
    assert driver.launches[0][3] == [packed]


def test_a_kernel_without_arguments_gets_no_parameter_array(driver: Driver) -> None:
    assert _native.launch(1, DIMS, 2, (), b"", (), 0, 0) == 0
    assert driver.launches[0][3] == []


def test_another_number_of_arguments_launches_nothing(driver: Driver) -> None:
    mem = Memory(2)
    types = (np.float32, np.int32)
    assert _native.launch(1, DIMS, 2, types, b"fi", (np.float32(1),), mem.addr, mem.pointers) == -1
    assert driver.launches == []


def test_an_argument_of_another_type_launches_nothing(driver: Driver) -> None:
    mem = Memory(2)
    types = (np.float32, np.int32)
    args = (np.float32(1), np.int64(1))  # int64 where the plan has int32
    assert _native.launch(1, DIMS, 2, types, b"fi", args, mem.addr, mem.pointers) == -1
    assert driver.launches == []


@pytest.mark.parametrize("why", ["no memory", "closed context"])
def test_an_unusable_buffer_launches_nothing(driver: Driver, why: str) -> None:
    b = Buf(0x1000)
    if why == "no memory":
        b._alloc = None  # take_ptr() gave the memory away
    else:
        b._ctx._state.closed = True
    assert launch(driver, (b,), b"P") == -1
    assert driver.launches == []


def test_the_marker_follows_a_successful_launch(driver: Driver) -> None:
    assert launch(driver, (np.int32(1),), b"i", 0xC0, 41) == 0
    assert driver.writes == [(0x5EA, 0xC0, 41)]


def test_a_failed_launch_places_no_marker(driver: Driver) -> None:
    driver.launch_result = 700
    assert launch(driver, (np.int32(1),), b"i", 0xC0, 41) == 700
    assert driver.writes == []


def test_a_failed_marker_is_told_apart_from_a_failed_launch(driver: Driver) -> None:
    driver.write_result = 1
    assert launch(driver, (np.int32(1),), b"i", 0xC0, 41) == _native.MARKER_FAILED + 1
    assert len(driver.launches) == 1


def test_write64_calls_the_driver_with_the_stream_address_and_value(driver: Driver) -> None:
    assert _native.write64(0x5EA, 0xC0, 2**63 + 5) == 0
    assert driver.writes == [(0x5EA, 0xC0, 2**63 + 5)]


@pytest.mark.parametrize(
    "bad",
    [
        lambda: _native.launch(1, (1, 1, 1), 2, (), b"", (), 0, 0),  # dims of 3
        lambda: _native.launch(1, DIMS, 2, (int,), b"", (1,), 8, 8),  # codes too short
        lambda: _native.launch(1, DIMS, 2, (np.int32,), b"i", (np.int32(1),), 0, 0),  # no memory
        lambda: _native.launch(-1, DIMS, 2, (), b"", (), 0, 0),  # negative handle
        lambda: _native.write64(1, 2),
    ],
)
def test_malformed_calls_raise_instead_of_calling_the_driver(driver: Driver, bad: Any) -> None:
    with pytest.raises((TypeError, ValueError, OverflowError)):
        bad()
    assert driver.launches == [] and driver.writes == []


def test_bind_refuses_null_entry_points() -> None:
    with pytest.raises(ValueError, match="NULL"):
        _native.bind(0, 0)


@pytest.fixture
def scalars_restored() -> Iterator[None]:
    """Whatever a test does to the in-place scalar table, the package's is back after."""
    from asyncgpu._api.context import _SCALAR_SAMPLES

    try:
        yield
    finally:
        assert _native.configure_scalars(b"fdbhiqBHIQ", _SCALAR_SAMPLES) == b"fdbhiqBHIQ"


@pytest.mark.parametrize("sample", range(10))
def test_a_numpy_scalar_packs_the_same_read_in_place_or_converted(
    driver: Driver, scalars_restored: None, sample: int
) -> None:
    """The launch copies a NumPy scalar's value from the scalar itself; with
    that switched off it converts it through float() or __index__: the kernel
    gets the same bytes either way."""
    from asyncgpu._api.context import _SCALAR_SAMPLES

    value, code = _SCALAR_SAMPLES[sample], b"fdbhiqBHIQ"[sample : sample + 1]
    assert launch(driver, (value,), code) == 0
    _native.configure_scalars(b"", ())
    assert launch(driver, (value,), code) == 0
    in_place, converted = driver.launches[0][3], driver.launches[1][3]
    assert in_place == converted
    assert in_place == [struct.pack("<" + code.decode(), value) + bytes(8 - value.nbytes)]


def test_only_types_that_keep_their_value_where_numpy_scalars_do_are_read_in_place(
    scalars_restored: None,
) -> None:
    """A Python float keeps a double where a float32 would be: its first four
    bytes are not 1.5 as a float32, so it is not registered for code ``f``."""
    assert _native.configure_scalars(b"fi", (1.5, np.int32(-5))) == b"i"


def test_configure_scalars_refuses_a_code_that_is_not_a_number(scalars_restored: None) -> None:
    with pytest.raises(ValueError, match="P is not a number's code"):
        _native.configure_scalars(b"P", (np.float32(1.0),))
    with pytest.raises(TypeError, match="one code per sample"):
        _native.configure_scalars(b"ff", (np.float32(1.0),))
