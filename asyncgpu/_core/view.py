"""The fields of a context view (``_ContextBase``): its shared state, its current
stream and its reference. ``DeviceContext`` extends it; buffers check a context
argument against it without importing the public face.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._accel import c_base

__all__ = ["_ContextBase"]


class _ContextFields:
    """The fields of a ``DeviceContext``: its shared state, its current stream,
    and its reference (in ``asyncgpu._native.ContextCore`` where the extension is
    built, whose C ``enqueue_function`` and ``enqueue_create_buffer`` read them
    directly)."""

    __slots__ = ("_impl", "_ref", "_state")


if TYPE_CHECKING:
    _ContextBase = _ContextFields
else:
    _ContextBase = c_base("ContextCore", _ContextFields)
