"""Serving a PyTorch model from asyncio over HTTP, and how the handler waits for
the GPU.

The service (aiohttp) answers ``POST /infer?wait=STRATEGY`` with a batch of
float32 rows: a 4-layer MLP runs it on one of a pool of PyTorch CUDA streams
(copy in from pinned memory, forward pass, copy out into a pinned buffer of the
request) and the handler waits for that stream in one of five ways before it
replies:

* ``sync``: ``stream.synchronize()`` (the whole event loop stops meanwhile);
* ``executor``: ``await loop.run_in_executor(None, stream.synchronize)``;
* ``poll-1ms``: ``event.record(stream)``, then ``while not event.query():
  await asyncio.sleep(0.001)``;
* ``poll-0``: the same with ``asyncio.sleep(0)``;
* ``asyncgpu``: ``await asyncgpu.torch.wait(stream)``.

A 1 ms ticker runs on the service's loop. The load generator (this script in a
child process) sends ``--requests`` requests from each of ``--clients``
concurrent clients, checks every ``--check-every``-th reply against the same
model run on its own CPU, and the service prints per strategy: requests/s, the
ticker's p99 and longest lag, its ticks during the run, and the service's CPU
time per request (every thread of its process)::

    pip install "asyncgpu[serve]" torch
    python examples/torch_server.py                          # every strategy, a table
    python examples/torch_server.py --serve --port 8080      # only the service

Without a CUDA GPU in PyTorch the model runs on the CPU, inside the handler,
and every strategy waits for nothing: the table then measures the HTTP service
and the load generator only, and the strategies mean nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import asyncgpu.torch

STRATEGIES = ("sync", "executor", "poll-1ms", "poll-0", "asyncgpu")
CPU_NOTE = (
    "CPU-only: PyTorch has no CUDA device here, so the model runs inside the handler and "
    "every strategy waits for nothing; these figures measure the service and the load "
    "generator, and the strategies mean nothing without a GPU"
)


def make_model(width: int, layers: int, device: str) -> torch.nn.Module:
    """A ``layers``-layer MLP, ``width`` wide, the same weights wherever it is
    made (fp16 on a GPU, fp32 on the CPU)."""
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*mods).eval()
    dtype = torch.float16 if device == "cuda" else torch.float32
    return model.to(device=device, dtype=dtype)


# -- how a handler waits for the GPU --------------------------------------------------------


async def wait_sync(s: Any) -> None:
    s.synchronize()


async def wait_executor(s: Any) -> None:
    await asyncio.get_running_loop().run_in_executor(None, s.synchronize)


def _poll(pause: float) -> Callable[[Any], Awaitable[None]]:
    async def wait(s: Any) -> None:
        ev = torch.cuda.Event()
        ev.record(s)
        while not ev.query():
            await asyncio.sleep(pause)

    return wait


async def wait_asyncgpu(s: Any) -> None:
    await asyncgpu.torch.wait(s)


WAITS: dict[str, Callable[[Any], Awaitable[None]]] = {
    "sync": wait_sync,
    "executor": wait_executor,
    "poll-1ms": _poll(0.001),
    "poll-0": _poll(0),
    "asyncgpu": wait_asyncgpu,
}


class Service:
    """The model on a pool of PyTorch streams (None on the CPU), and one request
    run with a given waiting strategy."""

    def __init__(self, width: int, batch: int, streams: int, device: str | None = None) -> None:
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.width, self.batch = width, batch
        self.model = make_model(width, 4, self.device)
        self.gpu = self.device == "cuda"
        self.streams = [torch.cuda.Stream() for _ in range(streams)] if self.gpu else [None]
        self._next = itertools.cycle(range(len(self.streams)))
        self.dtype = torch.float16 if self.gpu else torch.float32

        self._spare: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def take(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host buffers (input, output) for ``rows`` rows, pinned on a GPU: kept
        from an earlier request (pinning memory is a slow driver call)."""
        spare = self._spare.get(rows)
        if spare:
            return spare.pop()
        return (
            torch.empty((rows, self.width), dtype=self.dtype, pin_memory=self.gpu),
            torch.empty((rows, self.width), dtype=self.dtype, pin_memory=self.gpu),
        )

    def give(self, bufs: tuple[torch.Tensor, torch.Tensor]) -> None:
        self._spare.setdefault(len(bufs[0]), []).append(bufs)

    async def infer(self, x: torch.Tensor, out: torch.Tensor, strategy: str) -> None:
        """``out`` (host) = the model of ``x`` (host): queued on the next stream of
        the pool, then waited for with ``strategy``."""
        s = self.streams[next(self._next)]
        if s is None:  # the CPU: done when it returns
            with torch.inference_mode():
                out.copy_(self.model(x))
            return
        with torch.cuda.stream(s), torch.inference_mode():
            y = self.model(x.to("cuda", non_blocking=True))
            out.copy_(y, non_blocking=True)
            # (the allocator reuses y's memory only after the work queued on s so far)
        await WAITS[strategy](s)


@dataclass
class Ticker:
    """A 1 ms timer on the loop: how late each tick came."""

    lags: list[float] = field(default_factory=list)
    task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            self.lags.append(time.perf_counter() - t - 0.001)

    def start(self) -> None:
        self.lags.clear()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> dict[str, float]:
        assert self.task is not None
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        lags = sorted(self.lags) or [0.0]
        return {
            "ticks": len(self.lags),
            "ticker_p99_ms": 1e3 * lags[min(len(lags) - 1, int(0.99 * len(lags)))],
            "ticker_max_ms": 1e3 * lags[-1],
        }


