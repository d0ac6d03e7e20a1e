"""Soak: many awaited operations from many concurrent tasks, with random
cancellations; every result checked; memory, threads and events must stay flat.

    python benchmarks/soak.py --ops N --tasks T --streams S [--device cpu|cuda]
                              [--cancel-rate 0.01] [--seed 0] [--json OUT]

``T`` asyncio tasks share one context with ``S`` streams and together perform
``N`` awaited operations, each task picking at random, group after group:

* ``copy``: a small random array to a new device buffer and back (H2D, D2H);
* ``pinned``: the same through pinned host buffers (the host-buffer pool);
* ``kernel``: add-one on a new device buffer (one ``Kernel`` with a CUDA source
  and a NumPy body, so the same program runs on either device), then back;
* ``cpu``: a CPU function on the stream, its return value checked;
* ``cross``: data written on one stream, read on another after
  ``enqueue_wait_for`` (the cross-stream copy is also ordered on its own).

Every await counts as one operation. With probability ``--cancel-rate`` an
await is cancelled mid-flight (its task cancelled after it has suspended, or an
``asyncio.wait_for`` with a tiny timeout); the operation must still complete,
and the group awaits it again and checks its data.

Every 10% of the operations (and once at the end, after the tasks are done)
the run samples: resident memory (``/proc/self/statm``), OS and Python thread
counts, live ``DeviceEvent`` objects, and on CUDA the pinned pool's cached bytes,
device memory in use and the events in flight on the streams. A metric is
*flat* when its final sample is at most 1.2 times its 10% sample plus a small
absolute slack (``SLACK``). The run passes with no error, every result checked
and every metric flat; the exit status says so (0 pass, 1 fail).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncgpu as ag
from asyncgpu import DeviceContext, DeviceEvent, Kernel, ThreadBlock


def _add_one_cpu(b: ThreadBlock, x: np.ndarray, n: np.int32) -> None:
    i = b.global_idx.x
    i = i[i < n]
    x[i] += 1


ADD_ONE = Kernel(
    "soak_add_one",
    cuda=r"""
