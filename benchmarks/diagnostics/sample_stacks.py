"""Where a slow test spends its time, in every thread: runs pytest in this process
while a sampler thread records each thread's innermost asyncgpu frame (and the
frame that called into it) every few milliseconds, then prints the most frequent.

    python benchmarks/diagnostics/sample_stacks.py [--interval-ms 2] [--top 25] -- PYTEST_ARGS...

A diagnostic for the device machine, where no profiler is installed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _where(frame: FrameType | None) -> str:
    """The innermost frame in the package (else the innermost frame), with its caller."""
    chain: list[FrameType] = []
    f = frame
    while f is not None and len(chain) < 64:
        chain.append(f)
        f = f.f_back
    ours = [f for f in chain if "/asyncgpu/" in f.f_code.co_filename]
    top = ours[0] if ours else chain[0] if chain else None
    if top is None:
        return "?"

    def name(f: FrameType) -> str:
        return f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}:{f.f_lineno}"

    caller = top.f_back
    return name(top) + (f" <- {name(caller)}" if caller is not None else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval-ms", type=float, default=2.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = [x for x in a.pytest_args if x != "--"]

    import pytest

    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    samples = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal samples
        me = threading.get_ident()  # the sampler itself is not counted
        while not stop.wait(a.interval_ms / 1000):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    counts[(names.get(ident, str(ident)), _where(frame))] += 1
            samples += 1

    t = threading.Thread(target=sample, name="sampler", daemon=True)
    t.start()
    t0 = time.perf_counter()
    rc = pytest.main(args)
    wall = time.perf_counter() - t0
    stop.set()
    t.join()
    print(f"\n{samples} samples over {wall:.1f} s, every {a.interval_ms} ms; per thread and place:")
    for (thread, where), n in counts.most_common(a.top):
        print(f"{n / max(samples, 1):7.1%}  {thread[:28]:28}  {where}")
    return int(rc)


if __name__ == "__main__":
    raise SystemExit(main())
