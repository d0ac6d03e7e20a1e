"""The benchmark harness helpers (benchmarks/_harness.py): statistics, timing,
result records, JSON output and the environment probe.  Pure Python: these run
without a GPU (the probe then records "unavailable: ...")."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import _harness as H  # noqa: E402

# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("q", [0, 1, 25, 50, 75, 90, 99, 99.9, 100])
def test_percentile_matches_numpy_linear(q):
    data = np.random.default_rng(1).exponential(10.0, size=1001)
    assert H.percentile(data.tolist(), q) == pytest.approx(float(np.percentile(data, q)))


def test_percentile_small_inputs():
    assert H.percentile([7.0], 99) == 7.0
    assert H.percentile([1, 2, 3, 4], 50) == 2.5
    assert H.percentile([4, 1, 3, 2], 0) == 1
    assert H.percentile([4, 1, 3, 2], 100) == 4
    with pytest.raises(ValueError):
        H.percentile([], 50)
    with pytest.raises(ValueError):
        H.percentile([1, 2], 101)


def test_median_odd_even():
    assert H.median([3, 1, 2]) == 2
    assert H.median([4, 1, 3, 2]) == 2.5


def test_summarize_keys_and_values():
    s = H.summarize(range(1, 101), "us")
    assert s["n"] == 100
    assert s["median_us"] == s["p50_us"] == pytest.approx(50.5)
    assert s["p99_us"] == pytest.approx(float(np.percentile(np.arange(1, 101), 99)))
    assert s["min_us"] == 1 and s["max_us"] == 100
    assert s["mean_us"] == pytest.approx(50.5)
    assert next(iter(s)) == "median_us"  # the headline metric comes first
    with pytest.raises(ValueError):
        H.summarize([])


def test_summarize_ns_converts_units():
    s = H.summarize_ns([1000, 2000, 3000])
    assert s["median_us"] == pytest.approx(2.0)
    ms = H.summarize_ns([1_000_000, 3_000_000], "ms")
    assert ms["median_ms"] == pytest.approx(2.0)


def test_bandwidth():
    assert H.bandwidth_gbps(55e9, 1.0) == pytest.approx(55.0)
    assert H.bandwidth_gbps(1, 0) == math.inf
    b = H.summarize_bandwidth(512 << 20, [0.01, 0.02, 0.01])
    assert b["median_gbps"] == pytest.approx((512 << 20) / 0.01 / 1e9)
    assert b["min_gbps"] == pytest.approx((512 << 20) / 0.02 / 1e9)
    assert b["median_ms"] == pytest.approx(10.0)
    assert b["n"] == 3


# --------------------------------------------------------------------------- timing


def test_time_calls_counts_and_restores_gc():
    calls = []
    assert gc.isenabled()
    samples = H.time_calls(lambda: calls.append(gc.isenabled()), 20, warmup=5)
    assert len(samples) == 20
    assert all(isinstance(t, int) and t >= 0 for t in samples)
    assert len(calls) == 25
    assert calls[-1] is False  # paused while timing
    assert gc.isenabled()
    with pytest.raises(ValueError):
        H.time_calls(lambda: None, 0)


def test_time_calls_async():
    n = 0

    async def op():
        nonlocal n
        n += 1
        await asyncio.sleep(0)

    samples = asyncio.run(H.time_calls_async(op, 10, warmup=3))
    assert len(samples) == 10 and n == 13


def test_run_async_timeout():
    async def forever():
        await asyncio.sleep(10)

    with pytest.raises(asyncio.TimeoutError):
        H.run_async(forever, 0.05)
    assert H.run_async(lambda: asyncio.sleep(0, result=5)) == 5


# --------------------------------------------------------------------------- cases and records


def test_run_case_ok_cleans_numpy_scalars():
    r = H.run_case("x", "g", lambda a: {"median_us": np.float64(a), "n": np.int64(3)}, 2.5)
    assert r.status == "ok"
    assert r.metrics == {"median_us": 2.5, "n": 3}
    assert type(r.metrics["median_us"]) is float and type(r.metrics["n"]) is int


def test_run_case_unavailable_and_error():
    def missing():
        raise H.Unavailable("cupy: ModuleNotFoundError: No module named 'cupy'")

    r = H.run_case("cupy", "g", missing)
    assert r.status == "unavailable"
    assert r.reason.startswith("unavailable: cupy: ModuleNotFoundError")

    def broken():
        raise ValueError("bad\nsecond line")

    e = H.run_case("b", "g", broken)
    assert e.status == "error"
    assert e.reason == "error: ValueError: bad"
    assert "ValueError" in e.detail


def test_environment_records_unavailable_without_driver(monkeypatch):
    from cuda.bindings import driver as drv

    def no_driver():
        raise RuntimeError("Failed to dlopen libcuda.so.1")

    monkeypatch.setattr(drv, "cuDriverGetVersion", no_driver)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    env = H.environment_info()
    for key in ("date", "hostname", "python", "driver_version", "device", "nvml_driver_version"):
        assert key in env
    assert env["driver_version"].startswith("unavailable: RuntimeError: Failed to dlopen")
    assert env["device"].startswith("unavailable")
    assert isinstance(env["nvml_driver_version"], str)
    assert env["libraries"]["numpy"].startswith(np.__version__)
    assert H.device_name(env).startswith("unavailable")


def test_environment_real_probe_never_raises():
    env = H.environment_info()
    drv_ver = env["driver_version"]
    assert isinstance(drv_ver, int) or drv_ver.startswith("unavailable")
    if isinstance(drv_ver, str) or isinstance(env["device"], str):
        assert str(env["device"]).startswith("unavailable")
    else:
        assert env["device"]["name"]
    assert H.environment_info(probe_gpu=False)["device"] == "unavailable: not probed"


def test_library_versions_reports_missing(monkeypatch):
    monkeypatch.setattr(H, "LIBRARIES", {**H.LIBRARIES, "nope": ("no-such-dist-xyz",)})
    libs = H.library_versions()
    assert libs["nope"] == "unavailable: not installed"
    assert libs["numpy"].startswith(np.__version__)
    for label in ("cuda-core", "cuda-bindings", "cupy", "torch", "numba-cuda"):
        assert label in libs


def test_record_and_json_roundtrip(tmp_path):
    results = [
        H.run_case("a", "completion", lambda: {"median_us": 10.5, "p99_us": float("nan")}),
        H.CaseResult("b", "launch", "unavailable", reason="unavailable: no GPU"),
    ]
    env = H.environment_info(probe_gpu=False)
    rec = H.make_record(results, env, suite="peers_gpu", params={"repeats": np.int64(5)})
    out = tmp_path / "sub" / "r.json"
    assert H.write_json(out, rec) == str(out)
    data = json.loads(out.read_text())
    assert data["schema"] == H.SCHEMA and data["suite"] == "peers_gpu"
    assert data["counts"] == {"ok": 1, "unavailable": 1, "error": 0}
    assert data["params"] == {"repeats": 5}
    assert data["results"]["a"]["metrics"] == {"median_us": 10.5, "p99_us": None}
    assert data["results"]["b"]["reason"] == "unavailable: no GPU"
    for key in ("date", "hostname", "device", "driver_version", "nvml_driver_version"):
        assert key in data["environment"]
    assert data["environment"]["device"].startswith("unavailable")
    assert not list(tmp_path.glob("sub/*.tmp*"))


def test_format_table():
    results = [
        H.run_case("rt_x", "completion", lambda: {"median_us": 10.5, "p50_us": 10.5, "p99_us": 20}),
        H.CaseResult("rt_y", "completion", "unavailable", reason="unavailable: torch missing"),
    ]
    text = H.format_table(results, {"rt_x": ("median_us", 9.9)})
    assert "rt_x" in text and "median_us=10.50" in text and "p99_us=20" in text
    assert "p50_us" not in text  # secondary statistics are left to the JSON
    assert "median_us=9.90" in text
    assert "unavailable: torch missing" in text


# --------------------------------------------------------------------------- peers CLI (no GPU)


def test_peers_cli_and_unavailable_cases(tmp_path, monkeypatch):
    import peers_gpu as P

    args = P.build_parser().parse_args(["--json", str(tmp_path / "o.json"), "--quick"])
    p = P.params_from_args(args)
    full = P.Params()
    assert p.repeats * 10 == full.repeats and p.copy_mib < full.copy_mib
    assert p.tasks == full.tasks  # the throughput workload keeps its shape
    assert P.params_from_args(P.build_parser().parse_args(["--repeats", "7"])).repeats == 7
    assert [c.name for c in P.select_cases(["copy_d2d"])] == ["copy_d2d"]
    assert all(c.group == "launch" for c in P.select_cases(["launch"]))
    assert "rt_torch_sync" not in [c.name for c in P.select_cases(None, ["torch"])]

    def no_gpu(params):
        raise H.Unavailable("no CUDA driver: RuntimeError: Failed to dlopen libcuda.so.1")

    monkeypatch.setattr(P, "Gpu", no_gpu)
    res = P.run_all(p, P.select_cases(["rt_stream_sync", "copy_d2d"]))
    assert [r.status for r in res] == ["unavailable", "unavailable"]
    assert res[0].reason == (
        "unavailable: no CUDA driver: RuntimeError: Failed to dlopen libcuda.so.1"
    )


def test_a_probe_report_prints_flat_figures_and_writes_everything(tmp_path, capsys):
    out = {"environment": {"date": "d"}, "launch_us": 3.14159, "err": 0, "nested": {"a": 1}}
    path = tmp_path / "probe.json"
    H.report_probe(out, str(path), skip=("nested",))
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"{'launch_us':40s} 3.142", f"{'err':40s} 0"]
    assert json.loads(path.read_text()) == out


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
def test_the_engine_emulation_runs_on_a_stand_in_driver(tmp_path):
    """``benchmarks/emulate_engine.py``: asyncgpu's CUDA hot paths on a compiled
    stand-in driver, so they can be compared between versions without a GPU."""
    out = tmp_path / "emulated.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "emulate_engine.py"
    subprocess.run([sys.executable, str(script), "--quick", "--json", str(out)], check=True)
    figures = json.loads(out.read_text())
    for key in ("launch_4args_us", "launch_and_await_us", "throughput_ops_per_s"):
        assert figures[key] > 0
    assert figures["cpu_function_chain_us_per_step"] > 0


def test_the_loop_profile_counts_a_stand_in_run_where_every_await_waits(tmp_path):
    """``benchmarks/diagnostics/profile_loop_throughput.py`` on the stand-in clock
    target made to finish each operation 6 us after its submission: the reactor
    polled, woke every await in batches, and under trio (where installed) the
    run's own count says each await cost its task a step; a budget sweep ran
    (and put the default budget back: the next loop reports it)."""
    from asyncgpu._core import engine

    out = tmp_path / "profile.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "diagnostics"
    loops = "asyncio,trio" if importlib.util.find_spec("trio") else "asyncio"
    args = ["--target", "emulated", "--loops", loops, "--rounds", "1", "--top", "0"]
    args += ["--json", str(out), "--stand-in-op-us", "0", "--stand-in-latency-us", "6"]
    args += ["--budget-sweep", "0.3"]
    subprocess.run(
        [sys.executable, str(script / "profile_loop_throughput.py"), *args],
        check=True,
        capture_output=True,
    )
    got = json.loads(out.read_text())
    assert got["stand_in_us"] == {"op": 0.0, "latency": 6.0, "launch": 0.0}
    for loop in loops.split(","):
        counts = got[loop]["counts"]
        assert counts["polls_moved"] > 0 and counts["reactor_starts"] >= 1
        assert counts["batch_mean"] > 0
        sweep = got[loop]["budget_sweep"]
        assert sweep["0.3"]["ops_per_s"] > 0 and sweep["0.3"]["ticker_ops_per_s"] > 0
        assert sweep["default_ms"] == pytest.approx(engine.ITERATION_S * 1e3)
    if "trio" in got:
        assert got["trio"]["counts"]["task_steps_per_op"] > 0.5


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
@pytest.mark.parametrize("case", ["await", "launch", "launch4", "create"])
def test_the_instruction_count_workloads_run_without_valgrind(case: str) -> None:
    """``benchmarks/callgrind_paths.py`` runs its workloads (1,000 tasks awaiting
    launches, launches, kept buffers created and dropped, on the stand-in
    driver) under callgrind; each runs alone anywhere,
    and every await of it completes."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "callgrind_paths.py"
    done = subprocess.run(
        [sys.executable, str(script), "--workload", case, "2"],
        capture_output=True,
        text=True,
        timeout=120,  # a hung await fails the test here
    )
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------- the report


