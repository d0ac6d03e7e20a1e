"""Plain value types of the API: launch geometry, attributes, device info."""

from __future__ import annotations

import enum
import numbers
import operator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Union

__all__ = [
    "ConstantMemoryMapping",
    "DeviceAttribute",
    "Dim",
    "DimLike",
    "FuncAttribute",
    "GPUInfo",
    "LaunchAttribute",
    "LaunchAttributeID",
    "StreamPriorityRange",
]


def check_int(value: Any, what: str) -> int:
    """``value`` as an ``int``: a Python or NumPy integer, never a ``bool``
    (``TypeError`` naming ``what`` otherwise)."""
    if type(value) is int:  # the common case, without the ABC check below
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, not {value!r}")
    return operator.index(value)


class Dim(NamedTuple):
    """A launch dimension (x, y, z). Every component is a positive ``int``.

    ``Dim(4)`` is ``(4, 1, 1)``; ``Dim.of`` accepts an ``int``, a tuple of one to
    three ints, or a ``Dim``, and raises ``ValueError`` for a zero or negative
    component and ``TypeError`` for anything that is not an integer.
    """

    x: int
    y: int = 1
    z: int = 1

    @staticmethod
    def of(value: DimLike, what: str = "dimension") -> Dim:
        if isinstance(value, Dim):
            dim = value
        elif isinstance(value, int) and not isinstance(value, bool):
            dim = Dim(value)
        elif isinstance(value, tuple) and 1 <= len(value) <= 3:
            dim = Dim(*value)
        elif hasattr(value, "__index__") and not isinstance(value, bool):
            dim = Dim(value.__index__())  # a NumPy integer
        else:
            raise TypeError(f"{what} must be an int, a tuple of 1-3 ints or a Dim, not {value!r}")
        for c in dim:
            if isinstance(c, bool):
                raise TypeError(f"{what} components must be integers, not bools: {value!r}")
            if not isinstance(c, int):
                try:
                    c = c.__index__()
                except AttributeError:
                    raise TypeError(f"{what} components must be integers, got {value!r}") from None
            if c <= 0:
                raise ValueError(f"{what} components must be positive, got {tuple(dim)}")
        return Dim(int(dim.x), int(dim.y), int(dim.z))

    def size(self) -> int:
        """Number of elements: ``x * y * z``."""
        return self.x * self.y * self.z


DimLike = Union[int, tuple[int, ...], Dim]  # noqa: UP007 (a runtime alias)


class StreamPriorityRange(NamedTuple):
    """The stream priorities a device supports. On CUDA a *lower* number is a higher
    priority, so ``greatest <= least``."""

    least: int
    greatest: int


class DeviceAttribute(enum.IntEnum):
    """Device attributes, numbered as CUDA's ``CUdevice_attribute``."""

    MAX_THREADS_PER_BLOCK = 1
    MAX_BLOCK_DIM_X = 2
    MAX_BLOCK_DIM_Y = 3
    MAX_BLOCK_DIM_Z = 4
    MAX_GRID_DIM_X = 5
    MAX_GRID_DIM_Y = 6
    MAX_GRID_DIM_Z = 7
    MAX_SHARED_MEMORY_PER_BLOCK = 8
    TOTAL_CONSTANT_MEMORY = 9
    WARP_SIZE = 10
    MAX_PITCH = 11
    MAX_REGISTERS_PER_BLOCK = 12
    CLOCK_RATE = 13
    GPU_OVERLAP = 15
    MULTIPROCESSOR_COUNT = 16
    KERNEL_EXEC_TIMEOUT = 17
    INTEGRATED = 18
    CAN_MAP_HOST_MEMORY = 19
    COMPUTE_MODE = 20
    CONCURRENT_KERNELS = 31
    ECC_ENABLED = 32
    PCI_BUS_ID = 33
    PCI_DEVICE_ID = 34
    TCC_DRIVER = 35
    MEMORY_CLOCK_RATE = 36
    GLOBAL_MEMORY_BUS_WIDTH = 37
    L2_CACHE_SIZE = 38
    MAX_THREADS_PER_MULTIPROCESSOR = 39
    ASYNC_ENGINE_COUNT = 40
    UNIFIED_ADDRESSING = 41
    PCI_DOMAIN_ID = 50
    COMPUTE_CAPABILITY_MAJOR = 75
    COMPUTE_CAPABILITY_MINOR = 76
    STREAM_PRIORITIES_SUPPORTED = 78
    MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
    MAX_REGISTERS_PER_MULTIPROCESSOR = 82
    MANAGED_MEMORY = 83
    MULTI_GPU_BOARD = 84
    HOST_NATIVE_ATOMIC_SUPPORTED = 86
    PAGEABLE_MEMORY_ACCESS = 88
    CONCURRENT_MANAGED_ACCESS = 89
    COOPERATIVE_LAUNCH = 95
    MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
    MAX_BLOCKS_PER_MULTIPROCESSOR = 106
    MAX_PERSISTING_L2_CACHE_SIZE = 108
    MEMORY_POOLS_SUPPORTED = 115
    GPU_DIRECT_RDMA_SUPPORTED = 116
    CLUSTER_LAUNCH = 120
    CAN_USE_64_BIT_STREAM_MEM_OPS = 122
    CAN_USE_STREAM_WAIT_VALUE_NOR = 123
    MULTICAST_SUPPORTED = 132


