"""Timing, statistics and reporting helpers shared by the benchmark scripts.

Pure Python (NumPy is optional here) so that the statistics, the result
records, the JSON output and the environment probe work on machines without a
GPU; only the probes themselves touch CUDA, and each of them records
``"unavailable: <reason>"`` instead of failing.

Conventions used by every benchmark in this directory:

* Host-side latencies are timed with :func:`time.perf_counter_ns` around the
  whole operation, one sample per repeat, after a warm-up; they are reported
  in microseconds by :func:`summarize` (``median_us``, ``p50_us``, ``p99_us``,
  ...).
* Device-side durations are timed with CUDA events by the caller and passed in
  as milliseconds or converted to bandwidth (GB/s, 1 GB = 1e9 bytes).
* A benchmark case is a callable returning a flat ``dict`` of numbers.  It is
  run through :func:`run_case`, which turns :class:`Unavailable` into a
  ``status == "unavailable"`` result and any other exception into
  ``status == "error"``, so one broken case never loses the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import gc
import importlib
import importlib.metadata
import json
import math
import os
import platform
import socket
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "asyncgpu-bench/1"

#: Libraries whose versions are recorded: label -> candidate distribution names.
LIBRARIES: dict[str, tuple[str, ...]] = {
    "numpy": ("numpy",),
    "cuda-core": ("cuda-core",),
    "cuda-bindings": ("cuda-bindings",),
    "cuda-python": ("cuda-python",),
    "nvidia-cuda-nvrtc": ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu13", "nvidia-cuda-nvrtc-cu12"),
    "cupy": ("cupy-cuda13x", "cupy-cuda12x", "cupy"),
    "torch": ("torch",),
    "numba-cuda": ("numba-cuda",),
    "numba": ("numba",),
    "nvidia-ml-py": ("nvidia-ml-py", "pynvml"),
    "asyncgpu": ("asyncgpu",),
}

#: Import name used to test importability / read ``__version__``.
_IMPORT_NAMES: dict[str, str] = {
    "numpy": "numpy",
    "cuda-core": "cuda.core",
    "cuda-bindings": "cuda.bindings",
    "cupy": "cupy",
    "torch": "torch",
    "numba-cuda": "numba_cuda",
    "numba": "numba",
    "nvidia-ml-py": "pynvml",
    "asyncgpu": "asyncgpu",
}


# --------------------------------------------------------------------------- errors


class Unavailable(Exception):
    """Raised by a benchmark case when a library or the GPU it needs is missing."""


def describe_exception(exc: BaseException) -> str:
    """``"TypeName: message"`` on one line (first line of the message)."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0]}" if msg else type(exc).__name__


