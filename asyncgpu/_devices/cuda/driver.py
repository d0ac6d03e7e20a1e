"""The driver entry of the CUDA device: ``cuda.bindings.driver`` (``cu``), its
result codes, and the errors made of them.

* ``_check`` unpacks a cuda.bindings result tuple and raises ``_error``'s
  ``DeviceError`` on failure; the sticky faults that leave a context unusable
  (``_STICKY``: an illegal address, a failed launch, a device-side assert ...)
  become ``DeviceFaultError``.
* ``_native``: the C extension once bound to this driver's entry points
  (``cuLaunchKernel``, ``cuStreamWriteValue64``, ``cuEventRecord``,
  ``cuEventQuery``, ``cuMemcpyAsync``), which ``_entry_point`` finds
  (``cuGetProcAddress``) and ``backend._bind_native`` binds.
* The plain driver calls that a held stream runs later, in stream order
  (``cuMemcpyAsync``, ``cuMemcpyHtoDAsync``, ``cuMemsetD*Async``,
  ``cuGraphLaunch``, ``cuEventRecord``, ``cuStreamWaitEvent``, ``cuStreamWriteValue64``): each
  enqueues and returns without waiting for the device.

The bottom of the package: it imports no other module of it.
"""

from __future__ import annotations

import re
from typing import Any

from cuda.bindings import driver as cu

from ..._errors import DeviceError, DeviceFaultError

_SUCCESS = cu.CUresult.CUDA_SUCCESS
_NOT_READY = cu.CUresult.CUDA_ERROR_NOT_READY
_GEQ = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
_STICKY = {
    cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,
    cu.CUresult.CUDA_ERROR_LAUNCH_FAILED,
    cu.CUresult.CUDA_ERROR_ILLEGAL_INSTRUCTION,
    cu.CUresult.CUDA_ERROR_MISALIGNED_ADDRESS,
    cu.CUresult.CUDA_ERROR_INVALID_ADDRESS_SPACE,
    cu.CUresult.CUDA_ERROR_INVALID_PC,
    cu.CUresult.CUDA_ERROR_HARDWARE_STACK_ERROR,
    cu.CUresult.CUDA_ERROR_ASSERT,
    cu.CUresult.CUDA_ERROR_ECC_UNCORRECTABLE,
    cu.CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED,
}


def _error(err: Any, what: str) -> DeviceError:
    code = int(err)
    try:
        err = cu.CUresult(code)
        name = cu.cuGetErrorName(err)[1].decode()
        desc = cu.cuGetErrorString(err)[1].decode()
    except Exception:
        name, desc = f"CUresult {code}", ""
    cls = DeviceFaultError if err in _STICKY else DeviceError
    return cls(f"{what} failed: {name} ({desc})", code=code, name=name)


def _result_of(e: BaseException) -> tuple[int | None, str | None]:
    """The driver's result named in a cuda.core error's message (``CUDA_ERROR_...``),
    as ``DeviceError``'s code and name; ``(None, None)`` if it names none."""
    m = re.search(r"\bCUDA_ERROR_[A-Z0-9_]+", str(e))
    if m is None:
        return None, None
    try:
        return int(getattr(cu.CUresult, m.group(0))), m.group(0)
    except AttributeError:
        return None, m.group(0)


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda.bindings result tuple, raising ``DeviceError`` on failure."""
    err = result[0]
    if err != _SUCCESS:
        raise _error(err, what)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


# ``asyncgpu._native`` once ``backend._bind_native`` has bound it to the driver
# (when the driver is initialised), None before: read as ``driver._native``, as a
# name imported from here would stay None.
_native: Any = None


def _entry_point(name: str) -> int:
    """The driver's entry point of ``name`` for the CUDA 12.0 API (``cuGetProcAddress``)."""
    flags = cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    res = cu.cuGetProcAddress(name.encode(), 12000, flags)
    if res[0] != _SUCCESS or not int(res[1]):
        raise _error(res[0], f"cuGetProcAddress({name})")
    return int(res[1])


# -- driver calls that a held stream runs later (``_PolledStream._drain``) -----------------


def _memcpy(dst: int, src: int, nbytes: int, stream: Any) -> None:
    err = cu.cuMemcpyAsync(dst, src, nbytes, stream)[0]
    if err != _SUCCESS:
        raise _error(err, "cuMemcpyAsync")


def _memcpy_htod(dst: int, src: int, nbytes: int, stream: Any) -> None:
    _check(cu.cuMemcpyHtoDAsync(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")


def _memset(ptr: int, size: int, bits: int, count: int, stream: Any) -> None:
    if size == 1:
        r = cu.cuMemsetD8Async(ptr, bits, count, stream)
    elif size == 2:
        r = cu.cuMemsetD16Async(ptr, bits, count, stream)
    elif size == 4:
        r = cu.cuMemsetD32Async(ptr, bits, count, stream)
    else:
        r = cu.cuMemsetD2D32Async(ptr, 8, bits & 0xFFFFFFFF, 1, count, stream)
        if r[0] == _SUCCESS:
            r = cu.cuMemsetD2D32Async(ptr + 4, 8, bits >> 32, 1, count, stream)
    _check(r, "cuMemsetAsync")


def _record(e: Any, stream: Any) -> None:
    _check(cu.cuEventRecord(e, stream), "cuEventRecord")


def _wait_event(stream: Any, e: Any) -> None:
    _check(cu.cuStreamWaitEvent(stream, e, 0), "cuStreamWaitEvent")


def _wait_event_once(stream: Any, e: Any) -> None:
    try:
        _wait_event(stream, e)
    finally:
        cu.cuEventDestroy(e)


def _write_counter(stream: Any, addr: int, value: int) -> None:
    _check(cu.cuStreamWriteValue64(stream, addr, value, 0), "cuStreamWriteValue64")
