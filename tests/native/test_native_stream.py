"""The CUDA launch fast path in C (``StreamCore._launch_c``) and the C fields of
events and polled streams (``EventCore``, ``StreamCore``), against a stand-in
driver (ctypes functions that record what they were given) and a CudaStream
built without a GPU.

What must hold (the launches it does not take go to the general path,
``CudaStream._launch``): the launch gets the next sequence number and an event
that keeps its arguments until it is retired; a stream that is held, a plan
without parameter memory on the stream, or an argument not of the plan's type
launches nothing and hands the launch back (None); the marker rules of
``_PolledStream._before_submit`` hold (a marker for a last event the user still
holds, one every ``MARK_EVERY`` operations, a marker right after each launch
while the stream is eager); a failed launch raises and releases the submit
lock; and events retire in order once the counter passes them.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import sys
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _stand_in_driver import Driver, bound_stand_in
from test_native import DIMS, Buf

from asyncgpu import DeviceError, DeviceEvent, _native
from asyncgpu._devices.cuda import launch as _launch
from asyncgpu._devices.cuda import stream as _stream


class _Function:
    """What CudaStream.launch reads of a DeviceFunction, its compiled code, its
    launch configuration."""

    def __init__(self, plan: _launch._ArgPlan | None) -> None:
        self._impl = self
        self.last, self.handle, self.dims = plan, 0xF00, DIMS


class Stream:
    """A CudaStream on the stand-in driver, its counter in ordinary memory, its
    events in flight in ``queue`` (the extension's EventQueue, which the C code
    reaches directly, as a real stream's, or a deque, which it reaches through
    its methods)."""

    def __init__(self, sweeps: list[Any], queue: Any = None) -> None:
        s = self.s = _stream.CudaStream.__new__(_stream.CudaStream)
        s._seq = s._marked = s._awaited = s._issued_mark = s._counter_mark = s._done_seq = 0
        s._eager = s._after_copy = False
        s._touched = False
        s._inflight = _native.EventQueue() if queue is None else queue
        s._pending = None
        s._events = None
        s._copy_marks = deque()
        s._free_events = []
        s._submit_lock = threading.RLock()
        s._retire_lock = threading.Lock()
        s._marker_lock = threading.Lock()
        s._issue_waiters = []
        self.counter = ctypes.c_uint64(0)
        s._counter = self.counter
        s.h, s.caddr = 0x5EA, ctypes.addressof(self.counter)
        s._counter_in_c = True
        s._write_marker = lambda seq: _native.write64(s.h, s.caddr, seq)
        s._param_mem = {}
        s.label = "test/s0"
        s._launch = lambda *a: None  # the general path: "handed back"
        self.sweeps = sweeps

    def plan(self, args: tuple[Any, ...], codes: bytes) -> _launch._ArgPlan:
        plan = _launch._ArgPlan((), tuple(map(type, args)), codes)
        self.s._param_mem[plan] = _launch._ParamMemory(8 * len(args))
        return plan

    def launch(self, plan: _launch._ArgPlan, args: tuple[Any, ...]) -> DeviceEvent | None:
        """``CudaStream.launch``; None where it handed the launch to ``_launch``."""
        f = _Function(plan)
        return self.s.launch(f, args, f, ())


@pytest.fixture
def driver() -> Iterator[Driver]:
    with bound_stand_in(events=True) as d:
        yield d


@pytest.fixture(params=["EventQueue", "deque"])
def stream(driver: Driver, request: pytest.FixtureRequest) -> Iterator[Stream]:
    sweeps: list[Any] = []
    _native.configure(DeviceEvent, sweeps.append, 32)
    try:
        yield Stream(sweeps, None if request.param == "EventQueue" else deque())
    finally:
        from asyncgpu._core.engine import watcher

        _native.configure(DeviceEvent, watcher.sweep_later, _stream._PolledStream.MARK_EVERY)


ARGS = (np.float32(1.5), Buf(0x7F00_0000_1000), np.int32(7))
CODES = b"fPi"


def markers(driver: Driver) -> list[int]:
    return [value for _, _, value in driver.writes]


def test_a_launch_returns_the_event_of_the_next_operation(stream: Stream, driver: Driver) -> None:
    driver.nargs = 3
    plan = stream.plan(ARGS, CODES)
    ev = stream.launch(plan, ARGS)
    assert type(ev) is DeviceEvent
    assert (ev._stream, ev._seq, ev._done, ev._keep) == (stream.s, 1, False, ARGS)
    assert (ev._value, ev._error, ev._waiters, ev._lock, ev._timing) == (
        None,
        None,
        None,
        None,
        False,
    )
    assert stream.s._seq == 1 and list(stream.s._inflight) == [ev]
    ((f, dims, handle, values, _),) = driver.launches
    assert (f, dims, handle) == (0xF00, DIMS, 0x5EA)
    assert values[2] == np.int32(7).tobytes() + bytes(4)
    assert markers(driver) == []  # fire and forget: no marker
    assert stream.sweeps == [stream.s]  # the watcher sweeps a stream once it is touched


class _Kernel(_native.KernelCore):
    """A compiled function as ``_cuda._CudaFunction`` is one: its last plan in
    ``KernelCore``'s C field, read without an attribute lookup."""

    def __init__(self, plan: _launch._ArgPlan | None) -> None:
        self._impl = self
        self.last, self.handle, self.dims = plan, 0xF00, DIMS


