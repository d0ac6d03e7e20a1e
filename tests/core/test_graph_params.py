"""The versions of a graph's node parameters (``GraphParams``): an update makes
a new version and leaves the old one as it was (a replay still running reads
it), and the memory a version names stays pinned against ``take_ptr`` while
any version naming it lives, however the versions die."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from asyncgpu import DeviceContext
from asyncgpu._core.graph import MEMSET, GraphDefinition, MemsetOp


def _pinned(buf: object) -> bool:
    try:
        buf.take_ptr()  # type: ignore[attr-defined]
    except ValueError:
        return True
    return False


def test_an_update_makes_a_new_version_and_leaves_the_old_one() -> None:
    with DeviceContext(api="cpu") as ctx:
        x, y = (ctx.enqueue_create_buffer(np.int32, 4) for _ in range(2))
        g = GraphDefinition()
        a = g.add(MEMSET, MemsetOp(x, np.int32(1), 4), (), (x,))
        b = g.add(MEMSET, MemsetOp(x, np.int32(2), 4), (a._index,), (x,))
        first = g.seal()
        op = MemsetOp(y, np.int32(3), 4)
        second = first.replaced(b._index, op, (y,))
        assert first.ops[b._index].dst is x and first.buffers[b._index] == (x,)
        assert second.ops == (first.ops[a._index], op) and second.buffers[b._index] == (y,)
        assert second._pins[a._index] is first._pins[a._index]  # (shared, not pinned again)


@pytest.mark.parametrize("drop_first", [True, False])
def test_memory_stays_pinned_while_a_version_naming_it_lives(drop_first: bool) -> None:
    with DeviceContext(api="cpu") as ctx:
        x, y, z = (ctx.enqueue_create_buffer(np.int32, 4) for _ in range(3))
        g = GraphDefinition()
        a = g.add(MEMSET, MemsetOp(x, np.int32(1), 4), (), (x,))
        g.add(MEMSET, MemsetOp(z, np.int32(1), 4), (), (z,))
        first = g.seal()
        second = first.replaced(a._index, MemsetOp(y, np.int32(1), 4), (y,))
        assert _pinned(x) and _pinned(y) and _pinned(z)
        if drop_first:
            del first
            gc.collect()
            assert not _pinned(x) and _pinned(y) and _pinned(z)
        else:
            del second
            gc.collect()
            assert _pinned(x) and not _pinned(y) and _pinned(z)
