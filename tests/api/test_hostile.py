"""Programs a careless or hostile user might write: none of them may hang the
process, race with ``close()`` or leak. Each test pins one promise of
docs/guarantees.md on the CPU device. Where a hang is possible the program runs
in a child process under a timeout, so a regression fails instead of hanging
the suite; order comes from events and barriers, never from sleeping."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 60


def run_child(code: str, timeout: float = CHILD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (the CPU device); fails the test on a
    timeout (a hang) instead of hanging."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), ASYNCGPU_API="cpu")
    try:
        return subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the program hung (no exit in {timeout} s): {e.stdout!r} {e.stderr!r}")


def all_collected(refs: list[Any], timeout: float = CHILD_TIMEOUT_S) -> bool:
    """Whether every weak reference in ``refs`` dies, collecting until it has or
    ``timeout`` passes: a pool thread that has just finished an operation (and
    woken the test) may still hold its work item for a moment."""
    import gc
    import time

    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        if all(r() is None for r in refs):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


def assert_ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


# -- hangs -----------------------------------------------------------------------------


@pytest.mark.parametrize("instant", ["wait_for", "empty_range"])
def test_a_long_queue_of_instant_operations_behind_busy_work_runs(api: str, instant: str) -> None:
    """Thousands of operations that finish at once (waits for finished events,
    empty CPU ranges), queued behind a CPU function that holds the stream: once
    it ends, each starts the next from its completion, in a loop (nested, the
    chain ran out of stack and the stream stopped). On CUDA, host work right
    behind host work is started the same way."""
    proc = run_child(f"""
        import threading
        import asyncgpu
        ctx = asyncgpu.DeviceContext(api={api!r})
        other = ctx.select_stream(1)
        done = [other.enqueue_cpu_function(int) for _ in range(400)]
        other.synchronize()
        gate = threading.Event()
        ctx.enqueue_cpu_function(gate.wait)
        for i in range(3000):
            if {instant!r} == "wait_for":
                ctx.enqueue_wait_for(done[i % len(done)])
            else:
                ctx.enqueue_cpu_range(lambda i: None, 0)
        last = ctx.enqueue_cpu_function(lambda: "last")
        gate.set()
        assert last.synchronize() == "last"
        ctx.close()
        print("OK")
    """)
    assert_ok(proc)


def test_a_non_daemon_thread_may_use_the_context_after_the_main_thread_returns() -> None:
    """The interpreter waits for the program's non-daemon threads before it
    exits; the CPU pool still runs their work meanwhile."""
    proc = run_child("""
        import threading
        import asyncgpu
        ctx = asyncgpu.DeviceContext(api="cpu")
        main_done = threading.Event()

        def late_user():
            assert main_done.wait(30)
            for i in range(50):
                assert ctx.enqueue_cpu_function(lambda i=i: i).synchronize() == i
            ctx.close()
            print("OK", flush=True)

        threading.Thread(target=late_user).start()
        main_done.set()
    """)
    assert_ok(proc)


def test_an_atexit_close_waits_for_queued_work() -> None:
    """``atexit.register(ctx.close)`` with work still queued: the close waits for
    the work, which runs."""
    proc = run_child("""
        import atexit, threading
        import asyncgpu
        ctx = asyncgpu.DeviceContext(api="cpu")
        gate = threading.Event()
        ctx.enqueue_cpu_function(gate.wait)
        for i in range(20):
            ctx.enqueue_cpu_function(int)
        ctx.enqueue_cpu_function(lambda: print("OK", flush=True))
        atexit.register(ctx.close)
        atexit.register(gate.set)  # (runs first: atexit hooks run last-in first-out)
    """)
    assert_ok(proc)


@pytest.mark.parametrize("dropped", [False, True], ids=["kept", "dropped"])
def test_exit_with_pending_work_waits_for_it(dropped: bool) -> None:
    """A program that ends without closing its context (still referenced, or
    dropped and collected): the exit waits for the work still queued (bounded:
    see the next test), which runs, and nothing is printed but the program's
    own output."""
    drop = "del ctx; import gc; gc.collect()" if dropped else ""
    proc = run_child(f"""
        import threading
        import asyncgpu
        ctx = asyncgpu.DeviceContext(api="cpu")
        gate = threading.Event()
        ctx.enqueue_cpu_function(gate.wait)
        for s in range(4):
            ctx.select_stream(s).enqueue_cpu_function(int)
        ctx.enqueue_cpu_function(lambda: print("OK", flush=True))
        {drop}
        threading.Timer(0.05, gate.set).start()  # (opens the gate during the exit)
    """)
    assert_ok(proc)
    assert proc.stderr == ""


def test_exit_drops_work_that_does_not_finish_in_time_with_one_warning() -> None:
    """Work that is still running after the bounded exit wait is dropped with one
    warning naming the streams; the process exits."""
    proc = run_child("""
        import threading
        import asyncgpu
        from asyncgpu._core import state
        state.EXIT_WAIT_S = 0.2
        ctx = asyncgpu.DeviceContext(api="cpu")
        never = threading.Event()
        for s in range(3):
            ctx.select_stream(s).enqueue_cpu_function(never.wait)
            ctx.select_stream(s).enqueue_cpu_function(int)
        print("OK")
    """)
    assert_ok(proc)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert "at exit" in lines[0] and "cpu:0/s0" in lines[0] and "cpu:0/s2" in lines[0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_cpu_work_runs_in_a_forked_child() -> None:
    """After ``fork``, the child has a CPU pool of its own: new work runs there, and
    so does work that was queued but not finished at the fork (the parent runs
    its own copy)."""
    proc = run_child("""
        import os, threading
        import asyncgpu
        ctx = asyncgpu.DeviceContext(api="cpu")
        assert ctx.enqueue_cpu_function(lambda: 1).synchronize() == 1  # pool in use
        gate = threading.Event()
        entered = threading.Event()
        ctx.enqueue_cpu_function(lambda: (entered.set(), gate.wait(30))[1])
        queued = ctx.enqueue_cpu_function(lambda: "queued")
        assert entered.wait(30)
        pid = os.fork()
        if pid == 0:
            gate.set()  # (the child's copy of the running function runs again)
            ok = queued.synchronize() == "queued"
            ok = ok and ctx.enqueue_cpu_function(lambda: 7).synchronize() == 7
            rng = ctx.select_stream(2).enqueue_cpu_range(lambda i: None, 64)
            ok = ok and rng.synchronize() is None
            ctx.close()
            os._exit(0 if ok else 1)
        gate.set()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert queued.synchronize() == "queued"
        ctx.close()
        print("OK")
    """)
    assert_ok(proc)


def test_a_cpu_function_awaiting_its_own_stream_gets_runtime_error() -> None:
    """A CPU function that runs a loop of its own and awaits its own stream (the
    context, the stream or its own event) would wait for itself: the await
    raises ``RuntimeError``, as ``synchronize()`` does."""
    proc = run_child("""
        import asyncio
        import asyncgpu
        ctx = asyncgpu.DeviceContext(api="cpu")
        me = []

        def awaits_own_stream(what):
            async def wait():
                await {"ctx": ctx, "stream": ctx.stream(), "event": me[0] if me else ctx}[what]
            try:
                asyncio.run(wait())
            except RuntimeError as e:
                return "refused" if "wait for itself" in str(e) else repr(e)
            return "no error"

        for what in ("ctx", "stream"):
            assert ctx.enqueue_cpu_function(awaits_own_stream, what).synchronize() == "refused"
        ev = ctx.enqueue_cpu_function(lambda: awaits_own_stream("event"))
        me.append(ev)
        assert ev.synchronize() == "refused"  # (its own event, or the ctx if early)
        ctx.close()
        print("OK")
    """)
    assert_ok(proc)


@pytest.mark.parametrize("exc", ["SystemExit", "KeyboardInterrupt"])
def test_a_done_callback_raising_a_base_exception_does_not_stop_the_stream(exc: str) -> None:
    """A done callback of a pending event that raises ``SystemExit`` or
    ``KeyboardInterrupt`` is logged like any other; the stream's next operation
    still starts."""
    proc = run_child(f"""
        import threading
        import asyncgpu
        ctx = asyncgpu.DeviceContext(api="cpu")
        gate = threading.Event()
        first = ctx.enqueue_cpu_function(gate.wait)

        def bad(_ev):
            raise {exc}()

        first.add_done_callback(bad)
        after = ctx.enqueue_cpu_function(lambda: "after")
        gate.set()
        assert after.synchronize() == "after"
        ctx.close()
        print("OK")
    """)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout
    assert "exception in the done callback" in proc.stderr


def test_a_wait_for_a_never_recorded_event_is_refused_at_the_call() -> None:
    """``enqueue_wait_for`` of an event that was never recorded would hold the
    stream for good: ``ValueError`` at the call, and the stream goes on."""
    from asyncgpu import DeviceContext, DeviceEvent

    with DeviceContext(api="cpu") as ctx:
        with pytest.raises(ValueError, match="never recorded"):
            ctx.enqueue_wait_for(DeviceEvent(None))
        # A user event not recorded yet stands for nothing pending: no wait.
        assert ctx.enqueue_wait_for(ctx.create_event()).query()
        assert ctx.enqueue_cpu_function(lambda: 3).synchronize() == 3


def test_a_done_callback_error_is_logged_whether_or_not_the_event_was_done(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The same broken callback gives the same outcome, a log record, on a
    finished event (called at once) and on a pending one (called later)."""
    import threading

    from asyncgpu import DeviceContext

    def bad(_ev: object) -> None:
        raise ValueError("broken callback")

    with DeviceContext(api="cpu") as ctx:
        done = ctx.enqueue_cpu_function(int)
        done.synchronize()
        with caplog.at_level("ERROR", logger="asyncgpu"):
            done.add_done_callback(bad)  # does not raise
            gate = threading.Event()
            pending = ctx.enqueue_cpu_function(gate.wait)
            called = threading.Event()
            pending.add_done_callback(bad)
            pending.add_done_callback(lambda _e: called.set())
            gate.set()
            assert called.wait(CHILD_TIMEOUT_S)
    errors = [r for r in caplog.records if "done callback" in r.getMessage()]
    assert len(errors) == 2
    assert all(isinstance(r.exc_info[1], ValueError) for r in errors if r.exc_info)


