"""asyncgpu: async/await GPU scheduling for Python.

The Mojo/MAX ``DeviceContext`` API on NVIDIA's cuda-python, with every copy,
kernel and CPU function awaitable, and a full CPU device for machines without a
GPU. ``import asyncgpu`` needs no driver: the CUDA device is loaded on first use.
"""

from ._api.context import DeviceContext, default_api
from ._api.graph import DeviceGraph, DeviceGraphBuilder
from ._api.interop import from_cuda_array_interface, from_dlpack
from ._api.numba import NumbaKernel, load_numba_kernel
from ._api.stream import DeviceStream
from ._core.event import DeviceEvent
from ._core.function import DeviceExternalFunction, DeviceFunction, Kernel, ThreadBlock, kernel
from ._core.graph import DeviceGraphNode
from ._core.memory import DeviceBuffer, HostBuffer
from ._core.trace import Trace, TraceEdge, TraceNode
from ._errors import (
    AsyncGPUError,
    CompileError,
    ContextClosedError,
    DeviceError,
    DeviceFaultError,
    HealthCheckError,
    NoDeviceError,
    UnsupportedError,
)
from ._types import (
    ConstantMemoryMapping,
    DeviceAttribute,
    Dim,
    FuncAttribute,
    GPUInfo,
    LaunchAttribute,
    LaunchAttributeID,
    StreamPriorityRange,
)
from ._version import __version__

__all__ = [
    "AsyncGPUError",
    "CompileError",
    "ConstantMemoryMapping",
    "ContextClosedError",
    "DeviceAttribute",
    "DeviceBuffer",
    "DeviceContext",
    "DeviceError",
    "DeviceEvent",
    "DeviceExternalFunction",
    "DeviceFaultError",
    "DeviceFunction",
    "DeviceGraph",
    "DeviceGraphBuilder",
    "DeviceGraphNode",
    "DeviceStream",
    "Dim",
    "FuncAttribute",
    "GPUInfo",
    "HealthCheckError",
    "HostBuffer",
    "Kernel",
    "LaunchAttribute",
    "LaunchAttributeID",
    "NoDeviceError",
    "NumbaKernel",
    "StreamPriorityRange",
    "ThreadBlock",
    "Trace",
    "TraceEdge",
    "TraceNode",
    "UnsupportedError",
    "__version__",
    "default_api",
    "from_cuda_array_interface",
    "from_dlpack",
    "kernel",
    "load_numba_kernel",
]
