"""Where a loop's 1,000 x 10 awaits spend their time: ``bench_loops.py``'s
throughput case (ours only) on each loop, counted and profiled.

For each loop: ops/s of a few plain rounds; then one round with the reactor's
steps counted (polls, polls that moved nothing, batches woken and their sizes,
parks, reactor starts, lone awaiters' spins and how many ended in the spin, the
time per await in the reactor's polls and wake-ups; under trio, trio's own
count of task steps and scheduler passes per await; the garbage collector's
passes and pauses); then one round
under ``cProfile`` (its ops/s are the profiler's, not the loop's), whose top
functions by own time are printed.

    python benchmarks/diagnostics/profile_loop_throughput.py --target cuda \\
        [--loops asyncio,uvloop,trio] [--top 25] [--json OUT.json]

``--budget-sweep 0.2,0.4,0.8`` also compares budgets per loop iteration (the
reactor's ``ITERATION_S``, which sizes its batches of woken awaits) on each
loop: awaits per second against a 1 ms ticker's lag.

The ``emulated`` target can be made more like a GPU: ``--stand-in-latency-us``
(an operation ends no sooner than this after its submission, so every await
waits), ``--stand-in-launch-us`` (host time per launch), ``--stand-in-op-us``.

A diagnostic (the device machine has no sampling profiler); figures of the
``emulated`` and ``cpu`` targets are CPU figures of the machine that ran them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import threading
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import bench_loops as B
from _harness import GcRecorder

from asyncgpu._core import engine


def _rate(loop: B.Loop, t: Any, p: B.Params) -> float:
    async def ours(k: int) -> None:
        k %= p.streams
        for _ in range(p.per_task):
            await t.launch(k)

    async def main() -> float:
        await loop.gather([ours(k) for k in range(64)])  # warm up
        t0 = time.perf_counter()
        await loop.gather([ours(k) for k in range(p.tasks)])
        return p.tasks * p.per_task / (time.perf_counter() - t0)

    return loop.run(main)  # type: ignore[no-any-return]


class _Counts:
    """The reactor's steps, counted by wrapping its methods (this process only)."""

    def __init__(self) -> None:
        self.c: Counter[str] = Counter()
        self.batches: list[int] = []
        self.spent: Counter[str] = Counter()  # seconds in the reactor's polls and wakes
        self.undo: list[Any] = []

    def wrap(self, cls: Any, name: str, body: Any) -> None:
        orig = getattr(cls, name)
        self.undo.append((cls, name, orig))
        setattr(cls, name, body(orig))

    def __enter__(self) -> _Counts:
        c, batches = self.c, self.batches

        clock = time.perf_counter
        spent = self.spent

        def poll(orig: Any) -> Any:
            def f(self: Any) -> bool:
                t0 = clock()
                moved = orig(self)
                spent["poll_s"] += clock() - t0
                c["polls"] += 1
                c["polls_moved" if moved else "polls_idle"] += 1
                return moved  # type: ignore[no-any-return]

            return f

        def wake(orig: Any) -> Any:
            def f(self: Any, wakers: list[Any]) -> None:
                batches.append(len(wakers))
                t0 = clock()
                orig(self, wakers)
                spent["wake_s"] += clock() - t0

            return f

        def park(orig: Any) -> Any:
            async def f(self: Any, seconds: float) -> None:
                c["parks"] += 1
                await orig(self, seconds)

            return f

        def started(orig: Any) -> Any:
            async def f(self: Any) -> None:
                c["reactor_starts"] += 1
                await orig(self)

            return f

        for cls in (engine._Reactor, engine._TrioReactor):
            self.wrap(cls, "_wake", wake)
            self.wrap(cls, "_park", park)
        self.wrap(engine._Poller, "_poll_once", poll)
        self.wrap(engine._Poller, "_poll_loop", started)
        spin = engine._spin

        def counted_spin(stream: Any, ev: Any, reactor: Any) -> bool:
            done = spin(stream, ev, reactor)
            c["spins"] += 1
            c["spins_done" if done else "spins_gave_up"] += 1
            return done

        self.undo.append((engine, "_spin", spin))
        engine._spin = counted_spin
        return self

    def __exit__(self, *exc: Any) -> None:
        for obj, name, orig in reversed(self.undo):
            setattr(obj, name, orig)

    def summary(self, ops: int) -> dict[str, Any]:
        b = self.batches
        return {
            **dict(self.c),
            "batches": len(b),
            "batch_mean": statistics.fmean(b) if b else 0.0,
            "batch_median": statistics.median(b) if b else 0.0,
            "polls_per_op": self.c["polls"] / ops,
            # the reactor's own cost per await: its polls, and handing woken tasks
            # to the loop (asyncio: a callback; trio: rescheduling each task)
            "poll_us_per_op": self.spent["poll_s"] / ops * 1e6,
            "wake_us_per_op": self.spent["wake_s"] / ops * 1e6,
        }


