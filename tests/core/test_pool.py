"""The CPU pool (``asyncgpu._core.pool``): where its work runs when the
interpreter gives it no new thread."""

from __future__ import annotations

import threading

import pytest

from asyncgpu._core.pool import _CpuPool

TIMEOUT_S = 30


def _refuse_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every new thread fail to start, as an interpreter shutting down does
    (CPython 3.12.0 and 3.12.1 from the moment the main thread returns)."""

    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refused)


def test_work_that_no_thread_can_take_runs_on_the_calling_thread_in_order(monkeypatch) -> None:
    pool = _CpuPool(2)
    _refuse_threads(monkeypatch)
    ran: list[tuple[int, int]] = []
    for i in range(3):
        pool.submit(lambda i=i: ran.append((i, threading.get_ident())))
    assert ran == [(i, threading.get_ident()) for i in range(3)]
    assert pool._threads == 0 and not pool._work  # nothing counted, nothing stranded


def test_work_queued_while_a_thread_runs_waits_for_that_thread_when_no_new_one_starts(
    monkeypatch,
) -> None:
    pool = _CpuPool(2)
    gate, started = threading.Event(), threading.Event()

    def first() -> None:
        started.set()
        gate.wait(TIMEOUT_S)

    pool.submit(first)  # (a real thread)
    assert started.wait(TIMEOUT_S)
    _refuse_threads(monkeypatch)
    ran: list[int] = []
    done = threading.Event()
    pool.submit(lambda: (ran.append(threading.get_ident()), done.set()))
    assert ran == []  # queued for the running thread, not run here
    gate.set()
    assert done.wait(TIMEOUT_S)
    assert ran != [threading.get_ident()]
    assert pool._threads == 1