# --------------------------------------------------------------------------- statistics


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (NumPy's default)."""
    data = sorted(float(v) for v in values)
    if not data:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * (q / 100.0)
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    frac = pos - lo
    return data[lo] + (data[hi] - data[lo]) * frac


def median(values: Iterable[float]) -> float:
    return percentile(values, 50.0)


def summarize(values: Iterable[float], unit: str = "us", *, scale: float = 1.0) -> dict[str, float]:
    """Summary statistics of ``values * scale``, keys suffixed with ``_unit``.

    Returns ``median``, ``p50``, ``p90``, ``p99``, ``mean``, ``min``, ``max``
    (each ``<stat>_<unit>``) and ``n``.
    """
    data = sorted(float(v) * scale for v in values)
    if not data:
        raise ValueError("summarize of an empty sequence")
    out: dict[str, float] = {
        f"median_{unit}": percentile(data, 50.0),
        f"p50_{unit}": percentile(data, 50.0),
        f"p90_{unit}": percentile(data, 90.0),
        f"p99_{unit}": percentile(data, 99.0),
        f"mean_{unit}": math.fsum(data) / len(data),
        f"min_{unit}": data[0],
        f"max_{unit}": data[-1],
    }
    out["n"] = len(data)
    return out


def summarize_ns(samples_ns: Iterable[float], unit: str = "us") -> dict[str, float]:
    """Summarize nanosecond samples in microseconds (``unit="us"``) or milliseconds."""
    scale = {"ns": 1.0, "us": 1e-3, "ms": 1e-6, "s": 1e-9}[unit]
    return summarize(samples_ns, unit, scale=scale)


def bandwidth_gbps(nbytes: float, seconds: float) -> float:
    """Bytes per second in GB/s (1 GB = 1e9 bytes)."""
    if seconds <= 0:
        return float("inf")
    return nbytes / seconds / 1e9


def summarize_bandwidth(nbytes: float, durations_s: Sequence[float]) -> dict[str, float]:
    """Bandwidth statistics for ``nbytes`` moved in each of ``durations_s``."""
    if not durations_s:
        raise ValueError("no durations")
    rates = [bandwidth_gbps(nbytes, d) for d in durations_s]
    return {
        "median_gbps": median(rates),
        "max_gbps": max(rates),
        "min_gbps": min(rates),
        "median_ms": median(durations_s) * 1e3,
        "bytes": float(nbytes),
        "n": len(rates),
    }


# --------------------------------------------------------------------------- timing


@contextlib.contextmanager
def gc_paused(enabled: bool = True) -> Iterator[None]:
    """Disable the cyclic garbage collector inside the block (restored after)."""
    was = gc.isenabled()
    if enabled:
        gc.collect()
        gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def time_calls(
    fn: Callable[[], object], repeats: int, warmup: int = 0, *, pause_gc: bool = True
) -> list[int]:
    """Call ``fn()`` ``warmup`` times untimed, then ``repeats`` times; ns per call."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    for _ in range(warmup):
        fn()
    samples = [0] * repeats
    clock = time.perf_counter_ns
    with gc_paused(pause_gc):
        for i in range(repeats):
            t0 = clock()
            fn()
            samples[i] = clock() - t0
    return samples


async def time_calls_async(
    fn: Callable[[], Awaitable[object]], repeats: int, warmup: int = 0, *, pause_gc: bool = True
) -> list[int]:
    """Async counterpart of :func:`time_calls`: ``await fn()`` per sample."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    for _ in range(warmup):
        await fn()
    samples = [0] * repeats
    clock = time.perf_counter_ns
    with gc_paused(pause_gc):
        for i in range(repeats):
            t0 = clock()
            await fn()
            samples[i] = clock() - t0
    return samples


def run_async(coro_fn: Callable[[], Awaitable[Any]], timeout_s: float | None = None) -> Any:
    """Run ``coro_fn()`` in a fresh event loop, optionally bounded by ``timeout_s``."""

    async def _main() -> Any:
        if timeout_s is None:
            return await coro_fn()
        return await asyncio.wait_for(coro_fn(), timeout_s)

    return asyncio.run(_main())


# --------------------------------------------------------------------------- results


@dataclass
class CaseResult:
    """Outcome of one benchmark case."""

    name: str
    group: str
    status: str  # "ok" | "unavailable" | "error"
    metrics: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    seconds: float = 0.0
    detail: str | None = None  # traceback tail for errors

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "group": self.group,
            "status": self.status,
            "metrics": dict(self.metrics),
            "seconds": round(self.seconds, 4),
        }
        if self.reason is not None:
            out["reason"] = self.reason
        if self.detail is not None:
            out["detail"] = self.detail
        return out


def run_case(
    name: str, group: str, fn: Callable[..., Mapping[str, Any]], *args: Any, **kwargs: Any
) -> CaseResult:
    """Run one case; never raises (except KeyboardInterrupt / SystemExit)."""
    t0 = time.perf_counter()
    try:
        metrics = fn(*args, **kwargs)
    except Unavailable as exc:
        reason = str(exc) or "unavailable"
        if not reason.startswith("unavailable"):
            reason = f"unavailable: {reason}"
        return CaseResult(
            name, group, "unavailable", reason=reason, seconds=time.perf_counter() - t0
        )
    except Exception as exc:
        tb = traceback.format_exc(limit=8).strip().splitlines()
        return CaseResult(
            name,
            group,
            "error",
            reason=f"error: {describe_exception(exc)}",
            seconds=time.perf_counter() - t0,
            detail="\n".join(tb[-12:]),
        )
    clean = {str(k): _clean_number(v) for k, v in dict(metrics).items()}
    return CaseResult(name, group, "ok", metrics=clean, seconds=time.perf_counter() - t0)