def test_the_last_plan_of_a_compiled_function_is_read_from_its_c_field(
    stream: Stream, driver: Driver
) -> None:
    driver.nargs = 3
    plan = stream.plan(ARGS, CODES)
    f = _Kernel(plan)
    assert issubclass(_launch._CudaFunction, _native.KernelCore)
    ev = stream.s.launch(f, ARGS, f, ())
    assert type(ev) is DeviceEvent and len(driver.launches) == 1
    f.last = None  # no plan yet: the general path (here: handed back)
    assert stream.s.launch(f, ARGS, f, ()) is None and len(driver.launches) == 1


@pytest.mark.parametrize("why", ["held", "no parameter memory", "other type", "unusable buffer"])
def test_what_the_fast_path_cannot_take_is_handed_back(
    stream: Stream, driver: Driver, why: str
) -> None:
    plan = stream.plan(ARGS, CODES)
    args: tuple[Any, ...] = ARGS
    if why == "held":
        stream.s._pending = deque()
    elif why == "no parameter memory":
        stream.s._param_mem.clear()
    elif why == "other type":
        args = (np.float64(1.5), *ARGS[1:])
    else:
        dead = Buf(0x1000)
        dead._alloc = None
        args = (ARGS[0], dead, ARGS[2])
    assert stream.launch(plan, args) is None
    assert driver.launches == [] and stream.s._seq == 0 and not stream.s._inflight


def test_a_plan_without_codes_is_handed_back(stream: Stream, driver: Driver) -> None:
    plan = stream.plan(ARGS, CODES)
    plan.codes = None
    assert stream.launch(plan, ARGS) is None and driver.launches == []


def test_a_held_last_event_gets_its_marker_before_the_next_launch(
    stream: Stream, driver: Driver
) -> None:
    plan = stream.plan(ARGS, CODES)
    first = stream.launch(plan, ARGS)
    stream.launch(plan, ARGS)  # the user still holds ``first``: mark it first
    assert markers(driver) == [1]
    assert stream.s._marked == 1 and first is not None
    stream.launch(plan, ARGS)  # the second event was dropped: no marker for it
    assert markers(driver) == [1]


def test_unheld_work_is_marked_every_mark_every_operations(stream: Stream, driver: Driver) -> None:
    plan = stream.plan(ARGS, CODES)
    for _ in range(32):
        stream.launch(plan, ARGS)
    # The 32nd unmarked launch writes the marker itself, right after the kernel.
    assert markers(driver) == [32] and len(driver.launches) == 32
    for _ in range(38):
        stream.launch(plan, ARGS)
    assert markers(driver) == [32, 64]


def test_an_eager_stream_writes_the_counter_right_after_each_launch(
    stream: Stream, driver: Driver
) -> None:
    plan = stream.plan(ARGS, CODES)
    stream.s._eager = True
    held = [stream.launch(plan, ARGS) for _ in range(3)]
    assert markers(driver) == [1, 2, 3]
    assert (stream.s._marked, stream.s._issued_mark, stream.s._counter_mark) == (3, 3, 3)
    assert len(held) == 3


def test_an_eager_stream_goes_lazy_when_its_last_event_was_dropped_unawaited(
    stream: Stream, driver: Driver
) -> None:
    plan = stream.plan(ARGS, CODES)
    stream.s._eager = True
    stream.launch(plan, ARGS)  # dropped at once, never awaited
    stream.launch(plan, ARGS)
    assert stream.s._eager is False
    assert markers(driver) == [1]  # only the launch made while eager


def test_launches_of_two_functions_and_plans_in_turn_each_get_their_own(
    stream: Stream, driver: Driver
) -> None:
    # The stream keeps the last function's handle, the last plan's types and codes
    # and the last parameter memory's addresses: alternating must not mix them up.
    driver.nargs = 3
    plan_a = stream.plan(ARGS, CODES)
    other = (np.int32(5), Buf(0x7F00_0000_2000), np.float32(2.5))
    plan_b = stream.plan(other, b"iPf")
    fa, fb = _Function(plan_a), _Function(plan_b)
    fb.handle = 0xB00
    for _ in range(2):
        assert stream.s.launch(fa, ARGS, fa, ()) is not None
        assert stream.s.launch(fb, other, fb, ()) is not None
    assert stream.s.launch(fb, ARGS, fb, ()) is None  # not plan_b's types: handed back
    firsts = [(f, values[0], values[1]) for f, _, _, values, _ in driver.launches]
    a = (0xF00, np.float32(1.5).tobytes() + bytes(4), (0x7F00_0000_1000).to_bytes(8, "little"))
    b = (0xB00, np.int32(5).tobytes() + bytes(4), (0x7F00_0000_2000).to_bytes(8, "little"))
    assert firsts == [a, b, a, b]


