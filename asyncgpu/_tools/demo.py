"""``python -m asyncgpu demo``: a small multi-stream asyncio pipeline, verified.

On the default device (``DeviceContext()``: a GPU when there is one, else the CPU
device; ``$ASYNCGPU_API`` overrides), each batch goes onto a stream of the pool
(``select_stream``) as five stream-ordered steps:

1. copy a pinned host buffer to the device (H2D),
2. fill the output with 1.0 (memset),
3. run ``saxpy`` (``y = a*x + y``): one ``Kernel`` carrying CUDA C++ source for the
   GPU and a NumPy body for the CPU device,
4. copy the result back (D2H),
5. a CPU stage on the pool (``enqueue_cpu_function``) that reduces the batch.

Stream 0 then waits, on the device, for every batch stream
(``enqueue_wait_for``) and runs a last CPU stage that combines the partial sums.
Everything is awaited from asyncio; the results are checked against NumPy, and
the trace is written as Chrome/Perfetto JSON and drawn as a timeline PNG.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._api.context import DeviceContext
from .._core.function import Kernel, ThreadBlock
from .._core.trace_json import _span_ns

__all__ = ["SAXPY", "DemoError", "DemoResult", "run_demo"]

TRACE_NAME = "asyncgpu-demo-trace.json"
PNG_NAME = "asyncgpu-demo-timeline.png"

SAXPY_CUDA = r"""
extern "C" __global__ void saxpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
"""


def _saxpy_cpu(b: ThreadBlock, a: np.float32, x: np.ndarray, y: np.ndarray, n: np.int32) -> None:
    i = b.global_idx.x
    i = i[i < n]
    y[i] = a * x[i] + y[i]


#: ``y = a*x + y`` for both devices: CUDA C++ for the GPU, NumPy for the CPU device.
SAXPY = Kernel("saxpy", cuda=SAXPY_CUDA, cpu=_saxpy_cpu)

BLOCK = 256


class DemoError(Exception):
    """The demo ran but its results were wrong (or it could not run)."""


@dataclass
class OpRow:
    batch: int | None
    stream: str
    kind: str
    label: str
    start_ms: float
    dur_ms: float


@dataclass
class DemoResult:
    device: str
    api: str
    device_id: int
    num_streams: int
    streams_used: list[int]
    batches: int
    size: int
    wall_ms: float
    busy_ms: float
    total: float
    max_abs_err: float
    ops: list[OpRow] = field(default_factory=list)
    trace_path: Path | None = None
    png_path: Path | None = None
    png_note: str = ""


def _reduce(i: int, out: Any, partial: np.ndarray) -> float:
    """CPU stage of batch ``i``: the sum of its output, kept for the combine stage."""
    s = float(np.sum(np.asarray(out), dtype=np.float64))
    partial[i] = s
    return s


def _combine(partial: np.ndarray) -> float:
    return float(np.sum(partial))


async def run_demo(
    out_dir: str | Path = ".",
    *,
    batches: int = 8,
    size: int = 1 << 16,
    streams: int = 4,
    api: str | None = None,
    png: bool = True,
    echo: Callable[[str], None] = print,
) -> DemoResult:
    """Run the demo pipeline; write the trace JSON (and the PNG when matplotlib is
    there) into ``out_dir``. Raises ``DemoError`` when a result is wrong."""
    if batches < 1 or size < 1 or streams < 1:
        raise ValueError("batches, size and streams must all be at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / TRACE_NAME
    rng = np.random.default_rng(2026)
    xs = [rng.standard_normal(size, dtype=np.float32) for _ in range(batches)]
    alphas = [np.float32(0.5 + i) for i in range(batches)]
    partial = np.zeros(batches, np.float64)
    grid = (size + BLOCK - 1) // BLOCK

    async with DeviceContext(api=api) as ctx:
        pool = ctx.num_streams()
        # Stream 0 gathers; the batches go round-robin over streams 1..k.
        used = list(range(1, min(streams, pool - 1) + 1)) or [0]
        echo(
            f"device: {ctx.name()} (api={ctx.api()}, id={ctx.id()}); stream pool of {pool}, "
            f"batches on streams {', '.join(f's{j}' for j in used)}, gather on s0"
        )
        t_compile = time.perf_counter()
        fn = ctx.compile_function(SAXPY)
        echo(
            f"compiled {fn.name!r} for {ctx.default_device_info.target()} in "
            f"{(time.perf_counter() - t_compile) * 1e3:.1f} ms"
        )

        per_batch: list[list[Any]] = []
        hys = []
        async with ctx.trace(trace_path) as trace:
            t0 = time.perf_counter()
            reduced = []
            for i in range(batches):
                s = ctx.select_stream(used[i % len(used)])
                hx = s.enqueue_create_host_buffer(np.float32, size)
                hx.as_numpy()[:] = xs[i]
                dx = s.enqueue_create_buffer(np.float32, size)
                dy = s.enqueue_create_buffer(np.float32, size)
                hy = s.enqueue_create_host_buffer(np.float32, size)
                evs = [
                    s.enqueue_copy(dx, hx),
                    s.enqueue_memset(dy, 1.0),
                    s.enqueue_function(
                        fn, alphas[i], dx, dy, np.int32(size), grid_dim=grid, block_dim=BLOCK
                    ),
                    s.enqueue_copy(hy, dy),
                ]
                red = s.enqueue_cpu_function(_reduce, i, hy, partial)
                evs.append(red)
                reduced.append(red)
                per_batch.append(evs)
                hys.append(hy)
            gather = [ctx.enqueue_wait_for(ctx.select_stream(j)) for j in used if j != 0]
            total_ev = ctx.enqueue_cpu_function(_combine, partial)
            sums = await asyncio.gather(*reduced)
            total = await total_ev
            wall_ms = (time.perf_counter() - t0) * 1e3

        # -- verify against NumPy ----------------------------------------------------------
        max_err = 0.0
        for i in range(batches):
            expected = alphas[i] * xs[i] + np.float32(1.0)
            got = hys[i].as_numpy()
            err = float(np.max(np.abs(got - expected)))
            max_err = max(max_err, err)
            if not np.allclose(got, expected, rtol=1e-5, atol=1e-5):
                bad = int(np.argmax(np.abs(got - expected)))
                raise DemoError(
                    f"batch {i}: element {bad} is {got[bad]!r}, NumPy says {expected[bad]!r}"
                )
            want = float(np.sum(expected, dtype=np.float64))
            if not np.isclose(sums[i], want, rtol=1e-5, atol=1e-3):
                raise DemoError(f"batch {i}: CPU stage summed {sums[i]!r}, NumPy says {want!r}")
        if not np.isclose(total, float(np.sum(partial)), rtol=1e-12):
            raise DemoError(
                f"combine stage gave {total!r}, the partial sums add to {partial.sum()}"
            )

        # -- what ran where ------------------------------------------------------------------
        rows: list[OpRow] = []
        t_ms0 = trace.t0_ns

        def row(batch: int | None, ev: Any) -> None:
            node = trace.node_of(ev)
            if node is None:
                return
            start, end = _span_ns(node)  # the device's times where it measured them
            label = node.label
            if node.kind == "wait":
                others = [
                    trace.nodes[d].stream for d in node.deps if trace.nodes[d].stream != node.stream
                ]
                label = f"{node.stream} waits for {', '.join(others) or 'earlier work'}"
            rows.append(
                OpRow(
                    batch,
                    node.stream,
                    node.kind,
                    label,
                    (start - t_ms0) / 1e6,
                    (end - start) / 1e6,
                )
            )

        for i, evs in enumerate(per_batch):
            for ev in evs:
                row(i, ev)
        for ev in [*gather, total_ev]:
            row(None, ev)
        busy = sum(r.dur_ms for r in rows)
        result = DemoResult(
            device=ctx.name(),
            api=ctx.api(),
            device_id=ctx.id(),
            num_streams=pool,
            streams_used=used,
            batches=batches,
            size=size,
            wall_ms=wall_ms,
            busy_ms=busy,
            total=float(total),
            max_abs_err=max_err,
            ops=rows,
            trace_path=trace_path,
        )

    _print_table(result, echo)
    if png:
        try:
            from .timeline import draw_timeline

            png_path = out / PNG_NAME
            draw_timeline(
                trace,
                png_path,
                title=f"asyncgpu demo on {result.device} ({result.api}): {batches} batches",
            )
            result.png_path = png_path
        except ImportError:
            result.png_note = (
                "timeline PNG skipped: matplotlib is not installed (pip install asyncgpu[plot])"
            )
    else:
        result.png_note = "timeline PNG skipped (--no-png)"
    echo(f"trace:    {result.trace_path}  (open in https://ui.perfetto.dev)")
    echo(f"timeline: {result.png_path}" if result.png_path else result.png_note)
    return result


def _print_table(r: DemoResult, echo: Callable[[str], None]) -> None:
    steps = ("copy", "memset", "kernel", "copy", "cpu")
    names = ("H2D", "memset", "kernel", "D2H", "cpu")
    echo("")
    echo(f"{'batch':>5}  {'stream':<10} {'start ms':>9}  " + "  ".join(f"{n:>8}" for n in names))
    by_batch: dict[int, list[OpRow]] = {}
    for op in r.ops:
        if op.batch is not None:
            by_batch.setdefault(op.batch, []).append(op)
    for b, ops in sorted(by_batch.items()):
        durs = [
            f"{op.dur_ms:8.3f}" if op.kind == want else f"{'?':>8}"
            for want, op in zip(steps, ops, strict=False)
        ]
        echo(f"{b:>5}  {ops[0].stream:<10} {ops[0].start_ms:9.3f}  " + "  ".join(durs))
    tail = [op for op in r.ops if op.batch is None]
    for op in tail:
        line = f"{'-':>5}  {op.stream:<10} {op.start_ms:9.3f}  {op.kind:>8} {op.dur_ms:8.3f}"
        echo(f"{line}  {op.label}")
    echo("(per-op durations in ms)")
    echo("")
    overlap = r.busy_ms / r.wall_ms if r.wall_ms > 0 else 0.0
    echo(
        f"{r.batches} batches x {r.size} float32 on {r.device} ({r.api}): wall {r.wall_ms:.2f} ms, "
        f"sum of op times {r.busy_ms:.2f} ms (overlap x{overlap:.2f})"
    )
    echo(
        f"verified: every batch matches NumPy (max abs error {r.max_abs_err:.2e}); "
        f"combined sum {r.total:.6g}"
    )
