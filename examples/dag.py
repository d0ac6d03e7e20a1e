"""A small dependency graph across streams, ordered on the device.

    s1:  A  x = iota(n)          then  D  w = 3 * x
    s2:  B  y = 2.0 (memset)
    s3:  C  z = x * y            (waits for s1 after A, and for s2)
    s0:  E  out = z + w          (waits for C, and for the event of D)
         then copy out to the host and check it on the CPU pool

No host thread blocks for any of these edges: ``enqueue_wait_for`` puts each
one on the waiting stream (on CUDA, a device-side wait). The only await is the
last one. The graph is then read back from the trace, printed, written as
Chrome/Perfetto JSON and drawn as a timeline PNG (with matplotlib).

    python examples/dag.py --out /tmp/dag
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import numpy as np
from _draw import draw  # examples/_draw.py: the timeline through the command line

from asyncgpu import DeviceContext, Kernel, ThreadBlock

CUDA = r"""
extern "C" __global__ void iota(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = (float)i;
}
extern "C" __global__ void mul(const float* a, const float* b, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] * b[i];
}
extern "C" __global__ void axpby(float alpha, const float* x, float beta, const float* y,
                                 float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = alpha * x[i] + beta * y[i];
}
"""


def iota_cpu(b: ThreadBlock, x, n) -> None:
    i = b.global_idx.x
    i = i[i < n]
    x[i] = i


def mul_cpu(b: ThreadBlock, a, c, out, n) -> None:
    i = b.global_idx.x
    i = i[i < n]
    out[i] = a[i] * c[i]


def axpby_cpu(b: ThreadBlock, alpha, x, beta, y, out, n) -> None:
    i = b.global_idx.x
    i = i[i < n]
    out[i] = alpha * x[i] + beta * y[i]


IOTA = Kernel("iota", cuda=CUDA, cpu=iota_cpu)
MUL = Kernel("mul", cuda=CUDA, cpu=mul_cpu)
AXPBY = Kernel("axpby", cuda=CUDA, cpu=axpby_cpu)
BLOCK = 256


def check(out, n: int) -> int:
    """The CPU stage at the end of the graph: out must be 5 * iota."""
    want = 5.0 * np.arange(n, dtype=np.float32)
    bad = np.flatnonzero(~np.isclose(np.asarray(out), want, rtol=1e-6))
    return int(bad.size)


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=".", help="folder for the trace and the PNG")
    p.add_argument("--size", type=int, default=1 << 16, help="float32 elements")
    p.add_argument("--device", choices=("cpu", "cuda", "default"), default="default")
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = args.size
    nn = np.int32(n)
    grid = (n + BLOCK - 1) // BLOCK
    launch = {"grid_dim": grid, "block_dim": BLOCK}

    async with DeviceContext(api=None if args.device == "default" else args.device) as ctx:
        if ctx.num_streams() < 4:
            raise SystemExit("dag: needs a pool of at least 4 streams (ASYNCGPU_NUM_STREAMS)")
        s0, s1, s2, s3 = (ctx.select_stream(i) for i in range(4))
        iota, mul, axpby = (ctx.compile_function(k) for k in (IOTA, MUL, AXPBY))
        print(f"device: {ctx.name()} ({ctx.api()}), n = {n}")

        trace_path = out_dir / "dag-trace.json"
        async with ctx.trace(trace_path) as trace:
            x = s1.enqueue_create_buffer(np.float32, n)
            w = s1.enqueue_create_buffer(np.float32, n)
            y = s2.enqueue_create_buffer(np.float32, n)
            z = s3.enqueue_create_buffer(np.float32, n)
            res = s0.enqueue_create_buffer(np.float32, n)

            s1.enqueue_function(iota, x, nn, **launch)  # A
            s2.enqueue_memset(y, 2.0)  # B
            s3.enqueue_wait_for(s1)  # C after A ...
            s3.enqueue_wait_for(s2)  # ... and after B
            s3.enqueue_function(mul, x, y, z, nn, **launch)  # C
            d = s1.enqueue_function(axpby, np.float32(3), x, np.float32(0), x, w, nn, **launch)
            s0.enqueue_wait_for(s3)  # E after C ...
            s0.enqueue_wait_for(d)  # ... and after D (an event)
            s0.enqueue_function(axpby, np.float32(1), z, np.float32(1), w, res, nn, **launch)
            host = np.empty(n, np.float32)
            s0.enqueue_copy(host, res)
            mismatches = await s0.enqueue_cpu_function(check, host, n)

    if mismatches:
        print(f"dag: {mismatches} of {n} elements are wrong", file=sys.stderr)
        return 1

    names = {}
    for node in trace.nodes.values():
        names[node.id] = f"#{node.id} {node.label.split(' <')[0]} ({node.stream.split('/')[-1]})"
    print("graph (cross-stream edges):")
    for e in trace.edges:
        if e.kind == "wait":
            print(f"  {names[e.src]:<24} -> {names[e.dst]}")
    order_ok = all(
        trace.nodes[e.src].end_ns <= trace.nodes[e.dst].start_ns
        for e in trace.edges
        if trace.nodes[e.src].end_ns is not None and trace.nodes[e.dst].start_ns is not None
    )
    if not order_ok:
        print("dag: an operation started before one it depends on ended", file=sys.stderr)
        return 1
    print(f"verified: out == 5 * iota({n}) and every edge was respected")
    print(f"trace:    {trace_path}")
    draw(trace_path, out_dir / "dag-timeline.png", "dag: A, B -> C; A -> D; C, D -> E")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