def test_a_plans_parameter_memory_stays_alive_while_the_stream_launches_with_it(
    stream: Stream, driver: Driver
) -> None:
    """The stream finds a plan's parameter memory once and holds it: later launches
    of the plan pack into it, and the driver reads what they packed, even once
    nothing else refers to that memory (an entry of ``_param_mem`` never changes
    once made, so the stream does not look it up again)."""
    driver.nargs = 3
    plan = stream.plan(ARGS, CODES)
    assert stream.launch(plan, ARGS) is not None
    stream.s._param_mem.clear()
    gc.collect()
    other = (np.float32(-2.0), *ARGS[1:])
    assert stream.launch(plan, other) is not None
    values = driver.launches[-1][3]
    assert values[0] == np.float32(-2.0).tobytes() + bytes(4)
    assert values[1] == (0x7F00_0000_1000).to_bytes(8, "little")


class CoreBuf(_native.BufferCore):
    """A buffer whose fields live in C, as asyncgpu's own buffers' do."""

    def __init__(self, ptr: int) -> None:
        self._ptr, self._alloc, self._ctx = ptr, object(), Buf(0)._ctx


@pytest.mark.parametrize("state", ["usable", "no memory", "closed context"])
def test_a_buffer_with_c_fields_is_packed_from_them(
    stream: Stream, driver: Driver, state: str
) -> None:
    driver.nargs = 3
    plan = stream.plan(ARGS, CODES)
    buf = CoreBuf(0x7F00_0000_3000)
    plan.types = (np.float32, CoreBuf, np.int32)
    if state == "no memory":
        buf._alloc = None
    elif state == "closed context":
        buf._ctx._state.closed = True
    ev = stream.launch(plan, (ARGS[0], buf, ARGS[2]))
    if state != "usable":
        assert ev is None and driver.launches == []  # the general path raises the error
        return
    assert ev is not None and ev._keep[1] is buf
    (values,) = [launch[3] for launch in driver.launches]
    assert values[1] == (0x7F00_0000_3000).to_bytes(8, "little")


def test_a_blocking_wait_between_awaits_keeps_the_stream_eager(
    stream: Stream, driver: Driver
) -> None:
    plan = stream.plan(ARGS, CODES)
    awaited = stream.launch(plan, ARGS)
    assert awaited is not None and stream.s._poll(awaited) is False  # awaited: eager
    stream.counter.value = 1
    assert stream.s._poll(awaited) is True
    blocked = stream.launch(plan, ARGS)  # marked at once: the stream is eager
    assert blocked is not None and markers(driver) == [1, 2]
    stream.counter.value = 2
    _stream._PolledStream._block(stream.s, blocked)  # as ``blocked.synchronize()`` waits
    del awaited, blocked
    stream.launch(plan, ARGS)  # the last operation was waited for: still eager
    assert stream.s._eager is True and markers(driver) == [1, 2, 3]


def test_a_blocking_wait_does_not_make_a_lazy_stream_eager(stream: Stream, driver: Driver) -> None:
    plan = stream.plan(ARGS, CODES)
    ev = stream.launch(plan, ARGS)
    stream.counter.value = 1
    assert ev is not None and markers(driver) == []
    _stream._PolledStream._block(stream.s, ev)  # its marker is placed when it blocks
    assert markers(driver) == [1] and ev._done and stream.s._eager is False
    del ev
    stream.launch(plan, ARGS)
    assert markers(driver) == [1]


def test_the_watchers_sweep_marks_the_tail_without_counting_it_as_waited(
    stream: Stream, driver: Driver
) -> None:
    plan = stream.plan(ARGS, CODES)
    stream.launch(plan, ARGS)
    tail = stream.s.tail()
    assert tail is not None
    stream.s._need(tail, eager=False, waited=False)  # what the sweep does
    assert markers(driver) == [1]
    assert (stream.s._eager, stream.s._awaited) == (False, 0)


def test_finished_events_retire_in_order_and_release_their_arguments(
    stream: Stream, driver: Driver
) -> None:
    plan = stream.plan(ARGS, CODES)
    args = (np.float32(2.0), Buf(0x2000), np.int32(1))
    base = sys.getrefcount(args)
    evs = [stream.launch(plan, args) for _ in range(3)]
    assert sys.getrefcount(args) == base + 3  # each event keeps them
    stream.counter.value = 2  # the device passed the second launch
    last = stream.launch(plan, ARGS)
    assert [e._done for e in evs] == [True, True, False]  # type: ignore[union-attr]
    assert [e._keep for e in evs[:2]] == [None, None]  # type: ignore[union-attr]
    assert list(stream.s._inflight) == [evs[2], last]
    assert sys.getrefcount(args) == base + 1


def test_a_failed_launch_raises_and_leaves_the_stream_usable(
    stream: Stream, driver: Driver
) -> None:
    plan = stream.plan(ARGS, CODES)
    driver.launch_result = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(DeviceError, match="cuLaunchKernel"):
        stream.launch(plan, ARGS)
    assert stream.s._seq == 0 and not stream.s._inflight
    assert _lock_is_free(stream.s._submit_lock)
    driver.launch_result = 0
    assert stream.launch(plan, ARGS)._seq == 1  # type: ignore[union-attr]


def test_a_failed_marker_raises_after_the_launch_went_in(stream: Stream, driver: Driver) -> None:
    plan = stream.plan(ARGS, CODES)
    stream.s._eager = True
    driver.write_result = 1
    with pytest.raises(DeviceError, match="cuStreamWriteValue64"):
        stream.launch(plan, ARGS)
    assert stream.s._seq == 1 and len(stream.s._inflight) == 1  # the kernel is in flight
    assert _lock_is_free(stream.s._submit_lock)


