"""A three-stage pipeline on Ray: CPU preprocessing, a GPU stage, CPU postprocessing.

Each request is one batch of numbers:

    Preprocess (CPU)  ->  Transform (GPUWorker: upload, kernel, download)  ->  Summarize (CPU)

Each stage has ``--actors`` actors; request ``i`` goes through actor ``i % N`` of
each stage. The stages hand each other ``ObjectRef``s, so a batch moves from
actor to actor through Ray's object store, never through the driver. A load
generator keeps ``--inflight`` requests in the pipeline, then every result is
checked against NumPy, and the throughput and latencies are printed.

The GPU stage asks Ray for one GPU per actor when the cluster has enough
(``num_gpus=1``: Ray sets each actor's ``CUDA_VISIBLE_DEVICES``, and the
worker's context opens on that GPU), and runs on the CPU device otherwise, as
on a laptop. ``--direct`` runs the same stage classes without Ray, in this
process (how the GPU side is exercised on a machine without Ray).

    python examples/ray_pipeline.py                          # local Ray, 2 actors a stage
    python examples/ray_pipeline.py --actors 4 --requests 400
    python examples/ray_pipeline.py --direct                 # no Ray: the default device
    python examples/ray_pipeline.py --address auto           # an existing cluster
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import numpy as np

from asyncgpu import Kernel, ThreadBlock
from asyncgpu.ray import GPUWorker

# pipeline.py's kernel, written out again: the script stands alone, and Ray's worker
# processes get this module by value (a neighbouring example is not on their path).
POLY_CUDA = r"""
extern "C" __global__ void poly(const float* x, float* y, int n,
                                float c0, float c1, float c2, float c3) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        y[i] = ((c3 * v + c2) * v + c1) * v + c0;
    }
}
"""


def poly_cpu(b: ThreadBlock, x, y, n, c0, c1, c2, c3) -> None:
    i = b.global_idx.x
    i = i[i < n]
    v = x[i]
    y[i] = ((c3 * v + c2) * v + c1) * v + c0


POLY = Kernel("poly", cuda=POLY_CUDA, cpu=poly_cpu)
COEFFS = tuple(np.float32(c) for c in (0.25, -1.0, 0.5, 0.125))
BINS = np.linspace(-4.0, 4.0, 33)
BLOCK = 256
#: How long the actors may take to start (a hung start fails instead of waiting).
STARTUP_TIMEOUT_S = 120


def make_batch(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


def normalize(x: np.ndarray) -> np.ndarray:
    return ((x - x.mean()) / x.std()).astype(np.float32)


def poly_numpy(x: np.ndarray) -> np.ndarray:
    c0, c1, c2, c3 = COEFFS
    return ((c3 * x + c2) * x + c1) * x + c0


def summarize(y: np.ndarray) -> dict[str, Any]:
    counts, _ = np.histogram(y, bins=BINS)
    return {"counts": counts, "mean": float(y.mean())}


class Preprocess:
    """CPU stage: makes request ``seed``'s batch and normalizes it."""

    async def run(self, seed: int, size: int) -> np.ndarray:
        return normalize(make_batch(seed, size))


class Transform(GPUWorker):
    """GPU stage: the polynomial on the worker's device (the GPU Ray assigned,
    or the CPU device). The batch arrives from the object store and leaves
    through it as a NumPy array (the staged path; docs/ray.md)."""

    async def run(self, x: np.ndarray) -> np.ndarray:
        ctx = self.ctx
        fn = ctx.compile_function(POLY)  # compiled once per context, then cached
        xd = await self.upload(x)
        n = len(xd)
        yd = ctx.enqueue_create_buffer(np.float32, n)
        ctx.enqueue_function(
            fn, xd, yd, np.int32(n), *COEFFS, grid_dim=(n + BLOCK - 1) // BLOCK, block_dim=BLOCK
        )
        return await self.download(yd)


class Summarize:
    """CPU stage: a histogram and the mean of the transformed batch."""

    async def run(self, y: np.ndarray) -> dict[str, Any]:
        return summarize(y)


def check(seed: int, size: int, got: dict[str, Any]) -> None:
    want = summarize(poly_numpy(normalize(make_batch(seed, size))))
    np.testing.assert_array_equal(got["counts"], want["counts"])
    assert abs(got["mean"] - want["mean"]) <= 1e-4 * max(1.0, abs(want["mean"])), (got, want)


def report(
    name: str, actors: int, device: str, lat: list[float], wall: float, n: int
) -> dict[str, Any]:
    lat_ms = np.array(lat) * 1e3
    return {
        "mode": name,
        "actors": actors,
        "device": device,
        "requests": n,
        "wall_s": wall,
        "requests_per_s": n / wall,
        "latency_p50_ms": float(np.percentile(lat_ms, 50)),
        "latency_p99_ms": float(np.percentile(lat_ms, 99)),
    }


