"""The CPU pool: the threads that run CPU functions, CPU ranges, CPU kernels and
the CPU device's copies, and the guard that keeps host work from waiting for
itself.

Events (``event``) and the completion engine (``engine``) sit above this module:
a blocking wait registers here (``waiting_for``) so that the pool grows by one
thread for as long as one of its threads is blocked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import _config

__all__ = [
    "cpu_pool",
    "fan_out",
    "host_work",
    "pool_size",
    "range_work",
    "refuse_wait_from_own_work",
    "waiting_for",
]

# -- the CPU thread pool ------------------------------------------------------------

_pool_lock = threading.Lock()
_pool: _CpuPool | None = None


def pool_size() -> int:
    """Threads in the CPU pool: ``$ASYNCGPU_CPU_THREADS``, else max(4, cores)."""
    return _config.SETTINGS.cpu_threads


class _HostWork(threading.local):
    """The stream whose host work (a CPU function, range or CPU kernel) this pool
    thread is running, if any, that operation's sequence number, and whether the
    thread is blocked in a wait that the pool makes up for (``waiting_for``)."""

    stream: Any = None
    seq = 0
    waiting = False


host_work = _HostWork()


def refuse_wait_from_own_work(stream: Any, seq: int | None = None) -> None:
    """``RuntimeError`` when the calling thread runs host work of ``stream`` and
    is about to block for that stream's operation ``seq`` (None: all of it) at or
    after the running one: the wait would be for the very work doing it (as
    ``Thread.join`` refuses to join the current thread; CUDA answers
    ``CUDA_ERROR_NOT_PERMITTED`` to a stream sync inside its host functions).
    Waiting for earlier work of the stream is fine: it has finished, or (host
    work right behind host work on CUDA) finishes on its own."""
    if stream is not None and host_work.stream is stream and (seq is None or seq >= host_work.seq):
        raise RuntimeError(
            f"a CPU function running on {stream.label} cannot block for that stream's "
            "work (it would wait for itself); enqueue what comes next on the stream "
            "instead"
        )


class waiting_for:
    """``with waiting_for(stream, seq):`` around a blocking wait for ``stream``'s
    work (operation ``seq``; None: all of it). Refuses a wait of host work for
    itself (``refuse_wait_from_own_work``). Host work that blocks for other work
    holds one of the CPU pool's threads while the work it waits for may itself
    need one, so the pool has one thread more for as long as the wait lasts
    (``_CpuPool.blocked``): CPU functions that each wait for another stream's
    CPU work never use up the pool. A wait nested in such a wait counts once."""

    __slots__ = ("_counted",)

    def __init__(self, stream: Any, seq: int | None = None) -> None:
        refuse_wait_from_own_work(stream, seq)
        self._counted = False

    def __enter__(self) -> None:
        pool = _pool
        if host_work.stream is not None and not host_work.waiting and pool is not None:
            host_work.waiting = self._counted = True
            pool.blocked(1)

    def __exit__(self, *exc: object) -> None:
        if self._counted:
            host_work.waiting = False
            _pool.blocked(-1)  # type: ignore[union-attr]


class _CpuPool(ThreadPoolExecutor):
    """The CPU pool: a ``ThreadPoolExecutor`` of ``size`` threads, plus one for
    each of its threads blocked in a wait (``waiting_for``), as a work-stealing
    pool makes up for a blocked worker. The extra threads stay, idle, once the
    waits end; the pool never has more threads than ``size`` plus the most waits
    at one time. (The executor starts threads in ``_adjust_thread_count``, up to
    ``_max_workers``, unless its ``_idle_semaphore`` counts one idle; an executor
    without them gets no extra threads.)"""

    def __init__(self, size: int) -> None:
        super().__init__(size, thread_name_prefix="asyncgpu-cpu")
        self._size = size
        self._waits = 0
        self._waits_lock = threading.Lock()

    def blocked(self, change: int) -> None:
        """``change`` (+1, -1) more pool threads are blocked in a wait."""
        with self._waits_lock:
            self._waits += change
            self._max_workers = self._size + self._waits
        adjust = getattr(self, "_adjust_thread_count", None)
        idle = getattr(self, "_idle_semaphore", None)
        if change > 0 and adjust is not None and idle is not None:
            with self._shutdown_lock:
                if not self._shutdown:
                    # The executor counts a thread idle each time it finishes an
                    # item, so the count runs ahead of the truth and it would
                    # start no thread: drop the count, then start one (up to
                    # _max_workers).
                    while idle.acquire(timeout=0):
                        pass
                    adjust()


def cpu_pool() -> ThreadPoolExecutor:
    """The process-wide pool that runs CPU functions, CPU ranges, CPU kernels and
    the CPU device's copies."""
    global _pool
    pool = _pool
    if pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = _CpuPool(pool_size())
            pool = _pool
    return pool


def fan_out(
    stream: Any,
    seq: int,
    count: int,
    work: Callable[[int, int], None],
    finish: Callable[[Any, BaseException | None], None],
) -> None:
    """Run ``work(lo, hi)`` over ``[0, count)`` in up to ``pool_size()`` chunks on
    the CPU pool, each marked as host work of ``stream``'s operation ``seq``, then
    ``finish(None, error)`` once, after the last chunk: ``error`` is the first
    error a chunk raised, or None. Does not block."""
    if count == 0:
        finish(None, None)
        return
    k = min(count, pool_size())
    left = [k]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def chunk(lo: int, hi: int) -> None:
        host_work.stream, host_work.seq = stream, seq
        try:
            work(lo, hi)
        except BaseException as e:
            with lock:
                errors.append(e)
        host_work.stream = None
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            finish(None, errors[0] if errors else None)

    pool = cpu_pool()
    for j in range(k):
        pool.submit(chunk, count * j // k, count * (j + 1) // k)


def range_work(fn: Callable[[int], Any]) -> Callable[[int, int], None]:
    """``work(lo, hi)`` for ``fan_out`` that calls ``fn(i)`` for every ``i`` of the
    chunk, and raises the first error once the chunk is done."""

    def work(lo: int, hi: int) -> None:
        first: BaseException | None = None
        for i in range(lo, hi):
            try:
                fn(i)
            except BaseException as e:
                if first is None:
                    first = e
        if first is not None:
            raise first

    return work