def row(strategy: str, requests: int, wall: float, cpu: float, tick: dict[str, float]) -> dict:
    return {
        "strategy": strategy,
        "requests": requests,
        "requests_per_s": requests / wall,
        "cpu_per_request_ms": 1e3 * cpu / requests,
        **tick,
    }


def format_table(rows: list[dict], title: str) -> str:
    lines = [
        title,
        f"{'how the handler waits':<22} {'requests/s':>11} {'ticker p99':>11} {'ticker max':>11}"
        f" {'ticks':>7} {'CPU/request':>12}",
    ]
    for r in rows:
        lines.append(
            f"{r['strategy']:<22} {r['requests_per_s']:>11,.0f} {r['ticker_p99_ms']:>9.2f}ms"
            f" {r['ticker_max_ms']:>9.2f}ms {r['ticks']:>7} {r['cpu_per_request_ms']:>10.3f}ms"
        )
    return "\n".join(lines)


# -- the HTTP service ----------------------------------------------------------------------


def make_app(service: Service) -> Any:
    from aiohttp import web

    async def infer(request: web.Request) -> web.Response:
        strategy = request.query.get("wait", "asyncgpu")
        if strategy not in WAITS:
            raise web.HTTPBadRequest(text=f"wait must be one of {', '.join(STRATEGIES)}")
        body = await request.read()
        rows = len(body) // (4 * service.width)
        if rows * 4 * service.width != len(body) or rows == 0:
            raise web.HTTPBadRequest(text=f"the body is float32 rows of {service.width}")
        x, out = bufs = service.take(rows)
        try:
            x.copy_(torch.frombuffer(bytearray(body), dtype=torch.float32).view(rows, -1))
            await service.infer(x, out, strategy)
            reply = out.float().numpy().tobytes()
        finally:
            service.give(bufs)  # (after the wait: the GPU is done with them)
        return web.Response(body=reply)

    app = web.Application(client_max_size=1 << 26)
    app.router.add_post("/infer", infer)
    return app


async def serve_and_measure(a: argparse.Namespace) -> list[dict]:
    from aiohttp import web

    service = Service(a.width, a.batch, a.streams)
    runner = web.AppRunner(make_app(service), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", a.port)
    await site.start()
    port = runner.addresses[0][1]
    rows = []
    ticker = Ticker()
    try:
        for strategy in a.strategies:
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                os.path.abspath(__file__),
                "--load",
                f"http://127.0.0.1:{port}/infer?wait={strategy}",
                *("--clients", str(a.clients), "--requests", str(a.requests)),
                *("--width", str(a.width), "--batch", str(a.batch)),
                *("--check-every", str(a.check_every)),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            assert child.stdin is not None and child.stdout is not None
            await child.stdout.readline()  # "ready": it has started up (not measured)
            ticker.start()
            c0 = time.process_time()
            child.stdin.write(b"go\n")
            out = await child.stdout.readline()  # its result, as soon as the load ends
            cpu = time.process_time() - c0
            tick = await ticker.stop()
            if await child.wait() != 0 or not out:
                raise SystemExit(f"the load generator failed for {strategy}")
            load = json.loads(out)
            rows.append(row(strategy, load["requests"], load["wall_s"], cpu, tick))
    finally:
        await runner.cleanup()
    return rows


# -- the load generator (a child process) ----------------------------------------------------


async def load(a: argparse.Namespace) -> dict:
    import aiohttp

    model = make_model(a.width, 4, "cpu")
    rng = np.random.default_rng(1)
    checked = 0

    async def client(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal checked
        for k in range(a.requests):
            x = rng.standard_normal((a.batch, a.width), dtype=np.float32)
            async with session.post(a.load, data=x.tobytes()) as r:
                if r.status != 200:
                    raise SystemExit(f"HTTP {r.status}: {await r.text()}")
                y = np.frombuffer(await r.read(), np.float32).reshape(a.batch, a.width)
            if (i * a.requests + k) % a.check_every == 0:
                with torch.inference_mode():
                    ref = model(torch.from_numpy(x)).numpy()
                np.testing.assert_allclose(y, ref, rtol=0.05, atol=0.05)
                checked += 1

    conn = aiohttp.TCPConnector(limit=a.clients)
    async with aiohttp.ClientSession(connector=conn) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session, i) for i in range(a.clients)))
        wall = time.perf_counter() - t0
    return {"requests": a.clients * a.requests, "wall_s": wall, "checked": checked}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=20, help="per client")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--check-every", type=int, default=97)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--serve", action="store_true", help="only serve, until interrupted")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--load", help=argparse.SUPPRESS)  # (the child: the URL to load)
    a = p.parse_args(argv)
    if a.load:
        print("ready", flush=True)
        sys.stdin.readline()  # the service measures from here
        print(json.dumps(asyncio.run(load(a))), flush=True)
        return
    if a.serve:
        from aiohttp import web

        web.run_app(make_app(Service(a.width, a.batch, a.streams)), port=a.port or 8080)
        return
    a.strategies = a.strategies.split(",")
    unknown = set(a.strategies) - set(STRATEGIES)
    if unknown:
        p.error(f"unknown strategies {sorted(unknown)}: choose among {', '.join(STRATEGIES)}")
    gpu = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if gpu else "CPU"
    rows = asyncio.run(serve_and_measure(a))
    title = (
        f"{a.clients} clients x {a.requests} requests over HTTP, a 4-layer {a.width}-wide MLP, "
        f"batch {a.batch}, {a.streams if gpu else 0} PyTorch streams, on {device}"
    )
    print(format_table(rows, title))
    if not gpu:
        print(CPU_NOTE)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"title": title, "gpu": gpu, "rows": rows}, f, indent=1)
    print("verified: every checked reply matched the model on the CPU")


if __name__ == "__main__":
    main()
