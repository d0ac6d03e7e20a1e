"""Pieces of the CUDA device that need no GPU: the PTX signature reader and the
wait that turns a module load behind held CPU work into an error, not a hang."""

from __future__ import annotations

import ctypes
import threading

import pytest

cuda = pytest.importorskip("asyncgpu._cuda", reason="cuda-python is not installed")

from asyncgpu import DeviceError  # noqa: E402
from asyncgpu._compiler import compile_cuda  # noqa: E402

SRC = r"""
struct Pair { double a; int b; };
extern "C" __global__ void four(float a, const float* x, float* y, int n) {}
extern "C" __global__ void none() {}
extern "C" __global__ void byval(Pair p, char c, short s, long long q) {}
"""


@pytest.mark.parametrize(
    ("name", "sizes"),
    [("four", (4, 8, 8, 4)), ("none", ()), ("byval", (16, 1, 2, 8))],
)
def test_kernel_signatures_are_read_from_the_ptx(name, sizes) -> None:
    ptx = compile_cuda(SRC, name, arch="sm_90", want_ptx=True).ptx
    assert ptx is not None
    assert cuda._ptx_param_sizes(ptx, name) == sizes


def test_an_unknown_entry_has_no_signature() -> None:
    ptx = compile_cuda(SRC, "four", arch="sm_90", want_ptx=True).ptx
    assert cuda._ptx_param_sizes(ptx, "missing") is None


class _HeldStream:
    """Stands in for a CudaStream: ``_host_ops`` issued, ``_hostsig`` finished."""

    label = "cuda:0/s1"

    def __init__(self, issued: int, done: int) -> None:
        self._host_ops = issued
        self._hostsig = ctypes.c_uint64(done)


class _Backend:
    device_id = 0
    _wait_for_host_work = cuda.CudaBackend._wait_for_host_work

    def __init__(self, *streams: _HeldStream) -> None:
        self._streams = list(streams)


@pytest.fixture
def backend(monkeypatch):
    def make(*streams: _HeldStream) -> _Backend:
        b = _Backend(*streams)
        monkeypatch.setattr(cuda, "_all_streams", lambda _b: list(b._streams))
        return b

    return make


def test_loading_code_behind_unfinished_cpu_work_raises_instead_of_hanging(
    backend, monkeypatch
) -> None:
    monkeypatch.setenv("ASYNCGPU_LOAD_WAIT_S", "0.05")
    b = backend(_HeldStream(issued=2, done=1))
    with pytest.raises(DeviceError, match=r"cuda:0/s1 .*held back for CPU work"):
        b._wait_for_host_work("loading kernel 'k'")


def test_loading_code_waits_for_cpu_work_that_finishes(backend, monkeypatch) -> None:
    monkeypatch.setenv("ASYNCGPU_LOAD_WAIT_S", "30")
    held = _HeldStream(issued=1, done=0)
    b = backend(held)
    started = threading.Event()

    def finish_the_cpu_work() -> None:
        started.wait(10)
        held._hostsig.value = 1

    t = threading.Thread(target=finish_the_cpu_work)
    t.start()
    started.set()
    b._wait_for_host_work("loading kernel 'k'")  # returns once the work is done
    t.join(10)
    assert held._hostsig.value == 1