def test_the_report_renders_the_committed_gpu_runs_with_their_wake_budget_sweeps():
    """benchmarks/report.py turns each committed GPU run into the performance
    page's section; a run with the wake-budget sweep gets its table, and says
    whether the settings took turns round by round or ran one after another."""
    import report

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    runs = sorted(results.glob("*-h[0-9]*-bench-*.json"))
    assert runs, "no committed GPU run"
    for path in runs:
        text = report.render(json.loads(path.read_text()))
        assert "taking turns round by round" in text or "one setting after another" in text
        rows = [line for line in text.splitlines() if line.startswith(("| 0.1 |", "| 0.3 |"))]
        assert len(rows) == 2 and "n/a" not in "".join(rows), path.name


def test_the_report_leaves_out_the_sweep_of_a_run_that_has_none():
    import report

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    runs = sorted(results.glob("*-h[0-9]*-bench-*.json"))  # (whichever GPU runs are committed)
    assert runs, "no committed GPU run"
    doc = json.loads(runs[0].read_text())
    del doc["results"]["engine_iteration_budget_sweep"]  # as runs before the sweep existed
    assert "wake-up budget" not in report.render(doc)


def test_the_suite_can_leave_out_its_cpu_loop_sections_and_still_be_reported(tmp_path):
    """``run.py --skip-cpu-loops`` (what a device call that also holds the test
    cases passes) runs without the loops on the CPU device and the stand-in
    clock, and a run without a GPU still renders, saying so."""
    import report

    out = tmp_path / "r.json"
    subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--quick", "--skip-cpu-loops", "--json", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    doc = json.loads(out.read_text())
    assert "cpu_functions" in doc["results"]
    assert not {"loops_cpu", "loops_emulated"} & set(doc["results"])
    assert report.render(doc).startswith(f"Run of {doc['started_at']} on no GPU")