def _lock_is_free(lock: Any) -> bool:
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(lock.acquire(timeout=1) and not lock.release()))
    t.start()
    t.join()
    return got == [True]


def test_events_from_c_are_collected_like_any_other(stream: Stream, driver: Driver) -> None:
    plan = stream.plan(ARGS, CODES)
    refs = []
    for _ in range(100):
        ev = stream.launch(plan, ARGS)
        refs.append(weakref.ref(ev))
    del ev
    stream.counter.value = 100
    stream.s._retire()
    gc.collect()
    assert [r() for r in refs] == [None] * 100


def test_an_event_in_a_reference_cycle_is_collected() -> None:
    ev = DeviceEvent(None)
    ev._keep = [ev]  # the event keeps what keeps it
    ref = weakref.ref(ev)
    del ev
    gc.collect()
    assert ref() is None


def test_a_device_event_is_made_with_the_same_defaults_either_way() -> None:
    ev = DeviceEvent(None)
    assert (ev._stream, ev._seq, ev._done, ev._keep, ev._timing) == (None, 0, False, None, False)
    ev = DeviceEvent(stream=None, seq=5, keep="k")
    assert (ev._seq, ev._keep) == (5, "k")
    with pytest.raises(TypeError):
        DeviceEvent(None, "five")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ev._done = 1  # type: ignore[assignment]  # a flag is a bool


def test_configure_wants_a_device_event_class() -> None:
    with pytest.raises(TypeError, match="EventCore"):
        _native.configure(object, print, 32)
    with pytest.raises(ValueError, match="at least 1"):
        _native.configure(DeviceEvent, print, 0)


def test_finish_wakes_each_waiter_once_and_keeps_the_first_outcome() -> None:
    ev = DeviceEvent(None, 1, keep=["kept"])
    seen: list[Any] = []
    assert ev._add_waiter(seen.append) is True
    ev._finish("value", None)
    assert (ev._done, ev._value, ev._keep, seen) == (True, "value", None, [ev])
    ev._finish(None, RuntimeError("late"))  # finished already: nothing changes
    assert (ev._value, ev._error, seen) == ("value", None, [ev])
    assert ev._add_waiter(seen.append) is False  # done: the caller resolves


def test_a_raising_waiter_does_not_keep_later_events_or_waiters_from_finishing(
    stream: Stream, driver: Driver, caplog: pytest.LogCaptureFixture
) -> None:
    plan = stream.plan(ARGS, CODES)
    first, second = stream.launch(plan, ARGS), stream.launch(plan, ARGS)
    assert first is not None and second is not None

    def boom(_: DeviceEvent) -> None:
        raise RuntimeError("a waiter failed")

    first._add_waiter(boom)
    seen: list[DeviceEvent] = []
    first._add_waiter(seen.append)
    stream.counter.value = 2
    with caplog.at_level(logging.ERROR, logger="asyncgpu"):
        stream.s._retire()  # the waiter's error is logged, not raised into the retire
    assert first._done and second._done and not stream.s._inflight
    assert seen == [first]  # the waiter after the broken one is still woken
    assert "a waiter failed" in caplog.text


def test_a_waited_kernel_is_finished_in_c_and_its_waiters_woken_once(
    stream: Stream, driver: Driver
) -> None:
    plan = stream.plan(ARGS, CODES)
    ev = stream.launch(plan, ARGS)
    assert ev is not None
    seen: list[tuple[bool, object, object]] = []
    ev._add_waiter(lambda e: seen.append((e._done, e._value, e._keep)))

    def not_here(_: DeviceEvent) -> None:
        raise AssertionError("a kernel's event is finished in C")

    stream.s._finish_retired = not_here
    stream.counter.value = 1
    assert stream.s._retire() is True
    assert seen == [(True, None, None)]  # done, no value, its arguments released
    stream.s._retire()
    assert len(seen) == 1


def test_a_traced_kernel_retired_in_c_has_its_trace_end_before_it_is_done(
    stream: Stream, driver: Driver
) -> None:
    """A traced event with no waiter still goes through ``_finish``: its trace
    stamps the end first, so nobody sees it done without the end."""
    from asyncgpu import Trace

    plan = stream.plan(ARGS, CODES)
    t = Trace(device_stamps=False)
    ev = stream.launch(plan, ARGS)
    assert ev is not None
    node = t.record(stream.s, ev, "kernel")
    seen: list[tuple[bool, int | None]] = []
    on_done = t._on_done

    def stamp(e: DeviceEvent) -> None:
        seen.append((e._done, node.end_ns))
        on_done(e)

    t._on_done = stamp  # type: ignore[method-assign]
    stream.counter.value = 1
    stream.s._retire()
    assert ev._done and seen == [(False, None)] and node.end_ns is not None
    assert ev._keep is None


