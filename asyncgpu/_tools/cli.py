"""The ``asyncgpu`` command line (``python -m asyncgpu``).

Subcommands: ``info`` (what devices there are), ``demo`` (a verified
multi-stream pipeline, with its trace and timeline), ``bench`` (the benchmark
suite of a source checkout) and ``trace`` (draw a saved trace). Every failure
prints one line, ``asyncgpu: error: ...``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["main"]

PROG = "asyncgpu"


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``asyncgpu: error: ...``) and no exit."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _fail(message: str) -> int:
    first = " ".join(str(message).split()) or "failed"
    print(f"{PROG}: error: {first}", file=sys.stderr)
    return 2


# -- info ------------------------------------------------------------------------------

_ATTRIBUTES = (
    "MULTIPROCESSOR_COUNT",
    "MAX_THREADS_PER_BLOCK",
    "WARP_SIZE",
    "COMPUTE_CAPABILITY_MAJOR",
    "COMPUTE_CAPABILITY_MINOR",
    "MAX_SHARED_MEMORY_PER_BLOCK",
    "CONCURRENT_KERNELS",
    "ASYNC_ENGINE_COUNT",
    "UNIFIED_ADDRESSING",
)


def _version_text(api: str, v: int) -> str:
    major, minor = v // 1000, (v % 1000) // 10
    return f"CUDA driver {major}.{minor} ({v})" if api == "cuda" else f"Python {major}.{minor}"


def _device_facts(api: str, device_id: int) -> dict[str, Any]:
    from .._api.context import DeviceContext
    from .._types import DeviceAttribute

    facts: dict[str, Any] = {"api": api, "id": device_id}
    with DeviceContext(device_id, api=api) as ctx:
        facts["name"] = ctx.name()
        v = ctx.get_api_version()
        facts["api_version"] = v
        facts["api_version_text"] = _version_text(api, v)
        info = ctx.default_device_info
        facts["info"] = {
            f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.name != "extra"
        }
        facts["info"]["target"] = info.target()
        facts["info"].update({f"extra.{k}": val for k, val in info.extra.items()})
        attrs: dict[str, Any] = {}
        for name in _ATTRIBUTES:
            try:
                attrs[name] = ctx.get_attribute(DeviceAttribute[name])
            except Exception as e:
                attrs[name] = f"n/a ({type(e).__name__})"
        facts["attributes"] = attrs
        free, total = ctx.get_memory_info()
        facts["memory"] = {"free": free, "total": total}
        facts["max_single_alloc_size"] = ctx.max_single_alloc_size()
        facts["num_streams"] = ctx.num_streams()
        rng = ctx.stream_priority_range()
        facts["stream_priority_range"] = {"least": rng.least, "greatest": rng.greatest}
        facts["is_compatible"] = ctx.is_compatible()
        facts["supports_multicast"] = ctx.supports_multicast()
        try:
            ctx.run_healthcheck()
            facts["healthcheck"] = "ok"
        except Exception as e:
            check = getattr(e, "check", None)
            facts["healthcheck"] = f"FAILED{f' ({check})' if check else ''}: {e}"
    return facts


def _why_no_device(api: str) -> str:
    """Why ``api`` has no device, in the words opening one would raise (the count
    alone says only that there is none); ``info`` and ``demo`` both say this."""
    from .._api.context import DeviceContext
    from .._errors import NoDeviceError

    try:
        DeviceContext(0, api=api).close()
    except NoDeviceError as e:
        return str(e)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no device found"


def _api_facts(api: str) -> dict[str, Any]:
    from .._api.context import DeviceContext

    try:
        count = DeviceContext.number_of_devices(api=api)
    except Exception as e:
        return {"api": api, "available": False, "reason": f"{type(e).__name__}: {e}", "devices": []}
    if count == 0:
        return {"api": api, "available": False, "reason": _why_no_device(api), "devices": []}
    devices = []
    for i in range(count):
        try:
            devices.append(_device_facts(api, i))
        except Exception as e:
            devices.append({"api": api, "id": i, "error": f"{type(e).__name__}: {e}"})
    return {"api": api, "available": True, "count": count, "devices": devices}


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _print_info(data: dict[str, Any]) -> None:
    print(f"asyncgpu {data['asyncgpu']} on Python {data['python']} ({data['platform']})")
    print(f"default device api: {data['default_api']}")
    for entry in data["apis"]:
        api = entry["api"]
        print("")
        if not entry["available"]:
            print(f"[{api}] not available: {entry['reason']}")
            continue
        print(f"[{api}] {entry['count']} device(s)")
        for dev in entry["devices"]:
            if "error" in dev:
                print(f"  device {dev['id']}: cannot open: {dev['error']}")
                continue
            processor = dev["info"].get("extra.processor")
            print(f"  device {dev['id']}: {dev['name']}{f' ({processor})' if processor else ''}")
            print(f"    api version: {dev['api_version_text']}")
            mem = dev["memory"]
            print(f"    memory: {_gib(mem['free'])} free of {_gib(mem['total'])}")
            print(f"    max single allocation: {_gib(dev['max_single_alloc_size'])}")
            rng = dev["stream_priority_range"]
            print(
                f"    streams in pool: {dev['num_streams']}; priorities "
                f"{rng['least']}..{rng['greatest']}"
            )
            print(f"    healthcheck: {dev['healthcheck']}")
            print("    default_device_info:")
            for k, v in dev["info"].items():
                print(f"      {k}: {v}")
            print("    attributes:")
            for k, v in dev["attributes"].items():
                print(f"      {k}: {v}")


def _cmd_info(args: argparse.Namespace) -> int:
    from .._api.context import default_api
    from .._version import __version__

    try:
        dflt = default_api()
    except ValueError as e:  # a bad ASYNCGPU_API
        return _fail(str(e))
    except Exception as e:
        dflt = f"unknown ({type(e).__name__}: {e})"
    apis = ["cpu", "cuda"] if args.api is None else [args.api]
    facts = [_api_facts(a) for a in apis]
    data: dict[str, Any] = {
        "asyncgpu": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "default_api": dflt,
        "apis": facts,
    }
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        _print_info(data)
    if args.api is not None and not facts[0]["available"]:
        return _fail(f"no {args.api} device: {facts[0]['reason']}")
    return 0


# -- demo ------------------------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def _cmd_demo(args: argparse.Namespace) -> int:
    from .._errors import NoDeviceError
    from .demo import run_demo

    try:
        asyncio.run(
            run_demo(
                args.out,
                batches=args.batches,
                size=args.size,
                streams=args.streams,
                api=args.api,
                png=not args.no_png,
            )
        )
    except BrokenPipeError:
        raise  # the reader went away: main ends quietly
    except NoDeviceError as e:  # the same line as ``info --api cuda``
        return _fail(f"no {args.api or 'cuda'} device: {e}")
    except Exception as e:
        return _fail(f"demo failed: {type(e).__name__}: {e}")
    return 0


# -- bench -----------------------------------------------------------------------------


def _repo_root() -> Path:
    """The folder above the package (``asyncgpu/_tools/cli.py`` is three levels down)."""
    return Path(__file__).resolve().parents[2]


def _json_path_in(argv: list[str]) -> str | None:
    """The ``--json PATH`` (or ``--json=PATH``) of benchmarks/run.py's arguments."""
    for i, a in enumerate(argv):
        if a == "--json" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--json="):
            return a.split("=", 1)[1]
    return None


