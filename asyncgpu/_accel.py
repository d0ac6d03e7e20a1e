"""The C extension ``asyncgpu._native``, where it is built and not switched off.

``native`` is the module, or None: not built (asyncgpu then runs on Python and
cuda.bindings alone), or ``ASYNCGPU_NATIVE=0`` (``_config``) when asyncgpu
was imported. Events, polled streams and buffers keep their fields in its C
types (``EventCore``, ``StreamCore``, ``BufferCore``, ``SpareCore``,
``FunctionCore``, ``ContextCore``; ``c_base``) and their locks are its ``RLock``
(``hot_lock``) when it is there; the CUDA backend also binds its driver calls
(``_cuda._bind_native``), which it does only once a driver has initialised.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from . import _config


def _load() -> Any:
    if not _config.SETTINGS.native:
        return None
    # By name: the extension is C and imports nothing of the package, and a
    # ``from . import _native`` reads to the import checker (import-linter, which
    # sees only Python modules) as an import of the package root, which imports
    # every layer.
    try:
        return importlib.import_module(f"{__package__}._native")
    except ImportError:
        return None


native: Any = _load()


def c_base(name: str, fallback: type) -> type:
    """The C type ``name`` of the extension that a class keeps its fields in, or
    ``fallback`` (a Python class with the same fields) where it is not loaded."""
    return fallback if native is None else getattr(native, name)


def hot_lock() -> Any:
    """A lock the hot paths take: the extension's ``RLock`` (re-entrant, with
    ``threading.RLock``'s methods), which its C code takes and gives back
    without a Python call, or ``threading.RLock`` where it is not loaded."""
    return threading.RLock() if native is None else native.RLock()
