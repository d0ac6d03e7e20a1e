"""A multi-stream pipeline: H2D copy, kernel, D2H copy and a CPU stage, overlapped.

A large array is cut into chunks. Each chunk runs four stream-ordered stages on
one stream of the context's pool (chosen with ``select_stream``, round-robin):

    H2D copy  ->  kernel (a cubic polynomial)  ->  D2H copy  ->  CPU stage (histogram)

Chunks on different streams overlap: while one chunk is in its kernel, another
is copying and a third is in its CPU stage. The script runs the same work on one
stream and then on ``--streams`` streams, checks every result against NumPy, and
writes both traces (Chrome/Perfetto JSON) and the timeline of the multi-stream
run (PNG, with matplotlib) into ``--out``.

    python examples/pipeline.py --out /tmp/pipeline            # default device
    ASYNCGPU_API=cpu python examples/pipeline.py --chunks 8    # the CPU device
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np
from _draw import draw  # examples/_draw.py: the timeline through the command line

from asyncgpu import DeviceContext, Kernel, ThreadBlock

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

# What the multi-stream speed-up means on the device the script ran on.
OVERLAP_NOTE = {
    "cpu": (
        "the CPU device runs kernels as Python on a thread pool under the GIL, and its "
        "copies are NumPy copies with no copy engines, so an overlap of about 1.0x is "
        "expected; run on a GPU for the real figure"
    ),
    "cuda": (
        "on a GPU, one chunk's copies, another's kernel and a third's CPU stage run at "
        "the same time; the gain is bounded by the busiest stage (see the time in stages "
        "below) and is small when chunks are small"
    ),
}


def histogram(out) -> np.ndarray:
    """The CPU stage: a histogram of one chunk's result."""
    counts, _ = np.histogram(np.asarray(out), bins=BINS)
    return counts


async def run(ctx: DeviceContext, xs: list[np.ndarray], streams: int, trace_path: Path | None):
    """Run every chunk through the pipeline on ``streams`` streams; return the
    outputs, the histograms, the wall time and the trace."""
    fn = ctx.compile_function(POLY)
    n = xs[0].size
    grid = (n + BLOCK - 1) // BLOCK

    async def chunk(i: int, s: DeviceContext):
        staging = s.enqueue_create_host_buffer(np.float32, n)  # pinned on CUDA
        staging.as_numpy()[:] = xs[i]
        d_in = s.enqueue_create_buffer(np.float32, n)
        d_out = s.enqueue_create_buffer(np.float32, n)
        h_out = s.enqueue_create_host_buffer(np.float32, n)
        s.enqueue_copy(d_in, staging)
        s.enqueue_function(fn, d_in, d_out, np.int32(n), *COEFFS, grid_dim=grid, block_dim=BLOCK)
        s.enqueue_copy(h_out, d_out)
        counts = await s.enqueue_cpu_function(histogram, h_out)  # waits for the D2H only
        return h_out.as_numpy().copy(), counts

    async with ctx.trace(trace_path) as trace:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(chunk(i, ctx.select_stream(i % streams)) for i in range(len(xs)))
        )
        wall = time.perf_counter() - t0
    return results, wall, trace


def verify(xs: list[np.ndarray], results) -> float:
    c0, c1, c2, c3 = COEFFS
    worst = 0.0
    for i, (x, (y, counts)) in enumerate(zip(xs, results, strict=True)):
        want = ((c3 * x + c2) * x + c1) * x + c0
        if not np.allclose(y, want, rtol=1e-5, atol=1e-5):
            raise SystemExit(f"pipeline: chunk {i} differs from NumPy")
        if not np.array_equal(counts, np.histogram(y, bins=BINS)[0]):
            raise SystemExit(f"pipeline: histogram of chunk {i} differs from NumPy")
        worst = max(worst, float(np.max(np.abs(y - want))))
    return worst


def stage_totals(trace) -> dict[str, float]:
    totals: dict[str, float] = {}
    for node in trace.nodes.values():
        if node.start_ns is None or node.end_ns is None:
            continue
        name = {"copy": "copies", "kernel": "kernels", "cpu": "cpu stages"}.get(node.kind)
        if name:
            totals[name] = totals.get(name, 0.0) + (node.end_ns - node.start_ns) / 1e6
    return totals


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".", help="folder for the traces and the PNG")
    p.add_argument("--chunks", type=int, default=12, help="number of chunks")
    p.add_argument("--size", type=int, default=1 << 16, help="float32 elements per chunk")
    p.add_argument("--streams", type=int, default=4, help="streams of the multi-stream run")
    p.add_argument("--device", choices=("cpu", "cuda", "default"), default="default")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    rng = np.random.default_rng(7)
    xs = [rng.uniform(-3.0, 3.0, args.size).astype(np.float32) for _ in range(args.chunks)]
    api = None if args.device == "default" else args.device
    async with DeviceContext(api=api) as ctx:
        streams = max(1, min(args.streams, ctx.num_streams()))
        device_api = ctx.api()
        print(f"device: {ctx.name()} ({device_api}), {args.chunks} chunks x {args.size} float32")
        await run(ctx, xs[:1], 1, None)  # compile once, warm the pool
        serial, t_serial, _ = await run(ctx, xs, 1, out / "pipeline-serial-trace.json")
        overlapped, t_multi, trace = await run(ctx, xs, streams, out / "pipeline-trace.json")

    err = max(verify(xs, serial), verify(xs, overlapped))
    print(f"  1 stream : {t_serial * 1e3:8.2f} ms")
    print(f"  {streams} streams: {t_multi * 1e3:8.2f} ms  (x{t_serial / t_multi:.2f})")
    print(f"  what x{t_serial / t_multi:.2f} means here: {OVERLAP_NOTE.get(device_api, '')}")
    busy = stage_totals(trace)
    stages = ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(busy.items()))
    print(f"  time in stages (multi-stream run): {stages}")
    print(f"verified: {args.chunks} chunks and histograms match NumPy (max abs error {err:.1e})")
    print(f"trace:    {out / 'pipeline-trace.json'}")
    draw(
        out / "pipeline-trace.json",
        out / "pipeline-timeline.png",
        f"pipeline: {args.chunks} chunks on {streams} streams",
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
