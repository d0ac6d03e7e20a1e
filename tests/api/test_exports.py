"""The public surface: ``asyncgpu.__all__`` is exactly these names, each
importable from the package root. A name added or removed here is an API
change (and a line in the changelog)."""

from __future__ import annotations

import asyncgpu

PUBLIC = {
    # context, streams, events
    "DeviceContext", "DeviceStream", "DeviceEvent", "default_api",
    # memory
    "DeviceBuffer", "HostBuffer",
    # kernels and functions
    "Kernel", "kernel", "ThreadBlock", "DeviceFunction", "DeviceExternalFunction",
    # device graphs
    "DeviceGraph", "DeviceGraphBuilder", "DeviceGraphNode",
    # types
    "ConstantMemoryMapping", "DeviceAttribute", "Dim", "FuncAttribute", "GPUInfo",
    "LaunchAttribute", "LaunchAttributeID", "StreamPriorityRange",
    # interoperability
    "from_dlpack", "from_cuda_array_interface", "NumbaKernel", "load_numba_kernel",
    # tracing
    "Trace", "TraceEdge", "TraceNode",
    # errors
    "AsyncGPUError", "CompileError", "ContextClosedError", "DeviceError", "DeviceFaultError",
    "HealthCheckError", "NoDeviceError", "UnsupportedError",
    "__version__",
}  # fmt: skip


def test_all_names_exactly_the_public_api() -> None:
    assert set(asyncgpu.__all__) == PUBLIC
    assert len(asyncgpu.__all__) == len(PUBLIC)  # (no name listed twice)


def test_every_public_name_is_importable_from_the_root() -> None:
    for name in PUBLIC:
        assert getattr(asyncgpu, name) is not None, name