extern "C" __global__ void soak_add_one(int* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1;
}
""",
    cpu=_add_one_cpu,
)

KINDS = ("copy", "pinned", "kernel", "cpu", "cross")
#: Awaited operations per group of each kind.
COST = {"copy": 2, "pinned": 2, "kernel": 3, "cpu": 1, "cross": 3}
BLOCK = 256
MIB = 1 << 20

#: Absolute slack of the flatness test, per metric (on top of 1.2 x the 10% sample).
SLACK = {
    "rss_bytes": 32 * MIB,
    "os_threads": 2,
    "py_threads": 2,
    "live_events": 256,  # plus 4 per task: see _slack
    "inflight_events": 64,  # plus 4 per task, and each stream's unmarked run
    "pinned_cached_bytes": 16 * MIB,
    "device_used_bytes": 64 * MIB,
}


def _slack(metric: str, tasks: int, streams: int) -> float:
    s = SLACK[metric]
    if metric == "live_events":
        s += 4 * tasks
    if metric == "inflight_events":
        s += 4 * tasks + 32 * streams
    return s


# -- sampling -------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _os_threads() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return threading.active_count()


def _live_events() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is DeviceEvent)


def sample(ctx: DeviceContext, streams: int, progress: float, t0: float) -> dict[str, Any]:
    s: dict[str, Any] = {
        "progress": round(progress, 3),
        "t_s": round(time.perf_counter() - t0, 3),
        "rss_bytes": _rss_bytes(),
        "os_threads": _os_threads(),
        "py_threads": threading.active_count(),
        "live_events": _live_events(),
    }
    if ctx.api() == "cuda":
        from asyncgpu._devices.cuda import memory as _memory

        inflight = [len(ctx.select_stream(i)._impl._inflight) for i in range(streams)]
        free, total = ctx.get_memory_info()
        s["inflight_events"] = sum(inflight)
        s["inflight_per_stream"] = inflight
        s["pinned_cached_bytes"] = _memory._pinned.cached_bytes()
        s["device_used_bytes"] = total - free
    return s


# -- the work -----------------------------------------------------------------------------


class Soak:
    def __init__(
        self,
        ctx: DeviceContext,
        ops: int,
        tasks: int,
        streams: int,
        cancel_rate: float,
        seed: int,
    ) -> None:
        self.ctx = ctx
        self.ops = ops
        self.tasks = tasks
        self.streams = streams
        self.cancel_rate = cancel_rate
        self.seed = seed
        self.views = [ctx.select_stream(i) for i in range(streams)]
        self.fn = ctx.compile_function(ADD_ONE)
        self.left = ops  # operations not yet claimed by a task
        self.done = 0  # awaited operations finished
        self.groups = dict.fromkeys(KINDS, 0)
        self.checked = 0  # groups whose results were verified
        self.cancelled = 0
        self.errors: list[str] = []
        self.samples: list[dict[str, Any]] = []
        self.next_sample = 1
        self.t0 = time.perf_counter()

    def claim(self, rnd: random.Random) -> str | None:
        if self.left <= 0:
            return None
        kind = rnd.choice(KINDS)
        if COST[kind] > self.left:
            kind = "cpu"
        self.left -= COST[kind]
        return kind

    async def wait(self, ev: DeviceEvent, rnd: random.Random) -> Any:
        """Await ``ev``; now and then cancel that await mid-flight first. Either way
        the operation completes and its value is returned."""
        if rnd.random() < self.cancel_rate:
            if rnd.random() < 0.5:
                task = asyncio.ensure_future(_await(ev))
                await asyncio.sleep(0)  # the task starts and suspends in its await
                if not task.done():
                    task.cancel()
                    self.cancelled += 1
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            else:
                try:
                    await asyncio.wait_for(_await(ev), 1e-6)
                except (asyncio.TimeoutError, TimeoutError):
                    self.cancelled += 1
        value = await ev
        self.done += 1
        if self.done * 10 >= self.next_sample * self.ops and self.next_sample <= 10:
            self.next_sample += 1
            self.samples.append(sample(self.ctx, self.streams, self.done / self.ops, self.t0))
            print(
                f"  {self.done} ops  {time.perf_counter() - self.t0:.1f} s  "
                f"errors {len(self.errors)}",
                flush=True,
            )
        return value

    async def group(self, kind: str, rnd: random.Random, nrng: np.random.Generator) -> None:
        i = rnd.randrange(self.streams)
        view = self.views[i]
        n = rnd.randrange(16, 1024)
        data = nrng.integers(-(2**30), 2**30, n, dtype=np.int32)
        out = np.empty(n, np.int32)
        w = self.wait
        if kind == "copy":
            buf = view.enqueue_create_buffer(np.int32, n)
            await w(view.enqueue_copy(buf, data), rnd)
            await w(view.enqueue_copy(out, buf), rnd)
            want = data
        elif kind == "pinned":
            h_in = view.enqueue_create_host_buffer(np.int32, n)
            h_out = view.enqueue_create_host_buffer(np.int32, n)
            h_in.as_numpy()[:] = data
            buf = view.enqueue_create_buffer(np.int32, n)
            await w(view.enqueue_copy(buf, h_in), rnd)
            await w(view.enqueue_copy(h_out, buf), rnd)
            out = h_out.as_numpy().copy()
            want = data
        elif kind == "kernel":
            buf = view.enqueue_create_buffer(np.int32, n)
            await w(view.enqueue_copy(buf, data), rnd)
            grid = (n + BLOCK - 1) // BLOCK
            await w(
                view.enqueue_function(self.fn, buf, np.int32(n), grid_dim=grid, block_dim=BLOCK),
                rnd,
            )
            await w(view.enqueue_copy(out, buf), rnd)
            want = data + 1
        elif kind == "cpu":
            x = rnd.randrange(1 << 30)
            got = await w(view.enqueue_cpu_function(_triple_plus_one, x), rnd)
            if got != 3 * x + 1:
                raise AssertionError(f"cpu function returned {got}, want {3 * x + 1}")
            self.checked += 1
            return
        else:  # cross
            j = (i + 1 + rnd.randrange(self.streams - 1)) % self.streams if self.streams > 1 else i
            other = self.views[j]
            buf = view.enqueue_create_buffer(np.int32, n)
            await w(view.enqueue_copy(buf, data), rnd)
            await w(other.enqueue_wait_for(view), rnd)
            await w(other.enqueue_copy(out, buf), rnd)
            want = data
        if not np.array_equal(out, want):
            bad = int(np.count_nonzero(out != want))
            raise AssertionError(f"{kind}: {bad} of {n} elements wrong")
        self.checked += 1

    async def worker(self, i: int) -> None:
        rnd = random.Random(self.seed * 1_000_003 + i)
        nrng = np.random.default_rng([self.seed, i])
        while (kind := self.claim(rnd)) is not None:
            self.groups[kind] += 1
            try:
                await self.group(kind, rnd, nrng)
            except Exception as e:  # counted and reported; the soak goes on
                if len(self.errors) < 20:
                    self.errors.append(f"{kind}: {type(e).__name__}: {e}")
                else:
                    self.errors.append("")

    async def run(self) -> None:
        await asyncio.gather(*(self.worker(i) for i in range(self.tasks)))
        for v in self.views:  # every stream drained
            await v
        gc.collect()
        end = sample(self.ctx, self.streams, 1.0, self.t0)
        end["progress"] = "end"
        self.samples.append(end)


async def _await(ev: DeviceEvent) -> Any:
    return await ev


def _triple_plus_one(x: int) -> int:
    return 3 * x + 1


# -- the run --------------------------------------------------------------------------------


def flatness(samples: list[dict[str, Any]], tasks: int, streams: int) -> dict[str, dict[str, Any]]:
    """Per metric: the 10% and final samples, the peak in between, the bound and
    whether the final sample is within it."""
    if len(samples) < 2:
        return {}
    first, last = samples[0], samples[-1]
    out: dict[str, dict[str, Any]] = {}
    for metric in SLACK:
        if metric not in first:
            continue
        bound = 1.2 * first[metric] + _slack(metric, tasks, streams)
        out[metric] = {
            "at_10pct": first[metric],
            "final": last[metric],
            "peak": max(s[metric] for s in samples),
            "bound": int(bound),
            "flat": last[metric] <= bound,
        }
    return out


def run(
    ops: int = 20_000,
    tasks: int = 100,
    streams: int = 8,
    device: str = "cpu",
    cancel_rate: float = 0.01,
    seed: int = 0,
) -> dict[str, Any]:
    """Run one soak in this process (its own event loop); the result record."""
    if streams < 1 or tasks < 1 or ops < 10:
        raise ValueError("need at least 1 stream, 1 task and 10 operations")
    with DeviceContext(api=device, num_streams=max(streams, 1)) as ctx:
        soak = Soak(ctx, ops, tasks, streams, cancel_rate, seed)
        t0 = time.perf_counter()
        asyncio.run(soak.run())
        elapsed = time.perf_counter() - t0
        flat = flatness(soak.samples, tasks, streams)
        n_errors = len(soak.errors)
        record = {
            "benchmark": "soak",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": {"api": ctx.api(), "name": ctx.name(), "api_version": ctx.get_api_version()},
            "params": {
                "ops": ops,
                "tasks": tasks,
                "streams": streams,
                "cancel_rate": cancel_rate,
                "seed": seed,
            },
            "awaited_ops": soak.done,
            "elapsed_s": round(elapsed, 3),
            "ops_per_s": round(soak.done / elapsed, 1),
            "groups": soak.groups,
            "groups_checked": soak.checked,
            "cancelled_awaits": soak.cancelled,
            "errors": n_errors,
            "error_examples": [e for e in soak.errors if e][:20],
            "flat": flat,
            "all_flat": bool(flat) and all(m["flat"] for m in flat.values()),
            "samples": soak.samples,
            "versions": {
                "asyncgpu": ag.__version__,
                "numpy": np.__version__,
                "python": platform.python_version(),
            },
            "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        }
    record["passed"] = (
        n_errors == 0
        and soak.done == ops
        and soak.checked == sum(soak.groups.values())
        and record["all_flat"]
    )
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=20_000, help="awaited operations in all")
    p.add_argument("--tasks", type=int, default=100, help="concurrent asyncio tasks")
    p.add_argument("--streams", type=int, default=8, help="streams of the context")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--cancel-rate", type=float, default=0.01, help="awaits cancelled mid-flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the record here")
    a = p.parse_args(argv)
    rec = run(a.ops, a.tasks, a.streams, a.device, a.cancel_rate, a.seed)
    print(
        f"soak {rec['device']['api']} ({rec['device']['name']}): {rec['awaited_ops']} awaited ops "
        f"from {a.tasks} tasks on {a.streams} streams in {rec['elapsed_s']} s "
        f"({rec['ops_per_s']:.0f} ops/s); {rec['groups_checked']} groups checked, "
        f"{rec['cancelled_awaits']} awaits cancelled, {rec['errors']} errors"
    )
    for metric, m in rec["flat"].items():
        print(
            f"  {metric:20} 10%: {m['at_10pct']:>12}  final: {m['final']:>12}  "
            f"peak: {m['peak']:>12}  bound: {m['bound']:>12}  {'flat' if m['flat'] else 'GREW'}"
        )
    for e in rec["error_examples"]:
        print("  error:", e)
    print("PASS" if rec["passed"] else "FAIL")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rec, indent=2) + "\n")
    return 0 if rec["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
