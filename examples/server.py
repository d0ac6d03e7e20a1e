"""An asyncio TCP service that runs every request on the device, and a load test.

The server listens on 127.0.0.1 (an ephemeral port). A request is a float32
payload (a little-endian uint32 element count, then the elements); for each
one the server picks the next stream of the context's pool (``select_stream``,
round-robin), copies the payload in, runs a kernel, copies the result out and
replies. Two versions of the same handler are measured:

* ``await``: ``await`` the copy-out event: the event loop keeps serving other
  connections while the device works;
* ``sync``: ``ctx.synchronize()`` instead, the blocking call most code uses
  today: the whole event loop stops until that request's work is done.

A bounded load generator (its own event loop, in a thread of this process)
sends ``--requests`` requests from ``--concurrency`` concurrent clients over
loopback, checks every reply against NumPy and stops by itself. The script
prints requests/s, p50/p99 latency and the longest event-loop stall of each
version, and, given ``--out DIR``, writes them to ``DIR/server-results.json``.

    python examples/server.py                          # default device
    python examples/server.py --device cpu --requests 100 --json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np

from asyncgpu import DeviceContext, Kernel, ThreadBlock

HEADER = struct.Struct("<I")  # number of float32 elements that follow
HOST = "127.0.0.1"

AFFINE_CUDA = r"""
extern "C" __global__ void affine(float* x, int n, float a, float b, int iters) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float v = x[i];
        for (int k = 0; k < iters; ++k) v = a * v + b;
        x[i] = v;
    }
}
"""


# What the await-against-sync comparison means on the device the script ran on.
COMPARISON_NOTE = {
    "cpu": (
        "the CPU device runs each request's copies and kernel as Python on a thread pool "
        "under the GIL, so there is little device time to overlap, and an await adds a "
        "hop from the pool thread back to the event loop that a blocking synchronize() "
        "does not: await may well come out slower here. Run on a GPU for the real "
        "comparison"
    ),
    "cuda": (
        "with await the event loop keeps serving other clients while the GPU works; "
        "ctx.synchronize() stops the whole loop for each request, which the loop stall "
        "column shows"
    ),
}


def affine_cpu(blk: ThreadBlock, x, n, a, b, iters) -> None:
    i = blk.global_idx.x
    i = i[i < n]
    v = x[i]
    for _ in range(int(iters)):
        v = a * v + b
    x[i] = v


AFFINE = Kernel("affine", cuda=AFFINE_CUDA, cpu=affine_cpu)
A, B = np.float32(0.75), np.float32(0.5)
BLOCK = 256


def expected(x: np.ndarray, iters: int) -> np.ndarray:
    v = x.copy()
    for _ in range(iters):
        v = A * v + B
    return v


# -- the service ---------------------------------------------------------------------


class Service:
    """Runs one request on the next stream of the pool: copy in, kernel, copy out."""

    def __init__(self, ctx: DeviceContext, iters: int, mode: str) -> None:
        self.ctx = ctx
        self.fn = ctx.compile_function(AFFINE)
        self.iters = np.int32(iters)
        self.mode = mode
        self._next = itertools.count()
        self.streams = ctx.num_streams()

    async def process(self, x: np.ndarray) -> np.ndarray:
        s = self.ctx.select_stream(next(self._next) % self.streams)
        n = x.size
        buf = s.enqueue_create_buffer(np.float32, n)
        s.enqueue_copy(buf, x)
        grid = max(1, (n + BLOCK - 1) // BLOCK)
        s.enqueue_function(
            self.fn, buf, np.int32(n), A, B, self.iters, grid_dim=grid, block_dim=BLOCK
        )
        out = np.empty(n, np.float32)
        done = s.enqueue_copy(out, buf)
        if self.mode == "await":
            await done  # the loop serves other connections meanwhile
        else:
            s.synchronize()  # blocks the event loop until this stream is idle
        return out

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                    payload = await reader.readexactly(4 * n)
                except asyncio.IncompleteReadError:
                    break  # the client closed the connection
                y = await self.process(np.frombuffer(payload, np.float32))
                writer.write(HEADER.pack(n) + y.tobytes())
                await writer.drain()
        finally:
            writer.close()


class StallMeter:
    """Measures how late a 1 ms heartbeat on the server's loop wakes up."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, time.perf_counter() - t - 0.001)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._beat())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


