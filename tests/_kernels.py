"""Kernels and helpers the tests share.

Every kernel carries both a CUDA C++ source (``extern "C"``) and a NumPy body, so
one test launches the same object on the CPU device and on a GPU. The NumPy
body is called once per thread block with a ``ThreadBlock`` (launch geometry,
thread indices as arrays) and the launch arguments, buffers as NumPy views.
"""

from __future__ import annotations

import threading

import numpy as np

from asyncgpu import Kernel, ThreadBlock

#: How long a gate or barrier waits before it gives up, so that a broken
#: ordering fails the test instead of hanging it.
TIMEOUT_S = 30.0


#: CUDA source of the fault tests' kernels, which their child processes compile:
#: ``trap`` (a sticky device fault) and ``spin(cycles)`` (busy for that many clock
#: cycles).
TRAP_AND_SPIN = r"""
extern "C" __global__ void trap() { __trap(); }
extern "C" __global__ void spin(long long c) {
    long long t = clock64(); while (clock64() - t < c) {} }
"""


class Gate:
    """A CPU function that holds its stream until ``open()``.

    Enqueue it with ``ctx.enqueue_cpu_function(gate)``: everything enqueued after
    it on that stream cannot run until the test calls ``open()``. ``entered`` is
    set once the stream has reached the gate. If nobody opens it within
    ``TIMEOUT_S`` it raises ``TimeoutError`` (the test then fails, not hangs).
    """

    def __init__(self) -> None:
        self._open = threading.Event()
        self.entered = threading.Event()

    def __call__(self) -> str:
        self.entered.set()
        if not self._open.wait(TIMEOUT_S):
            raise TimeoutError("the gate was never opened")
        return "opened"

    def open(self) -> None:
        self._open.set()


# -- y[i] = a * x[i] --------------------------------------------------------------------


def _scale_cpu(b: ThreadBlock, y: np.ndarray, x: np.ndarray, a: np.float32, n: np.int32) -> None:
    i = b.global_idx.x
    i = i[i < n]
    y[i] = a * x[i]


SCALE = Kernel(
    "scale",
    cuda=r"""
extern "C" __global__ void scale(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i];
}
""",
    cpu=_scale_cpu,
)


# -- y[i] = a * x[i] + y[i] -------------------------------------------------------------
# Tests pass a power of two for ``a``, so a * x is exact and a fused multiply-add on
# the GPU rounds exactly like NumPy's multiply-then-add.


def _axpy_cpu(b: ThreadBlock, a: np.float32, x: np.ndarray, y: np.ndarray, n: np.int32) -> None:
    i = b.global_idx.x
    i = i[i < n]
    y[i] = a * x[i] + y[i]


AXPY = Kernel(
    "axpy",
    cuda=r"""
extern "C" __global__ void axpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
""",
    cpu=_axpy_cpu,
)


# -- x[i] += 1 (int32, in place) ----------------------------------------------------------


def _add_one_cpu(b: ThreadBlock, x: np.ndarray, n: np.int32) -> None:
    i = b.global_idx.x
    i = i[i < n]
    x[i] += 1


ADD_ONE = Kernel(
    "add_one",
    cuda=r"""
extern "C" __global__ void add_one(int* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1;
}
""",
    cpu=_add_one_cpu,
)


# -- out[linear thread id] = linear thread id, for any 3-D grid and block --------------------


def _fill_index_cpu(b: ThreadBlock, out: np.ndarray, n: np.int32) -> None:
    g, d, bi, t = b.grid_dim, b.block_dim, b.block_idx, b.thread_idx
    block = bi.x + g.x * (bi.y + g.y * bi.z)
    thread = t.x + d.x * (t.y + d.y * t.z)
    i = block * (d.x * d.y * d.z) + thread
    i = i[i < n]
    out[i] = i


FILL_INDEX = Kernel(
    "fill_index",
    cuda=r"""
extern "C" __global__ void fill_index(int* out, int n) {
    int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    int i = block * (blockDim.x * blockDim.y * blockDim.z) + thread;
    if (i < n) out[i] = i;
}
""",
    cpu=_fill_index_cpu,
)


def blocks_for(n: int, block: int = 256) -> int:
    """Enough blocks of ``block`` threads to cover ``n`` elements."""
    return (n + block - 1) // block


def poison(dtype: np.dtype | type, n: int) -> np.ndarray:
    """An output array filled with a value no correct run produces."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return np.full(n, np.nan, dt)
    if dt.kind in "iu":
        return np.full(n, np.iinfo(dt).max, dt)
    raise TypeError(dt)


def random_array(rng: np.random.Generator, dtype: np.dtype | type, n: int) -> np.ndarray:
    """Fresh random data of ``dtype`` (never all zeros, never the poison value)."""
    dt = np.dtype(dtype)
    if dt.kind == "f":
        a = rng.uniform(-1000, 1000, n).astype(dt)
        a[a == 0] = 1
        return a
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, n, dtype=dt, endpoint=False)
    raise TypeError(dt)


def cuda_device_count() -> int:
    """CUDA devices asyncgpu sees; 0 where there is no driver or no backend."""
    import asyncgpu

    try:
        return asyncgpu.DeviceContext.number_of_devices(api="cuda")
    except Exception:
        return 0
