"""Every event loop awaits alike: asyncio, uvloop and trio (through anyio's pytest
plugin: ``anyio_backend`` is each of them), on every device.

Awaits return the operation's value, finish in stream order, give up through
the loop's own cancellation (``asyncio.timeout`` under asyncio and uvloop, a
cancel scope under trio) without cancelling the work, carry an operation's
error, and a loop closed (or a run ended) with awaits pending leaves nothing
broken behind.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import numpy as np
import pytest
import trio
from _kernels import ADD_ONE, TIMEOUT_S, TRAP_AND_SPIN, blocks_for, poison, random_array
from _loops import BACKENDS, checkpoint, is_trio, uvloop

from asyncgpu import DeviceContext

N = 256


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    return request.param


@pytest.mark.anyio
async def test_the_loop_under_test_is_the_one_named(anyio_backend: object) -> None:
    """The fixture's uvloop case runs on uvloop's loop, not asyncio's."""
    if is_trio(anyio_backend):
        assert trio.lowlevel.current_task() is not None
    elif anyio_backend == "asyncio":
        assert type(asyncio.get_running_loop()).__module__.startswith("asyncio")
    else:
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")


@pytest.mark.anyio
async def test_awaits_return_each_operations_value(
    ctx: DeviceContext, anyio_backend: object, rng: np.random.Generator
) -> None:
    """A copy in, a kernel, a copy out, a CPU function: each awaited on its own,
    again and again (each time alone on its loop, so short work is seen by the
    await's brief spin)."""
    data = random_array(rng, np.int32, N) // 2
    out = poison(np.int32, N)
    buf = ctx.enqueue_create_buffer(np.int32, N)
    with anyio.fail_after(TIMEOUT_S):
        await ctx.enqueue_copy(buf, data)
        for _ in range(20):
            await ctx.enqueue_function(
                ADD_ONE, buf, np.int32(N), grid_dim=blocks_for(N), block_dim=256
            )
        await ctx.enqueue_copy(out, buf)
        assert await ctx.enqueue_cpu_function(lambda: "value") == "value"
    np.testing.assert_array_equal(out, data + 20)


@pytest.mark.anyio
async def test_awaits_finish_in_stream_order(
    ctx: DeviceContext, anyio_backend: object, gate
) -> None:
    """Forty tasks await forty operations held behind a gate, starting in a random
    order. When an await returns, every earlier operation of the stream has
    finished. Under asyncio and uvloop the tasks resume in the stream's order;
    trio runs each batch of woken tasks in an order of its own choosing, so
    there only the set is checked."""
    n = 40
    g = gate()
    ctx.enqueue_cpu_function(g)
    events = [ctx.enqueue_cpu_function(lambda i=i: i) for i in range(n)]
    resumed: list[int] = []
    earlier_done: list[bool] = []
    waiting = 0

    async def waiter(i: int) -> None:
        nonlocal waiting
        waiting += 1
        assert await events[i] == i
        earlier_done.append(all(e.query() for e in events[:i]))
        resumed.append(i)

    order = list(range(n))
    random.shuffle(order)
    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            for i in order:
                tg.start_soon(waiter, i)
            while waiting < n:
                await checkpoint(anyio_backend)
            g.open()
    assert all(earlier_done)
    if is_trio(anyio_backend):
        assert sorted(resumed) == list(range(n))
    else:
        assert resumed == list(range(n))


async def _give_up(backend: object, ev: object) -> bool:
    """Await ``ev`` under a deadline that has passed: the loop's own way of
    giving up (``asyncio.timeout`` under asyncio and uvloop, a cancel scope
    under trio). True if the await was given up."""
    if is_trio(backend):
        with trio.move_on_after(0) as scope:
            await ev  # type: ignore[misc]
        return scope.cancelled_caught
    if sys.version_info >= (3, 11):
        try:
            async with asyncio.timeout(0):
                await ev  # type: ignore[misc]
        except TimeoutError:
            return True
        return False
    try:
        await asyncio.wait_for(ev, 0)  # type: ignore[arg-type]
    except asyncio.TimeoutError:
        return True
    return False


