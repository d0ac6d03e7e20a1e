"""Every event loop side by side: asyncgpu's awaits under asyncio, uvloop and
trio, each against its peers run on the same loop in the same process.

For each loop, one row of each:

* **latency**: the median await of an empty operation against the same launch
  followed by a blocking wait (``cuStreamSynchronize`` on CUDA) and against the
  naive poll (launch, ``cuEventRecord``, then ``cuEventQuery`` and a yield to
  the loop until done), interleaved round by round;
* **throughput**: 1,000 tasks x 10 awaits over 8 streams against the
  host-callback strategy (``cuLaunchHostFunc`` waking the loop from the
  driver's thread: ``call_soon_threadsafe`` or ``TrioToken.run_sync_soon``) on
  the same loop, rounds alternating;
* **ticker**: a 1 ms ticker's lag while 1,000 tasks keep awaiting (4 s);
* **idle**: the process's CPU time over wall time while one task awaits a
  200 ms operation.

Targets: ``cuda`` (an empty kernel; a clock-spinning kernel for the idle
case), ``cpu`` (the CPU device: a no-op CPU function, ``time.sleep`` for the
idle case; its blocking wait is ``event.synchronize()`` and its host callback
``add_done_callback``, as the device has no driver), and ``emulated`` (a
polled stream whose completion counter follows the clock: each operation
"runs" 8 us, so the polling engine, not a device, is what is measured; it has
no host callback). Figures of the ``cpu`` and ``emulated`` targets are CPU
figures of the machine that ran them, never GPU figures.

    python benchmarks/bench_loops.py --target cpu [--quick] [--json OUT.json]
    python benchmarks/bench_loops.py --target cuda [--json OUT.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Unavailable, percentile

import asyncgpu as ag
from asyncgpu import DeviceEvent
from asyncgpu._core.stream import _PolledStream

LOOPS = ("asyncio", "uvloop", "trio")
TARGETS = ("cpu", "emulated", "cuda")


class Params:
    """The sizes of one run (the issue's figures; ``quick`` shrinks them for CI)."""

    def __init__(self, quick: bool) -> None:
        self.latency_n = 300 if quick else 2000
        self.tasks = 200 if quick else 1000
        self.per_task = 5 if quick else 10
        self.streams = 8
        self.pairs = 2 if quick else 5
        self.ticker_tasks = 200 if quick else 1000
        self.ticker_s = 0.5 if quick else 4.0
        self.idle_ms = 50.0 if quick else 200.0
        self.idle_waits = 1 if quick else 3


# -- the loops ---------------------------------------------------------------------------


class Loop:
    """How to run a coroutine function, yield, gather and wake from a thread on one
    event loop. ``asyncio`` and ``uvloop`` share asyncio's API; ``trio`` has its own."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "uvloop":
            try:
                import uvloop
            except ImportError as e:
                raise Unavailable(f"uvloop is not installed: {e}") from e
            self._run: Callable[[Any], Any] = lambda main: uvloop.run(main())
        elif name == "trio":
            try:
                import trio
            except ImportError as e:
                raise Unavailable(f"trio is not installed: {e}") from e
            self.trio = trio
            self._run = trio.run
        else:
            self._run = lambda main: asyncio.run(main())

    def run(self, main: Callable[[], Awaitable[Any]]) -> Any:
        return self._run(main)

    async def yield_(self) -> None:
        if self.name == "trio":
            await self.trio.lowlevel.checkpoint()
        else:
            await asyncio.sleep(0)

    async def sleep(self, seconds: float) -> None:
        if self.name == "trio":
            await self.trio.sleep(seconds)
        else:
            await asyncio.sleep(seconds)

    async def gather(self, coros: list[Awaitable[Any]]) -> None:
        if self.name == "trio":
            async with self.trio.open_nursery() as nursery:
                for c in coros:
                    nursery.start_soon(_awaiting, c)
        else:
            await asyncio.gather(*coros)

    def waiter(self) -> tuple[Callable[[], Awaitable[Any]], Callable[[], None]]:
        """(wait, wake): ``await wait()`` returns once ``wake()`` was called, from
        any thread (the host-callback strategy's hop onto the loop)."""
        if self.name == "trio":
            done = self.trio.Event()
            token = self.trio.lowlevel.current_trio_token()
            return done.wait, partial(token.run_sync_soon, done.set)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        return lambda: fut, partial(loop.call_soon_threadsafe, _resolve, fut)


async def _awaiting(c: Awaitable[Any]) -> None:
    await c


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# -- the targets -------------------------------------------------------------------------


def _noop() -> None:
    pass


class CpuTarget:
    """The CPU device: a no-op CPU function is the empty operation."""

    name = "cpu"
    has_host_callback = True

    def __init__(self, streams: int) -> None:
        self.ctx = ag.DeviceContext(api="cpu")
        self.views = [self.ctx.select_stream(i % self.ctx.num_streams()) for i in range(streams)]

    def launch(self, k: int = 0) -> DeviceEvent:
        return self.views[k].enqueue_cpu_function(_noop)

    def blocking_once(self) -> None:
        self.launch().synchronize()

    def naive_start(self) -> Callable[[], bool]:
        return self.launch().query

    def host_callback(self, k: int, wake: Callable[[], None]) -> None:
        self.launch(k).add_done_callback(lambda _e: wake())

    def long(self, ms: float) -> DeviceEvent:
        return self.ctx.enqueue_cpu_function(time.sleep, ms / 1e3)

    def close(self) -> None:
        self.ctx.close()


class ClockStream(_PolledStream):
    """A polled stream whose counter follows the clock: each operation ends
    ``duration`` seconds after the previous one (or its submission), and a marker
    is passed once the operation it covers has ended."""

    def __init__(self) -> None:
        super().__init__(SimpleNamespace(api="emulated", device_id=0), 0, 0)
        self.ends: deque[tuple[int, float]] = deque()  # (seq, end) of each operation
        self.marks: deque[tuple[int, float]] = deque()  # (seq, end) of each marker
        self.reached = 0
        self.busy_until = 0.0

    def _place_marker(self, counter: bool = False) -> None:
        self._marked = self._seq
        self.marks.append((self._seq, self.busy_until))

    def _completed(self) -> int:
        marks = self.marks
        now = time.perf_counter()
        while marks and marks[0][1] <= now:
            self.reached = marks.popleft()[0]
        return self.reached

    def submit(self, duration: float, latency: float = 0.0) -> DeviceEvent:
        """An operation taking ``duration`` that ends no sooner than ``latency``
        after its submission (a GPU's launch-to-completion time)."""
        with self._submit_lock:
            self._before_submit()
            self._seq += 1
            now = time.perf_counter()
            self.busy_until = max(now + latency, max(now, self.busy_until) + duration)
            ev = DeviceEvent(self, self._seq)
            self._inflight.append(ev)
            if self._eager:
                self._place_marker()
        return ev


class EmulatedTarget:
    """Polled streams on the clock (``ClockStream``): an operation takes
    ``op_s`` (8 us), ends no sooner than ``latency_s`` after its submission,
    and its launch costs the host ``launch_s`` of busy time (both 0 unless
    asked for: ``profile_loop_throughput.py``'s ``--stand-in-*`` options)."""

    name = "emulated"
    has_host_callback = False

    def __init__(
        self, streams: int, op_s: float = 8e-6, latency_s: float = 0.0, launch_s: float = 0.0
    ) -> None:
        self.streams = [ClockStream() for _ in range(streams)]
        self.op_s, self.latency_s, self.launch_s = op_s, latency_s, launch_s

    def launch(self, k: int = 0) -> DeviceEvent:
        if self.launch_s:
            end = time.perf_counter() + self.launch_s
            while time.perf_counter() < end:
                pass
        return self.streams[k].submit(self.op_s, self.latency_s)

    def blocking_once(self) -> None:
        self.launch().synchronize()

    def naive_start(self) -> Callable[[], bool]:
        return self.launch().query

    def host_callback(self, k: int, wake: Callable[[], None]) -> None:
        raise Unavailable("the emulated streams have no host callback")

    def long(self, ms: float) -> DeviceEvent:
        return self.streams[0].submit(ms / 1e3)

    def close(self) -> None:
        pass  # (nothing to release: the clock finishes whatever is left)


class CudaTarget:
    """An empty kernel on the context's streams; the peers launch it with raw
    driver calls (``cuLaunchKernel``) on the same streams."""

    name = "cuda"
    has_host_callback = True

    def __init__(self, streams: int, ctx: ag.DeviceContext | None = None) -> None:
        try:
            from cuda.bindings import driver as drv
        except ImportError as e:
            raise Unavailable(f"cuda.bindings is not installed: {e}") from e
        import bench_engine
        import peers_gpu

        self.drv = drv
        self.own = ctx is None  # (a context handed in stays open)
        self.ctx = ag.DeviceContext(api="cuda") if ctx is None else ctx
        self.empty = self.ctx.compile_function(bench_engine.SRC, "empty")
        self.spin = self.ctx.compile_function(bench_engine.SRC, "spin")
        self.views = [self.ctx.select_stream(i % self.ctx.num_streams()) for i in range(streams)]
        self.raw_streams = [drv.CUstream(v._impl.h) for v in self.views]
        self.raw_empty = drv.CUfunction(int(self.empty._impl.fn))
        self.bridge = peers_gpu.HostFnBridge()
        self.flags = drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        (err, self.event) = drv.cuEventCreate(self.flags)
        self._check(err, "cuEventCreate")
        self.not_ready = drv.CUresult.CUDA_ERROR_NOT_READY
        bench_engine.warm_gpu(self.ctx, self.empty)

    def _check(self, err: Any, call: str) -> None:
        if err:
            raise RuntimeError(f"{call} failed: {err!r}")

    def _raw_launch(self, k: int) -> Any:
        s = self.raw_streams[k]
        (err,) = self.drv.cuLaunchKernel(self.raw_empty, 1, 1, 1, 1, 1, 1, 0, s, 0, 0)
        self._check(err, "cuLaunchKernel")
        return s

    def launch(self, k: int = 0) -> DeviceEvent:
        return self.views[k].enqueue_function(self.empty, grid_dim=1, block_dim=1)

    def blocking_once(self) -> None:
        (err,) = self.drv.cuStreamSynchronize(self._raw_launch(0))
        self._check(err, "cuStreamSynchronize")

    def naive_start(self) -> Callable[[], bool]:
        drv, ev = self.drv, self.event
        (err,) = drv.cuEventRecord(ev, self._raw_launch(0))
        self._check(err, "cuEventRecord")

        def done() -> bool:
            (err,) = drv.cuEventQuery(ev)
            if err and err != self.not_ready:
                self._check(err, "cuEventQuery")
            return not err

        return done

    def host_callback(self, k: int, wake: Callable[[], None]) -> None:
        token = self.bridge.add(wake)
        (err,) = self.drv.cuLaunchHostFunc(self._raw_launch(k), self.bridge.fn, token)
        self._check(err, "cuLaunchHostFunc")

    def long(self, ms: float) -> DeviceEvent:
        import numpy as np

        cycles = np.int64(self.ctx.default_device_info.clock_rate_khz * ms)
        return self.ctx.enqueue_function(self.spin, cycles, grid_dim=1, block_dim=1)

    def close(self) -> None:
        self.ctx.synchronize()
        self.bridge.check()
        self.drv.cuEventDestroy(self.event)
        if self.own:
            self.ctx.close()


def make_target(name: str, streams: int, ctx: ag.DeviceContext | None = None) -> Any:
    if name == "cpu":
        return CpuTarget(streams)
    if name == "emulated":
        return EmulatedTarget(streams)
    return CudaTarget(streams, ctx)


# -- the cases ---------------------------------------------------------------------------


def _us(ns: list[int]) -> float:
    return statistics.median(ns) / 1e3


def latency(loop: Loop, t: Any, p: Params) -> dict[str, float]:
    """Median await against the blocking wait and the naive poll, interleaved."""

    async def awaited() -> int:
        t0 = time.perf_counter_ns()
        await t.launch()
        return time.perf_counter_ns() - t0

    async def naive() -> int:
        t0 = time.perf_counter_ns()
        done = t.naive_start()
        while not done():
            await loop.yield_()
        return time.perf_counter_ns() - t0

    def blocking() -> int:
        t0 = time.perf_counter_ns()
        t.blocking_once()
        return time.perf_counter_ns() - t0

    async def main() -> tuple[list[int], list[int], list[int]]:
        for _ in range(100):
            blocking()
            await awaited()
            await naive()
        a: list[int] = []
        b: list[int] = []
        n: list[int] = []
        for _ in range(p.latency_n):
            b.append(blocking())
            a.append(await awaited())
            n.append(await naive())
        return a, b, n

    a, b, n = loop.run(main)
    return {
        "await_median_us": _us(a),
        "await_p99_us": percentile([x / 1e3 for x in a], 99),
        "blocking_median_us": _us(b),
        "naive_poll_median_us": _us(n),
        "await_over_blocking": _us(a) / _us(b),
        "await_over_naive_poll": _us(a) / _us(n),
    }


def throughput(loop: Loop, t: Any, p: Params) -> dict[str, Any]:
    """``tasks`` x ``per_task`` awaits over ``streams`` streams against the
    host-callback strategy on the same loop, rounds alternating (who goes first
    alternates too)."""

    async def ours(k: int) -> None:
        k %= p.streams
        for _ in range(p.per_task):
            await t.launch(k)

    async def theirs(k: int) -> None:
        k %= p.streams
        for _ in range(p.per_task):
            wait, wake = loop.waiter()
            t.host_callback(k, wake)
            await wait()

    async def rate(task: Callable[[int], Awaitable[None]]) -> float:
        t0 = time.perf_counter()
        await loop.gather([task(k) for k in range(p.tasks)])
        return p.tasks * p.per_task / (time.perf_counter() - t0)

    async def main() -> tuple[list[float], list[float]]:
        peers = (ours, theirs) if t.has_host_callback else (ours,)
        for task in peers:
            await loop.gather([task(k) for k in range(64)])  # warm up
        a: list[float] = []
        b: list[float] = []
        for i in range(p.pairs):
            a_first = i % 2 == 0
            if a_first:
                a.append(await rate(ours))
            if t.has_host_callback:
                b.append(await rate(theirs))
            if not a_first:
                a.append(await rate(ours))
        return a, b

    a, b = loop.run(main)
    out: dict[str, Any] = {"ops_per_s": statistics.median(a), "ops_per_s_rounds": a}
    if b:
        out["host_callback_ops_per_s"] = statistics.median(b)
        out["over_host_callback"] = statistics.median([x / y for x, y in zip(a, b, strict=True)])
    return out


def ticker(loop: Loop, t: Any, p: Params) -> dict[str, float]:
    """A 1 ms ticker's lag while ``ticker_tasks`` tasks keep awaiting for
    ``ticker_s``; ticks begun in the first tenth of the time (the start burst)
    are left out of ``steady_p99_ms``."""

    async def main() -> dict[str, float]:
        stop = False
        ops = 0
        lags: list[float] = []
        steady: list[float] = []

        async def worker(k: int) -> None:
            nonlocal ops
            k %= p.streams
            while not stop:
                await t.launch(k)
                ops += 1

        async def tick(start: float) -> None:
            nonlocal stop
            end = start + p.ticker_s
            while True:
                t0 = time.perf_counter()
                if t0 >= end:
                    break
                await loop.sleep(0.001)
                lag = time.perf_counter() - t0 - 0.001
                lags.append(lag)
                if t0 - start >= p.ticker_s / 10:
                    steady.append(lag)
            stop = True

        t0 = time.perf_counter()
        await loop.gather([tick(t0)] + [worker(k) for k in range(p.ticker_tasks)])
        dt = time.perf_counter() - t0
        return {
            "lag_p50_ms": percentile(lags, 50) * 1e3,
            "lag_p99_ms": percentile(lags, 99) * 1e3,
            "steady_lag_p99_ms": percentile(steady, 99) * 1e3,
            "ticks": len(lags),
            "ops_per_s": ops / dt,
            "seconds": dt,
        }

    return loop.run(main)  # type: ignore[no-any-return]


def idle(loop: Loop, t: Any, p: Params) -> dict[str, Any]:
    """Process CPU time over wall time while one task awaits an operation that
    runs ``idle_ms`` (the median of ``idle_waits`` waits)."""

    async def main() -> list[tuple[float, float]]:
        await t.launch()
        out = []
        for _ in range(p.idle_waits):
            ev = t.long(p.idle_ms)
            c0, m0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
            await ev
            w = time.perf_counter() - w0
            out.append((time.process_time() - c0, time.thread_time() - m0, w))
        return out

    samples = loop.run(main)
    fractions = [c / w for c, _, w in samples]
    return {
        "cpu_fraction_of_one_core": statistics.median(fractions),
        "cpu_fraction_max": max(fractions),
        # the loop's own thread alone (the rest: the pool, the watcher, the OS's)
        "loop_thread_cpu_fraction": statistics.median(m / w for _, m, w in samples),
        "wall_ms": statistics.median(w for _, _, w in samples) * 1e3,
        "op_ms": p.idle_ms,
    }


CASES: dict[str, Callable[[Loop, Any, Params], dict[str, Any]]] = {
    "latency": latency,
    "throughput": throughput,
    "ticker": ticker,
    "idle": idle,
}


def section(
    target: str,
    quick: bool,
    loops: tuple[str, ...] = LOOPS,
    ctx: ag.DeviceContext | None = None,
) -> dict[str, Any]:
    """Every case on every loop for one target: ``{loop}_{case}_{metric}`` figures
    (a loop that cannot run gives ``{loop}_unavailable``). ``ctx``: the CUDA
    context to use (default: one of its own)."""
    p = Params(quick)
    t = make_target(target, p.streams, ctx)
    out: dict[str, Any] = {"target": target, "quick": quick}
    try:
        for name in loops:
            try:
                loop = Loop(name)
            except Unavailable as e:
                out[f"{name}_unavailable"] = str(e)
                continue
            for case, fn in CASES.items():
                for key, value in fn(loop, t, p).items():
                    out[f"{name}_{case}_{key}"] = value
    finally:
        t.close()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", choices=TARGETS, default="cpu")
    ap.add_argument("--loops", default=",".join(LOOPS), help="comma-separated, of " + str(LOOPS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    res = section(a.target, a.quick, tuple(a.loops.split(",")))
    text = json.dumps(res, indent=2)
    if a.json:
        Path(a.json).write_text(text)
    print(text)
    return res


if __name__ == "__main__":
    main()
