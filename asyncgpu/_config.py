"""Every environment variable asyncgpu reads, read and checked here and nowhere
else.

============================  ===============  ================  ============================
variable                      default          accepted          meaning
============================  ===============  ================  ============================
ASYNCGPU_API                  cuda with a      cpu, cuda         the device API of a context
                              usable GPU,                        made without ``api=``
                              else cpu                           (per context)
ASYNCGPU_NUM_STREAMS          8                integer >= 1      streams in a context's pool
                                                                 without ``num_streams=``
                                                                 (per context)
ASYNCGPU_TRACE                unset: none      a file path       every new context records a
                                                                 trace and writes it there
                                                                 (per context)
ASYNCGPU_WAKE_BUDGET_MS       0.2              0.01 to 100       how long the tasks a reactor
                                                                 wakes in one loop iteration
                                                                 may take together, in ms
ASYNCGPU_CPU_THREADS          max(4, cores)    integer >= 1      threads of the CPU pool
ASYNCGPU_KERNEL_MARKERS       counter          counter, event    what follows an eager launch
                                                                 on the C fast path: a
                                                                 counter write or an event
ASYNCGPU_COMPLETION           counter          counter, event    completion markers: the
                                                                 GPU-written counter or
                                                                 driver events
ASYNCGPU_CACHE_DIR            under            a directory       the on-disk kernel cache
                              XDG_CACHE_HOME   (``~`` expands)
XDG_CACHE_HOME                ~/.cache         a directory       the user's cache directory;
                                                                 the kernel cache is its
                                                                 asyncgpu/kernels by default
ASYNCGPU_LOAD_WAIT_S          30               seconds >= 0      how long loading a kernel
                                                                 waits for CPU work that
                                                                 holds a wrapped stream
ASYNCGPU_DISABLE_HEALTHCHECK  0                flag              1: no healthcheck when a
                                                                 CUDA context opens
CUDA_DEVICE_MAX_CONNECTIONS   8                1 to 32 (else 8)  the driver's own: hardware
                                                                 queues a device's streams
                                                                 share (read, never set)
CUDA_VISIBLE_DEVICES          unset: every     the driver's      the driver's own: the GPUs
                              GPU              list              it shows; ``asyncgpu.ray``
                                                                 maps a Ray GPU id to a CUDA
                                                                 ordinal through it (read,
                                                                 never set; per worker)
============================  ===============  ================  ============================

An unset or empty variable means its default. Values are stripped of
surrounding blanks (paths excepted) and, where they are words, compared in
lower case. A flag is ``1``, ``true``, ``yes`` or ``on`` (set) or ``0``,
``false``, ``no`` or ``off`` (not set).

Each variable has one reader here, ``read_<name>(env=os.environ)``, which parses
it and raises ``ValueError`` naming the variable, the bad value and what is
accepted. ``CUDA_DEVICE_MAX_CONNECTIONS`` is the exception: it belongs to the
CUDA driver, which runs with values asyncgpu would not accept, so an integer
outside 1..32 or a non-integer counts as the driver's default of 8 instead of
stopping a program that the driver runs.

When they are read
------------------
The three per-context defaults (``ASYNCGPU_API``, ``ASYNCGPU_NUM_STREAMS``,
``ASYNCGPU_TRACE``) are read, and checked, each time a context is made, through
``read_api``, ``read_num_streams`` and ``read_trace``: a program may change them
between contexts. ``CUDA_VISIBLE_DEVICES`` is read (``read_cuda_visible_devices``)
each time an ``asyncgpu.ray`` worker opens its context, as Ray sets it per actor.

All the others are settings of the process, read once, when this module is
first imported (at ``import asyncgpu``), into ``SETTINGS``, a frozen
``Settings``; a bad value makes that import fail. Changing them afterwards has
no effect (the driver, too, reads ``CUDA_DEVICE_MAX_CONNECTIONS`` once). The
package reads ``_config.SETTINGS.<field>`` when it needs a value, so a test that
needs another setting replaces the whole object for its duration::

    monkeypatch.setattr(_config, "SETTINGS", _config.SETTINGS.replace(load_wait_s=0.05))

One setting is fixed at import by design and cannot be replaced so: the
reactor's wake budget (``_engine.ITERATION_S``). Tests of it run a subprocess
with the variable set.

This module imports only the standard library, so that every layer may use it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

__all__ = [
    "SETTINGS",
    "Settings",
    "read_api",
    "read_cache_dir",
    "read_completion",
    "read_cpu_threads",
    "read_cuda_visible_devices",
    "read_device_max_connections",
    "read_disable_healthcheck",
    "read_kernel_markers",
    "read_load_wait_s",
    "read_num_streams",
    "read_trace",
    "read_wake_budget_s",
]

NUM_STREAMS_DEFAULT = 8
WAKE_BUDGET_S_DEFAULT = 0.0002
LOAD_WAIT_S_DEFAULT = 30.0
DEVICE_MAX_CONNECTIONS_DEFAULT = 8  # the driver's own default

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

Env = Mapping[str, str]


def _raw(env: Env, name: str) -> str:
    """The value of ``name`` in ``env``, or ``""`` where it is unset. The one
    place this module looks a variable up (the tests find the names here)."""
    return env.get(name) or ""


def _flag(env: Env, name: str, default: bool) -> bool:
    value = _raw(env, name).strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"{name} must be a flag (1, true, yes, on or 0, false, no, off), not {_raw(env, name)!r}"
    )


def _choice(env: Env, name: str, choices: tuple[str, ...], default: str) -> str:
    value = _raw(env, name).strip().lower()
    if not value:
        return default
    if value not in choices:
        raise ValueError(f"{name} must be {' or '.join(choices)}, not {_raw(env, name)!r}")
    return value


def _int_at_least_1(env: Env, name: str, default: int) -> int:
    value = _raw(env, name).strip()
    if not value:
        return default
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name} must be an integer of at least 1, not {value!r}")
    return n


# -- per-context defaults: read each time a context is made --------------------------


def read_api(env: Env = os.environ) -> str | None:
    """``ASYNCGPU_API``: ``"cpu"`` or ``"cuda"``, or None where unset (the caller
    then picks ``cuda`` if a GPU is usable)."""
    value = _raw(env, "ASYNCGPU_API")
    if not value.strip():
        return None
    api = value.strip().lower()
    if api not in ("cpu", "cuda"):
        raise ValueError(f"ASYNCGPU_API must be cpu or cuda, not {value!r}")
    return api


def read_num_streams(env: Env = os.environ) -> int:
    """``ASYNCGPU_NUM_STREAMS``: the streams of a context's pool, at least 1."""
    return _int_at_least_1(env, "ASYNCGPU_NUM_STREAMS", NUM_STREAMS_DEFAULT)


