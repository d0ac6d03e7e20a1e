"""Exceptions raised by asyncgpu.

Bad input raises the builtin exception that fits (``TypeError`` for a wrong
type or dtype, ``ValueError`` for a wrong size or value, ``IndexError`` for an
offset, stream id or device id out of range), always at the call. Failures of
the device, the driver or the compiler raise the classes below.
"""

from __future__ import annotations

__all__ = [
    "AsyncGPUError",
    "CompileError",
    "ContextClosedError",
    "DeviceError",
    "DeviceFaultError",
    "HealthCheckError",
    "NoDeviceError",
    "UnsupportedError",
]


class AsyncGPUError(Exception):
    """Base class of every error asyncgpu raises itself. Every one pickles with
    its fields (``code``, ``name``, ``log``, ``check``), so that it reaches the
    caller whole from another process (a process pool, a Ray actor)."""

    def __reduce__(self) -> tuple[object, ...]:
        # Pickle's default rebuilds an exception as cls(*args), which drops the
        # keyword-only fields and fails where one is required.
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(
    cls: type[AsyncGPUError], args: tuple[object, ...], fields: dict[str, object]
) -> AsyncGPUError:
    e = cls.__new__(cls)
    e.args = args
    e.__dict__.update(fields)
    return e


class DeviceError(AsyncGPUError):
    """A driver call failed. ``code`` and ``name`` carry the driver's result (e.g.
    ``CUDA_ERROR_INVALID_VALUE``) where there is one."""

    def __init__(self, message: str, *, code: int | None = None, name: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.name = name


class DeviceFaultError(DeviceError):
    """The device hit a sticky fault (a trap, an illegal address, ...). Every pending
    await on the faulted context raises this; the context cannot be used again."""


class CompileError(AsyncGPUError):
    """Compiling a kernel failed. ``log`` holds the compiler's full log."""

    def __init__(self, message: str, *, log: str = "") -> None:
        super().__init__(message if not log else f"{message}\n{log}")
        self.log = log


class ContextClosedError(AsyncGPUError):
    """A closed ``DeviceContext`` (or a buffer, stream or function of one) was used."""


class NoDeviceError(AsyncGPUError):
    """The requested API or device does not exist on this machine."""


class UnsupportedError(AsyncGPUError):
    """The device cannot do what was asked (e.g. an attribute the CPU device has no
    answer for)."""


class HealthCheckError(DeviceError):
    """``run_healthcheck`` found the device unhealthy. ``check`` names the failed check."""

    def __init__(self, message: str, *, check: str) -> None:
        super().__init__(message)
        self.check = check
