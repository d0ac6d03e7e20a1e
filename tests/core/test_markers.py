"""Where a polled stream (CUDA) places its completion markers.

A marker is a tiny device operation after which the host learns that the work
before it has finished. Where it goes matters: on CUDA a marker right after a
long kernel holds up every later item of the kernel's hardware queue, other
streams' kernels included. These cases drive the policy with a stand-in stream
whose markers are recorded instead of sent to a device.
"""

from __future__ import annotations

from _recording_stream import RecordingStream

from asyncgpu._core.stream import _HardwareQueues


def test_fire_and_forget_work_gets_no_marker() -> None:
    s = RecordingStream()
    for _ in range(5):
        s.submit()
    assert s.markers == []


def test_an_await_marks_its_operation_and_makes_later_ones_eager() -> None:
    s = RecordingStream()
    ev = s.submit()
    s._need(ev)  # what an await does
    assert s.markers == [1]
    s.submit()
    assert s.markers == [1, 2], "an awaited stream marks each new operation at once"


def test_an_operation_nobody_awaited_or_kept_ends_eager_mode() -> None:
    s = RecordingStream()
    s._need(s.submit())
    s.submit()  # marked (eager), then dropped without an await
    s.submit()  # the one before went unused: lazy again
    assert s.markers == [1, 2]
    assert not s._eager


def test_a_drained_stream_ends_eager_mode_when_its_last_operation_was_not_awaited() -> None:
    s = RecordingStream()
    s._need(s.submit())
    s.finish_all()
    s.submit()  # eager: the last operation was awaited
    s.finish_all()  # everything retired, op 2 never awaited
    s.submit()
    assert s.markers == [1, 2]
    assert not s._eager


def test_blocking_waits_place_their_marker_but_do_not_make_the_stream_eager() -> None:
    s = RecordingStream()
    ev = s.submit()
    s._need(ev, eager=False)  # what synchronize() does
    later = s.submit()
    assert s.markers == [1]
    assert not s._eager
    assert later._seq == 2


def test_streams_sharing_hardware_queues_place_markers_only_when_asked() -> None:
    s = RecordingStream()
    s._queues = _HardwareQueues(8)
    s._queues.solo = False  # more streams than queues
    first = s.submit()
    s._need(first)
    second = s.submit()
    assert s.markers == [1], "no marker right after an operation while queues are shared"
    assert not s._eager
    s._need(second)
    assert s.markers == [1, 2]


def test_a_held_event_is_marked_before_the_next_operation() -> None:
    """The user kept the event: it may be awaited later, and a marker placed
    then would also wait for the operations submitted in between."""
    s = RecordingStream()
    kept = s.submit()
    s.submit()
    assert s.markers == [1]
    assert kept._seq == 1
