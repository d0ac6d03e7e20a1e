"""The scripts in examples/ run to completion and verify their results, on the
CPU device and (where there is one) the GPU. Each one runs as a subprocess with
small sizes and writes into tmp_path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False


def run_example(
    name: str, *args: str, cwd: Path, api: str = "cpu"
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "ASYNCGPU_API": api,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    env.pop("ASYNCGPU_TRACE", None)
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )
    assert r.returncode == 0, f"{name} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r


def check_trace(path: Path) -> dict:
    data = json.loads(path.read_text())
    assert any(e["ph"] == "X" for e in data["traceEvents"])
    return data


def check_png(path: Path) -> None:
    if HAVE_MPL:
        assert path.read_bytes()[:8] == PNG_MAGIC
    else:
        assert not path.exists()


def test_examples_folder_has_the_scripts():
    names = {p.name for p in EXAMPLES.glob("*.py")}
    assert {"server.py", "pipeline.py", "dag.py", "ray_pipeline.py"} <= names


def test_pipeline(tmp_path, api):
    r = run_example(
        "pipeline.py",
        "--out",
        str(tmp_path),
        "--chunks",
        "6",
        "--size",
        "4096",
        cwd=tmp_path,
        api=api,
    )
    assert "verified:" in r.stdout
    data = check_trace(tmp_path / "pipeline-trace.json")
    check_trace(tmp_path / "pipeline-serial-trace.json")
    lanes = {e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "thread_name"}
    assert len(lanes) >= 2  # the chunks really went onto several streams
    kinds = {e["cat"] for e in data["traceEvents"] if e["ph"] == "X"}
    assert {"copy", "kernel", "cpu"} <= kinds
    check_png(tmp_path / "pipeline-timeline.png")


def test_dag(tmp_path, api):
    r = run_example("dag.py", "--out", str(tmp_path), "--size", "2048", cwd=tmp_path, api=api)
    assert "verified:" in r.stdout
    data = check_trace(tmp_path / "dag-trace.json")
    flows = [e for e in data["traceEvents"] if e["ph"] == "s"]
    assert len(flows) == 4  # A->C, B->C, C->E, D->E
    check_png(tmp_path / "dag-timeline.png")


@pytest.mark.parametrize("as_json", [False, True])
def test_server(tmp_path, as_json, api):
    args = ["--device", api, "--requests", "40", "--concurrency", "8", "--size", "512"]
    r = run_example("server.py", *args, "--out", str(tmp_path), *(["--json"] if as_json else []),
                    cwd=tmp_path, api=api)  # fmt: skip
    saved = json.loads((tmp_path / "server-results.json").read_text())
    assert saved["verified"] is True
    assert [run["mode"] for run in saved["runs"]] == ["await", "sync"]
    for run in saved["runs"]:
        assert run["requests"] == 40 and run["wrong_replies"] == 0
        assert run["requests_per_s"] > 0 and run["p99_ms"] >= run["p50_ms"] > 0
    if as_json:
        assert json.loads(r.stdout) == saved
    else:
        assert "req/s" in r.stdout and "p99 ms" in r.stdout
        assert "verified: every reply matches NumPy" in r.stdout


def test_server_writes_a_file_only_when_given_out(tmp_path, api):
    args = ["--device", api, "--requests", "8", "--concurrency", "2", "--size", "64", "--json"]
    r = run_example("server.py", *args, cwd=tmp_path, api=api)
    assert json.loads(r.stdout)["verified"] is True
    assert list(tmp_path.iterdir()) == []  # nothing in the current folder


def test_torch_server(tmp_path):
    """The PyTorch service and its load generator, every waiting strategy, a
    tiny model (on the CPU where PyTorch has no GPU: the note says so)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("aiohttp")
    out = tmp_path / "rows.json"
    r = run_example(
        "torch_server.py",
        *("--clients", "3", "--requests", "4", "--width", "32", "--batch", "2"),
        *("--check-every", "1", "--json", str(out)),
        cwd=tmp_path,
    )
    assert "verified:" in r.stdout
    saved = json.loads(out.read_text())
    assert [row["strategy"] for row in saved["rows"]] == [
        "sync",
        "executor",
        "poll-1ms",
        "poll-0",
        "asyncgpu",
    ]
    assert all(row["requests"] == 12 for row in saved["rows"])
    assert saved["gpu"] == torch.cuda.is_available()
    assert ("the strategies mean nothing without a GPU" in r.stdout) != saved["gpu"]


def test_ray_pipeline_without_ray(tmp_path, api):
    """The pipeline's stage classes driven directly (the GPU side without Ray)."""
    out = tmp_path / "direct.json"
    args = ["--direct", "--actors", "2", "--requests", "24", "--size", "4096", "--json", str(out)]
    r = run_example("ray_pipeline.py", *args, cwd=tmp_path, api=api)
    assert "all results match NumPy: OK" in r.stdout
    res = json.loads(out.read_text())
    assert (res["mode"], res["device"], res["requests"]) == ("direct", api, 24)


@pytest.mark.ray
def test_ray_pipeline_on_a_local_cluster(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install asyncgpu[ray])")
    out = tmp_path / "ray.json"
    args = ["--actors", "2", "--requests", "24", "--size", "4096", "--json", str(out)]
    r = run_example("ray_pipeline.py", *args, cwd=tmp_path)
    assert "all results match NumPy: OK" in r.stdout
    res = json.loads(out.read_text())
    assert (res["mode"], res["device"], res["actors"]) == ("ray", "cpu", 2)
