"""The devices below the core's seam, and the one place a backend is chosen.

``backend_class(api)`` imports a device's module on first use: ``cpu`` is pure
Python and NumPy; ``cuda`` needs cuda-python and a driver, so ``import
asyncgpu`` stays possible on machines without either.
"""

from __future__ import annotations

from typing import Any

from .._errors import NoDeviceError

__all__ = ["backend_class", "check_api", "cuda_available", "pointer_device"]


def check_api(api: str) -> str:
    """``api`` as a device name, ``"cpu"`` or ``"cuda"`` (any case); ``ValueError``
    for any other string."""
    name = api.lower()
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device api {api!r}: use 'cuda' or 'cpu'")
    return name


def backend_class(api: str) -> Any:
    """The backend class of ``api`` (``"cpu"`` or ``"cuda"``)."""
    api = check_api(api)
    if api == "cpu":
        from .cpu import CpuBackend

        return CpuBackend
    try:
        from .cuda.backend import CudaBackend
    except ImportError as e:
        raise NoDeviceError(
            f"the CUDA device needs cuda-python ({e}); pip install 'asyncgpu[cuda]'"
        ) from None
    return CudaBackend


def cuda_available() -> bool:
    """True when the CUDA device can be loaded and sees at least one GPU."""
    try:
        return backend_class("cuda").number_of_devices() > 0  # type: ignore[no-any-return]
    except Exception:
        return False


def pointer_device(ptr: int) -> int | None:
    """The CUDA device ordinal of an address another library handed over (None
    when the driver cannot say)."""
    return backend_class("cuda").pointer_device(ptr)  # type: ignore[no-any-return]