def read_trace(env: Env = os.environ) -> str | None:
    """``ASYNCGPU_TRACE``: where every new context writes its trace (at its
    close, or once it is freed if dropped), or None."""
    return _raw(env, "ASYNCGPU_TRACE") or None


def read_cuda_visible_devices(env: Env = os.environ) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as the driver reads it, or None where unset or
    empty. Never checked here: its ids are the driver's and Ray's to interpret."""
    return _raw(env, "CUDA_VISIBLE_DEVICES").strip() or None


# -- settings of the process: read once, into SETTINGS ----------------------------------


def read_wake_budget_s(env: Env = os.environ) -> float:
    """The reactor's ``ITERATION_S`` from ``ASYNCGPU_WAKE_BUDGET_MS``
    (milliseconds, 0.01 to 100). A smaller budget keeps other tasks on the loop
    more responsive while many awaits finish, a larger one moves more awaits per
    loop iteration."""
    value = _raw(env, "ASYNCGPU_WAKE_BUDGET_MS").strip()
    if not value:
        return WAKE_BUDGET_S_DEFAULT
    try:
        ms = float(value)
    except ValueError:
        raise ValueError(
            f"ASYNCGPU_WAKE_BUDGET_MS must be a number of milliseconds, not {value!r}"
        ) from None
    if not 0.01 <= ms <= 100:  # (also refuses nan and inf)
        raise ValueError(f"ASYNCGPU_WAKE_BUDGET_MS must be from 0.01 to 100 ms, not {value}")
    return ms / 1e3


def read_cpu_threads(env: Env = os.environ) -> int:
    """``ASYNCGPU_CPU_THREADS``: threads of the CPU pool, else max(4, cores)."""
    return _int_at_least_1(env, "ASYNCGPU_CPU_THREADS", max(4, os.cpu_count() or 1))


def read_kernel_markers(env: Env = os.environ) -> str:
    """``ASYNCGPU_KERNEL_MARKERS``: ``"counter"`` or ``"event"``."""
    return _choice(env, "ASYNCGPU_KERNEL_MARKERS", ("counter", "event"), "counter")


def read_completion(env: Env = os.environ) -> str:
    """``ASYNCGPU_COMPLETION``: ``"counter"`` or ``"event"``."""
    return _choice(env, "ASYNCGPU_COMPLETION", ("counter", "event"), "counter")


def read_device_max_connections(env: Env = os.environ) -> int:
    """``CUDA_DEVICE_MAX_CONNECTIONS``, the driver's: 1..32, anything else 8 (see
    the module's doc for why this one is not refused)."""
    try:
        n = int(_raw(env, "CUDA_DEVICE_MAX_CONNECTIONS").strip())
    except ValueError:
        return DEVICE_MAX_CONNECTIONS_DEFAULT
    return n if 1 <= n <= 32 else DEVICE_MAX_CONNECTIONS_DEFAULT


