"""The C extension ``asyncgpu._native``: the compiled hot path, which asyncgpu
needs (``pip install`` builds it; an install that cannot build it fails).

Events, polled streams, buffers, functions, context states and views keep
their fields in its C types (``EventCore``, ``StreamCore``, ``BufferCore``,
``FunctionCore``, ``StateCore``, ``RefCore``, ``ContextCore``; the CUDA
device's ``KernelCore`` and ``SpareCore``), which the classes of the core, the
public face and the CUDA device subclass; the CUDA backend also binds its
driver calls (``bind``), which it does only once a driver has initialised.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any


def _load() -> Any:
    # By name: the extension is C and imports nothing of the package, and a
    # ``from . import _native`` reads to the import checker (import-linter, which
    # sees only Python modules) as an import of the package root, which imports
    # every layer.
    try:
        return importlib.import_module(f"{__package__}._native")
    except ImportError as e:
        raise ImportError(
            "asyncgpu's C extension asyncgpu._native is missing or cannot be loaded "
            f"({e}). It is built when asyncgpu is installed: reinstall with a C compiler "
            "(gcc or clang) and the Python headers present (`pip install asyncgpu`, or "
            "`pip install -e .` in a checkout), or build it in place with "
            "`python setup.py build_ext --inplace`."
        ) from e


if TYPE_CHECKING:  # (its types: _native.pyi)
    from . import _native as native
else:
    native = _load()