def _cmd_bench(args: argparse.Namespace) -> int:
    root = _repo_root()
    script = root / "benchmarks" / "run.py"
    if not script.is_file():
        return _fail(
            f"no benchmark suite at {script}: it ships with the source checkout "
            "(clone the repository and run 'python -m asyncgpu bench' from there)"
        )
    extra = list(args.extra or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    out = _json_path_in(extra)
    if out is None:
        # The suite writes its full results only when told where; a new file in
        # the temp folder keeps the checkout clean and names where they went.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = str(Path(tempfile.gettempdir()) / f"asyncgpu-bench-{stamp}-{os.getpid()}.json")
        extra += ["--json", out]
    cmd = [sys.executable, str(script), *(["--quick"] if args.quick else []), *extra]
    print(f"running {' '.join(cmd[1:])} (in {root})")
    print(f"results: the table below; the full results go to {Path(root, out)}")
    sys.stdout.flush()
    try:
        rc = subprocess.call(cmd, cwd=root)
    except OSError as e:
        return _fail(f"cannot run {script}: {e}")
    if rc != 0:
        return _fail(f"benchmarks/run.py exited with status {rc}")
    return 0


# -- trace -----------------------------------------------------------------------------


def _cmd_trace(args: argparse.Namespace) -> int:
    from .timeline import draw_timeline, load_chrome_trace, timeline_of

    src = Path(args.file)
    if not src.is_file():
        return _fail(f"no such trace file: {src}")
    try:
        data = load_chrome_trace(src)
        tl = timeline_of(data)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    kinds: dict[str, int] = {}
    for op in tl.ops:
        kinds[op.kind] = kinds.get(op.kind, 0) + 1
    span = max((op.end_ms for op in tl.ops), default=0.0) - min(
        (op.start_ms for op in tl.ops), default=0.0
    )
    print(
        f"{src}: {len(tl.ops)} operations on {len(tl.lanes)} streams over {span:.3f} ms, "
        f"{len(tl.waits)} cross-stream waits"
    )
    print("  " + ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items())))
    png = Path(args.png) if args.png else src.with_suffix(".png")
    try:
        draw_timeline(data, png, title=args.title)
    except ImportError as e:
        return _fail(str(e))
    except (ValueError, OSError) as e:
        return _fail(f"cannot draw {png}: {e}")
    print(f"timeline: {png}")
    return 0