def test_an_async_kernel_body_is_refused() -> None:
    """An ``async def`` kernel body would only make coroutines that nobody runs
    (its event would succeed with the body never run): ``TypeError``, as for an
    async CPU function, for a plain callable and a ``Kernel``'s CPU body."""
    from asyncgpu import DeviceContext, Kernel

    async def body(b: object, x: object) -> None:
        pass

    with pytest.raises(TypeError, match="async"):
        Kernel("k", cpu=body)
    with DeviceContext(api="cpu") as ctx:
        buf = ctx.enqueue_create_buffer("int32", 4)
        with pytest.raises(TypeError, match="async"):
            ctx.compile_function(body)
        with pytest.raises(TypeError, match="async"):
            ctx.enqueue_function(body, buf, grid_dim=1, block_dim=1)


def test_a_huge_stream_pool_is_made_on_first_use() -> None:
    """``num_streams=10**7`` makes a context at once (its streams beyond the first
    few are made on first use) whose last stream works."""
    from asyncgpu import DeviceContext

    with DeviceContext(api="cpu", num_streams=10**7) as ctx:
        assert ctx.num_streams() == 10**7
        assert len(ctx._state.all_streams()) <= 32
        last = ctx.select_stream(10**7 - 1)
        assert last.enqueue_cpu_function(lambda: 5).synchronize() == 5
        with pytest.raises(IndexError):
            ctx.select_stream(10**7)


