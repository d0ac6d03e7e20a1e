"""Fixtures shared by the suite: every case runs on every device.

``ctx`` (and ``api``) are parametrized over the devices: ``cpu`` always, and
``cuda`` marked ``gpu``, skipped with the reason when this machine has no CUDA
GPU. ``rng`` is a NumPy generator with a fresh seed per test (printed, so a
failure can be replayed with ``ASYNCGPU_TEST_SEED``). ``gate`` makes gates:
CPU functions that hold a stream until the test opens them.
"""

from __future__ import annotations

import faulthandler
import os
import secrets
import sys

import numpy as np
import pytest
from _kernels import Gate

import asyncgpu


def _cuda_devices() -> tuple[int, str]:
    """How many CUDA devices asyncgpu sees, and why there are none."""
    try:
        n = asyncgpu.DeviceContext.number_of_devices(api="cuda")
    except Exception as e:  # no driver, no cuda-python, no backend: never an error here
        return 0, f"no CUDA device: number_of_devices(api='cuda') raised {type(e).__name__}: {e}"
    if n == 0:
        return 0, "no CUDA GPU: DeviceContext.number_of_devices(api='cuda') is 0"
    return n, ""


CUDA_DEVICES, NO_CUDA_REASON = _cuda_devices()

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


@pytest.fixture(params=DEVICES)
def api(request: pytest.FixtureRequest) -> str:
    """The device API of this run of the test: ``"cpu"`` or ``"cuda"``."""
    if request.param == "cuda" and CUDA_DEVICES == 0:
        pytest.skip(NO_CUDA_REASON)
    return request.param


@pytest.fixture
def ctx(api: str):
    """A fresh context on the device under test, closed after the test.

    On CUDA the suite's kernels are compiled up front: the driver cannot load code
    while a stream is held back for CPU work (a gate), so a test that compiled its
    kernel behind a gate would wait for the gate it has yet to open (see
    docs/guarantees.md, "Loading kernels while CPU work holds a stream")."""
    c = asyncgpu.DeviceContext(api=api)
    if api == "cuda":
        import _kernels

        for k in vars(_kernels).values():
            if isinstance(k, asyncgpu.Kernel) and k.cuda is not None:
                c._compiled(k, None)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def gate(ctx):
    """``gate()`` returns a new ``Gate``; every gate is opened at teardown (before
    the context closes), so a failing test never leaves a stream held."""
    made: list[Gate] = []

    def make() -> Gate:
        g = Gate()
        made.append(g)
        return g

    try:
        yield make
    finally:
        for g in made:
            g.open()


#: A test still running after this long is hung: dump every thread's stack and exit,
#: so a broken completion path fails the run instead of stalling it.
HANG_S = float(os.environ.get("ASYNCGPU_TEST_HANG_S", 300))


# The process's own stderr: pytest's capture replaces sys.stderr, and faulthandler
# needs a real file descriptor (the device run uses --capture=sys, so fd 2 is the log).
_WATCHDOG_FILE = sys.__stderr__


def _dump_engine_state(test: str) -> None:
    """Before the watchdog fires: what every polled stream and reactor holds (the
    stacks alone do not show which completion never came)."""
    import gc

    from asyncgpu._core import engine as _engine
    from asyncgpu._core.stream import _PolledStream

    out = _WATCHDOG_FILE
    if out is None:
        return
    print(f"\n== hung: {test}; engine state ==", file=out)
    for o in gc.get_objects():
        if isinstance(o, _PolledStream) and o._inflight:
            head = o._inflight[0]
            print(
                f"{o.label}: seq={o._seq} marked={o._marked} issued={o._issued_mark} "
                f"completed={o._completed()} awaited={o._awaited} eager={o._eager} "
                f"solo={o._queues.solo} held={o._pending is not None and len(o._pending)} "
                f"inflight={len(o._inflight)} head={head!r} waiters={head._waiters!r} "
                f"issue_waiters={len(o._issue_waiters)}",
                file=out,
            )
    for loop, r in list(_engine._reactors.items()):
        print(
            f"reactor {id(loop):#x} closed={loop.is_closed()} task={r.task is not None} "
            f"park={r.park is not None} deferred={len(r.deferred)} "
            f"pending={ {s.label: [a[0] for a in list(q)[:4]] for s, q in r.pending.items()} }",
            file=out,
        )
    w = _engine.watcher
    print(f"watcher running={w.running} pending={len(w._pending)} sweep={len(w._sweep)}", file=out)
    out.flush()


@pytest.fixture(autouse=True)
def _hang_watchdog(request: pytest.FixtureRequest):
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=_WATCHDOG_FILE)
    import threading

    state = threading.Timer(max(1.0, HANG_S - 5), _dump_engine_state, (request.node.nodeid,))
    state.daemon = True
    state.start()
    try:
        yield
    finally:
        state.cancel()
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(os.environ.get("ASYNCGPU_TEST_SEED") or secrets.randbits(32))
    print(f"rng seed: ASYNCGPU_TEST_SEED={seed}")
    return np.random.default_rng(seed)