class GcRecorder:
    """The garbage collector's passes while it is entered (it may be entered
    again; the figures add up): how many of each generation, and the time they
    stopped the process (``gc.callbacks``). One full pass can outweigh what it
    interrupts: over 800,000 small objects it took 57 ms on the development
    machine, a quarter of a throughput round on a GPU."""

    def __init__(self) -> None:
        self.passes = [0, 0, 0]
        self.pause_s = 0.0
        self.longest_s = 0.0
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            dt = time.perf_counter() - self._t0
            self.passes[info["generation"]] += 1
            self.pause_s += dt
            self.longest_s = max(self.longest_s, dt)

    def __enter__(self) -> GcRecorder:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def metrics(self) -> dict[str, Any]:
        return {
            "gc_passes_by_generation": list(self.passes),
            "gc_pause_ms": self.pause_s * 1e3,
            "gc_longest_pause_ms": self.longest_s * 1e3,
        }


def report_probe(out: Mapping[str, Any], json_path: str | None, skip: Iterable[str] = ()) -> None:
    """Print a probe's flat figures one per line (``skip``: nested ones, which only
    the JSON keeps), and write all of it to ``json_path`` if given."""
    leave = {"environment", *skip}
    for k, v in out.items():
        if k not in leave:
            print(f"{k:40s} {v:.3f}" if isinstance(v, float) else f"{k:40s} {v}")
    if json_path:
        from pathlib import Path

        Path(json_path).write_text(json.dumps(out, indent=1))


def _clean_number(v: Any) -> Any:
    """Plain Python numbers for JSON (NumPy scalars become int/float/bool)."""
    if v is None or type(v) in (bool, int, float, str):
        return v
    if isinstance(v, (list, tuple)):  # per-round figures
        return [_clean_number(x) for x in v]
    item = getattr(v, "item", None)  # NumPy scalar (np.float64 subclasses float)
    if callable(item):
        return _clean_number(item())
    for base in (bool, int, float, str):  # subclasses such as IntEnum
        if isinstance(v, base):
            return base(v)
    return float(v)


def make_record(
    results: Sequence[CaseResult] | Mapping[str, CaseResult],
    environment: Mapping[str, Any],
    *,
    suite: str,
    params: Mapping[str, Any] | None = None,
    started_at: str | None = None,
    total_seconds: float | None = None,
) -> dict[str, Any]:
    """The JSON document for one benchmark run."""
    items = results.values() if isinstance(results, Mapping) else results
    res = {r.name: r.to_dict() for r in items}
    counts = {"ok": 0, "unavailable": 0, "error": 0}
    for r in res.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return {
        "schema": SCHEMA,
        "suite": suite,
        "started_at": started_at or utc_now(),
        "total_seconds": None if total_seconds is None else round(total_seconds, 3),
        "environment": dict(environment),
        "params": dict(params or {}),
        "counts": counts,
        "results": res,
    }


def _sanitize(obj: Any) -> Any:
    """JSON-safe copy: NumPy scalars -> Python, non-finite floats -> None, tuples -> lists."""
    if isinstance(obj, Mapping):
        return {str(k): _sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_sanitize(v) for v in obj]
    if obj is None or type(obj) in (bool, int, str):
        return obj
    if type(obj) is float:
        return obj if math.isfinite(obj) else None
    item = getattr(obj, "item", None)  # NumPy scalars and 0-d arrays
    if callable(item):
        return _sanitize(item())
    if isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, bytes):
        return obj.decode("utf-8", "replace")
    return str(obj)


