"""Where a loop's 1,000 x 10 awaits spend their time: ``bench_loops.py``'s
throughput case (ours only) on each loop, counted and profiled.

For each loop: ops/s of a few plain rounds; then one round with the reactor's
steps counted (polls, polls that moved nothing, batches woken and their sizes,
parks, lone awaiters' spins and how many ended in the spin, the garbage
collector's passes and pauses); then one round
under ``cProfile`` (its ops/s are the profiler's, not the loop's), whose top
functions by own time are printed.

    python benchmarks/diagnostics/profile_loop_throughput.py --target cuda \\
        [--loops asyncio,uvloop,trio] [--top 25] [--json OUT.json]

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
        self.undo: list[Any] = []

    def wrap(self, cls: Any, name: str, body: Any) -> None:
        orig = getattr(cls, name)
        self.undo.append((cls, name, orig))
        setattr(cls, name, body(orig))

    def __enter__(self) -> _Counts:
        c, batches = self.c, self.batches

        def poll(orig: Any) -> Any:
            def f(self: Any) -> bool:
                moved = orig(self)
                c["polls"] += 1
                c["polls_moved" if moved else "polls_idle"] += 1
                return moved  # type: ignore[no-any-return]

            return f

        def wake(orig: Any) -> Any:
            def f(self: Any, wakers: list[Any]) -> None:
                batches.append(len(wakers))
                orig(self, wakers)

            return f

        def park(orig: Any) -> Any:
            async def f(self: Any, seconds: float) -> None:
                c["parks"] += 1
                await orig(self, seconds)

            return f

        for cls in (engine._Reactor, engine._TrioReactor):
            self.wrap(cls, "_wake", wake)
            self.wrap(cls, "_park", park)
        self.wrap(engine._Poller, "_poll_once", poll)
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
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", choices=B.TARGETS, default="cuda")
    ap.add_argument("--loops", default="asyncio,uvloop,trio")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    p = B.Params(False)
    t = B.make_target(a.target, p.streams)
    out: dict[str, Any] = {"target": a.target}
    try:
        for name in a.loops.split(","):
            try:
                loop = B.Loop(name)
            except B.Unavailable as e:
                out[name] = {"unavailable": str(e)}
                continue
            rates = [_rate(loop, t, p) for _ in range(a.rounds)]
            with _Counts() as counts, GcRecorder() as gcs:
                counted = _rate(loop, t, p)
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
                "counts": counts.summary((p.tasks + 64) * p.per_task),
                "gc": gcs.metrics(),
                "profile": text.getvalue(),
                # (a thread that wants the GIL makes every release of it, such as a
                # launch's driver call, cost the loop's thread a switch)
                "threads": sorted(th.name for th in threading.enumerate()),
            }
            out[name] = row
            print(f"== {name}: {row['ops_per_s']:.0f} ops/s {row['counts']} {row['gc']}")
            print(f"   threads: {row['threads']}")
            print(row["profile"])
    finally:
        t.close()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
