"""What one await of another library's (PyTorch's) stream costs the host: Python
function calls per await (cProfile, builtins included) and host time per await,
for each way of awaiting it.

``--target stand-in`` (anywhere): a wrapped ``CudaStream`` on the stand-in driver
of the tests (``tests/_stand_in_driver.py``: ``cuEventRecord`` and
``cuEventQuery`` are Python callbacks there, so they count among the calls; the
marker event reports finished at its ``--polls``-th query), awaited as

* ``await stream``: ``DeviceStream.__await__`` of the wrapped stream;
* ``await fence``: the event of ``fence()``, what ``asyncgpu.torch.wait`` returns.

``--target cuda`` (a GPU with CUDA PyTorch): ``x.add_(1)`` on a PyTorch stream,
then one of

* ``wrap each time + await``: ``ctx.create_external_stream(s)`` per request;
* ``await stream``: the stream wrapped once;
* ``asyncgpu.torch.wait``: ``await asyncgpu.torch.wait(s)``;
* ``poll sleep(0)``: ``ev.record(s)``, then ``ev.query()`` and ``asyncio.sleep(0)``;
* ``synchronize``: ``s.synchronize()``.

    python benchmarks/diagnostics/probe_foreign_await.py [--target stand-in|cuda] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

Step = Callable[[], Awaitable[None]]


def measure(steps: dict[str, Step], n: int, profile_top: int) -> dict[str, Any]:
    """Per step: host microseconds per await (process time and wall, unprofiled),
    then Python calls per await under cProfile, and the most called functions."""
    out: dict[str, Any] = {}
    for name, step in steps.items():

        async def loop(step: Step = step) -> None:
            for _ in range(n):
                await step()

        asyncio.run(loop())  # (warm)
        c0, t0 = time.process_time(), time.perf_counter()
        asyncio.run(loop())
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
        prof = cProfile.Profile()
        prof.enable()
        asyncio.run(loop())
        prof.disable()
        stats = pstats.Stats(prof)
        calls = sum(v[1] for v in stats.stats.values())  # (primitive + recursive)
        # (asyncio.run's own setup and teardown are in the count: 1/n of it per await)
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][1])[:profile_top]
        out[name] = {
            "cpu_us_per_await": 1e6 * cpu / n,
            "wall_us_per_await": 1e6 * wall / n,
            "calls_per_await": calls / n,
            "most_called": [
                {"function": f"{k[0].split('/')[-1]}:{k[1]}:{k[2]}", "calls_per_await": v[1] / n}
                for k, v in top
            ],
        }
    return out


# -- the stand-in driver ------------------------------------------------------------------


class _FinishAtPoll:
    """The stand-in's ``finished``: an event is finished at its ``polls``-th query
    since its last record."""

    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.asked: dict[int, int] = {}

    def __contains__(self, event: int) -> bool:
        k = self.asked.get(event, 0) + 1
        self.asked[event] = k
        return k >= self.polls

    def discard(self, event: int) -> None:
        self.asked.pop(event, None)


def stand_in_steps(polls: int) -> tuple[dict[str, Step], Any]:
    from contextlib import ExitStack
    from types import SimpleNamespace

    from _stand_in_driver import bound_stand_in, wrapped_stream

    from asyncgpu import DeviceEvent, _accel
    from asyncgpu._api.stream import DeviceStream
    from asyncgpu._core.engine import watcher
    from asyncgpu._core.stream import _PolledStream
    from asyncgpu._devices.cuda import driver as _driver
    from asyncgpu._devices.cuda import memory as _memory
    from asyncgpu._devices.cuda import stream as _stream

    stack = ExitStack()
    c = stack.enter_context(bound_stand_in(events=True))
    c.finished = _FinishAtPoll(polls)  # type: ignore[assignment]
    made: list[int] = []

    class Cu:  # (the Python driver calls of a marker event: creating one)
        class CUevent_flags:
            CU_EVENT_DISABLE_TIMING = 2

        @staticmethod
        def cuEventCreate(flags: int) -> tuple[Any, int]:
            made.append(0xE0 + len(made))
            return _driver._SUCCESS, made[-1]

    _stream.cu = Cu  # type: ignore[assignment]
    _accel.native.configure(
        DeviceEvent,
        watcher.sweep_later,
        _PolledStream.MARK_EVERY,
        _stream.CudaStream,
        _memory._DeviceAlloc,
    )
    s = wrapped_stream(0x5EA)
    ctx = SimpleNamespace(_check_open=lambda: None)
    wrapped = DeviceStream(ctx, s)  # type: ignore[arg-type]

    async def await_stream() -> None:
        await wrapped

    async def await_fence() -> None:
        await s.fence()

    return {"await stream": await_stream, "await fence": await_fence}, (stack, made)


# -- CUDA with PyTorch ----------------------------------------------------------------------


def cuda_steps() -> tuple[dict[str, Step], Any]:
    import torch

    import asyncgpu as ag
    import asyncgpu.torch as agt

    if not torch.cuda.is_available():
        raise SystemExit("--target cuda needs a CUDA build of PyTorch and a GPU")
    ctx = ag.DeviceContext(api="cuda")
    s = torch.cuda.Stream()
    x = torch.zeros(1, device="cuda")
    wrapped = ctx.create_external_stream(s)

    def work() -> None:
        with torch.cuda.stream(s):
            x.add_(1)

    async def wrap_each_time() -> None:
        work()
        await ctx.create_external_stream(s)

    async def await_stream() -> None:
        work()
        await wrapped

    async def torch_wait() -> None:
        work()
        await agt.wait(s, ctx=ctx)

    async def poll0() -> None:
        work()
        ev = torch.cuda.Event()
        ev.record(s)
        while not ev.query():
            await asyncio.sleep(0)

    async def synchronize() -> None:
        work()
        s.synchronize()

    steps = {
        "wrap each time + await": wrap_each_time,
        "await stream": await_stream,
        "asyncgpu.torch.wait": torch_wait,
        "poll sleep(0)": poll0,
        "synchronize": synchronize,
    }
    return steps, ctx


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", choices=("stand-in", "cuda"), default="stand-in")
    p.add_argument("-n", type=int, default=2000)
    p.add_argument("--polls", type=int, default=1, help="stand-in: queries until finished")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json")
    a = p.parse_args()
    from _harness import environment_info, write_json

    if a.target == "stand-in":
        steps, _keep = stand_in_steps(a.polls)  # (kept alive: the binding, the context)
    else:
        steps, _keep = cuda_steps()
    out: dict[str, Any] = {
        "target": a.target,
        "n": a.n,
        "environment": environment_info(probe_gpu=a.target == "cuda"),
        "steps": measure(steps, a.n, a.top),
    }
    for name, r in out["steps"].items():
        print(
            f"{name:26s} {r['cpu_us_per_await']:8.2f} us CPU  {r['wall_us_per_await']:8.2f} us"
            f" wall  {r['calls_per_await']:6.1f} calls per await"
        )
        for f in r["most_called"][:6]:
            print(f"    {f['calls_per_await']:6.2f}  {f['function']}")
    if a.target == "stand-in":
        print(
            "(the stand-in's cuEventRecord and cuEventQuery are Python callbacks: they are "
            "among the calls; host times are this machine's, never a GPU's)"
        )
    if a.json:
        write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
