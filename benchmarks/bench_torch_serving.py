"""Serving PyTorch from asyncio: how the handler waits for the GPU, side by side.

One process, one event loop at a time (asyncio, then uvloop): ``--clients``
concurrent clients each send ``--requests`` requests to the service of
``examples/torch_server.py`` (called directly, no HTTP): a 4-layer
``--width``-wide MLP (fp16 on a GPU) on a batch of ``--batch`` rows, on a pool
of ``--streams`` PyTorch streams, the input copied in from pinned memory and the
output copied out into a pinned buffer of the client. A 1 ms ticker runs on the
same loop. Every waiting strategy of the example runs in each round, in a
rotated order (``sync``, ``executor``, ``poll-1ms``, ``poll-0``, ``asyncgpu``,
and ``asyncgpu-stream``: ``await ctx.create_external_stream(s)`` per request);
the table gives per loop and strategy the median over ``--rounds`` rounds of
requests/s, the ticker's p99 and longest lag, its ticks in the run and the
process's CPU time per request (every thread). Every client's last result is
checked against the model run again, synchronously, after the run.

The goals (per loop, in the same round): asyncgpu serves at least 0.95x the
requests/s of the best other strategy, with a CPU time per request at most 1.1x
that strategy's, while the ticker's p99 stays at most 14 ms and its longest lag
at most 100 ms; ``goals`` in the JSON says, per round, which held.

    python benchmarks/bench_torch_serving.py --json torch-serving.json     # on a GPU
    python benchmarks/bench_torch_serving.py --quick                       # anywhere

Without a CUDA GPU in PyTorch the model runs on the CPU inside the handler and
no strategy has anything to wait for: the run is labelled CPU-only and its
figures say nothing about waiting for a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch
from _harness import Unavailable, environment_info, write_json
from torch_server import CPU_NOTE, STRATEGIES, WAITS, Service, Ticker, format_table, row

LOOPS = ("asyncio", "uvloop")


def _await_the_wrapped_stream() -> Any:
    """One more way of asyncgpu's: ``await ctx.create_external_stream(s)`` per
    request, as code written before ``asyncgpu.torch`` does (the context wraps
    each stream once; the await is the wrapped stream's)."""
    ctx = None

    async def wait(s: Any) -> None:
        nonlocal ctx
        if ctx is None:
            import asyncgpu

            ctx = asyncgpu.DeviceContext(api="cuda")
        await ctx.create_external_stream(s)

    return wait


WAITS["asyncgpu-stream"] = _await_the_wrapped_stream()
OURS = ("asyncgpu", "asyncgpu-stream")
GOAL_RATE, GOAL_CPU, GOAL_P99_MS, GOAL_MAX_MS = 0.95, 1.1, 14.0, 100.0


def loop_runner(name: str) -> Any:
    """``run(coroutine_function)`` on a new loop of kind ``name``."""
    if name == "uvloop":
        try:
            import uvloop
        except ImportError as e:
            raise Unavailable(f"uvloop is not installed: {e}") from e
        return lambda main: uvloop.run(main())
    return lambda main: asyncio.run(main())


async def one_run(service: Service, strategy: str, clients: int, requests: int) -> dict:
    """``clients`` x ``requests`` requests waited for with ``strategy``; the row,
    and the clients' inputs and last outputs for the check."""
    bufs = [service.take(service.batch) for _ in range(clients)]
    for i, (x, _) in enumerate(bufs):
        seeded = torch.Generator().manual_seed(i)
        x.copy_(torch.randn((service.batch, service.width), generator=seeded))

    async def client(i: int) -> None:
        x, out = bufs[i]
        for _ in range(requests):
            # A request arrives: a server reads it from a socket, which yields to
            # the loop. Without this, a handler whose wait finds the work already
            # done (as awaiting a finished future does) runs all its requests in
            # one step, and the loop's other tasks (the ticker) starve whatever
            # the strategy.
            await asyncio.sleep(0)
            await service.infer(x, out, strategy)

    ticker = Ticker()
    ticker.start()  # (its task runs first: its first tick starts with the clients)
    c0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tick = await ticker.stop()
    result = row(strategy, clients * requests, wall, cpu, tick)
    result["_bufs"] = bufs
    return result


def check(service: Service, bufs: list[Any]) -> None:
    """Every client's last output is the model of its input (run again now,
    synchronously, on the current stream)."""
    with torch.inference_mode():
        for x, out in bufs:
            ref = service.model(x.to(service.device)).to("cpu")
            if service.gpu:
                torch.cuda.synchronize()
            torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


def goals(rows: list[dict]) -> dict[str, Any]:
    """The goals of one round on one loop (see the module doc)."""
    by = {r["strategy"]: r for r in rows}
    ours = by.get("asyncgpu")
    others = [r for r in rows if r["strategy"] not in OURS]
    if ours is None or not others:
        return {}
    best = max(others, key=lambda r: r["requests_per_s"])
    return {
        "best_other": best["strategy"],
        "rate_ratio": ours["requests_per_s"] / best["requests_per_s"],
        "cpu_ratio": ours["cpu_per_request_ms"] / best["cpu_per_request_ms"],
        "rate_ok": ours["requests_per_s"] >= GOAL_RATE * best["requests_per_s"],
        "cpu_ok": ours["cpu_per_request_ms"] <= GOAL_CPU * best["cpu_per_request_ms"],
        "ticker_ok": ours["ticker_p99_ms"] <= GOAL_P99_MS and ours["ticker_max_ms"] <= GOAL_MAX_MS,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--requests", type=int, default=20, help="per client")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--loops", default=",".join(LOOPS))
    p.add_argument("--strategies", default=",".join((*STRATEGIES, "asyncgpu-stream")))
    p.add_argument(
        "--fence-marker",
        choices=("event", "counter"),
        default="event",
        help="what marks asyncgpu's empty operation on a PyTorch stream: a recorded driver "
        "event (asyncgpu's choice) or the completion counter's write (for comparison)",
    )
    p.add_argument("--quick", action="store_true", help="a tiny run (CI, the CPU)")
    p.add_argument("--json", help="write the record here")
    a = p.parse_args(argv)
    if a.quick:
        a.clients, a.requests, a.width, a.batch, a.rounds = 8, 3, 64, 2, 1
    strategies = a.strategies.split(",")
    gpu = torch.cuda.is_available()
    if gpu:
        from asyncgpu._devices.cuda.stream import CudaStream

        CudaStream._fence_event_marker = a.fence_marker == "event"
    else:
        # (one thread for the model on the CPU: the intra-op pool's threads spin
        # between operations, and on a busy machine that swamps a tiny model)
        torch.set_num_threads(1)
    service = Service(a.width, a.batch, a.streams)
    title = (
        f"{a.clients} clients x {a.requests} requests, a 4-layer {a.width}-wide MLP, batch "
        f"{a.batch}, {a.streams if gpu else 0} PyTorch streams, "
        + (torch.cuda.get_device_name() if gpu else "CPU-only")
        + ("" if a.fence_marker == "event" else ", asyncgpu's fence marked by the counter")
    )
    record: dict[str, Any] = {
        "benchmark": "torch_serving",
        "title": title,
        "gpu": gpu,
        "environment": environment_info(probe_gpu=gpu),
        "torch": torch.__version__,
        "params": {k: v for k, v in vars(a).items() if k != "json"},
        "loops": {},
    }
    print(title)
    if not gpu:
        print(CPU_NOTE)
    for loop in a.loops.split(","):
        try:
            run = loop_runner(loop)
        except Unavailable as e:
            record["loops"][loop] = {"unavailable": str(e)}
            print(f"{loop}: {e}")
            continue

        async def warm() -> None:
            for s in strategies:
                r = await one_run(service, s, min(a.clients, 8), 2)
                for b in r.pop("_bufs"):
                    service.give(b)

        run(warm)  # (first use: cuBLAS, the allocator, asyncgpu's context)
        rounds: list[list[dict]] = []
        for k in range(a.rounds):
            order = strategies[k % len(strategies) :] + strategies[: k % len(strategies)]
            rows = []
            for s in order:
                r = run(lambda s=s: one_run(service, s, a.clients, a.requests))
                bufs = r.pop("_bufs")
                check(service, bufs)
                for b in bufs:
                    service.give(b)
                rows.append(r)
            rows.sort(key=lambda r: strategies.index(r["strategy"]))
            rounds.append(rows)
        median = [
            {
                "strategy": s,
                "requests": rounds[0][i]["requests"],
                **{
                    key: statistics.median(rs[i][key] for rs in rounds)
                    for key in (
                        "requests_per_s",
                        "cpu_per_request_ms",
                        "ticks",
                        "ticker_p99_ms",
                        "ticker_max_ms",
                    )
                },
            }
            for i, s in enumerate(strategies)
        ]
        record["loops"][loop] = {
            "rounds": rounds,
            "median": median,
            "goals": [goals(rs) for rs in rounds],
        }
        print(format_table(median, f"\n{loop}: the median of {a.rounds} rounds"))
        for k, g in enumerate(record["loops"][loop]["goals"]):
            if g:
                print(
                    f"  round {k + 1}: asyncgpu/{g['best_other']}: requests/s x"
                    f"{g['rate_ratio']:.2f}, CPU/request x{g['cpu_ratio']:.2f}; goals: rate "
                    f"{'met' if g['rate_ok'] else 'missed'}, CPU "
                    f"{'met' if g['cpu_ok'] else 'missed'}, ticker "
                    f"{'met' if g['ticker_ok'] else 'missed'}"
                    + ("" if gpu else " (CPU-only: meaningless)")
                )
    if a.json:
        write_json(a.json, record)
    return record


if __name__ == "__main__":
    main()
