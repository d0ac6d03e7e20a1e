"""Instructions per awaited launch on the stand-in driver, counted by callgrind.

Timings of the emulated engine (``emulate_engine.py``) move by several percent
from run to run on a shared machine; callgrind's count of the main thread's
instructions moves by about 0.3%. This runs the emulated throughput case
(1,000 tasks awaiting launches on 8 streams, the "GPU" writing the counters once
per loop iteration) twice under ``valgrind --tool=callgrind --separate-threads=yes``,
with ``per_task`` awaits and three times as many, and prints the difference
over the extra awaits: the main thread's instructions per awaited launch, with
start-up and imports cancelled out. The reactor's wake batch is fixed at 64 and
its park, fault checks, inline spin and the garbage collector are off, so that
the count does not follow the timing. Figures of the machine and Python it runs
on, for comparing two versions of the code there; never GPU figures.

    python benchmarks/callgrind_await.py [--per-task 10]   (needs valgrind)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TASKS = 1000
STREAMS = 8


def _workload(per_task: int) -> None:
    """The emulated throughput case (``emulate_engine.throughput``), no warm-up."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import emulate_engine as em

    from asyncgpu import _engine

    _engine.WAKE_MIN = _engine.WAKE_MAX = 64
    _engine.SPIN_S = _engine.FAULT_CHECK_S = 1e9
    _engine.INLINE_SPIN_S = 0.0
    gc.disable()
    with tempfile.TemporaryDirectory() as tmp:
        em.bind(em.stub_driver(tmp), deferred=True)
        streams = [em.stream(i) for i in range(STREAMS)]
        g = em.kernel(streams, (), b"")
        asyncio.run(em.throughput(streams, g, TASKS, per_task, warm_up=0))


def _main_thread_instructions(per_task: int, workdir: str) -> int:
    out = os.path.join(workdir, f"cg.{per_task}")
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--separate-threads=yes",
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            "--workload",
            str(per_task),
        ],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    main = sorted(glob.glob(out + "-01"))[0]
    for line in Path(main).read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no instruction total in {main}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-task", type=int, default=10)
    p.add_argument("--workload", type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.workload is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        _workload(a.workload)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        low = _main_thread_instructions(a.per_task, tmp)
        high = _main_thread_instructions(3 * a.per_task, tmp)
    extra = TASKS * 2 * a.per_task
    print(f"main-thread instructions per awaited launch: {(high - low) / extra:,.0f}")


if __name__ == "__main__":
    main()