def test_an_operation_submitted_in_python_gets_its_event_from_mark(
    stream: Stream, driver: Driver
) -> None:
    """``_mark`` (the compiled ``_mark_c``), after the general path's driver call:
    the next sequence number, an event keeping what the operation uses, queued in
    flight; a marker too while the stream is eager."""
    s = stream.s
    kept = object()
    ev = s._mark(kept)
    assert type(ev) is DeviceEvent and (ev._seq, ev._keep, ev._stream) == (1, kept, s)
    assert list(s._inflight) == [ev] and markers(driver) == []
    placed: list[bool] = []
    s._place_marker = lambda counter=False: placed.append(counter)
    s._eager = True
    assert s._mark(None)._seq == 2 and placed == [False]


def test_polling_an_unmarked_event_marks_it_and_retires_it_once_passed(
    stream: Stream, driver: Driver
) -> None:
    plan = stream.plan(ARGS, CODES)
    ev = stream.launch(plan, ARGS)
    assert ev is not None and markers(driver) == []
    assert stream.s._poll(ev) is False  # asked for: a marker now, and eager from now on
    assert markers(driver) == [1] and stream.s._eager is True and stream.s._awaited == 1
    stream.counter.value = 1
    assert stream.s._poll(ev) is True and ev._done and not stream.s._inflight


def test_the_counter_is_read_in_c_and_marker_events_queried_there(
    stream: Stream, driver: Driver
) -> None:
    stream.counter.value = 7
    assert stream.s._completed_fast() == 7
    stream.s._copy_marks.append((8, 0xE8))  # a copy's marker event
    assert stream.s._completed_fast() == 7  # not finished (cuEventQuery)
    driver.finished.add(0xE8)
    assert stream.s._completed_fast() == 8 and stream.s._free_events == [0xE8]


def test_marker_events_without_cuEventQuery_are_an_error_not_a_guess(stream: Stream) -> None:
    stream.s._copy_marks.append((8, 0xE8))
    with bound_stand_in(events=False), pytest.raises(RuntimeError, match="cuEventQuery"):
        stream.s._completed_fast()


def test_a_marker_event_placed_from_python_is_recorded_in_c(stream: Stream, driver: Driver) -> None:
    """``_record_marker_c``: a free event (else ``_new_marker_event``'s) recorded on
    the stream, queued with its operation's number in ``_copy_marks``, or in
    ``_events`` with event completion."""
    stream.s._new_marker_event = lambda: 0xE1
    stream.s._free_events.append(0xE0)
    stream.s._record_marker_c(3)
    stream.s._record_marker_c(4)
    assert driver.records == [(0xE0, 0x5EA), (0xE1, 0x5EA)]
    assert list(stream.s._copy_marks) == [(3, 0xE0), (4, 0xE1)] and not stream.s._free_events
    stream.s._events = deque()
    stream.s._free_events.append(0xE2)
    stream.s._record_marker_c(5)
    assert list(stream.s._events) == [(5, 0xE2)] and len(stream.s._copy_marks) == 2
    with bound_stand_in(events=False), pytest.raises(RuntimeError, match="cuEventRecord"):
        stream.s._record_marker_c(6)


def test_event_completion_queries_the_marker_events_in_c(stream: Stream, driver: Driver) -> None:
    """ASYNCGPU_COMPLETION=event: every marker is a driver event, and the counter
    says nothing. Finished events retire in order; once the newest has finished,
    every one has (stream order), and none of the others is asked."""
    s = stream.s
    s._events = deque([(1, 0xE0), (2, 0xE1), (3, 0xE2)])
    stream.counter.value = 99  # never read
    assert s._completed_fast() == 0
    driver.finished.add(0xE0)
    assert s._completed_fast() == 1 and s._free_events == [0xE0]
    driver.finished.add(0xE2)  # the newest: 0xE1 finished before it
    assert s._completed_fast() == 3 and s._free_events == [0xE0, 0xE1, 0xE2]
    assert not s._events


@pytest.mark.parametrize("why", ["fast", "constant memory", "no plan", "no dimensions"])
def test_cuda_stream_launch_takes_the_fast_path_or_hands_the_launch_to_launch(
    stream: Stream, driver: Driver, why: str
) -> None:
    f = _Function(stream.plan(ARGS, CODES))
    general: list[tuple[Any, ...]] = []
    stream.s._launch = lambda *a: general.append(a) or "general"
    constant = ["a mapping"] if why == "constant memory" else []
    if why == "no plan":
        f.last = None
    elif why == "no dimensions":
        f.dims = None  # type: ignore[assignment]
    ev = stream.s.launch(f, ARGS, f, constant)
    if why == "fast":
        assert type(ev) is DeviceEvent and general == [] and len(driver.launches) == 1
    else:
        assert ev == "general" and general == [(f, f, ARGS, f, constant)]
        assert driver.launches == []


# -- the marker after an eager launch as a driver event --------------------------------
# cuStreamWriteValue64 costs the host about three times cuEventRecord
# (benchmarks/diagnostics/probe_driver.py): the eager marker after a launch is an event.


@pytest.fixture
def evented(stream: Stream) -> Stream:
    stream.s._kernel_event_markers = True
    stream.s._eager = True
    made = iter(range(0xE0, 0x100))
    stream.s._new_marker_event = lambda: next(made)  # event "handles"
    return stream


