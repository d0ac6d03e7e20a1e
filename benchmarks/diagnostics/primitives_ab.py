"""Two builds of asyncgpu side by side in one run: this checkout's (the extension's
own re-entrant lock and event queue) against a variant's (``.variant/``: the
``cpython-prims`` branch, whose streams use CPython's ``threading.RLock`` and
``collections.deque``, taken and changed from C through their bound methods).
Whether the hot paths need the extension's own primitives is a question of
these figures.

    bash benchmarks/diagnostics/make_variant.sh      # .variant/ from the cpython-prims branch
    python benchmarks/diagnostics/primitives_ab.py --variant-dir .variant --json OUT.json

Every figure comes from a fresh process of one build (``PYTHONPATH`` this
checkout's root or the variant's folder); the builds take turns within each
round, which goes first alternating, over ``--rounds`` rounds; a figure is the
median of its build's rounds. Sections:

* ``device``: on CUDA when a GPU is there, else on the CPU device (where no
  polled stream runs, so its figures show the harness, not the primitives): an
  awaited empty kernel (median; on CUDA with the blocking launch +
  ``cuStreamSynchronize`` it is measured against, ``bench_engine.latency``), the
  host cost of ``enqueue_function`` (empty, and 4 arguments) and of a 4 KiB
  pinned host-to-device ``enqueue_copy`` (``bench_fastpaths``' per-call timing),
  and 1,000 tasks x 10 awaits over 8 streams (``bench_engine.throughput``).
* ``stand-in``: the CUDA streams' C hot paths on the stand-in driver, no GPU
  needed (``benchmarks/emulate_engine.py``): launch, ``enqueue_function``, a
  launch and its await, and the 8-stream throughput.

The table gives each build's median, the spread of its rounds, and the ratio
variant/main (for microseconds, below 1 means the variant is faster; for ops/s,
above 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
MARK = "PRIMITIVES_AB "  # the line of a child's figures on its stdout

# (section, key, what, unit): ``us`` lower is better, ``ops/s`` higher.
METRICS = [
    ("device", "await_empty_us", "awaited empty kernel, median", "us"),
    ("device", "blocking_empty_us", "launch + cuStreamSynchronize, median (CUDA)", "us"),
    ("device", "launch_empty_us", "enqueue_function, empty kernel", "us"),
    ("device", "launch_4args_us", "enqueue_function, 4 arguments", "us"),
    ("device", "copy_h2d_4k_us", "enqueue_copy 4 KiB pinned host -> device", "us"),
    ("device", "tasks_ops_per_s", "1,000 tasks x 10 awaits, 8 streams", "ops/s"),
    ("stand-in", "launch_4args_us", "CudaStream.launch, 4 arguments", "us"),
    ("stand-in", "enqueue_function_empty_us", "enqueue_function, empty", "us"),
    ("stand-in", "enqueue_function_4args_us", "enqueue_function, 4 arguments", "us"),
    ("stand-in", "launch_and_await_us", "launch and await, median", "us"),
    ("stand-in", "throughput_ops_per_s", "tasks x awaits over 8 streams", "ops/s"),
]


# -- in a child process: one build's figures ---------------------------------------------


def _empty_cpu(block: Any) -> None:
    return None


def _axpy_cpu(block: Any, a: Any, x: Any, y: Any, n: Any) -> None:
    i = block.global_idx.x
    i = i[i < n]
    y[i] = a * x[i] + y[i]


def device_figures(api: str, quick: bool) -> dict[str, Any]:
    """The ``device`` section on ``api`` ("cuda" or "cpu")."""
    import numpy as np
    from _harness import time_calls_async
    from bench_engine import latency, throughput
    from bench_fastpaths import SRC, _median_per_call_us

    import asyncgpu as ag

    calls, rounds, n_await = (2000, 3, 300) if quick else (10000, 5, 2000)
    out: dict[str, Any] = {}
    with ag.DeviceContext(api=api) as ctx:
        if api == "cuda":  # as the suite compiles them (run.py, bench_fastpaths.launch)
            empty = ctx.compile_function(SRC, "empty")
            axpy = ctx.compile_function(SRC, "axpy")
        else:
            empty = ctx.compile_function(ag.Kernel("empty", cpu=_empty_cpu))
            axpy = ctx.compile_function(ag.Kernel("axpy", cpu=_axpy_cpu))

        def launch_empty() -> Any:
            return ctx.enqueue_function(empty, grid_dim=1, block_dim=1)

        if api == "cuda":
            r = latency(ctx, empty, n_await)
            out["await_empty_us"] = r["asyncgpu_await"]["median_us"]
            out["blocking_empty_us"] = r["blocking_stream_sync"]["median_us"]
        else:

            async def awaits() -> list[int]:
                return await time_calls_async(launch_empty, n_await, warmup=200)

            out["await_empty_us"] = statistics.median(asyncio.run(awaits())) / 1e3

        n = 1 << 10
        x = ctx.enqueue_create_buffer(np.float32, n)
        y = ctx.enqueue_create_buffer(np.float32, n)
        ctx.enqueue_copy(x, np.ones(n, np.float32))
        ctx.enqueue_copy(y, np.ones(n, np.float32))
        a, nn = np.float32(1.0001), np.int32(n)

        def launch_4args() -> Any:
            return ctx.enqueue_function(axpy, a, x, y, nn, grid_dim=4, block_dim=256)

        host = ctx.enqueue_create_host_buffer(np.uint8, 4096)
        dev = ctx.enqueue_create_buffer(np.uint8, 4096)

        def copy_h2d() -> Any:
            return ctx.enqueue_copy(dev, host)

        for fn in (launch_empty, launch_4args, copy_h2d):
            for _ in range(calls // 4):  # warm: caches, the pools, the clocks
                fn()
        ctx.synchronize()
        for key, fn in (
            ("launch_empty_us", launch_empty),
            ("launch_4args_us", launch_4args),
            ("copy_h2d_4k_us", copy_h2d),
        ):
            out[key] = _median_per_call_us(fn, calls, rounds, ctx.synchronize)["median_us"]
        out["tasks_ops_per_s"] = throughput(ctx, empty, 1000, 10, 8, rounds=1)["ops_per_s"]
    return out


def stand_in_figures(quick: bool) -> dict[str, Any]:
    """The ``stand-in`` section: ``emulate_engine.py``'s own run, its JSON read back."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "emulate.json"
        argv = sys.argv
        sys.argv = ["emulate_engine.py", "--json", str(path), *(["--quick"] if quick else [])]
        try:
            runpy.run_path(str(BENCH / "emulate_engine.py"), run_name="__main__")
        finally:
            sys.argv = argv
        got = json.loads(path.read_text())
    return {key: got.get(key) for s, key, _, _ in METRICS if s == "stand-in"}


