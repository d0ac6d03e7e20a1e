"""``asyncgpu._config``: every environment variable is read and checked there
alone, and listed in its table (and in the docs')."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncgpu import _config

PACKAGE = Path(_config.__file__).resolve().parent
REPO = PACKAGE.parent

CORES = max(4, os.cpu_count() or 1)
HOME_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "asyncgpu", "kernels")

# (reader, variable, value, what it reads as); "" and unset give the default.
GOOD = [
    (_config.read_api, "ASYNCGPU_API", "", None),
    (_config.read_api, "ASYNCGPU_API", "cpu", "cpu"),
    (_config.read_api, "ASYNCGPU_API", " CUDA ", "cuda"),
    (_config.read_num_streams, "ASYNCGPU_NUM_STREAMS", "", 8),
    (_config.read_num_streams, "ASYNCGPU_NUM_STREAMS", "1", 1),
    (_config.read_num_streams, "ASYNCGPU_NUM_STREAMS", " 32 ", 32),
    (_config.read_trace, "ASYNCGPU_TRACE", "", None),
    (_config.read_trace, "ASYNCGPU_TRACE", "/tmp/t.json", "/tmp/t.json"),
    (_config.read_wake_budget_s, "ASYNCGPU_WAKE_BUDGET_MS", "", 0.0002),
    (_config.read_wake_budget_s, "ASYNCGPU_WAKE_BUDGET_MS", "0.1", 0.0001),
    (_config.read_wake_budget_s, "ASYNCGPU_WAKE_BUDGET_MS", " 1.5 ", 0.0015),
    (_config.read_wake_budget_s, "ASYNCGPU_WAKE_BUDGET_MS", "0.01", 0.00001),
    (_config.read_wake_budget_s, "ASYNCGPU_WAKE_BUDGET_MS", "100", 0.1),
    (_config.read_cpu_threads, "ASYNCGPU_CPU_THREADS", "", CORES),
    (_config.read_cpu_threads, "ASYNCGPU_CPU_THREADS", "1", 1),
    (_config.read_cpu_threads, "ASYNCGPU_CPU_THREADS", "64", 64),
    (_config.read_kernel_markers, "ASYNCGPU_KERNEL_MARKERS", "", "counter"),
    (_config.read_kernel_markers, "ASYNCGPU_KERNEL_MARKERS", "event", "event"),
    (_config.read_kernel_markers, "ASYNCGPU_KERNEL_MARKERS", "Counter", "counter"),
    (_config.read_completion, "ASYNCGPU_COMPLETION", "", "counter"),
    (_config.read_completion, "ASYNCGPU_COMPLETION", " EVENT ", "event"),
    (_config.read_device_max_connections, "CUDA_DEVICE_MAX_CONNECTIONS", "", 8),
    (_config.read_device_max_connections, "CUDA_DEVICE_MAX_CONNECTIONS", "1", 1),
    (_config.read_device_max_connections, "CUDA_DEVICE_MAX_CONNECTIONS", "32", 32),
    # The driver's variable: what it would run with is never refused, only read as 8.
    (_config.read_device_max_connections, "CUDA_DEVICE_MAX_CONNECTIONS", "0", 8),
    (_config.read_device_max_connections, "CUDA_DEVICE_MAX_CONNECTIONS", "64", 8),
    (_config.read_device_max_connections, "CUDA_DEVICE_MAX_CONNECTIONS", "x", 8),
    (_config.read_cache_dir, "ASYNCGPU_CACHE_DIR", "", HOME_CACHE),
    (_config.read_cache_dir, "ASYNCGPU_CACHE_DIR", "/k", "/k"),
    (_config.read_cache_dir, "ASYNCGPU_CACHE_DIR", "~/k", os.path.expanduser("~/k")),
    (_config.read_cache_dir, "XDG_CACHE_HOME", "/c", "/c/asyncgpu/kernels"),
    (_config.read_load_wait_s, "ASYNCGPU_LOAD_WAIT_S", "", 30.0),
    (_config.read_load_wait_s, "ASYNCGPU_LOAD_WAIT_S", "0", 0.0),
    (_config.read_load_wait_s, "ASYNCGPU_LOAD_WAIT_S", "0.05", 0.05),
    (_config.read_load_wait_s, "ASYNCGPU_LOAD_WAIT_S", "inf", float("inf")),
    (_config.read_disable_healthcheck, "ASYNCGPU_DISABLE_HEALTHCHECK", "", False),
    (_config.read_disable_healthcheck, "ASYNCGPU_DISABLE_HEALTHCHECK", "1", True),
    (_config.read_disable_healthcheck, "ASYNCGPU_DISABLE_HEALTHCHECK", "true", True),
    (_config.read_disable_healthcheck, "ASYNCGPU_DISABLE_HEALTHCHECK", "True", True),
    (_config.read_disable_healthcheck, "ASYNCGPU_DISABLE_HEALTHCHECK", "0", False),
]

BAD = [
    (_config.read_api, "ASYNCGPU_API", "metal"),
    (_config.read_num_streams, "ASYNCGPU_NUM_STREAMS", "many"),
    (_config.read_num_streams, "ASYNCGPU_NUM_STREAMS", "0"),
    (_config.read_num_streams, "ASYNCGPU_NUM_STREAMS", "-3"),
    (_config.read_num_streams, "ASYNCGPU_NUM_STREAMS", "2.5"),
    (_config.read_wake_budget_s, "ASYNCGPU_WAKE_BUDGET_MS", "fast"),
    (_config.read_wake_budget_s, "ASYNCGPU_WAKE_BUDGET_MS", "0"),
    (_config.read_wake_budget_s, "ASYNCGPU_WAKE_BUDGET_MS", "-1"),
    (_config.read_wake_budget_s, "ASYNCGPU_WAKE_BUDGET_MS", "1000"),
    (_config.read_wake_budget_s, "ASYNCGPU_WAKE_BUDGET_MS", "nan"),
    (_config.read_wake_budget_s, "ASYNCGPU_WAKE_BUDGET_MS", "inf"),
    (_config.read_cpu_threads, "ASYNCGPU_CPU_THREADS", "lots"),
    (_config.read_cpu_threads, "ASYNCGPU_CPU_THREADS", "0"),
    (_config.read_kernel_markers, "ASYNCGPU_KERNEL_MARKERS", "fence"),
    (_config.read_completion, "ASYNCGPU_COMPLETION", "poll"),
    (_config.read_load_wait_s, "ASYNCGPU_LOAD_WAIT_S", "soon"),
    (_config.read_load_wait_s, "ASYNCGPU_LOAD_WAIT_S", "-1"),
    (_config.read_load_wait_s, "ASYNCGPU_LOAD_WAIT_S", "nan"),
    (_config.read_disable_healthcheck, "ASYNCGPU_DISABLE_HEALTHCHECK", "please"),
]


@pytest.mark.parametrize(("read", "name", "value", "expected"), GOOD)
def test_each_variable_reads_its_accepted_values(read, name, value, expected) -> None:
    got = read({name: value})
    assert got == (pytest.approx(expected) if isinstance(expected, float) else expected)


@pytest.mark.parametrize("read", sorted({g[0] for g in GOOD}, key=lambda f: f.__name__))
def test_an_unset_variable_is_its_default(read) -> None:
    empty = [g for g in GOOD if g[0] is read and g[2] == ""]
    assert empty, f"no default case for {read.__name__}"
    assert read({}) == empty[0][3]


def test_the_cache_dir_prefers_asyncgpus_variable_to_xdg() -> None:
    env = {"ASYNCGPU_CACHE_DIR": "/mine", "XDG_CACHE_HOME": "/xdg"}
    assert _config.read_cache_dir(env) == "/mine"


@pytest.mark.parametrize(("read", "name", "value"), BAD)
def test_a_bad_value_is_a_value_error_naming_the_variable_and_the_value(read, name, value) -> None:
    with pytest.raises(ValueError, match=name) as info:
        read({name: value})
    assert value in str(info.value)


def test_the_api_error_keeps_its_wording() -> None:
    with pytest.raises(ValueError, match="ASYNCGPU_API must be cpu or cuda, not 'bogus'"):
        _config.read_api({"ASYNCGPU_API": "bogus"})


def test_the_settings_of_the_process_are_frozen_and_replaced_whole() -> None:
    s = _config.Settings.from_env({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.load_wait_s = 1.0  # type: ignore[misc]
    t = s.replace(load_wait_s=1.0)
    assert t.load_wait_s == 1.0 and s.load_wait_s == 30.0
    assert dataclasses.replace(t, load_wait_s=30.0) == s


def test_the_settings_are_read_at_import_and_a_bad_one_stops_it() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "ASYNCGPU_COMPLETION": "poll"}
    out = subprocess.run(
        [sys.executable, "-c", "import asyncgpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "ValueError: ASYNCGPU_COMPLETION must be counter or event, not 'poll'" in out.stderr


# -- one module reads the environment, and its table lists what it reads --------------------


def _package_sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_other_module_reads_the_environment() -> None:
    readers = []
    for path in _package_sources():
        if path.name == "_config.py":
            continue
        text = path.read_text(encoding="utf-8")
        if re.search(r"\benviron\b|\bgetenv\b|\bputenv\b", text):
            readers.append(path.relative_to(PACKAGE).as_posix())
    for path in sorted(PACKAGE.rglob("*.c")):
        if re.search(r"\bgetenv\s*\(", path.read_text(encoding="utf-8")):
            readers.append(path.relative_to(PACKAGE).as_posix())
    assert readers == [], "read the environment through asyncgpu._config"


def test_config_imports_only_the_standard_library() -> None:
    tree = ast.parse((PACKAGE / "_config.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, "asyncgpu._config must stay a leaf"
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            assert top in sys.stdlib_module_names or top == "__future__", name


def _variables_read() -> set[str]:
    """The names ``_config`` looks up: every lookup goes through ``_raw``."""
    tree = ast.parse((PACKAGE / "_config.py").read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_raw":
            arg = node.args[1]
            if isinstance(arg, ast.Constant):
                names.add(arg.value)
            else:  # the shared parsers get the name from their caller
                assert isinstance(arg, ast.Name) and arg.id == "name", ast.dump(arg)
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None) in ("_flag", "_choice", "_int_at_least_1")
            and isinstance(node.args[1], ast.Constant)
        ):
            names.add(node.args[1].value)
    return names


def _table_rows(text: str) -> set[str]:
    return set(re.findall(r"^([A-Z][A-Z0-9]*_[A-Z0-9_]+)\s", text, re.MULTILINE))


def test_the_module_table_lists_every_variable_read() -> None:
    read = _variables_read()
    assert len(read) == 13
    assert _table_rows(_config.__doc__ or "") == read


def test_every_variable_is_in_a_table_of_the_docs() -> None:
    docs = REPO / "docs"
    if not docs.is_dir():
        pytest.skip("no docs next to the package (an installed copy)")
    rows = set()
    for page in docs.rglob("*.md"):
        rows |= set(re.findall(r"^\|\s*`([A-Z0-9_]+)`\s*\|", page.read_text("utf-8"), re.M))
    assert _variables_read() <= rows