def test_the_pytorch_serving_benchmark_runs_a_tiny_configuration(tmp_path):
    """``benchmarks/bench_torch_serving.py --quick``: every waiting strategy on
    one loop, checked results, a record that says whether a GPU ran it."""
    torch = pytest.importorskip("torch")
    out = tmp_path / "serving.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_torch_serving.py"
    subprocess.run(
        [sys.executable, str(script), "--quick", "--loops", "asyncio", "--json", str(out)],
        check=True,
        timeout=300,
    )
    record = json.loads(out.read_text())
    assert record["gpu"] == torch.cuda.is_available()
    rows = record["loops"]["asyncio"]["median"]
    assert [r["strategy"] for r in rows] == [
        *("sync", "executor", "poll-1ms", "poll-0", "asyncgpu", "asyncgpu-stream")
    ]
    assert all(r["requests_per_s"] > 0 and r["requests"] == 24 for r in rows)
    assert set(record["loops"]["asyncio"]["goals"][0]) >= {"rate_ok", "cpu_ok", "ticker_ok"}


def test_the_foreign_await_probe_runs_on_the_stand_in_driver(tmp_path):
    """``benchmarks/diagnostics/probe_foreign_await.py``: the Python calls and
    host time of one await of a wrapped stream, without a GPU."""
    pytest.importorskip("cuda.bindings", reason="cuda-python is not installed")
    out = tmp_path / "probe.json"
    diagnostics = Path(__file__).resolve().parents[2] / "benchmarks" / "diagnostics"
    script = diagnostics / "probe_foreign_await.py"
    subprocess.run(
        [sys.executable, str(script), "-n", "50", "--polls", "2", "--json", str(out)],
        check=True,
        timeout=300,
    )
    steps = json.loads(out.read_text())["steps"]
    assert set(steps) == {"await stream", "await fence"}
    assert all(s["calls_per_await"] > 0 for s in steps.values())
