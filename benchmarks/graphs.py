"""Device graphs: a chain of small kernels replayed as one graph, against the
same chain enqueued kernel by kernel, and (CUDA) against raw driver calls on
the very graph asyncgpu instantiated.

    python benchmarks/graphs.py                      # the default device
    python benchmarks/graphs.py --api cpu            # CPU rows only
    python benchmarks/graphs.py --api cuda --json graphs.json

Rows (wall time per round trip, median):

* ``enqueue_chain_await``: ``--kernels`` ``enqueue_function`` calls and one await;
* ``replay_await``: ``await graph.replay()`` of the same chain built once;
* ``raw_launch_sync`` (CUDA): ``cuGraphLaunch`` + ``cuStreamSynchronize`` of
  the same instantiated graph (its ``CUgraphExec``) on a stream of its own;
* ``replay_host`` / ``raw_launch_host`` (the latter CUDA): host time of one
  ``replay()`` / one ``cuGraphLaunch`` call, the stream synchronized every
  ``--batch`` calls (outside the timed calls). The batch is small on purpose:
  once a stream has a few dozen graphs of 100 kernels queued, the driver's
  ``cuGraphLaunch`` blocks until one finishes, and the sample then times the
  device's work, not the host's (with 50 per batch, over a tenth of either
  side's samples took a whole graph's run);
* ``update_host``: host time of one ``graph.update`` of a kernel node's
  arguments (on CUDA one ``cuGraphExecKernelNodeSetParams``);
* ``tasks_replay`` / ``tasks_enqueue``: ``--tasks`` asyncio tasks, each awaiting
  ``--rounds`` replays of a graph of ``--small`` kernels on its stream, against
  the same kernels enqueued one by one (chains per second, whole run).

Goals (issue: device graphs): replay_await <= 1.1x raw_launch_sync; the
kernel-by-kernel chain >= 3x replay_await; replay_host <= 1.5x raw_launch_host.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _harness as H  # noqa: E402

import asyncgpu as ag  # noqa: E402

ADD_ONE = ag.Kernel(
    "graph_bench_add_one",
    cuda=r"""