def test_an_empty_api_is_refused() -> None:
    """``api=""`` is an unknown device, not the default one."""
    from asyncgpu import DeviceContext

    with pytest.raises(ValueError, match="unknown device api"):
        DeviceContext(api="")


def test_an_impossible_allocation_is_asyncgpus_error(api: str) -> None:
    """More bytes than an address space holds is a ``ValueError`` of asyncgpu's
    (not NumPy's "maximum allowed dimension"); a size that could exist but does
    not fit in memory is ``DeviceError`` with CUDA's out-of-memory name (not
    NumPy's ``MemoryError``), as the CUDA device's driver reports it."""
    import numpy as np

    from asyncgpu import DeviceContext, DeviceError

    with DeviceContext(api=api) as ctx:
        for create in (ctx.enqueue_create_buffer, ctx.enqueue_create_host_buffer):
            for dtype, size in ((np.float64, 1 << 62), (np.uint8, 1 << 63), (np.int32, 10**30)):
                with pytest.raises(ValueError, match="more than any allocation can hold"):
                    create(dtype, size)
            with pytest.raises(DeviceError) as info:
                create(np.uint8, 1 << 61)
            assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
            assert not isinstance(info.value, MemoryError)
        assert ctx.enqueue_create_buffer(np.uint8, 8) is not None  # still usable