@pytest.mark.anyio
async def test_giving_up_an_await_leaves_the_work_running(
    ctx: DeviceContext, anyio_backend: object, gate, rng: np.random.Generator
) -> None:
    """Thirty tasks give up their awaits of a copy, a kernel and a CPU function
    held behind a gate; ten others keep awaiting the same operations. The work
    still runs in full, the patient tasks get its value, and a later await of a
    given-up event works."""
    data = random_array(rng, np.int32, N) // 2
    out = poison(np.int32, N)
    g = gate()
    held = ctx.enqueue_cpu_function(g)
    buf = ctx.enqueue_create_buffer(np.int32, N)
    ctx.enqueue_copy(buf, data)
    kernel = ctx.enqueue_function(ADD_ONE, buf, np.int32(N), grid_dim=blocks_for(N), block_dim=256)
    copied = ctx.enqueue_copy(out, buf)
    value = ctx.enqueue_cpu_function(lambda: 42)
    events = [held, kernel, copied, value]
    gave_up: list[bool] = []
    got: list[object] = []
    waiting = 0

    async def impatient(i: int) -> None:
        gave_up.append(await _give_up(anyio_backend, events[i % len(events)]))

    async def patient() -> None:
        nonlocal waiting
        waiting += 1
        got.append(await value)

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(patient)
            for i in range(30):
                tg.start_soon(impatient, i)
            while waiting < 10 or len(gave_up) < 30:
                await checkpoint(anyio_backend)
            assert not held.query()
            g.open()
        assert all(gave_up)
        assert got == [42] * 10
        assert await held == "opened"
        await copied
    np.testing.assert_array_equal(out, data + 1)