extern "C" __global__ void graph_bench_add_one(int* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1;
}
""",
    cpu=lambda b, x, n: np.add.at(x, b.global_idx.x[b.global_idx.x < n], 1),
)  # (one block of 256 threads: the smallest kernel, so the launch cost is what is timed)


def _chain_graph(ctx: ag.DeviceContext, x: ag.DeviceBuffer, k: int) -> ag.DeviceGraph:
    n = np.int32(len(x))

    def build(b: ag.DeviceGraphBuilder) -> None:
        node: list[ag.DeviceGraphNode] = []
        for _ in range(k):
            node = [b.add_function(ADD_ONE, x, n, grid_dim=1, block_dim=256, dependencies=node)]

    return ag.DeviceGraph.create(ctx, build)


def run(
    api: str, kernels: int, repeats: int, batch: int, tasks: int, rounds: int, small: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with ag.DeviceContext(api=api) as ctx:
        x = ctx.enqueue_create_buffer(np.int32, 256)
        ctx.enqueue_memset(x, 0)
        n = np.int32(256)
        graph = _chain_graph(ctx, x, kernels)

        def enqueue_chain() -> ag.DeviceEvent:
            ev = None
            for _ in range(kernels):
                ev = ctx.enqueue_function(ADD_ONE, x, n, grid_dim=1, block_dim=256)
            assert ev is not None
            return ev

        async def timed() -> None:
            warm = max(3, repeats // 10)
            out["enqueue_chain_await"] = H.summarize_ns(
                await H.time_calls_async(enqueue_chain, repeats, warm)
            )
            out["replay_await"] = H.summarize_ns(
                await H.time_calls_async(graph.replay, repeats, warm)
            )

        H.run_async(timed)
        ctx.synchronize()
        out["replay_host"] = H.summarize_ns(
            _host_times(graph.replay, ctx.synchronize, repeats, batch)
        )
        first = graph._def.nodes[0]  # (a kernel node of the chain)
        out["update_host"] = H.summarize_ns(
            _host_times(lambda: graph.update(first, x, n), ctx.synchronize, repeats, batch)
        )
        # Every round added ``kernels`` to each element: a lost kernel shows here.
        host = ctx.enqueue_create_host_buffer(np.int32, 256)
        ctx.enqueue_copy(host, x).synchronize()
        assert host.as_numpy()[0] % kernels == 0, "the chain lost a kernel"
        if api == "cuda":
            out.update(_raw(graph, repeats, batch))
        out.update(_tasks(ctx, tasks, rounds, small))
    return out


def _tasks(ctx: ag.DeviceContext, tasks: int, rounds: int, small: int) -> dict[str, Any]:
    """``tasks`` asyncio tasks, each awaiting ``rounds`` replays of a small graph
    (``small`` kernels) of its stream (task i on stream i % num_streams), against
    the same tasks enqueuing the same kernels one by one and awaiting the last."""
    lanes = [ctx.select_stream(i) for i in range(ctx.num_streams())]
    bufs = [lane.enqueue_create_buffer(np.int32, 256) for lane in lanes]
    graphs = [_chain_graph(lane, b, small) for lane, b in zip(lanes, bufs, strict=True)]
    n = np.int32(256)

    async def replaying(i: int) -> None:
        g = graphs[i % len(graphs)]
        for _ in range(rounds):
            await g.replay()

    async def enqueuing(i: int) -> None:
        lane, b = lanes[i % len(lanes)], bufs[i % len(bufs)]
        for _ in range(rounds):
            ev = None
            for _ in range(small):
                ev = lane.enqueue_function(ADD_ONE, b, n, grid_dim=1, block_dim=256)
            await ev  # type: ignore[misc]

    out: dict[str, Any] = {}
    for name, body in (("tasks_enqueue", enqueuing), ("tasks_replay", replaying)):

        async def all_tasks(body: Any = body) -> float:
            t0 = time.perf_counter()
            await asyncio.gather(*(body(i) for i in range(tasks)))
            return time.perf_counter() - t0

        H.run_async(all_tasks)  # (warm-up: the reactor, the streams' markers)
        wall = H.run_async(all_tasks)
        out[name] = {"wall_ms": wall * 1e3, "graphs_per_s": tasks * rounds / wall}
    ctx.synchronize()
    return out


def _host_times(call: Any, sync: Any, repeats: int, batch: int) -> list[int]:
    """ns of each ``call()``, with ``sync()`` (untimed) every ``batch`` calls."""
    samples: list[int] = []
    clock = time.perf_counter_ns
    for _ in range(3):
        call()
    sync()
    with H.gc_paused():
        while len(samples) < repeats:
            for _ in range(min(batch, repeats - len(samples))):
                t0 = clock()
                call()
                samples.append(clock() - t0)
            sync()
    return samples


def _raw(graph: ag.DeviceGraph, repeats: int, batch: int) -> dict[str, Any]:
    """The same instantiated graph through cuda.bindings alone, on its own stream."""
    from cuda.bindings import driver as cu

    (exe, _), *rest = graph._exec.steps  # (a chain of kernels: one driver graph)
    assert not rest
    flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
    err, stream = cu.cuStreamCreate(flags)
    assert err == cu.CUresult.CUDA_SUCCESS, err
    launch, sync = cu.cuGraphLaunch, cu.cuStreamSynchronize

    def launch_sync() -> None:
        launch(exe, stream)
        sync(stream)

    try:
        res = {
            "raw_launch_sync": H.summarize_ns(
                H.time_calls(launch_sync, repeats, max(3, repeats // 10))
            ),
            "raw_launch_host": H.summarize_ns(
                _host_times(lambda: launch(exe, stream), lambda: sync(stream), repeats, batch)
            ),
        }
    finally:
        cu.cuStreamSynchronize(stream)
        cu.cuStreamDestroy(stream)
    return res


def goals(res: dict[str, Any]) -> list[tuple[str, float | None, str]]:
    def med(k: str) -> float | None:
        r = res.get(k)
        return None if r is None else float(r["median_us"])

    def per_s(a: str, b: str) -> float | None:
        x, y = res.get(a), res.get(b)
        return None if x is None or y is None else x["graphs_per_s"] / y["graphs_per_s"]

    def ratio(a: str, b: str) -> float | None:
        x, y = med(a), med(b)
        return None if x is None or y is None or y == 0 else x / y

    return [
        ("replay_await / raw_launch_sync", ratio("replay_await", "raw_launch_sync"), "<= 1.1"),
        (
            "enqueue_chain_await / replay_await",
            ratio("enqueue_chain_await", "replay_await"),
            ">= 3",
        ),
        ("replay_host / raw_launch_host", ratio("replay_host", "raw_launch_host"), "<= 1.5"),
        ("tasks: replay / enqueue chains per s", per_s("tasks_replay", "tasks_enqueue"), "(shown)"),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--api", choices=("cuda", "cpu"), default=None, help="default: the default device"
    )
    p.add_argument("--kernels", type=int, default=100)
    p.add_argument("--repeats", type=int, default=None, help="default: 2000 on CUDA, 50 on CPU")
    p.add_argument("--batch", type=int, default=8, help="host-time calls between syncs")
    p.add_argument("--tasks", type=int, default=1000, help="tasks awaiting small graphs")
    p.add_argument("--rounds", type=int, default=None, help="replays per task (default 20; CPU 2)")
    p.add_argument("--small", type=int, default=5, help="kernels in each task's graph")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    api = a.api or ag.default_api()
    repeats = a.repeats or (2000 if api == "cuda" else 50)
    a.rounds = a.rounds or (20 if api == "cuda" else 2)
    t0 = time.perf_counter()
    res = run(api, a.kernels, repeats, a.batch, a.tasks, a.rounds, a.small)
    print(f"device: {api}; chain of {a.kernels} kernels; {repeats} repeats; median us")
    for name, r in res.items():
        if "median_us" in r:
            print(f"  {name:<22} {r['median_us']:>10.2f}  (p90 {r['p90_us']:.2f})")
        else:
            print(f"  {name:<22} {r['graphs_per_s']:>10.0f} chains/s  ({r['wall_ms']:.1f} ms)")
    print("goals:")
    for name, v, target in goals(res):
        shown = "n/a (needs CUDA)" if v is None else f"{v:.2f}"
        print(f"  {name:<38} {shown:>16}  target {target}")
    if a.json:
        env = H.environment_info(probe_gpu=api == "cuda")
        results = [H.CaseResult(k, "graphs", "ok", dict(v)) for k, v in res.items()]
        record = H.make_record(
            results,
            env,
            suite="graphs",
            params={"api": api, "kernels": a.kernels, "repeats": repeats, "batch": a.batch},
            total_seconds=time.perf_counter() - t0,
        )
        record["goals"] = [{"goal": g, "value": v, "target": t} for g, v, t in goals(res)]
        print("wrote", H.write_json(a.json, record))


if __name__ == "__main__":
    main()