def write_json(path: str | os.PathLike[str], record: Mapping[str, Any]) -> str:
    """Write ``record`` as indented JSON (atomically: temp file + rename); returns the path."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    text = json.dumps(_sanitize(record), indent=2, sort_keys=False, allow_nan=False)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.write("\n")
    os.replace(tmp, path)
    return path


_SECONDARY = ("p50_", "p90_", "mean_", "min_", "max_")


def format_table(
    results: Sequence[CaseResult],
    references: Mapping[str, tuple[str, float]] | None = None,
    *,
    max_metrics: int = 3,
) -> str:
    """A plain-text table: case, status, the first metrics, and a reference value."""
    references = references or {}
    rows = [("case", "status", "result", "reference")]
    for r in results:
        if r.status == "ok":
            keys = [k for k in r.metrics if not k.startswith(_SECONDARY)] or list(r.metrics)
            shown = [(k, r.metrics[k]) for k in keys[:max_metrics]]
            text = "  ".join(f"{k}={_fmt(v)}" for k, v in shown)
        else:
            text = (r.reason or "")[:100]
        ref = references.get(r.name)
        ref_text = f"{ref[0]}={_fmt(ref[1])}" if ref else ""
        rows.append((r.name, r.status, text, ref_text))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = []
    for i, row in enumerate(rows):
        cells = [f"{row[j]:<{widths[j]}}" for j in range(3)]
        lines.append("  ".join([*cells, row[3]]).rstrip())
        if i == 0:
            lines.append("-" * (sum(widths) + 4 + max(len(r[3]) for r in rows) + 2))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 1e5:
        return f"{v:.4g}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


# --------------------------------------------------------------------------- environment


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def library_versions(import_check: bool = False) -> dict[str, str]:
    """``{label: version}`` for :data:`LIBRARIES`; ``"unavailable: <reason>"`` if absent.

    Versions come from the installed distribution metadata (no import needed).
    A module already imported by this process adds its ``__version__`` when it
    differs; with ``import_check=True`` each installed library is imported and
    an import failure is recorded as ``"<version> (unavailable: <exception>)"``.
    """
    out: dict[str, str] = {}
    for label, dists in LIBRARIES.items():
        version = None
        for dist in dists:
            try:
                version = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
            except Exception:  # broken metadata
                continue
            if dist != label:
                version = f"{version} ({dist})"
            break
        mod_name = _IMPORT_NAMES.get(label)
        mod = sys.modules.get(mod_name) if mod_name else None
        if mod is None and import_check and mod_name and version is not None:
            try:
                mod = importlib.import_module(mod_name)
            except BaseException as exc:  # record whatever the import raises
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                version = f"{version} (unavailable: {describe_exception(exc)})"
        if mod is not None:
            mv = getattr(mod, "__version__", None)
            if isinstance(mv, str) and (version is None or mv not in version):
                version = mv if version is None else f"{version}; __version__={mv}"
        out[label] = version if version is not None else "unavailable: not installed"
    out.update(_loaded_runtime_versions())
    return out


def _loaded_runtime_versions() -> dict[str, str]:
    """CUDA versions that libraries already imported by this process were built for."""
    out: dict[str, str] = {}
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            out["torch.version.cuda"] = str(torch.version.cuda)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        with contextlib.suppress(Exception):
            v = int(cupy.cuda.runtime.runtimeGetVersion())
            out["cupy.cuda.runtime"] = f"{v // 1000}.{(v % 1000) // 10}"
    return out


def _cuda_driver_info(ordinal: int) -> dict[str, Any]:
    """Driver and device facts through cuda.bindings; 'unavailable: ...' where absent."""
    info: dict[str, Any] = {}
    try:
        from cuda.bindings import driver as drv
    except Exception as exc:
        reason = f"unavailable: {describe_exception(exc)}"
        return {"driver_version": reason, "device": reason}

    try:
        err, ver = drv.cuDriverGetVersion()
        if err:
            raise RuntimeError(f"cuDriverGetVersion -> {err!r}")
        info["driver_version"] = int(ver)
        info["driver_cuda_version"] = f"{ver // 1000}.{(ver % 1000) // 10}"
    except Exception as exc:
        info["driver_version"] = f"unavailable: {describe_exception(exc)}"
        info["device"] = info["driver_version"]
        return info

    try:
        (err,) = drv.cuInit(0)
        if err:
            raise RuntimeError(f"cuInit -> {err!r}")
        err, count = drv.cuDeviceGetCount()
        if err:
            raise RuntimeError(f"cuDeviceGetCount -> {err!r}")
        if count <= ordinal:
            raise RuntimeError(f"device {ordinal} requested, {count} present")
        err, dev = drv.cuDeviceGet(ordinal)
        if err:
            raise RuntimeError(f"cuDeviceGet -> {err!r}")
        err, name = drv.cuDeviceGetName(256, dev)
        if err:
            raise RuntimeError(f"cuDeviceGetName -> {err!r}")
        d: dict[str, Any] = {"ordinal": ordinal, "count": int(count)}
        d["name"] = bytes(name).split(b"\0", 1)[0].decode("utf-8", "replace")
        attr = drv.CUdevice_attribute
        for key, a in (
            ("cc_major", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            ("cc_minor", attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            ("sm_count", attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            ("async_engine_count", attr.CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT),
            (
                "can_use_64bit_stream_mem_ops",
                attr.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
            ),
        ):
            err, val = drv.cuDeviceGetAttribute(a, dev)
            d[key] = int(val) if not err else f"unavailable: {err!r}"
        if isinstance(d["cc_major"], int) and isinstance(d["cc_minor"], int):
            d["compute_capability"] = f"{d['cc_major']}.{d['cc_minor']}"
        err, total = drv.cuDeviceTotalMem(dev)
        if not err:
            d["total_memory_bytes"] = int(total)
        err, bus = drv.cuDeviceGetPCIBusId(64, dev)
        if not err:
            d["pci_bus_id"] = bytes(bus).split(b"\0", 1)[0].decode("ascii", "replace")
        info["device"] = d
    except Exception as exc:
        info["device"] = f"unavailable: {describe_exception(exc)}"
    return info


def _kmd_version_via_cuda_core() -> str:
    """The kernel-mode driver version ("580.65.06") through cuda.core.system (NVML)."""
    try:
        from cuda.core import system

        return ".".join(
            f"{v:02d}" if i else str(v)
            for i, v in enumerate(system.get_kernel_mode_driver_version())
        )
    except Exception as exc:
        return f"unavailable: {describe_exception(exc)}"


def _nvml_info(ordinal: int) -> dict[str, Any]:
    try:
        import pynvml
    except Exception as exc:
        fallback = _kmd_version_via_cuda_core()
        if not fallback.startswith("unavailable"):
            return {"nvml_driver_version": fallback, "nvml_source": "cuda.core.system"}
        return {
            "nvml_driver_version": f"unavailable: pynvml: {describe_exception(exc)}; "
            f"cuda.core.system: {fallback[len('unavailable: ') :]}"
        }
    out: dict[str, Any] = {}
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        return {"nvml_driver_version": f"unavailable: {describe_exception(exc)}"}
    try:
        v = pynvml.nvmlSystemGetDriverVersion()
        out["nvml_driver_version"] = v.decode() if isinstance(v, bytes) else str(v)
        out["nvml_source"] = "pynvml"
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(ordinal)
            n = pynvml.nvmlDeviceGetName(h)
            out["nvml_device_name"] = n.decode() if isinstance(n, bytes) else str(n)
        except Exception as exc:
            out["nvml_device_name"] = f"unavailable: {describe_exception(exc)}"
    except Exception as exc:
        out["nvml_driver_version"] = f"unavailable: {describe_exception(exc)}"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return out


def _nvrtc_version() -> str:
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
        if err:
            return f"unavailable: {err!r}"
        return f"{major}.{minor}"
    except Exception as exc:
        return f"unavailable: {describe_exception(exc)}"


def environment_info(
    device_ordinal: int = 0, *, probe_gpu: bool = True, import_check: bool = False
) -> dict[str, Any]:
    """Where and when a run happened: host, Python, device, driver, library versions.

    Never raises; every probe that cannot run records ``"unavailable: <reason>"``.
    """
    env: dict[str, Any] = {
        "date": utc_now(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "executable": sys.executable,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "env_vars": {
            k: os.environ[k]
            for k in (
                "CUDA_VISIBLE_DEVICES",
                "CUDA_MODULE_LOADING",
                "CUDA_DEVICE_MAX_CONNECTIONS",
                "ASYNCGPU_API",
            )
            if k in os.environ
        },
    }
    if probe_gpu:
        env.update(_cuda_driver_info(device_ordinal))
        env.update(_nvml_info(device_ordinal))
    else:
        env["driver_version"] = "unavailable: not probed"
        env["device"] = "unavailable: not probed"
        env["nvml_driver_version"] = "unavailable: not probed"
    env["nvrtc_version"] = _nvrtc_version()
    env["libraries"] = library_versions(import_check=import_check)
    return env


def device_name(env: Mapping[str, Any]) -> str:
    """The device name recorded in ``env`` (or the 'unavailable' reason)."""
    dev = env.get("device")
    if isinstance(dev, Mapping):
        return str(dev.get("name", "unknown"))
    return str(dev)