# -- the load generator -----------------------------------------------------------------


async def _client(port: int, take, size: int, iters: int, seed: int, lat: list, bad: list):
    reader, writer = await asyncio.open_connection(HOST, port)
    rng = np.random.default_rng(seed)
    try:
        while take():
            x = rng.standard_normal(size, dtype=np.float32)
            t0 = time.perf_counter()
            writer.write(HEADER.pack(size) + x.tobytes())
            await writer.drain()
            (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            y = np.frombuffer(await reader.readexactly(4 * n), np.float32)
            lat.append(time.perf_counter() - t0)
            if n != size or not np.allclose(y, expected(x, iters), rtol=1e-4, atol=1e-5):
                bad.append(len(lat))
    finally:
        writer.close()
        await writer.wait_closed()


def load(port: int, requests: int, concurrency: int, size: int, iters: int) -> dict:
    """Run the load generator on its own event loop (call it from a thread)."""
    counter = itertools.count()
    lock = threading.Lock()

    def take() -> bool:
        with lock:
            return next(counter) < requests

    lat: list[float] = []
    bad: list[int] = []

    async def run() -> float:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(_client(port, take, size, iters, i, lat, bad) for i in range(concurrency))
        )
        return time.perf_counter() - t0

    wall = asyncio.run(run())
    ms = np.array(lat) * 1e3
    return {
        "requests": len(lat),
        "wall_s": wall,
        "requests_per_s": len(lat) / wall if wall > 0 else 0.0,
        "p50_ms": float(np.percentile(ms, 50)) if ms.size else 0.0,
        "p99_ms": float(np.percentile(ms, 99)) if ms.size else 0.0,
        "wrong_replies": len(bad),
    }


async def measure(ctx: DeviceContext, mode: str, args: argparse.Namespace) -> dict:
    service = Service(ctx, args.iters, mode)
    server = await asyncio.start_server(service.handle, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    # Warm up: compile, first allocation, the pool threads.
    await service.process(np.zeros(args.size, np.float32))
    meter = StallMeter()
    meter.start()
    try:
        stats = await asyncio.to_thread(
            load, port, args.requests, args.concurrency, args.size, args.iters
        )
    finally:
        await meter.stop()
        server.close()
        await server.wait_closed()
    stats["mode"] = mode
    stats["max_loop_stall_ms"] = meter.worst * 1e3
    return stats


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda", "default"), default="default")
    p.add_argument("--requests", type=int, default=200, help="requests per run (default 200)")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent clients (default 32)")
    p.add_argument("--size", type=int, default=4096, help="float32 elements per request")
    p.add_argument("--iters", type=int, default=8, help="kernel work per element")
    p.add_argument("--out", help="write server-results.json into this folder (default: none)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.size < 1:
        p.error("--requests, --concurrency and --size must be at least 1")

    api = None if args.device == "default" else args.device
    async with DeviceContext(api=api) as ctx:
        device = {"name": ctx.name(), "api": ctx.api(), "streams": ctx.num_streams()}
        runs = [await measure(ctx, mode, args) for mode in ("await", "sync")]

    result = {
        "device": device,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "size": args.size,
        "iters": args.iters,
        "runs": runs,
        "verified": all(r["wrong_replies"] == 0 and r["requests"] == args.requests for r in runs),
    }
    saved = None
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        saved = out / "server-results.json"
        saved.write_text(json.dumps(result, indent=2) + "\n")

    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"device: {device['name']} ({device['api']}), {device['streams']} streams; "
            f"{args.requests} requests x {args.size} float32, {args.concurrency} clients"
        )
        print(f"{'server':<22}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'loop stall ms':>15}")
        names = {"await": "await (asyncgpu)", "sync": "ctx.synchronize()"}
        for r in runs:
            print(
                f"{names[r['mode']]:<22}{r['requests_per_s']:>10.0f}{r['p50_ms']:>10.2f}"
                f"{r['p99_ms']:>10.2f}{r['max_loop_stall_ms']:>15.2f}"
            )
        print(f"what this means here: {COMPARISON_NOTE.get(device['api'], '')}")
        verdict = "every reply matches NumPy" if result["verified"] else "WRONG REPLIES"
        print(f"verified: {verdict}" + (f"; results in {saved}" if saved else ""))
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