# -- the parser ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    p = _Parser(
        prog=PROG,
        description=(
            "asyncgpu: async/await GPU scheduling for Python (the Mojo/MAX DeviceContext API "
            "on cuda-python, with a full CPU device)."
        ),
        epilog=(
            "The default device is a CUDA GPU when one is usable, else the CPU device; "
            "set ASYNCGPU_API=cpu or ASYNCGPU_API=cuda to choose. "
            "Run 'asyncgpu COMMAND --help' for each command."
        ),
    )
    p.add_argument("--version", action="version", version=f"asyncgpu {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    info = sub.add_parser(
        "info",
        help="show devices, driver version, device info, attributes, memory, health",
        description=(
            "Show every device asyncgpu can use: the CPU device and, where cuda-python "
            "finds a GPU, each CUDA device, with its driver/API version, "
            "default_device_info, a few attributes, memory info and a healthcheck."
        ),
    )
    info.add_argument("--api", choices=("cpu", "cuda"), help="only this device api")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=_cmd_info)

    demo = sub.add_parser(
        "demo",
        help="run a verified multi-stream pipeline on the default device",
        description=(
            "Run a small asyncio pipeline on the default device: per batch, on a stream "
            "of the pool, copy host->device, memset, a saxpy kernel (CUDA C++ or its NumPy "
            "twin), copy device->host and a CPU stage; stream 0 waits for the others and "
            "combines. Results are checked against NumPy; the trace "
            "(asyncgpu-demo-trace.json) and timeline (asyncgpu-demo-timeline.png, with "
            "matplotlib) are written to --out."
        ),
    )
    demo.add_argument(
        "--out", default=".", metavar="DIR", help="where to write the trace and PNG (default: .)"
    )
    demo.add_argument("--batches", type=_positive, default=8, help="batches (default: 8)")
    demo.add_argument(
        "--size",
        type=_positive,
        default=1 << 16,
        help="float32 elements per batch (default: 65536)",
    )
    demo.add_argument(
        "--streams", type=_positive, default=4, help="streams to spread batches over (default: 4)"
    )
    demo.add_argument(
        "--api",
        choices=("cpu", "cuda"),
        default=None,
        help="device api (default: the default device)",
    )
    demo.add_argument("--no-png", action="store_true", help="do not draw the timeline PNG")
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser(
        "bench",
        help="run the benchmark suite (source checkout only)",
        description=(
            "Run benchmarks/run.py of the source checkout this package lives in. It prints "
            "a table; the full results go to a new JSON file in the temp folder (named "
            "before the run), or to PATH with '-- --json PATH'. Extra arguments after '--' "
            "are passed through."
        ),
    )
    bench.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    bench.add_argument("extra", nargs=argparse.REMAINDER, help="arguments for benchmarks/run.py")
    bench.set_defaults(func=_cmd_bench)

    trace = sub.add_parser(
        "trace",
        help="draw a saved trace JSON as a timeline PNG",
        description=(
            "Read a trace JSON written by DeviceContext.trace(path) (or asyncgpu demo), "
            "print a summary and draw it as a timeline PNG (needs matplotlib: "
            "pip install asyncgpu[plot])."
        ),
    )
    trace.add_argument("file", metavar="FILE.json", help="the trace JSON file")
    trace.add_argument("--png", metavar="OUT.png", help="output PNG (default: FILE.png)")
    trace.add_argument("--title", help="title of the plot")
    trace.set_defaults(func=_cmd_trace)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the
    exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except _UsageError as e:
        return _fail(str(e))
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else 0
    if getattr(args, "func", None) is None:
        return _fail(f"a command is required: info, demo, bench or trace (see '{PROG} --help')")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return _fail("interrupted")
    except BrokenPipeError:
        # The reader went away (``asyncgpu info | head -1``): end quietly, with
        # stdout pointed at /dev/null so that the interpreter's last flush does
        # not raise again (the recipe of Python's signal module docs).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
