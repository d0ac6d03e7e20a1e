"""Instructions per call of asyncgpu's hot paths on the stand-in driver,
counted by callgrind.

Timings of the emulated engine (``emulate_engine.py``) move by several percent
from run to run on a shared machine; callgrind's count of the main thread's
instructions moves by well under 1%. Each case runs twice under ``valgrind
--tool=callgrind --separate-threads=yes`` (``PYTHONHASHSEED=0``, OpenBLAS on
one thread), with ``n`` calls and with ``6 n``, and the difference over the
extra calls is printed: the main thread's instructions per call, with start-up
and imports cancelled out. The loops are functions (a loop at module level would
also count its global variable's stores).

Cases:

- ``await``: the emulated throughput case (1,000 tasks awaiting launches on 8
  streams, the "GPU" writing the counters once per loop iteration), per awaited
  launch; the reactor's wake batch is fixed at 64 and its park, fault checks,
  inline spin and the garbage collector are off, so that the count does not
  follow the timing;
- ``launch``: ``ctx.enqueue_function(f, grid_dim=1, block_dim=1)`` of an empty
  kernel, the event dropped (retired by the launches after it);
- ``launch4``: the same with four arguments (a float32, two device buffers, an
  int32), passed as a user writes them;
- ``create``: ``ctx.enqueue_create_buffer(np.uint8, 1 << 20)`` of memory the
  stream kept, then dropped.

Figures of the machine and Python it runs on, for comparing two versions of the
code there; never GPU figures.

    python benchmarks/callgrind_paths.py [--case await launch launch4 create] [-n N]
    (needs valgrind)
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
from typing import Any

TASKS = 1000
STREAMS = 8
CASES = ("await", "launch", "launch4", "create")
DEFAULT_N = {"await": 10, "launch": 2000, "launch4": 2000, "create": 2000}


def _await(em: Any, n: int) -> None:
    """The emulated throughput case (``emulate_engine.throughput``), no warm-up:
    ``TASKS`` tasks of ``n`` awaits each."""
    from asyncgpu._core import engine as _engine

    _engine.WAKE_MIN = _engine.WAKE_MAX = 64
    _engine.SPIN_S = _engine.FAULT_CHECK_S = 1e9
    _engine.INLINE_SPIN_S = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        em.bind(em.stub_driver(tmp), deferred=True)
        streams = [em.stream(i) for i in range(STREAMS)]
        g = em.kernel(streams, (), b"")
        asyncio.run(em.throughput(streams, g, TASKS, n, warm_up=0))


def _launch(em: Any, n: int, four: bool) -> None:
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        em.bind(em.stub_driver(tmp), deferred=False)
        s = em.stream(0)
        ctx = em.context(s)
        x, y = em._Buffer(0x1000, ctx._state), em._Buffer(0x2000, ctx._state)
        a, k = np.float32(1.5), np.int32(7)
        args = (a, x, y, k) if four else ()
        f = em.function(ctx, em.kernel([s], args, b"fPPi" if four else b""), 1, 1)
        launch = ctx.enqueue_function
        if four:
            for _ in range(n):
                launch(f, a, x, y, k, grid_dim=1, block_dim=1)
        else:
            for _ in range(n):
                launch(f, grid_dim=1, block_dim=1)


def _create(em: Any, n: int) -> None:
    import numpy as np

    from asyncgpu._devices.cuda import memory as _memory

    with tempfile.TemporaryDirectory() as tmp:
        em.bind(em.stub_driver(tmp), deferred=False)
        s = em.stream(0)
        ctx = em.context(s)
        s.spare.keep(_memory._DeviceAlloc(None, em._CoreBuffer(), None, 1 << 20), 1 << 20)
        create, u8 = ctx.enqueue_create_buffer, np.uint8
        for _ in range(n):
            b = create(u8, 1 << 20)
            del b


def _workload(case: str, n: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import emulate_engine as em

    gc.disable()
    if case == "await":
        _await(em, n)
    elif case in ("launch", "launch4"):
        _launch(em, n, case == "launch4")
    else:
        _create(em, n)


def _main_thread_instructions(case: str, n: int, workdir: str) -> int:
    out = os.path.join(workdir, f"cg.{case}.{n}")
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--separate-threads=yes",
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            "--workload",
            case,
            str(n),
        ],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1"},
    )
    main = sorted(glob.glob(out + "-01"))[0]
    for line in Path(main).read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no instruction total in {main}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("-n", type=int, help="calls (await: awaits per task) of the smaller run")
    p.add_argument("--workload", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.workload is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        _workload(a.workload[0], int(a.workload[1]))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed")
    for case in a.case:
        n = a.n or DEFAULT_N[case]
        with tempfile.TemporaryDirectory() as tmp:
            low = _main_thread_instructions(case, n, tmp)
            high = _main_thread_instructions(case, 6 * n, tmp)
        extra = 5 * n * (TASKS if case == "await" else 1)
        print(f"{case:8} main-thread instructions per call: {(high - low) / extra:,.0f}")


if __name__ == "__main__":
    main()