@pytest.mark.anyio
async def test_an_operations_error_reaches_its_awaiters_and_the_stream_goes_on(
    ctx: DeviceContext, anyio_backend: object
) -> None:
    def boom() -> None:
        raise ValueError("boom")

    failed = ctx.enqueue_cpu_function(boom)
    after = ctx.enqueue_cpu_function(lambda: "after")
    errors: list[BaseException] = []

    async def wait() -> None:
        try:
            await failed
        except ValueError as e:
            errors.append(e)

    with anyio.fail_after(TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(wait)
        assert await after == "after"
    assert [str(e) for e in errors] == ["boom"] * 5


# -- a loop closed, or a run ended, with awaits pending (in a child process) -------------


def _run_child(
    tmp_path: Path, script: str, loop_name: str, arg: str
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a child process with ``loop_name`` and ``arg``; it must
    exit 0 and print ``OK`` last."""
    if loop_name == "uvloop" and uvloop is None:
        pytest.skip("uvloop is not installed")
    path = tmp_path / "child.py"
    path.write_text(script)
    env = dict(os.environ, ASYNCGPU_DISABLE_HEALTHCHECK="1")
    proc = subprocess.run(
        [sys.executable, str(path), loop_name, arg],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("OK")
    return proc


CLOSE_SCRIPT = textwrap.dedent(
    r"""
    import asyncio, sys, threading
    import numpy as np
    import asyncgpu as ag

    loop_name, api = sys.argv[1], sys.argv[2]
    ctx = ag.DeviceContext(api=api)
    opened = threading.Event()

    def gate():
        if not opened.wait(30):
            raise TimeoutError("never opened")
        return "opened"

    held = ctx.enqueue_cpu_function(gate)
    buf = ctx.enqueue_create_buffer(np.int32, 16)
    behind = ctx.enqueue_memset(buf, 1)  # (on CUDA: polled, behind the host work)
    events = [held, behind]
    waiting = 0

    async def wait(ev):
        global waiting
        waiting += 1
        await ev

    if loop_name == "trio":
        import trio

        async def main():
            async with trio.open_nursery() as nursery:
                for ev in events:
                    for _ in range(8):
                        nursery.start_soon(wait, ev)
                while waiting < 16:
                    await trio.lowlevel.checkpoint()
                await trio.lowlevel.checkpoint()
                nursery.cancel_scope.cancel()  # the run ends with every await given up

        trio.run(main)
        run = trio.run
    else:
        if loop_name == "uvloop":
            import uvloop
            new_loop = uvloop.new_event_loop
        else:
            new_loop = asyncio.new_event_loop
        loop = new_loop()
        tasks = [loop.create_task(wait(ev)) for ev in events for _ in range(8)]

        async def all_waiting():
            while waiting < 16:
                await asyncio.sleep(0)
            await asyncio.sleep(0)

        loop.run_until_complete(all_waiting())
        loop.close()  # closed with every await pending
        run = lambda fn: asyncio.run(fn()) if loop_name == "asyncio" else uvloop.run(fn())

    opened.set()  # the work finishes after its loop is gone
    assert held.synchronize() == "opened"
    behind.synchronize()

    async def again():  # a new loop awaits the same work
        return await held

    assert run(again) == "opened"
    ctx.close()
    print("OK")
    """
)


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop", "trio"])
def test_a_loop_closed_with_awaits_pending_leaves_nothing_broken(
    api: str, loop_name: str, tmp_path: Path
) -> None:
    """Sixteen awaits pending when their loop closes (asyncio, uvloop) or their
    run ends (trio); the work then finishes, nobody is left to wake, and a
    new loop awaits it. In a child process, as a hang must not stall the
    suite."""
    proc = _run_child(tmp_path, CLOSE_SCRIPT, loop_name, api)
    # (asyncio reports each pending task it destroys; nothing else may be reported)
    reported = [
        line
        for line in proc.stderr.splitlines()
        if line != "Task was destroyed but it is pending!" and not line.startswith("task: <Task")
    ]
    assert reported == []


FAULT_SCRIPT = textwrap.dedent(
    r"""
    import asyncio, sys
    import numpy as np
    import asyncgpu as ag

    loop_name, SRC = sys.argv[1], sys.argv[2]  # (tests/_kernels.py's TRAP_AND_SPIN)
    ctx = ag.DeviceContext(api="cuda")
    trap = ctx.compile_function(SRC, "trap")
    spin = ctx.compile_function(SRC, "spin")
    khz = ctx.default_device_info.clock_rate_khz
    buf = ctx.enqueue_create_buffer(np.float32, 1024)
    ctx.synchronize()
    ctx.enqueue_function(spin, np.int64(khz * 50), grid_dim=1, block_dim=1)  # ~50 ms
    pending = [
        ctx.enqueue_function(trap, grid_dim=1, block_dim=1),
        ctx.enqueue_memset(buf, 1.0),
        ctx.enqueue_cpu_function(lambda: "behind the fault"),
    ]
    results = []

    async def wait(ev):
        try:
            results.append(await ev)
        except ag.DeviceFaultError as e:
            results.append(e)

    if loop_name == "trio":
        import trio

        async def main():
            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    for ev in pending:
                        for _ in range(4):
                            nursery.start_soon(wait, ev)

        trio.run(main)
    else:
        async def main():
            await asyncio.wait_for(
                asyncio.gather(*(wait(ev) for ev in pending for _ in range(4))), 10
            )

        if loop_name == "uvloop":
            import uvloop
            uvloop.run(main())
        else:
            asyncio.run(main())
    kinds = sorted({type(r).__name__ for r in results})
    assert len(results) == 12 and kinds == ["DeviceFaultError"], kinds
    print("OK")
    """
)


@pytest.mark.gpu
@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop", "trio"])
def test_a_device_fault_fails_the_pending_awaits_on_every_loop(
    loop_name: str, tmp_path: Path
) -> None:
    """A trapping kernel with work behind it, each awaited by four tasks: on
    every loop each await raises ``DeviceFaultError`` (none hangs). In a child
    process: a sticky fault ruins the process's CUDA context."""
    from conftest import CUDA_DEVICES, NO_CUDA_REASON

    if CUDA_DEVICES == 0:
        pytest.skip(NO_CUDA_REASON)
    _run_child(tmp_path, FAULT_SCRIPT, loop_name, TRAP_AND_SPIN)