class FuncAttribute(NamedTuple):
    """A function attribute to set before launches, numbered as CUDA's
    ``CUfunction_attribute``. Build one with the constructors below."""

    attribute: int
    value: int

    @staticmethod
    def MAX_DYNAMIC_SHARED_SIZE_BYTES(value: int) -> FuncAttribute:
        """Opt in to this much dynamic shared memory per block (above 48 KiB)."""
        return FuncAttribute(8, int(value))

    @staticmethod
    def PREFERRED_SHARED_MEMORY_CARVEOUT(value: int) -> FuncAttribute:
        """Percentage of L1/shared memory to carve out as shared memory."""
        return FuncAttribute(9, int(value))

    @staticmethod
    def NON_PORTABLE_CLUSTER_SIZE_ALLOWED(value: int) -> FuncAttribute:
        """Allow cluster sizes above 8 where the device supports them."""
        return FuncAttribute(14, int(value))


class LaunchAttributeID(enum.IntEnum):
    """Launch attribute kinds, numbered as CUDA's ``CUlaunchAttributeID``."""

    COOPERATIVE = 2
    CLUSTER_DIMENSION = 4
    PRIORITY = 8


@dataclass(frozen=True)
class LaunchAttribute:
    """One launch attribute: ``LaunchAttribute.cooperative()``,
    ``LaunchAttribute.priority(p)`` or ``LaunchAttribute.cluster_dim(dim)``."""

    id: LaunchAttributeID
    value: Any

    def __post_init__(self) -> None:
        # An id no device knows would otherwise be accepted and mean nothing.
        if isinstance(self.id, bool) or not isinstance(self.id, numbers.Integral):
            raise TypeError(f"a launch attribute's id is a LaunchAttributeID, not {self.id!r}")
        if int(self.id) not in LaunchAttributeID._value2member_map_:
            known = ", ".join(f"{a.name} ({a.value})" for a in LaunchAttributeID)
            raise ValueError(f"unknown launch attribute id {self.id!r}: the known ids are {known}")

    @staticmethod
    def cooperative(enabled: bool = True) -> LaunchAttribute:
        return LaunchAttribute(LaunchAttributeID.COOPERATIVE, bool(enabled))

    @staticmethod
    def priority(priority: int) -> LaunchAttribute:
        return LaunchAttribute(LaunchAttributeID.PRIORITY, int(priority))

    @staticmethod
    def cluster_dim(dim: DimLike) -> LaunchAttribute:
        return LaunchAttribute(LaunchAttributeID.CLUSTER_DIMENSION, Dim.of(dim, "cluster_dim"))


@dataclass(frozen=True)
class ConstantMemoryMapping:
    """Bytes to copy into the ``__constant__`` symbol ``name`` of the launched
    function's module before the launch. ``data`` is anything with the buffer
    protocol (a NumPy array, ``bytes``)."""

    name: str
    data: Any

    def as_bytes(self) -> bytes:
        return memoryview(self.data).cast("B").tobytes()


@dataclass(frozen=True)
class GPUInfo:
    """What a device is, queried from the device itself (never assumed)."""

    name: str
    api: str
    vendor: str
    arch: str
    compute_capability: tuple[int, int] | None
    sm_count: int
    warp_size: int
    threads_per_block: int
    max_block_dim: tuple[int, int, int]
    max_grid_dim: tuple[int, int, int]
    shared_memory_per_block: int
    shared_memory_per_block_optin: int
    total_memory: int
    clock_rate_khz: int
    memory_clock_rate_khz: int
    l2_cache_size: int
    extra: dict[str, Any] = field(default_factory=dict)

    def target(self) -> str:
        """The compilation target: ``sm_<major><minor>`` on CUDA (``sm_90`` on
        compute capability 9.0), ``cpu`` on the CPU device."""
        return self.arch
