"""Render a benchmark JSON (from ``run.py --json``) as the Markdown tables of
docs/performance.md, so the docs quote measured numbers only.

    python benchmarks/report.py benchmarks/results/DATE-GPU-bench-COMMIT.json [PROBE.json]
    python benchmarks/report.py --across RUN1.json RUN2.json ...   (goals side by side)
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _m(res: dict[str, Any], case: str, key: str) -> float | None:
    r = res.get(case)
    if not r or r.get("status") != "ok":
        return None
    v = r["metrics"].get(key)
    return float(v) if isinstance(v, (int, float)) else None


def _budget_sweep(res: dict[str, Any]) -> list[str]:
    """The reactor's wake-up budget per loop iteration against throughput and
    ticker lag (``engine_iteration_budget_sweep``), where the run has it."""
    sweep = "engine_iteration_budget_sweep"
    if _m(res, sweep, "default_iteration_ms") is None:
        return []
    # each setting's rounds are listed since 20dee70, where they take turns
    turns = "ops_per_s_rounds_at_0.2ms" in res[sweep]["metrics"]
    how = (
        "the settings taking turns round by round (medians of their rounds)"
        if turns
        else "one setting after another (the median of each one's three rounds)"
    )
    out = [
        "The wake-up budget per loop iteration (`ITERATION_S`; the default is "
        f"{_f(_m(res, sweep, 'default_iteration_ms'), '{:g}')} ms), the same load, {how}:",
        "",
        "| budget (ms) | awaited ops/s | ticker p50 (ms) | ticker p99 after the start (ms) "
        "| loop iteration p50 (ms) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for ms in ("0.1", "0.15", "0.2", "0.3"):
        out.append(
            f"| {ms} | {_f(_m(res, sweep, f'ops_per_s_at_{ms}ms'), '{:,.0f}')} "
            f"| {_f(_m(res, sweep, f'ticker_lag_p50_ms_at_{ms}ms'), '{:.2f}')} "
            f"| {_f(_m(res, sweep, f'ticker_lag_steady_p99_ms_at_{ms}ms'), '{:.2f}')} "
            f"| {_f(_m(res, sweep, f'iteration_p50_ms_at_{ms}ms'), '{:.2f}')} |"
        )
    return [*out, ""]


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def render(doc: dict[str, Any]) -> str:
    res = doc["results"]
    env = doc["environment"]
    device = env.get("device")
    # (a run without a GPU records why there is none, a string, in place of the device)
    name = device.get("name", "?") if isinstance(device, dict) else "no GPU"
    out = [
        f"Run of {doc['started_at']} on {name}, driver "
        f"{env.get('nvml_driver_version')} (CUDA {env.get('driver_cuda_version')}), python "
        f"{env.get('python')}; command `python benchmarks/run.py --device --json ...` "
        "through `benchmarks/device_run.sh`.",
        "",
        "### Completion round trip (enqueue an empty kernel, learn it finished; median µs)",
        "",
        "| strategy | µs | / blocking sync |",
        "| --- | --- | --- |",
    ]
    base = _m(res, "engine_latency", "blocking_median_us")
    rows = [
        (
            "asyncgpu `await` (same process, interleaved)",
            _m(res, "engine_latency", "await_median_us"),
        ),
        (
            "asyncgpu `event.synchronize()`",
            _m(res, "engine_latency", "event_synchronize_median_us"),
        ),
        (
            "asyncgpu `await`, a driver event after each launch (the losing marker)",
            _m(res, "engine_latency_event_markers", "await_median_us"),
        ),
        ("launch + `cuStreamSynchronize` (same process)", base),
        ("peers: `cuStreamSynchronize`", _m(res, "rt_stream_sync", "median_us")),
        ("peers: mapped counter, busy spin", _m(res, "rt_mapped_counter_spin", "median_us")),
        (
            "peers: mapped counter + `asyncio.sleep(0)`",
            _m(res, "rt_asyncio_mapped_counter", "median_us"),
        ),
        (
            "peers: `cuEventQuery` + `asyncio.sleep(0)`",
            _m(res, "rt_asyncio_event_poll", "median_us"),
        ),
        ("peers: blocking-sync event", _m(res, "rt_blocking_event_sync", "median_us")),
        (
            "peers: `cuLaunchHostFunc` → `threading.Event`",
            _m(res, "rt_hostfunc_threading_event", "median_us"),
        ),
        (
            "peers: `cuLaunchHostFunc` → `call_soon_threadsafe`",
            _m(res, "rt_hostfunc_asyncio", "median_us"),
        ),
        (
            "peers: `run_in_executor(cuEventSynchronize)`",
            _m(res, "rt_executor_event_sync", "median_us"),
        ),
        ("peers: CuPy `stream.synchronize()`", _m(res, "rt_cupy_stream_sync", "median_us")),
        ("peers: PyTorch `torch.cuda.synchronize()`", _m(res, "rt_torch_sync", "median_us")),
    ]
    for name, v in rows:
        if v is None and "losing marker" in name:
            continue  # runs before the suite timed the other marker
        ratio = None if v is None or not base else v / base
        out.append(f"| {name} | {_f(v)} | {_f(ratio, '{:.2f}')} |")
    nb = res.get("rt_numba_async_done", {})
    if nb.get("status") != "ok":
        out.append(f"| peers: numba-cuda `async_done()` | {nb.get('reason', 'n/a')[:90]} | |")
    out += [
        "",
        "### Throughput: 1000 tasks x 10 awaited empty launches over 8 streams",
        "",
        "| strategy | awaited ops/s |",
        "| --- | --- |",
        f"| asyncgpu | {_f(_m(res, 'engine_throughput', 'ops_per_s'), '{:,.0f}')} |",
        *(
            [
                "| asyncgpu, a driver event after each launch | "
                f"{_f(_m(res, 'engine_throughput_event_markers', 'ops_per_s'), '{:,.0f}')} |"
            ]
            if _m(res, "engine_throughput_event_markers", "ops_per_s") is not None
            else []
        ),
        *(
            [
                "| asyncgpu, every finished await woken in each loop iteration | "
                f"{_f(_m(res, 'engine_throughput_uncapped_wakes', 'ops_per_s'), '{:,.0f}')} |"
            ]
            if _m(res, "engine_throughput_uncapped_wakes", "ops_per_s") is not None
            else []
        ),
        f"| host callbacks into asyncio | "
        f"{_f(_m(res, 'tp_hostfunc_asyncio', 'median_ops_per_s'), '{:,.0f}')} |",
        f"| `cuEventQuery` polling with `asyncio.sleep(0)` | "
        f"{_f(_m(res, 'tp_event_poll_asyncio', 'median_ops_per_s'), '{:,.0f}')} |",
        f"| `run_in_executor(cuEventSynchronize)` | "
        f"{_f(_m(res, 'tp_executor_event_sync', 'median_ops_per_s'), '{:,.0f}')} |",
        "",
        *(
            [
                "Paired rounds (the same streams, kernel and loop, asyncgpu and the host "
                "callbacks alternating, the collector on for both): asyncgpu "
                f"{_f(_m(res, 'engine_throughput_paired', 'asyncgpu_median_ops_per_s'), '{:,.0f}')}"
                ", host callbacks "
                f"{_f(_m(res, 'engine_throughput_paired', 'hostfunc_median_ops_per_s'), '{:,.0f}')}"
                " awaited ops/s; the median pair's ratio "
                f"{_f(_m(res, 'engine_throughput_paired', 'ratio_median'), '{:.2f}')}x (pairs "
                f"{_f(_m(res, 'engine_throughput_paired', 'ratio_min'), '{:.2f}')}x to "
                f"{_f(_m(res, 'engine_throughput_paired', 'ratio_max'), '{:.2f}')}x).",
                "",
            ]
            if _m(res, "engine_throughput_paired", "ratio_median") is not None
            else []
        ),
        f"Ticker lag during the asyncgpu run: p50 "
        f"{_f(_m(res, 'engine_throughput', 'ticker_lag_p50_ms'), '{:.2f}')} ms, p99 "
        f"{_f(_m(res, 'engine_throughput', 'ticker_lag_p99_ms'), '{:.2f}')} ms. CPU while one "
        f"task awaits a 200 ms kernel: "
        f"{_f(_m(res, 'engine_idle', 'cpu_fraction_of_one_core'), '{:.1%}')} of a core.",
        "",
        *_budget_sweep(res),
        "### Launch (host µs per launch, median)",
        "",
        "Each library timed in its own phase of the run (asyncgpu's is `fast_launch`):",
        "",
        "| kernel | asyncgpu | cuda.core | raw cuda.bindings | CuPy | PyTorch `add_` |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| empty | {_f(_m(res, 'fast_launch', 'empty_median_us'), '{:.2f}')} | "
        f"{_f(_m(res, 'launch_core_empty', 'median_us'), '{:.2f}')} | "
        f"{_f(_m(res, 'launch_raw_empty', 'median_us'), '{:.2f}')} | | |",
        f"| 4 args | {_f(_m(res, 'fast_launch', 'axpy4_median_us'), '{:.2f}')} | "
        f"{_f(_m(res, 'launch_core_4args', 'median_us'), '{:.2f}')} | "
        f"{_f(_m(res, 'launch_raw_4args', 'median_us'), '{:.2f}')} | "
        f"{_f(_m(res, 'launch_cupy_4args', 'median_us'), '{:.2f}')} | "
        f"{_f(_m(res, 'launch_torch_add', 'median_us'), '{:.2f}')} |",
        "",
        "The same kernels in alternating rounds of one process (the goals' ratios; "
        "PyTorch's smallest op, `add_` on 1,024 floats, beside the 4-argument kernel):",
        "",
        "| kernel | asyncgpu | cuda.core | CuPy `RawKernel` | PyTorch `add_` |",
        "| --- | --- | --- | --- | --- |",
        f"| empty | {_f(_m(res, 'fast_launch', 'paired_empty_median_us'), '{:.2f}')} | "
        f"{_f(_m(res, 'fast_launch', 'paired_core_empty_median_us'), '{:.2f}')} | | |",
        f"| 4 args | {_f(_m(res, 'fast_launch', 'paired_axpy4_median_us'), '{:.2f}')} | "
        f"{_f(_m(res, 'fast_launch', 'paired_core_axpy4_median_us'), '{:.2f}')} | "
        f"{_f(_m(res, 'fast_launch', 'paired_cupy_axpy4_median_us'), '{:.2f}')} | "
        f"{_f(_m(res, 'fast_launch', 'paired_torch_add_median_us'), '{:.2f}')} |",
        "",
        "### Copies, 512 MiB of random data (GB/s; D2D counts read + write)",
        "",
        "| copy | asyncgpu | raw |",
        "| --- | --- | --- |",
    ]
    for name, ours, peer in (
        ("H2D pinned", "h2d_pinned_gbps", "copy_h2d_pinned"),
        ("D2H pinned", "d2h_pinned_gbps", "copy_d2h_pinned"),
        ("D2D", "d2d_gbps", "copy_d2d"),
        ("H2D pageable", "h2d_pageable_gbps", "copy_h2d_pageable"),
        ("D2H pageable", "d2h_pageable_gbps", "copy_d2h_pageable"),
    ):
        out.append(
            f"| {name} | {_f(_m(res, 'fast_copies', ours))} | {_f(_m(res, peer, 'median_gbps'))} |"
        )
    out += [
        "",
        "### Allocation of 1 MiB and its release (µs per pair)",
        "",
        "| what | asyncgpu | raw |",
        "| --- | --- | --- |",
        f"| device buffer, kept by its stream | "
        f"{_f(_m(res, 'fast_alloc', 'device_1mib_us'), '{:.2f}')} | "
        f"`cuMemAlloc`+`cuMemFree` {_f(_m(res, 'alloc_device', 'median_us'), '{:.2f}')}; "
        f"`cuMemAllocAsync` pool {_f(_m(res, 'alloc_async_pool', 'median_us'), '{:.2f}')} |",
        f"| device buffer, no spare kept | "
        f"{_f(_m(res, 'fast_alloc', 'device_1mib_no_spare_us'), '{:.2f}')} | "
        f"`cuMemAlloc`+`cuMemFree` {_f(_m(res, 'alloc_device', 'median_us'), '{:.2f}')}; "
        f"`cuMemAllocAsync` pool {_f(_m(res, 'alloc_async_pool', 'median_us'), '{:.2f}')} |",
        f"| pinned host buffer | {_f(_m(res, 'fast_alloc', 'host_1mib_us'), '{:.2f}')} | "
        f"`cuMemAllocHost`+`cuMemFreeHost` "
        f"{_f(_m(res, 'alloc_pinned_host', 'median_us'), '{:.1f}')} |",
        "",
        "### Compile and overlap",
        "",
        f"A fresh process compiling a new kernel (NVRTC's load included) "
        f"{_f(_m(res, 'fast_compile', 'fresh_process_cold_compile_ms'))} ms; NVRTC alone, "
        f"loaded {_f(_m(res, 'fast_compile', 'cold_nvrtc_ms'))} ms; a fresh process's "
        f"disk-cache hit {_f(_m(res, 'fast_compile', 'fresh_process_disk_hit_ms'), '{:.2f}')} "
        f"ms; `compile_function` from the disk cache, the module's load included, "
        f"{_f(_m(res, 'fast_compile', 'compile_function_disk_hit_ms'))} ms; in-process repeat "
        f"{_f(_m(res, 'fast_compile', 'in_process_repeat_us'))} µs. 16 streams x 2 ms "
        f"one-block kernel: {_f(_m(res, 'fast_overlap', 'sixteen_streams_ms'), '{:.2f}')} ms "
        f"against {_f(_m(res, 'fast_overlap', 'one_stream_ms'), '{:.2f}')} ms for one "
        f"(raw peers: {_f(_m(res, 'overlap_spin_streams', 'many_streams_ms'), '{:.2f}')} / "
        f"{_f(_m(res, 'overlap_spin_streams', 'one_stream_ms'), '{:.2f}')} ms). 4-stream "
        f"pipeline speed-up: {_f(_m(res, 'fast_overlap', 'pipeline_speedup'), '{:.2f}')}x "
        f"(raw peers: {_f(_m(res, 'pipeline_streams', 'throughput_ratio'), '{:.2f}')}x).",
        "",
        "### Goals",
        "",
        "| goal | measured | target | met |",
        "| --- | --- | --- | --- |",
    ]
    for g in doc.get("goals", []):
        v = "n/a" if g["value"] is None else f"{g['value']:.3f}"
        op = ">=" if g["better"] == "higher" else "<="
        met = {True: "yes", False: "**no**", None: "-"}[g["met"]]
        target = "" if g["target"] is None else f"{op} {g['target']:g}"
        out.append(f"| {g['goal']} | {v} | {target} | {met} |")
    return "\n".join(out)


def render_probe(probe: dict[str, Any]) -> str:
    """The driver-call probe (``probe_driver.py --json``) as a table."""
    rows = [
        (
            "`cuLaunchKernel`, 4 arguments",
            "bindings_launch_4args_us",
            "native_launch_4args_packed_us",
        ),
        ("`cuLaunchKernel`, no arguments", "bindings_launch_empty_us", "native_launch_empty_us"),
        ("`cuStreamWriteValue64`", "bindings_write64_us", "native_write64_us"),
    ]
    out = [
        "| driver call (host µs, median) | cuda.bindings | `asyncgpu._native` "
        "| cuda.core `launch` |",
        "| --- | --- | --- | --- |",
    ]
    core = {0: "core_launch_4args_us", 1: "core_launch_empty_us"}
    for i, (what, b, n) in enumerate(rows):
        c = _f(probe.get(core[i]), "{:.2f}") if i in core else ""
        out.append(
            f"| {what} | {_f(probe.get(b), '{:.2f}')} | {_f(probe.get(n), '{:.2f}')} | {c} |"
        )
    out.append(
        f"| launch and marker in one call | | "
        f"{_f(probe.get('native_launch_4args_and_marker_us'), '{:.2f}')} | |"
    )
    if "layer_stream_launch_4args_us" in probe:
        out += ["", *_render_layers(probe)]
    return "\n".join(out)


def _render_layers(probe: dict[str, Any]) -> list[str]:
    """Where ``enqueue_function``'s host time goes: its layers, outermost last,
    and the pieces of the stream's layer timed alone."""
    layers = [
        ("`_native.launch`: the driver call, arguments packed", "native_launch_4args_packed_us"),
        (
            "`CudaStream.launch`: lock, order, event, markers, retiring (in C from 9964773)",
            "layer_stream_launch_4args_us",
        ),
        (
            "`DeviceContext.enqueue_function`: checks, geometry look-up",
            "layer_enqueue_function_4args_us",
        ),
        ("the same, 10,000 calls per round", "layer_enqueue_function_4args_10k_calls_us"),
        (
            "the same, the garbage collector off",
            "layer_enqueue_function_4args_10k_calls_no_gc_us",
        ),
    ]
    out = ["| layer of a 4-argument launch (host µs, median) | µs | above the layer below |"]
    out.append("| --- | --- | --- |")
    below = None
    for i, (what, key) in enumerate(layers):
        v = probe.get(key)
        step = ""
        if i < 3 and below is not None and v is not None:
            step = f"+{v - below:.2f}"
        out.append(f"| {what} | {_f(v, '{:.2f}')} | {step} |")
        if i < 3:
            below = v
    pieces = [
        ("the submit lock (the extension's `RLock`, by `with`)", "piece_submit_lock_us"),
        ("a `DeviceEvent`", "piece_event_init_us"),
        ("`_before_submit`", "piece_before_submit_us"),
        ("`_prune`", "piece_prune_us"),
        ("the geometry look-up", "piece_cfg_lookup_us"),
    ]
    out += [
        "",
        "| piece of the stream's layer, timed alone (in Python; the fast path does it in C"
        " from 9964773) | µs |",
        "| --- | --- |",
    ]
    out += [f"| {what} | {_f(probe.get(key), '{:.2f}')} |" for what, key in pieces]
    return out


def render_across(paths: list[str]) -> str:
    """The goals' ratios of several runs side by side (how much they move)."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    names = [p.rsplit("/", 1)[-1].removesuffix(".json") for p in paths]
    goals: dict[str, list[str]] = {}
    for i, d in enumerate(docs):
        for g in d.get("goals", []):
            v = g.get("value")
            row = goals.setdefault(g["goal"], [""] * len(docs))
            row[i] = "n/a" if v is None else f"{v:.3f}"
    out = ["| goal | " + " | ".join(f"`{n}`" for n in names) + " |"]
    out.append("| --- |" + " --- |" * len(names))
    out += [f"| {g} | " + " | ".join(vals) + " |" for g, vals in goals.items()]
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1] == "--across":
        print(render_across(sys.argv[2:]))
        raise SystemExit(0)
    with open(sys.argv[1]) as f:
        print(render(json.load(f)))
    if len(sys.argv) > 2:
        with open(sys.argv[2]) as f:
            print()
            print(render_probe(json.load(f)))
