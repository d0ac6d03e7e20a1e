"""The event loops every await must work on, as anyio's pytest plugin names them
(tests/api/test_loops.py, tests/core/test_engine_loops.py): a module that sets
``anyio_backend`` to each of ``BACKENDS`` runs its ``anyio`` tests on asyncio,
uvloop and trio."""

from __future__ import annotations

import asyncio

import pytest
import trio

try:
    import uvloop
except ImportError:  # (not built for every platform)
    uvloop = None

BACKENDS = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param(
        ("asyncio", {"use_uvloop": True}),
        id="uvloop",
        marks=pytest.mark.skipif(uvloop is None, reason="uvloop is not installed"),
    ),
    pytest.param("trio", id="trio"),
]


def is_trio(backend: object) -> bool:
    return backend == "trio"


async def checkpoint(backend: object) -> None:
    """Let every other task of the loop run once."""
    if is_trio(backend):
        await trio.lowlevel.checkpoint()
    else:
        await asyncio.sleep(0)