def read_cache_dir(env: Env = os.environ) -> str:
    """The on-disk kernel cache: ``ASYNCGPU_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/asyncgpu/kernels``, else ``~/.cache/asyncgpu/kernels``
    (with ``os.path``: pathlib's first use costs a fresh process more)."""
    explicit = _raw(env, "ASYNCGPU_CACHE_DIR")
    if explicit:
        return os.path.expanduser(explicit)
    xdg = _raw(env, "XDG_CACHE_HOME")
    base = os.path.expanduser(xdg) if xdg else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "asyncgpu", "kernels")


def read_load_wait_s(env: Env = os.environ) -> float:
    """``ASYNCGPU_LOAD_WAIT_S``: seconds, at least 0 (``inf``: wait as long as it
    takes)."""
    value = _raw(env, "ASYNCGPU_LOAD_WAIT_S").strip()
    if not value:
        return LOAD_WAIT_S_DEFAULT
    try:
        s = float(value)
    except ValueError:
        s = math.nan
    if not s >= 0:  # (also refuses nan)
        raise ValueError(
            f"ASYNCGPU_LOAD_WAIT_S must be a number of seconds of at least 0, not {value!r}"
        )
    return s


def read_disable_healthcheck(env: Env = os.environ) -> bool:
    """``ASYNCGPU_DISABLE_HEALTHCHECK``: skip the healthcheck of a new CUDA context."""
    return _flag(env, "ASYNCGPU_DISABLE_HEALTHCHECK", False)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The settings of the process (see the module's doc)."""

    wake_budget_s: float
    cpu_threads: int
    kernel_markers: str
    completion: str
    device_max_connections: int
    cache_dir: str
    load_wait_s: float
    disable_healthcheck: bool

    @classmethod
    def from_env(cls, env: Env = os.environ) -> Settings:
        return cls(
            wake_budget_s=read_wake_budget_s(env),
            cpu_threads=read_cpu_threads(env),
            kernel_markers=read_kernel_markers(env),
            completion=read_completion(env),
            device_max_connections=read_device_max_connections(env),
            cache_dir=read_cache_dir(env),
            load_wait_s=read_load_wait_s(env),
            disable_healthcheck=read_disable_healthcheck(env),
        )

    def replace(self, **changes: object) -> Settings:
        """A copy with ``changes`` (for tests; see the module's doc)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


SETTINGS = Settings.from_env()
