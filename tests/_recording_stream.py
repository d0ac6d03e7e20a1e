"""A polled stream for the tests that drive the stream seam without a device:
``RecordingStream`` records where its completion markers go instead of sending
them to a device (tests/core/test_markers.py, test_engine.py, and
tests/api/test_trace.py)."""

from __future__ import annotations

from types import SimpleNamespace

from asyncgpu import DeviceEvent
from asyncgpu._core.stream import _PolledStream


class RecordingStream(_PolledStream):
    """A polled stream that records the sequence number each marker covers."""

    def __init__(self) -> None:
        super().__init__(SimpleNamespace(api="test", device_id=0), 0, 0)
        self.markers: list[int] = []
        self.done = 0  # what the device has finished (the completion counter)

    def _place_marker(self) -> None:
        self._marked = self._seq
        self.markers.append(self._seq)

    def _completed(self) -> int:
        return self.done

    def submit(self) -> DeviceEvent:
        """One operation, submitted the way the CUDA backend does."""
        with self._submit_lock:
            self._before_submit()
            self._seq += 1
            ev = DeviceEvent(self, self._seq)
            self._inflight.append(ev)
            if self._eager:
                self._place_marker()
        return ev

    def finish_all(self) -> None:
        self.done = self._seq
        self._retire()
