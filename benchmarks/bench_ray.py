"""asyncgpu workers on Ray: the cost of a worker call, and the pipeline's throughput.

**Call overhead.** One caller (the driver) calls an actor and waits for the
result, one call at a time, so each sample is a whole Ray round trip. Each call
sends a float32 array through the object store, the actor scales it with NumPy
(``x * 2``) and returns the result. The baseline is a plain Ray async actor that
does the NumPy work in its coroutine; against it:

* ``worker_inline``: a ``GPUWorker`` subclass doing the same work in its
  coroutine (the base class's own cost: its context opened, nothing awaited);
* ``worker_cpu_function``: the work as a CPU function on the worker's stream,
  awaited on the actor's loop (``await ctx.enqueue_cpu_function(...)``), the
  path a GPU worker takes for host work ordered with its kernels;
* ``worker_staged``: the staged device path of docs/ray.md: ``upload``, a
  kernel computing ``2 * x``, ``download``.

The actors' calls are interleaved in rounds (one call to each, in turn), so
drift on a shared machine falls on every variant alike; the figure is the
median, and the ratio is to the plain actor's median (goal: ``worker_*`` at most
1.1x).

**Pipeline throughput.** ``examples/ray_pipeline.py``'s three stages with 1, 2
and 4 actors a stage: requests per second and latency.

Figures on a machine without a GPU are CPU-device figures of that machine (the
actors' GPU stage runs on the CPU device), never GPU ones::

    python benchmarks/bench_ray.py                        # local cluster, 2 CPUs
    python benchmarks/bench_ray.py --quick --json ray.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import _harness as h  # noqa: E402
import ray  # noqa: E402
import ray.cloudpickle  # noqa: E402
import ray_pipeline  # noqa: E402

from asyncgpu import Kernel, ThreadBlock  # noqa: E402
from asyncgpu.ray import GPUWorker  # noqa: E402


def _twice_cpu(b: ThreadBlock, y, x, n) -> None:
    i = b.global_idx.x
    i = i[i < n]
    y[i] = x[i] * np.float32(2)


TWICE = Kernel(
    "twice",
    cuda=r"""
extern "C" __global__ void twice(float* y, const float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}
""",
    cpu=_twice_cpu,
)


class Plain:
    """The baseline: a plain Ray async actor."""

    async def work(self, x: np.ndarray) -> np.ndarray:
        return x * np.float32(2)


class Inline(GPUWorker):
    async def work(self, x: np.ndarray) -> np.ndarray:
        self.ctx  # noqa: B018 (the worker's context, opened on first use)
        return x * np.float32(2)


class CPUFunction(GPUWorker):
    async def work(self, x: np.ndarray) -> np.ndarray:
        return await self.ctx.enqueue_cpu_function(np.multiply, x, np.float32(2))


class Staged(GPUWorker):
    async def work(self, x: np.ndarray) -> np.ndarray:
        ctx = self.ctx
        fn = ctx.compile_function(TWICE)
        xd = await self.upload(x)
        n = len(xd)
        yd = ctx.enqueue_create_buffer(np.float32, n)
        ctx.enqueue_function(fn, yd, xd, np.int32(n), grid_dim=(n + 255) // 256, block_dim=256)
        return await self.download(yd)


VARIANTS = {
    "plain_actor": Plain,
    "worker_inline": Inline,
    "worker_cpu_function": CPUFunction,
    "worker_staged": Staged,
}


def call_overhead(size: int, rounds: int, warmup: int) -> dict[str, dict[str, Any]]:
    actors = {name: ray.remote(cls).remote() for name, cls in VARIANTS.items()}
    try:
        x = np.arange(size, dtype=np.float32)
        ref = ray.put(x)
        want = 2 * x
        for name, a in actors.items():
            for _ in range(warmup):
                np.testing.assert_array_equal(ray.get(a.work.remote(ref)), want, err_msg=name)
        samples: dict[str, list[int]] = {name: [] for name in actors}
        with h.gc_paused():
            for _ in range(rounds):
                for name, a in actors.items():
                    t = time.perf_counter_ns()
                    ray.get(a.work.remote(ref))
                    samples[name].append(time.perf_counter_ns() - t)
    finally:
        for a in actors.values():
            ray.kill(a)
    base = h.median(samples["plain_actor"])
    out = {}
    for name, s in samples.items():
        stats = h.summarize_ns(s)
        stats["ratio_to_plain"] = h.median(s) / base
        out[name] = stats
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds and requests")
    ap.add_argument("--sizes", default="1024,1048576", help="float32 elements per call")
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rounds, warmup = (100, 10) if args.quick else (400, 20)
    requests = 100 if args.quick else 300
    sizes = [int(s) for s in args.sizes.split(",")]

    started = h.utc_now()
    t0 = time.perf_counter()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    # The example's stage classes travel by value: Ray's workers do not have
    # examples/ on their path.
    ray.cloudpickle.register_pickle_by_value(ray_pipeline)
    results: dict[str, Any] = {}
    try:
        for size in sizes:
            results[f"call_{size}"] = call_overhead(size, rounds, warmup)
        for n in (1, 2, 4):
            results[f"pipeline_{n}_actors"] = ray_pipeline.run_on_ray(
                n, requests, 1 << 16, inflight=8
            )
    finally:
        ray.shutdown()

    env = h.environment_info(probe_gpu=False)
    device = results["pipeline_1_actors"]["device"]
    label = f"{device} device, {env['cpu_count']} CPUs ({env['cpu_model']})"
    print(f"asyncgpu workers on Ray: {label}")
    for size in sizes:
        print(f"\none call, {size} float32 in and out (median of {rounds}, rounds interleaved):")
        for name, st in results[f"call_{size}"].items():
            print(
                f"  {name:<20} median {st['median_us']:8.1f} us  p99 {st['p99_us']:8.1f} us  "
                f"x{st['ratio_to_plain']:.2f} of the plain actor"
            )
    print(f"\npipeline ({requests} requests of 65536 floats, 8 in flight):")
    for n in (1, 2, 4):
        r = results[f"pipeline_{n}_actors"]
        print(
            f"  {n} actor(s) a stage: {r['requests_per_s']:7.1f} requests/s, "
            f"p50 {r['latency_p50_ms']:.1f} ms, p99 {r['latency_p99_ms']:.1f} ms"
        )
    if args.json:
        record = {
            "suite": "ray",
            "started_at": started,
            "total_seconds": round(time.perf_counter() - t0, 3),
            "label": label,
            "environment": env,
            "params": {"rounds": rounds, "sizes": sizes, "requests": requests},
            "results": results,
        }
        h.write_json(args.json, record)


if __name__ == "__main__":
    main()
