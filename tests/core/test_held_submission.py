"""Held submission: work enqueued behind host work reaches the driver only when
that host work has finished (``_PolledStream``, used by the CUDA device).

A model stream stands in for the driver: every call handed to it is appended to
``log``, and a marker sets the completion counter at once (a device that runs
everything instantly). What is checked is *when* calls reach the driver and in
which order; the CUDA cases of test_cpu_work.py and test_cuda_backend.py check
the same promises on the GPU.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from types import SimpleNamespace
from typing import Any

import pytest

from asyncgpu import DeviceError, DeviceEvent
from asyncgpu._core.stream import _Gate, _PolledStream


class ModelStream(_PolledStream):
    def __init__(self, name: str, log: list[Any]) -> None:
        super().__init__(SimpleNamespace(api="model", device_id=0), 0, 0)
        self.name = name
        self.log = log
        self.counter = 0

    # the driver ---------------------------------------------------------------------

    def _completed(self) -> int:
        return self.counter

    def _place_marker(self) -> None:
        self._issue(0, self._write_counter, self._seq)
        self._marked = self._seq

    def _write_counter(self, seq: int) -> None:
        self.log.append((self.name, "marker", seq))
        self.counter = seq
        self._issued_mark = seq

    # what a backend's enqueue methods do ----------------------------------------------

    def op(self, what: str, call: Any = None) -> DeviceEvent:
        with self._submit_lock:
            self._before_submit()
            self._issue(self._seq + 1, call or partial(self.log.append, (self.name, what)))
            return self._new_event()

    def host_work(self) -> tuple[DeviceEvent, _Gate]:
        with self._submit_lock:
            self._before_submit()
            gate = self._hold()
            return self._new_event(), gate

    def _new_event(self) -> DeviceEvent:
        self._seq += 1
        ev = DeviceEvent(self, self._seq, None)
        self._inflight.append(ev)
        return ev


def ops(log: list[Any]) -> list[str]:
    return [entry[1] for entry in log if entry[1] != "marker"]


@pytest.fixture
def log() -> list[Any]:
    return []


def test_work_behind_host_work_reaches_the_driver_when_the_host_work_ends(log) -> None:
    s = ModelStream("s", log)
    s.op("copy in")
    _, gate = s.host_work()
    s.op("kernel")
    s.op("copy out")
    assert ops(log) == ["copy in"]

    s._open(gate)

    assert ops(log) == ["copy in", "kernel", "copy out"]
    assert s._pending is None  # no longer held: the next call goes straight through
    s.op("next")
    assert ops(log)[-1] == "next"


def test_each_hold_releases_only_what_lies_between_it_and_the_next(log) -> None:
    s = ModelStream("s", log)
    _, first = s.host_work()
    s.op("a")
    _, second = s.host_work()
    s.op("b")

    s._open(second)  # the later host work finished first: nothing may pass yet
    assert ops(log) == []
    s._open(first)
    assert ops(log) == ["a", "b"]


def test_an_await_behind_host_work_gets_a_marker_after_it(log) -> None:
    s = ModelStream("s", log)
    ev, gate = s.host_work()
    assert not ev.query()  # asks for a marker: it must wait behind the hold
    assert log == []

    s._open(gate)

    assert log == [("s", "marker", ev._seq)]
    assert ev.query()


def test_another_stream_learns_when_a_held_operation_reaches_the_driver(log) -> None:
    s = ModelStream("s", log)
    _, gate = s.host_work()
    kernel = s.op("kernel")
    s._need(kernel)
    issued: list[int] = []
    assert s._when_issued(kernel._seq, lambda: issued.append(s._issued_mark))
    assert issued == []

    s._open(gate)

    assert issued == [kernel._seq]
    assert not s._when_issued(kernel._seq, lambda: issued.append(-1))  # already there
    assert issued == [kernel._seq]


def test_settle_blocks_until_everything_held_has_reached_the_driver(log) -> None:
    s = ModelStream("s", log)
    _, gate = s.host_work()
    s.op("kernel")
    settled = threading.Event()

    def settle() -> None:
        s._settle()
        settled.set()

    t = threading.Thread(target=settle)
    t.start()
    deadline = time.monotonic() + 10
    while len(s._pending or ()) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)  # until settle() has queued its point behind the kernel
    assert not settled.is_set()

    s._open(gate)
    t.join(10)

    assert settled.is_set()
    assert ops(log) == ["kernel"]


def test_a_held_call_the_driver_refuses_fails_its_own_operation_only(log) -> None:
    s = ModelStream("s", log)
    _, gate = s.host_work()

    def refused() -> None:
        raise RuntimeError("CUDA_ERROR_INVALID_VALUE")

    bad = s.op("bad", refused)
    good = s.op("good")

    s._open(gate)

    assert isinstance(bad._error, DeviceError)
    assert f"operation #{bad._seq}" in str(bad._error)
    assert good._error is None
    assert ops(log) == ["good"]


def test_a_held_marker_the_driver_refuses_fails_what_is_in_flight(log) -> None:
    s = ModelStream("s", log)
    ev, gate = s.host_work()
    assert s._pending is not None
    s._pending.append((0, partial(_raise, RuntimeError("CUDA_ERROR_LAUNCH_FAILED"))))

    s._open(gate)

    assert ev.query()  # finished, with the error, rather than never
    with pytest.raises(DeviceError):
        ev.synchronize()


def _raise(err: BaseException) -> None:
    raise err
