"""The wrappers a context keeps of other libraries' streams (create_external_stream).

A context keeps the wrappers of the most recently wrapped handles
(``EXTERNAL_STREAMS_KEPT``); older ones are let go once idle, and released once
nothing else holds them, so that wrapping ever-new handles (a stream per request)
does not grow the context without bound. The CPU device has no streams of other
libraries: here its backend is taught to wrap an int as a new CPU stream, so the
context's own bookkeeping runs on real streams (with real pending work).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from _kernels import Gate

from asyncgpu import DeviceContext
from asyncgpu._core import state as _state
from asyncgpu._devices.cpu import CpuStream

KEPT = 4


@pytest.fixture
def ctx(monkeypatch):
    """A CPU context whose ``create_external_stream(h)`` wraps the int ``h``."""
    monkeypatch.setattr(_state, "EXTERNAL_STREAMS_KEPT", KEPT)
    with DeviceContext(api="cpu") as ctx:
        backend = ctx._state.backend
        monkeypatch.setattr(backend, "external_handle", int, raising=False)
        monkeypatch.setattr(
            backend,
            "external_stream",
            lambda state, stream, index: CpuStream(state, index, 0),
            raising=False,
        )
        yield ctx


def _live(ctx: DeviceContext) -> int:
    gc.collect()
    return len(ctx._state.external_streams)


def test_the_same_handle_wrapped_again_is_the_same_wrapper(ctx) -> None:
    first = ctx.create_external_stream(0x10)
    again = ctx.create_external_stream(0x10)
    assert again._impl is first._impl
    assert ctx.create_external_stream(0x11)._impl is not first._impl


def test_wrapping_many_distinct_handles_keeps_a_bounded_number(ctx) -> None:
    """A thousand handles wrapped once each (and let go by the caller): the
    context keeps the last ``KEPT``, and the others are released."""
    for h in range(1, 1001):
        ctx.create_external_stream(h)
    state = ctx._state
    assert list(state.kept_external) == list(range(1001 - KEPT, 1001))
    assert _live(ctx) == KEPT
    indices = [s.index for s in state.all_streams()]
    assert len(indices) == len(set(indices))  # (each stream its own index)


def test_a_recently_wrapped_handle_is_kept_and_refreshed(ctx) -> None:
    """Least recently wrapped goes first: wrapping a handle again keeps it."""
    hot = ctx.create_external_stream(0x1)._impl
    for h in range(0x100, 0x100 + 3 * KEPT):
        ctx.create_external_stream(h)
        assert ctx.create_external_stream(0x1)._impl is hot


def test_a_wrapper_with_pending_work_is_not_let_go(ctx) -> None:
    """Wrappers whose last operation has not finished stay kept, past the bound
    if all of them are busy; once their work is seen finished, the next new
    handle lets the excess go."""
    busy = ctx.create_external_stream(0x1)
    gate = Gate()
    busy.context().enqueue_cpu_function(gate)
    waiting = []
    try:
        for h in range(0x100, 0x100 + KEPT + 2):
            s = ctx.create_external_stream(h)
            s.enqueue_wait_for(busy)  # (pending until the gate opens)
            waiting.append(s)
        kept = ctx._state.kept_external
        assert len(kept) == KEPT + 3 and 0x1 in kept
    finally:
        gate.open()
    for s in [busy, *waiting]:
        s.synchronize()
    ctx.create_external_stream(0x200)
    assert len(kept) == KEPT and 0x1 not in kept and 0x200 in kept


def test_a_wrapper_let_go_but_still_held_is_the_one_wrapped_again(ctx) -> None:
    """A wrapper the caller still holds (a ``DeviceStream``, a buffer of it)
    lives on: its handle wrapped again gives it back, one wrapper per handle,
    and the context's close closes it with the others."""
    held = ctx.create_external_stream(0x1)
    buf = held.context().enqueue_create_buffer(np.float32, 8)
    for h in range(0x100, 0x100 + 2 * KEPT):
        ctx.create_external_stream(h)
    assert 0x1 not in ctx._state.kept_external
    assert ctx.create_external_stream(0x1)._impl is held._impl
    assert held._impl in ctx._state.all_streams()
    del buf
