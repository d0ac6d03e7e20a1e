"""The ``asyncgpu`` command line: info, demo, bench, trace, help and errors.

Run in-process through ``asyncgpu._tools.cli.main`` (plus one real ``python -m``
subprocess), on the CPU device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgpu._tools import cli as _cli
from asyncgpu._tools.cli import main

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _cpu(monkeypatch):
    monkeypatch.setenv("ASYNCGPU_API", "cpu")


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("asyncgpu: error: ")
    return lines[0]


# -- info ------------------------------------------------------------------------------


def test_info_text(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "default device api: cpu" in out
    assert "[cpu] 1 device(s)" in out
    assert "  device 0: cpu (" in out  # the name, then the processor
    assert "healthcheck: ok" in out
    assert "default_device_info:" in out and "warp_size: 1" in out
    assert "MAX_THREADS_PER_BLOCK: 1024" in out
    assert "[cuda]" in out  # present or "not available", never a crash


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["default_api"] == "cpu"
    (cpu,) = [a for a in data["apis"] if a["api"] == "cpu"]
    assert cpu["available"] and cpu["count"] == 1
    dev = cpu["devices"][0]
    assert dev["healthcheck"] == "ok"
    assert dev["info"]["api"] == "cpu" and dev["info"]["target"] == "cpu"
    assert dev["memory"]["total"] > 0
    assert dev["attributes"]["WARP_SIZE"] == 1
    assert dev["attributes"]["COMPUTE_CAPABILITY_MAJOR"].startswith("n/a")
    (cuda,) = [a for a in data["apis"] if a["api"] == "cuda"]
    assert isinstance(cuda["available"], bool)


def test_info_only_one_api(capsys):
    assert main(["info", "--api", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [a["api"] for a in data["apis"]] == ["cpu"]


# -- demo ------------------------------------------------------------------------------


def test_demo_writes_trace_and_png(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--batches", "3", "--size", "4096"]) == 0
    out = capsys.readouterr().out
    assert "verified:" in out
    assert "api=cpu" in out
    assert "cpu:0/s1" in out  # the stream of each op is shown
    data = json.loads((tmp_path / "asyncgpu-demo-trace.json").read_text())
    kinds = {e["cat"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert {"copy", "memset", "kernel", "cpu", "wait"} <= kinds
    assert any(e["ph"] == "s" for e in data["traceEvents"])
    # Every operation's record was complete when the file was written.
    assert not [e for e in data["traceEvents"] if e["ph"] == "X" and "incomplete" in e["args"]]
    png = tmp_path / "asyncgpu-demo-timeline.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not png.exists()
        assert "matplotlib" in out
    else:
        assert png.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.gpu
def test_demo_on_the_gpu(tmp_path, capsys, monkeypatch):
    from conftest import CUDA_DEVICES, NO_CUDA_REASON

    if CUDA_DEVICES == 0:
        pytest.skip(NO_CUDA_REASON)
    monkeypatch.setenv("ASYNCGPU_API", "cuda")
    assert main(["demo", "--out", str(tmp_path), "--batches", "3", "--size", "4096"]) == 0
    out = capsys.readouterr().out
    assert "verified:" in out and "api=cuda" in out
    data = json.loads((tmp_path / "asyncgpu-demo-trace.json").read_text())
    kinds = {e["cat"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert {"copy", "memset", "kernel", "cpu", "wait"} <= kinds


def test_demo_without_matplotlib(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["demo", "--out", str(tmp_path), "--batches", "2", "--size", "512"]) == 0
    out = capsys.readouterr().out
    assert "matplotlib is not installed" in out and "asyncgpu[plot]" in out
    assert (tmp_path / "asyncgpu-demo-trace.json").is_file()
    assert not (tmp_path / "asyncgpu-demo-timeline.png").exists()


def test_demo_failure_is_one_line(tmp_path, capsys, monkeypatch):
    from asyncgpu._tools import demo as _demo

    async def broken(*a, **k):
        raise _demo.DemoError("batch 0: element 3 is 1.0, NumPy says 2.0")

    monkeypatch.setattr(_demo, "run_demo", broken)
    assert main(["demo", "--out", str(tmp_path)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "demo failed" in line and "element 3" in line


def test_demo_on_a_missing_api_fails_cleanly(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ASYNCGPU_API", "nonsense")
    assert main(["demo", "--out", str(tmp_path)]) == 2
    assert "nonsense" in _one_error_line(capsys.readouterr().err)


def test_no_gpu_is_one_reason_in_one_wording(tmp_path, capsys):
    from asyncgpu import DeviceContext

    if DeviceContext.number_of_devices(api="cuda") > 0:
        pytest.skip("this machine has a CUDA GPU")
    assert main(["info", "--api", "cuda"]) == 2
    out, err = capsys.readouterr()
    info_line = _one_error_line(err)
    assert main(["demo", "--api", "cuda", "--out", str(tmp_path), "--no-png"]) == 2
    assert _one_error_line(capsys.readouterr().err) == info_line
    reason = info_line.removeprefix("asyncgpu: error: no cuda device: ")
    assert reason != info_line and reason != "no device found"
    assert f"[cuda] not available: {reason}" in out


def test_info_with_a_bad_device_api_variable_fails_cleanly(capsys, monkeypatch):
    monkeypatch.setenv("ASYNCGPU_API", "bogus")
    assert main(["info"]) == 2
    assert "ASYNCGPU_API must be cpu or cuda" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv",
    [["info"], ["demo", "--batches", "2", "--size", "512", "--no-png"]],
    ids=["info", "demo"],
)
def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path, argv):
    """``asyncgpu info | head -1``, with the reader gone before the first write."""
    env = {**os.environ, "ASYNCGPU_API": "cpu", "PYTHONPATH": str(REPO)}
    if argv[0] == "demo":
        argv = [*argv, "--out", str(tmp_path)]
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "asyncgpu", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr


# -- trace -----------------------------------------------------------------------------


def test_trace_draws_a_saved_trace(tmp_path, capsys):
    assert (
        main(["demo", "--out", str(tmp_path), "--batches", "2", "--size", "512", "--no-png"]) == 0
    )
    capsys.readouterr()
    src = tmp_path / "asyncgpu-demo-trace.json"
    pytest.importorskip("matplotlib")
    png = tmp_path / "drawn.png"
    assert main(["trace", str(src), "--png", str(png), "--title", "t"]) == 0
    out = capsys.readouterr().out
    assert "operations on" in out and "cross-stream waits" in out
    assert png.read_bytes()[:8] == PNG_MAGIC
    # without --png the PNG goes beside the JSON
    assert main(["trace", str(src)]) == 0
    assert src.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


def test_trace_missing_file(tmp_path, capsys):
    assert main(["trace", str(tmp_path / "nope.json")]) == 2
    assert "no such trace file" in _one_error_line(capsys.readouterr().err)


def test_trace_not_a_trace(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    assert main(["trace", str(bad)]) == 2
    assert "traceEvents" in _one_error_line(capsys.readouterr().err)


# -- bench -----------------------------------------------------------------------------


def test_bench_finds_the_suite_of_this_checkout():
    assert _cli._repo_root() == REPO
    assert (REPO / "benchmarks" / "run.py").is_file()


def test_bench_without_suite(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(_cli, "_repo_root", lambda: tmp_path)
    assert main(["bench"]) == 2
    assert "source checkout" in _one_error_line(capsys.readouterr().err)


def test_bench_runs_the_suite_with_quick(tmp_path, capsys, monkeypatch):
    (tmp_path / "benchmarks").mkdir()
    record = tmp_path / "argv.json"
    (tmp_path / "benchmarks" / "run.py").write_text(
        "import json, os, sys\n"
        f"json.dump([sys.argv[1:], os.getcwd()], open({str(record)!r}, 'w'))\n"
    )
    monkeypatch.setattr(_cli, "_repo_root", lambda: tmp_path)
    monkeypatch.setattr(_cli.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert main(["bench", "--quick", "--", "--only", "launch"]) == 0
    out = capsys.readouterr().out
    argv, cwd = json.loads(record.read_text())
    assert argv[:3] == ["--quick", "--only", "launch"] and argv[3] == "--json"
    # The full results go to a new file in the temp folder, named before the run.
    written = Path(argv[4])
    assert written.parent == tmp_path / "tmp" and written.suffix == ".json"
    assert f"the full results go to {written}" in out
    assert Path(cwd) == tmp_path


def test_bench_names_the_json_path_it_was_given(tmp_path, capsys, monkeypatch):
    (tmp_path / "benchmarks").mkdir()
    record = tmp_path / "argv.json"
    (tmp_path / "benchmarks" / "run.py").write_text(
        f"import json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
    )
    monkeypatch.setattr(_cli, "_repo_root", lambda: tmp_path)
    assert main(["bench", "--", "--json", "out/r.json"]) == 0
    assert json.loads(record.read_text()) == ["--json", "out/r.json"]  # no second --json
    assert f"the full results go to {tmp_path / 'out' / 'r.json'}" in capsys.readouterr().out


def test_bench_failure_propagates(tmp_path, capsys, monkeypatch):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "run.py").write_text("raise SystemExit(3)\n")
    monkeypatch.setattr(_cli, "_repo_root", lambda: tmp_path)
    assert main(["bench"]) == 2
    assert "status 3" in _one_error_line(capsys.readouterr().err)


# -- help and bad arguments ------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--help"], ["info", "--help"], ["demo", "--help"],
                                  ["bench", "--help"], ["trace", "--help"]])  # fmt: skip
def test_help(argv, capsys):
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: asyncgpu")


def test_top_level_help_lists_commands(capsys):
    main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("info", "demo", "bench", "trace"):
        assert cmd in out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("asyncgpu 0.")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["nope"],
        ["demo", "--batches", "0"],
        ["demo", "--size", "many"],
        ["demo", "--api", "metal"],
        ["trace"],
        ["info", "--bogus"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    _one_error_line(captured.err)
    assert captured.out == ""


def test_python_dash_m(tmp_path):
    env = {**os.environ, "ASYNCGPU_API": "cpu", "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-m", "asyncgpu", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert r.returncode == 0 and "demo" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "asyncgpu", "frobnicate"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert r.returncode == 2
    _one_error_line(r.stderr)