def test_an_eager_launch_records_a_marker_event_instead_of_writing_the_counter(
    evented: Stream, driver: Driver
) -> None:
    plan = evented.plan(ARGS, CODES)
    ev = evented.launch(plan, ARGS)
    assert ev is not None and markers(driver) == []  # no counter write
    assert driver.records == [(0xE0, 0x5EA)]  # the event, on the stream
    s = evented.s
    assert list(s._copy_marks) == [(1, 0xE0)]
    assert (s._marked, s._issued_mark, s._counter_mark) == (1, 1, 0)


def test_finished_marker_events_retire_their_work_and_are_recorded_again(
    evented: Stream, driver: Driver
) -> None:
    plan = evented.plan(ARGS, CODES)
    first = evented.launch(plan, ARGS)
    second = evented.launch(plan, ARGS)
    assert first is not None and second is not None
    assert evented.s._completed() == 0 and not first._done  # neither event finished
    driver.finished.add(0xE0)
    assert evented.s._completed() == 1  # the first event says its launch finished
    assert evented.s._poll(first) and not second._done
    assert list(evented.s._copy_marks) == [(2, 0xE1)] and evented.s._free_events == [0xE0]
    evented.launch(plan, ARGS)  # the free event is recorded again, not a new one
    assert driver.records[-1] == (0xE0, 0x5EA) and evented.s._free_events == []


def test_a_counter_past_a_marker_event_retires_it_without_asking_the_driver(
    evented: Stream, driver: Driver
) -> None:
    plan = evented.plan(ARGS, CODES)
    evented.launch(plan, ARGS)
    evented.counter.value = 1  # a later counter marker reached the host first
    assert evented.s._completed() == 1 and not evented.s._copy_marks


def test_a_failed_event_record_raises_and_keeps_the_event(evented: Stream, driver: Driver) -> None:
    plan = evented.plan(ARGS, CODES)
    driver.record_result = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(DeviceError, match="cuEventRecord"):
        evented.launch(plan, ARGS)
    s = evented.s
    assert s._free_events == [0xE0] and not s._copy_marks and s._marked == 0
    assert s._seq == 1 and len(s._inflight) == 1  # the kernel went in
    assert _lock_is_free(s._marker_lock) and _lock_is_free(s._submit_lock)


def test_without_the_event_entry_points_an_eager_launch_writes_the_counter(
    stream: Stream,
) -> None:
    stream.s._kernel_event_markers = True
    stream.s._eager = True
    with bound_stand_in(events=False) as plain:  # cuLaunchKernel, cuStreamWriteValue64 only
        stream.launch(stream.plan(ARGS, CODES), ARGS)
    assert markers(plain) == [1] and plain.records == [] and not stream.s._copy_marks


# -- user events: a record's point in the stream's in-flight queue ----------------------


def test_a_user_event_recorded_again_elsewhere_leaves_the_first_stream_retiring(
    stream: Stream,
) -> None:
    """Recorded on B, then on A at a later sequence number: B's queue holds a
    point of its own, so B's later work still retires when B's counter passes it
    (the user event itself once sat in B's queue with A's number,
    and B's retirement stopped there for good: later awaits on B hung)."""
    from asyncgpu._core.event import _UserEvent

    a, b = stream, Stream(stream.sweeps, type(stream.s._inflight)())
    a.s.owned = b.s.owned = True
    plan_a, plan_b = a.plan(ARGS, CODES), b.plan(ARGS, CODES)
    for _ in range(10):
        a.launch(plan_a, ARGS)
    for _ in range(3):
        b.launch(plan_b, ARGS)
    ev = _UserEvent._new(("cuda", 0))
    b.s.record(ev)
    later_on_b = b.launch(plan_b, ARGS)
    assert later_on_b is not None
    a.s.record(ev)  # moved: now stands for A's 10th operation
    assert (ev._stream, ev._seq) == (a.s, 10)
    b.counter.value = 4  # B has finished everything
    assert later_on_b.query()
    assert not ev.query()  # B's point passed; the event is A's now
    a.counter.value = 10
    assert ev.query()


def test_a_user_event_recorded_again_before_its_first_point_stands_for_the_second(
    stream: Stream,
) -> None:
    from asyncgpu._core.event import _UserEvent

    s = stream
    s.s.owned = True
    plan = s.plan(ARGS, CODES)
    s.launch(plan, ARGS)
    ev = _UserEvent._new(("cuda", 0))
    s.s.record(ev)
    s.launch(plan, ARGS)
    s.s.record(ev)
    s.counter.value = 1  # the first record's point
    s.s._retire()
    assert not ev.query()
    s.counter.value = 2
    assert ev.query()


# -- copies: StreamCore._copy_c ------------------------------------------------------------


class _Mem:
    """What ``CudaStream.copy`` reads of an operand: its address and kind."""

    def __init__(self, ptr: int, kind: str = "device") -> None:
        self._ptr, self._kind = ptr, kind