def test_an_unknown_launch_attribute_is_refused() -> None:
    """``LaunchAttribute(999, 1)`` would be accepted and mean nothing."""
    from asyncgpu import LaunchAttribute, LaunchAttributeID

    with pytest.raises(ValueError, match=r"COOPERATIVE \(2\).*PRIORITY \(8\)"):
        LaunchAttribute(999, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LaunchAttributeID"):
        LaunchAttribute("priority", 1)  # type: ignore[arg-type]
    assert LaunchAttribute(2, True).id == LaunchAttributeID.COOPERATIVE  # type: ignore[arg-type]


# -- races with close() -----------------------------------------------------------------


def test_an_enqueue_overlapping_close_is_refused_when_close_comes_first(api: str) -> None:
    """A producer thread is inside ``enqueue_cpu_function`` (past its open check,
    held up by a callable slow to inspect) while another thread closes the
    context: the enqueue is refused with ``ContextClosedError`` and never runs
    (it ran after ``close()`` returned)."""
    proc = run_child(f"""
        import threading
        import asyncgpu
        from asyncgpu import ContextClosedError

        ctx = asyncgpu.DeviceContext(api={api!r})
        inspecting, go, ran = threading.Event(), threading.Event(), threading.Event()

        class SlowToInspect:
            # The async-function check reads __call__: the first read waits for go.
            first = True

            @property
            def __call__(self):
                if SlowToInspect.first:
                    SlowToInspect.first = False
                    inspecting.set()
                    go.wait()
                return ran.set

        outcome = []

        def produce():
            try:
                ctx.enqueue_cpu_function(SlowToInspect())
                outcome.append("enqueued")
            except ContextClosedError:
                outcome.append("refused")

        producer = threading.Thread(target=produce)
        producer.start()
        assert inspecting.wait(30)
        closer = threading.Thread(target=ctx.close)
        closer.start()
        closer.join(30)
        assert not closer.is_alive()
        go.set()
        producer.join(30)
        assert outcome == ["refused"], outcome
        assert not ran.is_set()
        print("OK")
    """)
    assert_ok(proc)


def test_enqueues_racing_close_ran_before_it_returned_or_were_refused(api: str) -> None:
    """Two producer threads enqueue CPU functions as fast as they can while the
    main thread closes the context, many times over: every enqueue that
    returned an event had run when ``close()`` returned, and every other one
    raised ``ContextClosedError`` (none ran after)."""
    proc = run_child(f"""
        import threading
        import asyncgpu
        from asyncgpu import ContextClosedError

        for _ in range(40):
            ctx = asyncgpu.DeviceContext(api={api!r}, num_streams=2)
            ran = [[], []]
            accepted = [0, 0]
            start = threading.Barrier(3)

            def produce(i):
                view = ctx.select_stream(i)
                start.wait()
                try:
                    while True:
                        view.enqueue_cpu_function(ran[i].append, 1)
                        accepted[i] += 1
                except ContextClosedError:
                    pass

            producers = [threading.Thread(target=produce, args=(i,)) for i in range(2)]
            for t in producers:
                t.start()
            start.wait()
            ctx.close()
            ran_at_close = [len(r) for r in ran]
            for t in producers:
                t.join(30)
            assert ran_at_close == accepted, (ran_at_close, accepted)
            assert [len(r) for r in ran] == accepted
        print("OK")
    """)
    assert_ok(proc)


def test_a_closing_stream_refuses_every_kind_of_submission(ctx: Any, gate: Any) -> None:
    """Once ``close()`` has begun on a stream (``begin_close``), each submission,
    compiled fast paths included, checks that under the lock it submits with
    and raises ``ContextClosedError``, although the context's own open check
    still passes (the gap a racing enqueue falls into)."""
    import numpy as np
    from _kernels import ADD_ONE

    from asyncgpu import ContextClosedError

    buf = ctx.enqueue_create_buffer(np.int32, 4)
    host = ctx.enqueue_create_host_buffer(np.int32, 4)
    ctx.enqueue_function(ADD_ONE, buf, np.int32(4), grid_dim=1, block_dim=4)  # (seen: compiled)
    dropped = ctx.enqueue_create_buffer(np.int8, 48)
    ctx.synchronize()
    del dropped  # (on CUDA the stream keeps its memory for its next 48 bytes: the C path)
    spare = getattr(ctx._impl, "spare", None)
    assert spare is None or spare.kept()
    other = ctx.select_stream(1)
    held = other.enqueue_cpu_function(gate())  # (opened at teardown, before the close)
    for s in ctx._state.all_streams():
        s.begin_close()
    submissions = {
        "copy": lambda: ctx.enqueue_copy(host, buf),
        "copy from NumPy": lambda: ctx.enqueue_copy(buf, np.zeros(4, np.int32)),
        "memset": lambda: ctx.enqueue_memset(buf, 0),
        "kernel": lambda: ctx.enqueue_function(ADD_ONE, buf, np.int32(4), grid_dim=1, block_dim=4),
        "cpu function": lambda: ctx.enqueue_cpu_function(int),
        "cpu range": lambda: ctx.enqueue_cpu_range(int, 2),
        "wait for a stream": lambda: ctx.enqueue_wait_for(other),
        "wait for an event": lambda: ctx.enqueue_wait_for(held),
        "record": lambda: ctx.stream().record_event(ctx.create_event()),
        "device buffer on kept memory": lambda: ctx.enqueue_create_buffer(np.int8, 48),
        "device buffer on new memory": lambda: ctx.enqueue_create_buffer(np.int8, 80),
        "device buffer, synchronized": lambda: ctx.create_buffer_sync(np.int8, 80),
        "host buffer": lambda: ctx.enqueue_create_host_buffer(np.int8, 80),
    }
    for what, submit in submissions.items():
        with pytest.raises(ContextClosedError, match="is closed"):
            submit()
            pytest.fail(f"{what} was accepted by a closing stream")
    assert spare is None or spare.kept()  # (nothing taken)


def _held_up_allocator(
    ctx: Any, monkeypatch: pytest.MonkeyPatch, name: str
) -> tuple[Any, Any, list[str], list[Any]]:
    """The backend's ``name`` (``alloc_device`` or ``alloc_host``) made to wait
    for ``go`` once it is called (``allocating`` set); ``order`` gets
    "allocated" when it returns, ``released`` each stream its memory is given
    back on."""
    import threading

    backend = ctx._state.backend
    real = getattr(backend, name)
    allocating, go = threading.Event(), threading.Event()
    order: list[str] = []
    released: list[Any] = []

    class Probe:
        def __init__(self, alloc: Any) -> None:
            self.alloc, self.ptr, self.host = alloc, alloc.ptr, alloc.host

        def release(self, stream: Any) -> None:
            released.append(stream)
            self.alloc.release(stream)

    def held_up(nbytes: int, stream: Any) -> Any:
        allocating.set()
        assert go.wait(30)
        out = real(nbytes, stream)
        order.append("allocated")
        return out if name == "alloc_device" else Probe(out)

    monkeypatch.setattr(backend, name, held_up)
    return allocating, go, order, released


def test_a_device_allocation_overlapping_close_ends_before_the_close_goes_on(
    ctx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device allocation is in progress (held up inside the backend's
    allocator, under the stream's submission lock) when another thread closes
    the context: the close waits for it (it sets its refusal flag under that
    lock), so the allocation ends with a buffer, and only then does the close
    go on to wait for the work and release the streams (on CUDA the memory is
    allocated on a stream the close destroys)."""
    import threading

    import numpy as np

    allocating, go, order, _ = _held_up_allocator(ctx, monkeypatch, "alloc_device")
    made: list[Any] = []
    allocator = threading.Thread(
        target=lambda: made.append(ctx.enqueue_create_buffer(np.int32, 1000))
    )
    allocator.start()
    assert allocating.wait(30)

    def close() -> None:
        ctx.close()
        order.append("closed")

    closer = threading.Thread(target=close)
    closer.start()
    closer.join(0.5)  # (a close that did not wait for the allocation would be done by now)
    go.set()
    allocator.join(30)
    closer.join(30)
    assert order == ["allocated", "closed"]
    assert len(made) == 1 and len(made[0]) == 1000 and made[0]._ctx._state.closed


def test_a_host_allocation_overlapping_close_is_refused_and_given_back(
    ctx: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host buffer's memory is taken outside the submission lock (no stream is
    used, and pinning can block for long), so a close does not wait for it:
    the allocation that ends after the close has begun keeps nothing, gives
    its memory back and raises ``ContextClosedError``."""
    import threading

    import numpy as np

    from asyncgpu import ContextClosedError

    allocating, go, order, released = _held_up_allocator(ctx, monkeypatch, "alloc_host")
    outcome: list[Any] = []

    def allocate() -> None:
        try:
            outcome.append(ctx.enqueue_create_host_buffer(np.int32, 1000))
        except ContextClosedError as e:
            outcome.append(e)

    allocator = threading.Thread(target=allocate)
    allocator.start()
    assert allocating.wait(30)
    impl = ctx._impl
    ctx.close()  # (returns with the allocation still held up)
    go.set()
    allocator.join(30)
    assert order == ["allocated"] and released == [impl]
    assert len(outcome) == 1 and isinstance(outcome[0], ContextClosedError)


@pytest.mark.parametrize("wait", ["ctx.synchronize", "stream.synchronize", "await ctx"])
def test_a_wait_that_a_close_overtakes_returns_and_touches_no_destroyed_stream(
    ctx: Any, monkeypatch: pytest.MonkeyPatch, wait: str
) -> None:
    """A blocking or awaited wait for the current stream is held up after the
    context's open check, before it reaches the stream (here where it first
    asks for the stream's last operation) while another thread closes the
    context; the close does not wait for it (it is not yet in the driver),
    waits for the work and, on CUDA, destroys the stream. The wait then
    returns, as it would have before the close (the work is done), and calls
    nothing on the destroyed stream (on CUDA an error of
    ``cuStreamSynchronize``, or worse, otherwise)."""
    import asyncio
    import threading

    impl = ctx._impl
    stream = ctx.stream()
    waiter_started = threading.Event()
    asking, go = threading.Event(), threading.Event()
    real_tail = type(impl).tail
    held: list[int] = []

    def tail(self: Any) -> Any:
        mine = self is impl and waiter_started.is_set() and not held
        if mine and threading.get_ident() == waiter.ident:
            held.append(1)
            asking.set()
            assert go.wait(30)
        return real_tail(self)

    monkeypatch.setattr(type(impl), "tail", tail)
    ctx.enqueue_cpu_function(int)  # (work for the close to wait for)

    async def await_ctx() -> None:
        await ctx

    calls = {
        "ctx.synchronize": ctx.synchronize,
        "stream.synchronize": stream.synchronize,
        "await ctx": lambda: asyncio.run(await_ctx()),
    }
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(calls[wait]())
        except BaseException as e:
            outcome.append(e)

    waiter = threading.Thread(target=run, daemon=True)
    waiter_started.set()
    waiter.start()
    assert asking.wait(30)
    closer = threading.Thread(target=ctx.close, daemon=True)
    closer.start()
    closer.join(30)
    assert not closer.is_alive()
    go.set()
    waiter.join(30)
    assert outcome == [None]


def test_allocations_racing_close_return_a_buffer_or_are_refused(api: str) -> None:
    """Two threads allocate device and host buffers as fast as they can while
    the main thread closes the context, many times over: each allocation
    returns a buffer or raises ``ContextClosedError``, never another error (on
    CUDA, an allocation on a stream being destroyed was a ``DeviceError``)."""
    proc = run_child(f"""
        import threading
        import numpy as np
        import asyncgpu
        from asyncgpu import ContextClosedError

        for _ in range(40):
            ctx = asyncgpu.DeviceContext(api={api!r}, num_streams=2)
            errors = []
            start = threading.Barrier(3)

            def allocate(i):
                view = ctx.select_stream(i)
                start.wait()
                try:
                    while True:
                        view.enqueue_create_buffer(np.float32, 256)
                        view.enqueue_create_host_buffer(np.float32, 256)
                except ContextClosedError:
                    pass
                except BaseException as e:
                    errors.append(repr(e))

            threads = [threading.Thread(target=allocate, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            start.wait()
            ctx.close()
            for t in threads:
                t.join(30)
            assert errors == [], errors
        print("OK")
    """)
    assert_ok(proc)


# -- leaks -------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["closure", "Kernel", "bound method"])
def test_a_kernel_body_is_freed_after_its_context_closes(form: str) -> None:
    """The CPU device's check of a body's argument count kept every body checked
    (a closure and what it holds) for the life of the process."""
    import weakref

    import numpy as np

    from asyncgpu import DeviceContext, Kernel

    class Holder:
        def __init__(self) -> None:
            self.big = np.zeros(10_000)

        def body(self, b: object, out: np.ndarray) -> None:
            out[0] = self.big.size

    def make_closure(big: np.ndarray) -> Any:
        def closure(b: object, out: np.ndarray) -> None:
            out[0] = big.size

        return closure

    holder = Holder()
    big = holder.big
    closure = make_closure(big)
    body = {"closure": closure, "Kernel": Kernel("k", cpu=closure), "bound method": holder.body}
    with DeviceContext(api="cpu") as ctx:
        out = ctx.enqueue_create_buffer(np.int64, 1)
        ctx.enqueue_function(body[form], out, grid_dim=1, block_dim=1)
        ctx.enqueue_function(body[form], out, grid_dim=1, block_dim=1)
        host = np.zeros(1, np.int64)
        ctx.enqueue_copy(host, out).synchronize()
        assert host[0] == 10_000
    gone = [weakref.ref(big), weakref.ref(closure), weakref.ref(holder)]
    del body, big, closure, holder, out, ctx
    assert all_collected(gone)


def test_contexts_dropped_without_close_are_freed(api: str) -> None:
    """Contexts made, used and dropped without ``close()``, many times over: once
    their work has finished, each one's state and streams are collected, and the
    registry of open contexts (what exit waits for) does not grow."""
    import weakref

    import numpy as np

    from asyncgpu import DeviceContext
    from asyncgpu._core.state import _open_states

    before = len(_open_states)
    gone = []
    for _ in range(300 if api == "cpu" else 40):
        ctx = DeviceContext(api=api)
        buf = ctx.enqueue_create_buffer(np.int32, 16)
        ctx.enqueue_memset(buf, 1)
        ctx.enqueue_cpu_function(int)
        gone += [weakref.ref(ctx._state), weakref.ref(ctx._impl)]
        del ctx, buf
    assert all_collected(gone)
    assert len(_open_states) <= before


def test_a_dropped_context_finishes_its_work_before_it_is_freed(api: str) -> None:
    """Work still queued on a context dropped without ``close()`` keeps it (and
    what the work uses) alive: the copy behind a gate lands in the NumPy array
    after the context was dropped, and only then is the context freed."""
    import gc
    import weakref

    import numpy as np
    from _kernels import Gate

    from asyncgpu import DeviceContext

    ctx = DeviceContext(api=api)
    gate = Gate()
    host = np.zeros(4, np.int32)
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    ctx.enqueue_cpu_function(gate)
    ctx.enqueue_memset(buf, 7)
    ctx.enqueue_copy(host, buf)
    state = weakref.ref(ctx._state)
    del ctx, buf
    gc.collect()
    assert state() is not None  # (its work is held behind the gate)
    gate.open()
    assert all_collected([state])
    assert host.tolist() == [7, 7, 7, 7]


def test_the_launch_geometry_cache_is_bounded(ctx: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A function launched with ever new shapes keeps at most
    ``MAX_LAUNCH_CONFIGS`` of them validated (the cache is then cleared), and
    launches right with shapes that fell out of it and with the one the compiled
    launch kept."""
    import numpy as np
    from _kernels import ADD_ONE

    from asyncgpu._api import context as context_module

    monkeypatch.setattr(context_module, "MAX_LAUNCH_CONFIGS", 8)
    fn = ctx.compile_function(ADD_ONE)
    buf = ctx.enqueue_create_buffer(np.int32, 4)
    ctx.enqueue_memset(buf, 0)
    n = np.int32(4)
    ctx.enqueue_function(fn, buf, n, grid_dim=1, block_dim=4)  # (the compiled launch's shape)
    for k in range(1, 40):
        ctx.enqueue_function(fn, buf, n, grid_dim=1, block_dim=4, shared_mem_bytes=4 * k)
        assert len(fn._cfgs) <= 8
    ctx.enqueue_function(fn, buf, n, grid_dim=1, block_dim=4)
    ctx.enqueue_function(fn, buf, n, grid_dim=1, block_dim=4, shared_mem_bytes=4)
    host = np.zeros(4, np.int32)
    ctx.enqueue_copy(host, buf).synchronize()
    assert host.tolist() == [42] * 4