def child(section: str, api: str, quick: bool) -> None:
    """One build's figures of one section, printed on the line after ``MARK``."""
    # This build's asyncgpu first: the benchmark modules put this checkout's root
    # first on sys.path, which must not change which asyncgpu is imported.
    import asyncgpu

    here = Path(asyncgpu.__file__).resolve().parents[1]
    sys.path[:0] = [str(BENCH)]
    info: dict[str, Any] = {
        "asyncgpu": str(here),
        # the extension's own primitives: in this checkout's build, not in the variant's
        "c_primitives": hasattr(asyncgpu._accel.native, "RLock"),
    }
    if section == "stand-in":
        from _harness import Unavailable

        try:
            figures = stand_in_figures(quick)
        except Unavailable as e:  # no C compiler for the stand-in driver
            figures, info["unavailable"] = {}, str(e)
    else:
        figures = device_figures(api, quick)
    if Path(asyncgpu.__file__).resolve().parents[1] != here:
        raise AssertionError("another asyncgpu was imported during the run")
    print(MARK + json.dumps({**info, "figures": figures}), flush=True)


# -- the parent: both builds, round by round ---------------------------------------------


def run_child(build: Path, section: str, api: str, quick: bool, timeout_s: float) -> dict[str, Any]:
    """``child`` in a fresh process of ``build`` (a folder holding ``asyncgpu/``)."""
    others = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() not in (ROOT, build)
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(build), *others]))
    cmd = [sys.executable, __file__, "--child", section, "--device", api]
    if quick:
        cmd.append("--quick")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])  # type: ignore[no-any-return]
    raise RuntimeError(
        f"{section} on {build} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    )


def cuda_available() -> bool:
    try:
        import asyncgpu

        return asyncgpu.DeviceContext.number_of_devices(api="cuda") > 0
    except Exception:
        return False


def summarize(per_build: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    rows = []
    for section, key, what, unit in METRICS:
        name = f"{section}.{key}"
        m = [v for v in per_build["main"].get(name, []) if v is not None]
        v = [x for x in per_build["variant"].get(name, []) if x is not None]
        if not m or not v:
            continue
        mm, vm = statistics.median(m), statistics.median(v)
        rows.append(
            {
                "section": section,
                "key": key,
                "what": what,
                "unit": unit,
                "main": mm,
                "variant": vm,
                "main_range": [min(m), max(m)],
                "variant_range": [min(v), max(v)],
                "ratio_variant_over_main": vm / mm if mm else None,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]], api: str) -> str:
    def num(x: float) -> str:
        return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3f}"

    head = (
        f"{'section':13} {'figure':46} {'unit':5} {'main':>12} {'variant':>12} "
        f"{'v/main':>7}  rounds (main | variant)"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        section = f"{r['section']}" + (f" ({api})" if r["section"] == "device" else "")
        lines.append(
            f"{section:13} {r['what']:46} {r['unit']:5} {num(r['main']):>12} "
            f"{num(r['variant']):>12} {r['ratio_variant_over_main']:7.3f}  "
            f"{num(r['main_range'][0])}..{num(r['main_range'][1])} | "
            f"{num(r['variant_range'][0])}..{num(r['variant_range'][1])}"
        )
    return "\n".join(lines)


def git_revision(where: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--variant-dir", default=str(ROOT / ".variant"))
    ap.add_argument("--json", metavar="PATH", help="write every figure here")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer calls per figure")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--sections", default="device,stand-in", help="comma-separated")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per child process")
    ap.add_argument("--child", choices=("device", "stand-in"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child, a.device, a.quick)
        return 0

    variant = Path(a.variant_dir).resolve()
    if not list((variant / "asyncgpu").glob("_native*.so")):
        ap.error(f"{variant}/asyncgpu has no built extension: run make_variant.sh first")
    api = a.device if a.device != "auto" else ("cuda" if cuda_available() else "cpu")
    sections = [s for s in a.sections.split(",") if s]
    builds = {"main": ROOT, "variant": variant}
    per_build: dict[str, dict[str, list[float]]] = {"main": {}, "variant": {}}
    children: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for r in range(a.rounds):
        order = ["main", "variant"] if r % 2 == 0 else ["variant", "main"]
        for section in list(sections):
            for name in order:
                got = run_child(builds[name], section, api, a.quick, a.timeout)
                if got["c_primitives"] != (name == "main"):
                    raise AssertionError(f"the {name} build is not the one expected: {got}")
                if "unavailable" in got:
                    print(f"{section}: unavailable ({got['unavailable']})", file=sys.stderr)
                    sections.remove(section)
                    break
                children.append({"round": r, "build": name, "section": section, **got})
                for key, value in got["figures"].items():
                    per_build[name].setdefault(f"{section}.{key}", []).append(value)
                print(f"round {r + 1}/{a.rounds} {section:8} {name:7} done", file=sys.stderr)
    rows = summarize(per_build)
    print(format_table(rows, api))
    if api == "cpu":
        print(
            "(CPU device: its streams are push-completed, without the polled streams' "
            "locks and queue; the stand-in section runs those.)"
        )
    if a.json:
        sys.path[:0] = [str(BENCH)]
        import _harness as H

        H.write_json(
            a.json,
            {
                "suite": "primitives_ab",
                "started_at": H.utc_now(),
                "total_seconds": time.perf_counter() - t0,
                "device": api,
                "rounds": a.rounds,
                "quick": a.quick,
                "builds": {
                    "main": {"path": str(ROOT), "revision": git_revision(ROOT)},
                    "variant": {
                        "path": str(variant),
                        "revision": (variant / "REVISION").read_text().strip()
                        if (variant / "REVISION").exists()
                        else "unknown",
                    },
                },
                "environment": H.environment_info(probe_gpu=api == "cuda"),
                "table": rows,
                "raw": per_build,
                "children": children,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