def test_a_copy_reaches_the_driver_in_one_compiled_call(stream: Stream, driver: Driver) -> None:
    """``CudaStream.copy`` is the only Python frame between the stream and
    ``cuMemcpyAsync``: the marker rules, the driver call, the event and the
    prune are one C call."""
    keep = (object(), object())
    called: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name != "memcpy":
            called.append(frame.f_code.co_name)

    dst, src = _Mem(0xD000), _Mem(0xC000)
    gc.disable()  # (a collection here would run other libraries' gc callbacks)
    sys.setprofile(profile)
    try:
        ev = stream.s.copy(dst, src, 4096, keep)
    finally:
        sys.setprofile(None)
        gc.enable()
    assert called == ["copy"]
    assert driver.copies == [(0xD000, 0xC000, 4096, 0x5EA)]
    assert type(ev) is DeviceEvent
    assert (ev._stream, ev._seq, ev._done, ev._keep) == (stream.s, 1, False, keep)
    assert list(stream.s._inflight) == [ev] and stream.s._after_copy
    assert _lock_is_free(stream.s._submit_lock)


def test_an_empty_copy_is_an_operation_without_a_driver_call(
    stream: Stream, driver: Driver
) -> None:
    ev = stream.s.copy(_Mem(0xD000), _Mem(0xC000), 0, None)
    assert driver.copies == [] and ev._seq == 1 and not stream.s._after_copy


def test_a_copy_follows_the_marker_rules(stream: Stream, driver: Driver) -> None:
    """A last event the user still holds gets its marker before the copy goes
    in; an eager stream places one right after the copy (a driver event there,
    since a copy's marker is an event: ``_place_marker``)."""
    placed: list[int] = []

    def place() -> None:
        placed.append(stream.s._seq)
        stream.s._marked = stream.s._seq

    stream.s._place_marker = place  # type: ignore[method-assign]
    first = stream.s.copy(_Mem(0xD000), _Mem(0xC000), 64, None)
    stream.s.copy(_Mem(0xD000), _Mem(0xC000), 64, None)
    assert first._seq == 1 and placed == [1]  # held by the test: marked first
    stream.s._eager = True
    ev = stream.s.copy(_Mem(0xD000), _Mem(0xC000), 64, None)
    assert placed[-1] == ev._seq == 3


def test_a_held_stream_hands_the_copy_back(stream: Stream, driver: Driver) -> None:
    stream.s._pending = deque()
    assert stream.s._copy_c(0xD000, 0xC000, 64, None) is None
    assert driver.copies == [] and stream.s._seq == 0


def test_a_failed_copy_raises_and_submits_nothing(stream: Stream, driver: Driver) -> None:
    stream.s._driver_error = _stream.CudaStream._driver_error.__get__(stream.s)  # type: ignore[method-assign]
    driver.copy_result = 1  # CUDA_ERROR_INVALID_VALUE
    with pytest.raises(DeviceError, match="cuMemcpyAsync"):
        stream.s.copy(_Mem(0xD000), _Mem(0xC000), 64, None)
    assert stream.s._seq == 0 and not stream.s._inflight
    assert _lock_is_free(stream.s._submit_lock)
    driver.copy_result = 0
    assert stream.s.copy(_Mem(0xD000), _Mem(0xC000), 64, None)._seq == 1


# -- graph launches: StreamCore._graph_c -------------------------------------------------


class _Graph:
    """What ``CudaStream.graph_launch`` reads of a device graph: its lock, the
    parameters its driver graphs hold (``applied``: their ``serials``), and ``launch`` (the Python
    path, which sets the replay's parameters first)."""

    def __init__(self, ops: object) -> None:
        self.lock = _native.RLock()
        self.applied = [ops]
        self.launched: list[tuple[Any, ...]] = []

    def launch(self, exe: Any, params: Any, raw: Any) -> None:
        self.launched.append((exe, params, raw))


class _Params:
    def __init__(self, ops: object) -> None:
        self.serials = ops


def test_a_graph_launch_reaches_the_driver_in_one_compiled_call(
    stream: Stream, driver: Driver
) -> None:
    """``CudaStream.graph_launch`` is the only Python frame between a replay and
    ``cuGraphLaunch`` while the driver graph holds the replay's parameters; the
    event keeps the graph and the parameters."""
    ops = ("op",)
    graph, params = _Graph(ops), _Params(ops)
    called: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not frame.f_code.co_filename.endswith("_stand_in_driver.py"):
            called.append(frame.f_code.co_name)

    gc.disable()
    sys.setprofile(profile)
    try:
        ev = stream.s.graph_launch(graph, "exe", 0xE0E, params)
    finally:
        sys.setprofile(None)
        gc.enable()
    assert called == ["graph_launch"]
    assert driver.graph_launches == [(0xE0E, 0x5EA)] and graph.launched == []
    assert type(ev) is DeviceEvent
    assert (ev._stream, ev._seq, ev._done, ev._keep) == (stream.s, 1, False, (graph, params))
    assert list(stream.s._inflight) == [ev] and not stream.s._after_copy
    assert _lock_is_free(stream.s._submit_lock) and _lock_is_free(graph.lock)


def test_the_compiled_graph_launch_takes_the_graphs_lock(stream: Stream, driver: Driver) -> None:
    """While another thread holds the graph's lock (an update, or a launch on
    another stream), the launch waits for it: the driver never sees two calls
    on one executable graph at once."""
    ops = ("op",)
    graph = _Graph(ops)
    graph.lock.acquire()
    result: list[Any] = []
    t = threading.Thread(
        target=lambda: result.append(stream.s.graph_launch(graph, "exe", 0xE0F, _Params(ops)))
    )
    t.start()
    t.join(0.05)
    assert t.is_alive() and driver.graph_launches == []
    graph.lock.release()
    t.join(5)
    assert not t.is_alive() and driver.graph_launches == [(0xE0F, 0x5EA)]
    assert result[0]._seq == 1