class _TrioSteps:
    """A trio instrument: the run's task steps (per task name) and its passes
    through the scheduler (one I/O check each, then a batch of runnable tasks)."""

    def __init__(self) -> None:
        self.steps: Counter[str] = Counter()
        self.passes = 0

    def before_task_step(self, task: Any) -> None:
        self.steps[task.name] += 1

    def after_io_wait(self, timeout: float) -> None:
        self.passes += 1

    def summary(self, ops: int) -> dict[str, Any]:
        total = sum(self.steps.values())
        reactor = sum(v for k, v in self.steps.items() if "asyncgpu" in k)
        return {
            "task_steps_per_op": total / ops,
            "reactor_steps_per_op": reactor / ops,
            "scheduler_passes_per_op": self.passes / ops,
        }


def _budget_sweep(loop: B.Loop, t: Any, p: B.Params, budgets_ms: list[float]) -> dict[str, Any]:
    """Each of ``budgets_ms`` as the reactor's budget per loop iteration
    (``engine.ITERATION_S``; it sizes the batches of woken awaits): the loop's
    1,000 x 10 awaits per second, and a 1 ms ticker's lag during 1 s of 1,000
    tasks awaiting. The settings take turns, three rounds; each figure is the
    median of its setting's rounds."""
    short = B.Params(False)
    short.ticker_s = 1.0
    saved = engine.ITERATION_S
    runs: dict[float, list[tuple[float, dict[str, float]]]] = {ms: [] for ms in budgets_ms}
    try:
        for _ in range(3):
            for ms in budgets_ms:
                engine.ITERATION_S = ms * 1e-3
                runs[ms].append((_rate(loop, t, p), B.ticker(loop, t, short)))
    finally:
        engine.ITERATION_S = saved
    out: dict[str, Any] = {"default_ms": saved * 1e3}
    for ms, got in runs.items():
        out[f"{ms:g}"] = {
            "ops_per_s": statistics.median(r for r, _ in got),
            "ops_per_s_rounds": [r for r, _ in got],
            "ticker_steady_lag_p99_ms": statistics.median(k["steady_lag_p99_ms"] for _, k in got),
            "ticker_lag_p99_ms_worst_round": max(k["lag_p99_ms"] for _, k in got),
            "ticker_ops_per_s": statistics.median(k["ops_per_s"] for _, k in got),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", choices=B.TARGETS, default="cuda")
    ap.add_argument("--loops", default="asyncio,uvloop,trio")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--stand-in-op-us", type=float, default=8.0, help="emulated: an operation's time"
    )
    ap.add_argument(
        "--stand-in-latency-us",
        type=float,
        default=0.0,
        help="emulated: the least time from an operation's submission to its end",
    )
    ap.add_argument(
        "--stand-in-launch-us", type=float, default=0.0, help="emulated: a launch's host time"
    )
    ap.add_argument(
        "--budget-sweep",
        default="",
        help="comma-separated budgets per loop iteration in ms (engine.ITERATION_S) to "
        "compare on each loop: awaits per second and a ticker's lag at each",
    )
    a = ap.parse_args()
    p = B.Params(False)
    budgets = [float(x) for x in a.budget_sweep.split(",") if x]
    if a.target == "emulated":
        t: Any = B.EmulatedTarget(
            p.streams,
            a.stand_in_op_us * 1e-6,
            a.stand_in_latency_us * 1e-6,
            a.stand_in_launch_us * 1e-6,
        )
    else:
        t = B.make_target(a.target, p.streams)
    out: dict[str, Any] = {"target": a.target}
    if a.target == "emulated":
        out["stand_in_us"] = {
            "op": a.stand_in_op_us,
            "latency": a.stand_in_latency_us,
            "launch": a.stand_in_launch_us,
        }
    try:
        for name in a.loops.split(","):
            try:
                loop = B.Loop(name)
            except B.Unavailable as e:
                out[name] = {"unavailable": str(e)}
                continue
            rates = [_rate(loop, t, p) for _ in range(a.rounds)]
            steps = None
            if name == "trio":  # (trio's own count of task steps and scheduler passes)
                steps = _TrioSteps()
                plain = loop._run
                loop._run = partial(loop.trio.run, instruments=[steps])
            try:
                with _Counts() as counts, GcRecorder() as gcs:
                    counted = _rate(loop, t, p)
            finally:
                if steps is not None:
                    loop._run = plain
            prof = cProfile.Profile()
            prof.enable()
            profiled = _rate(loop, t, p)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(a.top)
            row = {
                "ops_per_s": statistics.median(rates),
                "ops_per_s_rounds": rates,
                "ops_per_s_counted": counted,
                "ops_per_s_profiled": profiled,
                "counts": {
                    **counts.summary((p.tasks + 64) * p.per_task),
                    **(steps.summary((p.tasks + 64) * p.per_task) if steps else {}),
                },
                "gc": gcs.metrics(),
                "profile": text.getvalue(),
                # (a thread that wants the GIL makes every release of it, such as a
                # launch's driver call, cost the loop's thread a switch)
                "threads": sorted(th.name for th in threading.enumerate()),
            }
            if budgets:
                row["budget_sweep"] = _budget_sweep(loop, t, p, budgets)
            out[name] = row
            print(f"== {name}: {row['ops_per_s']:.0f} ops/s {row['counts']} {row['gc']}")
            print(f"   threads: {row['threads']}")
            if budgets:
                print(f"   budget sweep: {row['budget_sweep']}")
            print(row["profile"])
    finally:
        t.close()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
