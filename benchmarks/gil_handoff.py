"""How long a thread that gives the GIL up around short blocking calls (as a pool
thread does around driver calls) waits to get it back, while another thread
polls in a loop: with ``time.sleep(0)`` between polls (the watcher before
2026-12-04) or with a 20 us wait on a condition (``_engine.WATCH_POLL_S``).

    python benchmarks/gil_handoff.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncgpu._engine import WATCH_POLL_S, _fine_timer_slack


def _worker_us(n: int) -> float:
    """Microseconds per iteration of a loop that releases the GIL (``os.stat``)."""
    t0 = time.perf_counter()
    for _ in range(n):
        os.stat("/")
        sum(range(50))
    return (time.perf_counter() - t0) / n * 1e6


def _with_poller(poll: Callable[[], None] | None, n: int) -> float:
    stop = threading.Event()

    def poller() -> None:
        _fine_timer_slack()
        while not stop.is_set():
            poll()  # type: ignore[misc]

    t = threading.Thread(target=poller) if poll else None
    if t:
        t.start()
    out: list[float] = []
    w = threading.Thread(target=lambda: out.append(_worker_us(n)))
    w.start()
    w.join()
    stop.set()
    if t:
        t.join()
    return out[0]


def _wait_us(fn: Callable[[], None], n: int = 500) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("-n", type=int, default=3000)
    a = ap.parse_args()
    cond = threading.Condition()

    def cond_wait() -> None:
        with cond:
            cond.wait(WATCH_POLL_S)

    res = {
        "sleep0_us": _wait_us(lambda: time.sleep(0)),
        "cond_wait_default_slack_us": _wait_us(cond_wait),
    }
    _fine_timer_slack()
    res["cond_wait_fine_slack_us"] = _wait_us(cond_wait)
    res["worker_alone_us"] = _with_poller(None, a.n)
    res["worker_beside_sleep0_poller_us"] = _with_poller(lambda: time.sleep(0), a.n)
    res["worker_beside_cond_wait_poller_us"] = _with_poller(cond_wait, a.n)
    for k, v in res.items():
        print(f"{k:36} {v:10.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