def run_on_ray(actors: int, requests: int, size: int, inflight: int) -> dict[str, Any]:
    """The pipeline on the Ray cluster this process is connected to."""
    import ray

    # One GPU per actor where the cluster has enough. (Naming num_gpus at all,
    # even 0, makes Ray hold a CPU for the actor's whole life as well, which N
    # actors on a small machine would not get, so it is named only when asked.)
    gpu_opts: dict[str, Any] = {"max_concurrency": inflight}
    if ray.cluster_resources().get("GPU", 0) >= actors:
        gpu_opts["num_gpus"] = 1
    pre = [ray.remote(Preprocess).remote() for _ in range(actors)]
    gpu = [ray.remote(**gpu_opts)(Transform).remote() for _ in range(actors)]
    post = [ray.remote(Summarize).remote() for _ in range(actors)]
    device = "cpu"
    try:
        # One request through every actor first: actors started, kernels compiled.
        warm = [
            post[i].run.remote(gpu[i].run.remote(pre[i].run.remote(requests + i, size)))
            for i in range(actors)
        ]
        ray.get(warm, timeout=STARTUP_TIMEOUT_S)
        device = ray.get(gpu[0].device.remote())[0]

        started: dict[Any, tuple[int, float]] = {}
        results: dict[int, dict[str, Any]] = {}
        lat: list[float] = []
        nxt = 0
        t0 = time.perf_counter()
        while len(results) < requests:
            while nxt < requests and len(started) < inflight:
                i = nxt % actors
                ref = post[i].run.remote(gpu[i].run.remote(pre[i].run.remote(nxt, size)))
                started[ref] = (nxt, time.perf_counter())
                nxt += 1
            done, _ = ray.wait(list(started), num_returns=1)
            for ref in done:
                seed, t = started.pop(ref)
                results[seed] = ray.get(ref)
                lat.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
    finally:
        for a in pre + gpu + post:
            ray.kill(a)
    for seed, got in results.items():
        check(seed, size, got)
    return report("ray", actors, device, lat, wall, requests)


async def run_direct(actors: int, requests: int, size: int, inflight: int) -> dict[str, Any]:
    """The same stage classes without Ray: one instance per 'actor' in this
    process, ``inflight`` requests awaiting at once on this loop."""
    pre = [Preprocess() for _ in range(actors)]
    gpu = [Transform() for _ in range(actors)]
    post = [Summarize() for _ in range(actors)]
    sem = asyncio.Semaphore(inflight)
    lat: list[float] = []

    async def one(seed: int) -> dict[str, Any]:
        async with sem:
            t = time.perf_counter()
            i = seed % actors
            out = await post[i].run(await gpu[i].run(await pre[i].run(seed, size)))
            lat.append(time.perf_counter() - t)
            return out

    try:
        await asyncio.gather(*(one(requests + i) for i in range(actors)))  # warm-up
        lat.clear()
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(s) for s in range(requests)))
        wall = time.perf_counter() - t0
        device = gpu[0].device()[0]
    finally:
        for w in gpu:
            w.close()
    for seed, got in enumerate(results):
        check(seed, size, got)
    return report("direct", actors, device, lat, wall, requests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--actors", type=int, default=2, help="actors per stage")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--size", type=int, default=1 << 16, help="elements per batch")
    ap.add_argument("--inflight", type=int, default=8, help="requests kept in the pipeline")
    ap.add_argument("--direct", action="store_true", help="no Ray: the stages in this process")
    ap.add_argument("--address", default=None, help="ray.init's address (default: a local one)")
    ap.add_argument("--num-cpus", type=int, default=2, help="CPUs of a local Ray cluster")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    if args.actors < 1 or args.requests < 1 or args.inflight < 1 or args.size < 1:
        ap.error("--actors, --requests, --inflight and --size must be at least 1")

    if args.direct:
        res = asyncio.run(run_direct(args.actors, args.requests, args.size, args.inflight))
    else:
        import ray

        if args.address is None:
            ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=args.address)
        try:
            res = run_on_ray(args.actors, args.requests, args.size, args.inflight)
        finally:
            ray.shutdown()
    print(
        f"{res['mode']}: {res['actors']} actor(s) a stage, {res['device']} device, "
        f"{res['requests']} requests of {args.size} floats, {args.inflight} in flight: "
        f"{res['requests_per_s']:.1f} requests/s, latency p50 {res['latency_p50_ms']:.2f} ms, "
        f"p99 {res['latency_p99_ms']:.2f} ms"
    )
    print("all results match NumPy: OK")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
