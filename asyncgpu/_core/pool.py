"""The CPU pool: the threads that run CPU functions, CPU ranges, CPU kernels and
the CPU device's copies, and the guard that keeps host work from waiting for
itself.

Events (``event``) and the completion engine (``engine``) sit above this module:
a blocking wait registers here (``waiting_for``) so that the pool grows by one
thread for as long as one of its threads is blocked.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .. import _config

__all__ = [
    "cpu_pool",
    "fan_out",
    "host_work",
    "pool_size",
    "range_work",
    "refuse_wait_from_own_work",
    "start_chained",
    "waiting_for",
]

# -- the CPU thread pool ------------------------------------------------------------

_pool_lock = threading.Lock()
_pool: _CpuPool | None = None
_log = logging.getLogger("asyncgpu")


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


class _CpuPool:
    """The CPU pool: ``size`` threads taking work from one queue, plus one for each
    of its threads blocked in a wait (``waiting_for``), as a work-stealing pool
    makes up for a blocked worker. Threads start on demand and stay, idle, once
    started; the pool never has more than ``size`` plus the most waits at one
    time.

    Built on ``threading`` alone (an executor's private fields are not relied
    on). Its threads are daemon threads, so neither a non-daemon thread still
    enqueueing when the main thread returns nor an ``atexit`` hook that waits for
    work finds the pool shut down; what the interpreter's exit does with pending
    work is ``state``'s exit hook. After ``fork`` the child gets a pool of its own
    (``_after_fork``)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._waits = 0
        self._cond = threading.Condition(threading.Lock())
        self._work: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._threads = 0
        self._idle = 0  # threads waiting for work that have not taken an item yet
        self._running: dict[int, tuple[Callable[..., Any], tuple[Any, ...]]] = {}

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on a pool thread (in submission order, as threads free
        up). ``fn`` handles its own errors: one that escapes is logged.

        Where no thread can start and none is running (the interpreter is
        shutting down: CPython 3.12.0 and 3.12.1 refuse new threads as soon as
        the main thread has returned), the calling thread runs the queued work
        itself, in order, rather than leave it to nobody."""
        with self._cond:
            self._work.append((fn, args))
            if len(self._work) > self._idle and self._threads < self._size + self._waits:
                if self._start() or self._threads:
                    return
                stranded = list(self._work)
                self._work.clear()
            else:
                if self._idle:
                    self._cond.notify()
                return
        for item in stranded:
            _run_item(item)

    def call(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``fn(*args)`` on a pool thread, its outcome in a ``Future``."""
        fut: Future[Any] = Future()

        def run() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:
                    fut.set_exception(e)

        self.submit(run)
        return fut

    def blocked(self, change: int) -> None:
        """``change`` (+1, -1) more pool threads are blocked in a wait."""
        with self._cond:
            self._waits += change
            if change > 0 and self._work and self._threads < self._size + self._waits:
                self._start()

    def _start(self) -> bool:
        """Under ``_cond``: start one more thread; False where the interpreter
        refuses one (``RuntimeError``: it is shutting down)."""
        self._threads += 1
        t = threading.Thread(
            target=self._worker, name=f"asyncgpu-cpu_{self._threads - 1}", daemon=True
        )
        try:
            t.start()
        except RuntimeError:
            self._threads -= 1
            return False
        return True

    def _worker(self) -> None:
        me = threading.get_ident()
        cond, work, running = self._cond, self._work, self._running
        while True:
            with cond:
                running.pop(me, None)
                while not work:
                    self._idle += 1
                    cond.wait()
                    self._idle -= 1
                item = running[me] = work.popleft()
            _run_item(item)
            del item  # (an idle thread keeps nothing alive)

    def _fork_child(self) -> _CpuPool:
        """In a forked child: a pool of its own (the parent's threads do not exist
        here), given the work that had not finished at the fork: what was queued,
        and, first, what the parent's threads were running (run again from its
        start). ``_cond`` was held across the fork, so the snapshot is whole."""
        pool = _CpuPool(self._size)
        pool._work.extend(self._running.values())
        pool._work.extend(self._work)
        return pool


def _run_item(item: tuple[Callable[..., Any], tuple[Any, ...]]) -> None:
    try:
        item[0](*item[1])
    except BaseException as e:  # the work items catch their own errors
        _log.error("exception in CPU pool work %r", item[0], exc_info=e)


def cpu_pool() -> _CpuPool:
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


def _before_fork() -> None:
    _pool_lock.acquire()
    if _pool is not None:
        _pool._cond.acquire()


def _after_fork_in_parent() -> None:
    if _pool is not None:
        _pool._cond.release()
    _pool_lock.release()


def _after_fork_in_child() -> None:
    """The parent's pool threads do not exist in a forked child: the child gets a
    pool of its own, which runs the work that had not finished at the fork."""
    global _pool, _pool_lock
    _pool_lock = threading.Lock()
    old = _pool
    if old is not None:
        _pool = pool = old._fork_child()
        with pool._cond:
            for _ in range(min(len(pool._work), pool._size)):
                pool._start()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork,
        after_in_parent=_after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


class _Chain(threading.local):
    """The starts that ``start_chained`` deferred on this thread (None: none is
    running here)."""

    pending: deque[tuple[Callable[[Any], None], Any]] | None = None


_chain = _Chain()


def start_chained(start: Callable[[Any], None], arg: Any) -> None:
    """``start(arg)``, for an operation started by another's completion: now, or,
    when this thread is already inside such a start, right after it returns. An
    operation that finishes at once (a wait for a finished event, an empty range)
    finishes the next one's predecessor inside its own start, and so on: run
    nested, a long queue of them would exhaust the stack; run here, one after
    another, any length takes a loop. A start that raises is logged; the ones
    queued behind it still run."""
    pending = _chain.pending
    if pending is not None:
        pending.append((start, arg))
        return
    pending = _chain.pending = deque(((start, arg),))
    try:
        while pending:
            fn, a = pending.popleft()
            try:
                fn(a)
            except BaseException as e:  # nobody to raise to: the finishing thread's caller
                _log.error("exception starting the next operation %r", fn, exc_info=e)
    finally:
        _chain.pending = None


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
