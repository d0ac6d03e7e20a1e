"""``asyncgpu._native.EventQueue``: the events of a polled stream in flight,
oldest first, in a ring that the extension's launch and retire reach without a
method call. It offers the deque operations the streams use (``append``,
``popleft``, ``clear``, ``len``, ``q[i]`` with negative ``i`` from the end,
iteration, truth) and behaves like a ``collections.deque`` in each of them,
across the ring's growth, wrap-around and shrinking; a polled stream keeps its
events in one."""

from __future__ import annotations

import gc
import weakref
from collections import deque
from typing import Any

import pytest

from asyncgpu import _native


class Item:
    """Something weakly referable to put in the queue."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"Item({self.n})"


def same(q: Any, d: deque[Any]) -> None:
    """q holds what the deque d holds, seen through every read the streams use."""
    assert len(q) == len(d) and bool(q) == bool(d)
    assert list(q) == list(d)
    if d:
        assert q[0] is d[0] and q[-1] is d[-1]
        assert q[len(d) // 2] is d[len(d) // 2] and q[-len(d)] is d[0]


def test_a_new_queue_is_empty_and_false() -> None:
    q = _native.EventQueue()
    assert len(q) == 0 and not q and list(q) == []
    assert repr(q) == "<asyncgpu EventQueue of 0>"


def test_items_come_out_oldest_first() -> None:
    q = _native.EventQueue()
    items = [Item(i) for i in range(5)]
    for it in items:
        q.append(it)
    assert q[0] is items[0] and q[-1] is items[-1] and q[2] is items[2]
    assert [q.popleft() for _ in range(5)] == items
    assert not q


def test_it_matches_a_deque_through_growth_wrap_around_and_shrinking() -> None:
    """Appends and pops interleaved so that the ring wraps at every size it
    grows to, then drained from 10,000 items, which shrinks it."""
    q, d = _native.EventQueue(), deque()
    n = 0
    for round_ in range(12):
        for _ in range(3 * (round_ + 1)):
            it = Item(n)
            n += 1
            q.append(it)
            d.append(it)
        for _ in range(round_ + 1):
            assert q.popleft() is d.popleft()
        same(q, d)
    for _ in range(10_000):
        it = Item(n)
        n += 1
        q.append(it)
        d.append(it)
    same(q, d)
    while len(d) > 3:
        assert q.popleft() is d.popleft()
        if len(d) % 997 == 0:
            same(q, d)
    same(q, d)


def test_popping_an_empty_queue_raises_index_error() -> None:
    q = _native.EventQueue()
    with pytest.raises(IndexError, match="pop from an empty EventQueue"):
        q.popleft()
    q.append(Item(0))
    q.popleft()
    with pytest.raises(IndexError, match="pop from an empty EventQueue"):
        q.popleft()


@pytest.mark.parametrize("index", [2, -3, 100])
def test_an_index_outside_the_queue_raises_index_error(index: int) -> None:
    q = _native.EventQueue()
    q.append(Item(0))
    q.append(Item(1))
    with pytest.raises(IndexError, match="EventQueue index out of range"):
        q[index]


def test_an_index_that_is_not_an_integer_raises_type_error() -> None:
    q = _native.EventQueue()
    q.append(Item(0))
    with pytest.raises(TypeError):
        q["0"]


def test_the_queue_holds_its_items_until_they_are_taken_off() -> None:
    q = _native.EventQueue()
    it = Item(0)
    ref = weakref.ref(it)
    q.append(it)
    del it
    gc.collect()
    assert ref() is not None
    taken = q.popleft()
    assert ref() is taken
    del taken
    assert ref() is None


def test_clear_empties_the_queue_before_its_items_go() -> None:
    """An item whose finalizer looks at the queue finds it already empty, and
    may append to it: clear drops its references only once the ring is empty."""
    q = _native.EventQueue()
    seen: list[int] = []

    class Watcher:
        def __del__(self) -> None:
            seen.append(len(q))
            q.append(Item(99))

    q.append(Watcher())
    q.append(Item(1))
    q.clear()
    assert seen == [0]
    assert len(q) == 1 and q[0].n == 99


def test_a_cycle_through_the_queue_is_collected() -> None:
    """An event refers to its stream and the stream to its queue: the garbage
    collector sees through the queue."""

    class Holder:
        pass

    h = Holder()
    h.q = _native.EventQueue()
    h.q.append(h)
    ref = weakref.ref(h)
    del h
    gc.collect()
    assert ref() is None


def test_the_queue_cannot_be_subclassed() -> None:
    """The extension's fast paths recognise the queue by its exact type."""
    with pytest.raises(TypeError):
        type("Sub", (_native.EventQueue,), {})


def test_a_polled_stream_keeps_its_events_in_flight_in_an_event_queue() -> None:
    from types import SimpleNamespace

    from asyncgpu._core.stream import _PolledStream

    s = _PolledStream(SimpleNamespace(api="test", device_id=0), 0, 0)
    assert type(s._inflight) is _native.EventQueue
    assert type(s._submit_lock) is _native.RLock and type(s._retire_lock) is _native.RLock