def test_other_parameters_or_a_held_stream_take_the_python_path(
    stream: Stream, driver: Driver
) -> None:
    """The compiled launch hands back (None, nothing launched, both locks free)
    when the driver graph holds other parameters than the replay's (an update
    came between) or the stream is held behind host work; ``graph_launch``
    then has the graph make the call (``CudaGraph.launch``), queued while held."""
    graph = _Graph(("new",))
    old = _Params(("old",))
    assert stream.s._graph_c(0xE0E, graph.lock, graph.applied, old.serials, None) is None
    assert driver.graph_launches == [] and stream.s._seq == 0
    assert _lock_is_free(graph.lock) and _lock_is_free(stream.s._submit_lock)
    stream.s.backend = type("B", (), {"make_current": lambda self: None})()
    stream.s.raw = "raw"
    ev = stream.s.graph_launch(graph, "exe", 0xE0E, old)
    assert graph.launched == [("exe", old, "raw")] and ev._keep == (graph, old)
    assert driver.graph_launches == []

    stream.s._pending = deque()
    same = _Params(("new",))
    assert stream.s._graph_c(0xE0E, graph.lock, graph.applied, same.serials, None) is None
    stream.s.graph_launch(graph, "exe", 0xE0E, same)
    assert driver.graph_launches == [] and len(graph.launched) == 1
    (queued,) = (call for seq, call in stream.s._pending if seq == stream.s._seq)
    queued()  # (what the drain does once the gate opens)
    assert graph.launched[-1] == ("exe", same, "raw")


def test_a_failed_graph_launch_raises_and_submits_nothing(stream: Stream, driver: Driver) -> None:
    stream.s._driver_error = _stream.CudaStream._driver_error.__get__(stream.s)  # type: ignore[method-assign]
    driver.graph_launch_result = 1  # CUDA_ERROR_INVALID_VALUE
    ops = ("op",)
    graph = _Graph(ops)
    with pytest.raises(DeviceError, match="cuGraphLaunch"):
        stream.s.graph_launch(graph, "exe", 0xE0E, _Params(ops))
    assert stream.s._seq == 0 and not stream.s._inflight
    assert _lock_is_free(stream.s._submit_lock) and _lock_is_free(graph.lock)
    with pytest.raises(TypeError, match="RLock"):
        stream.s._graph_c(0xE0E, threading.RLock(), graph.applied, ops, None)
    driver.graph_launch_result = 0
    assert stream.s.graph_launch(graph, "exe", 0xE0E, _Params(ops))._seq == 1


# -- the general path (``CudaStream._launch``) and the compiled launch it hands back to ----


class _Compiled(_native.KernelCore):
    """A compiled function as the general path reads one: a signature, the plans
    made for it so far, and (as ``_Function``) a handle and a configuration."""

    def __init__(self, sizes: tuple[int, ...]) -> None:
        self._impl = self
        self.last = None
        self.handle, self.dims = 0xF00, DIMS
        self.name, self.param_sizes, self.plans = "k", sizes, {}


NUMBERS = (np.float32(1.5), np.int64(-5), np.int32(7))


def test_the_general_path_makes_what_the_compiled_launch_lacked_and_gives_the_launch_back(
    stream: Stream, driver: Driver
) -> None:
    del stream.s._launch  # (the stand-in's "handed back"): the real general path
    stream.s._touched = True  # (no sweep of the real watcher for a stand-in stream)
    driver.nargs = 3
    f = _Compiled((4, 8, 4))
    ev = stream.s.launch(f, NUMBERS, f, ())  # no plan yet: made, then launched in C
    plan = f.last
    assert plan is not None and plan.codes == b"fqi" and plan in stream.s._param_mem
    assert type(ev) is DeviceEvent and ev._seq == 1 and len(driver.launches) == 1
    (_, _, _, values, _) = driver.launches[0]
    assert values == [
        np.float32(1.5).tobytes() + bytes(4),
        np.int64(-5).tobytes(),
        np.int32(7).tobytes() + bytes(4),
    ]
    stream.s.launch(f, NUMBERS, f, ())  # the plan is the last: the compiled launch alone
    other = (np.float32(1), np.uint64(2), np.int32(3))  # new types: a new plan, then C
    assert type(stream.s.launch(f, other, f, ())) is DeviceEvent
    assert f.last is not plan and f.last.codes == b"fQi" and len(f.plans) == 2
    assert len(driver.launches) == 3 and stream.s._seq == 3


def test_a_held_stream_queues_the_launch_in_the_general_path(
    stream: Stream, driver: Driver
) -> None:
    del stream.s._launch
    stream.s._touched = True
    stream.s._pending = deque()
    f = _Compiled((4, 8, 4))
    ev = stream.s.launch(f, NUMBERS, f, ())  # handed back twice at most, never in a loop
    assert type(ev) is DeviceEvent and ev._seq == 1 and driver.launches == []
    assert [seq for seq, _ in stream.s._pending] == [1]  # the launch, queued for later
