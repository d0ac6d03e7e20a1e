"""``asyncgpu.torch``: awaiting PyTorch's CUDA work.

The first half runs everywhere, without PyTorch: the module is optional (``import
asyncgpu`` never loads it, nor PyTorch), and its calls say clearly what is
missing. PyTorch's stand-in there is a module of our own in ``sys.modules``. The
GPU half needs a CUDA GPU and a CUDA build of PyTorch (importorskip).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import types

import pytest
from _kernels import cuda_device_count

import asyncgpu as ag
import asyncgpu.torch as agt
from asyncgpu._api import interop as _api_interop


def test_import_asyncgpu_loads_neither_this_module_nor_pytorch() -> None:
    code = (
        "import sys, asyncgpu\n"
        "assert 'asyncgpu.torch' not in sys.modules\n"
        "assert 'torch' not in sys.modules\n"
        "import asyncgpu.torch\n"
        "assert 'torch' not in sys.modules  # (PyTorch comes at the first call)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_without_pytorch_a_call_says_so(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # (import torch raises ImportError)
    with pytest.raises(ag.NoDeviceError, match="PyTorch is not installed"):
        agt.wait()
    with pytest.raises(ag.NoDeviceError, match="PyTorch is not installed"):
        agt.wait_event(object())


class _Stream:
    def __init__(self, handle: int, device: int = 0) -> None:
        self.cuda_stream = handle
        self.device_index = device


class _Event:
    def __init__(self, handle: int) -> None:
        self.cuda_event = handle


def _torch(cuda: bool, current: _Stream | None = None) -> types.ModuleType:
    """PyTorch as this module sees it: ``torch.cuda`` with ``is_available``,
    ``current_stream`` (which raises without CUDA, as PyTorch's does) and
    ``current_device``."""

    def current_stream() -> _Stream:
        if not cuda:
            raise RuntimeError("Found no NVIDIA driver on your system")
        assert current is not None
        return current

    t = types.ModuleType("torch")
    t.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        is_available=lambda: cuda, current_stream=current_stream, current_device=lambda: 0
    )
    return t


def test_with_a_pytorch_without_cuda_a_call_says_there_is_nothing_to_await(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", _torch(cuda=False))
    with pytest.raises(ag.NoDeviceError, match=r"no CUDA device.*nothing to await"):
        agt.wait()
    with pytest.raises(ag.NoDeviceError, match="no CUDA device"):
        agt.wait_event(_Event(0x10))


def test_what_is_not_a_cuda_stream_or_event_is_a_type_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", _torch(cuda=True))
    with pytest.raises(TypeError, match=r"wait takes a torch\.cuda\.Stream, not object"):
        agt.wait(object())
    with pytest.raises(TypeError, match=r"wait_event takes a torch\.cuda\.Event, not int"):
        agt.wait_event(3)


def test_with_a_given_context_too_the_type_error_names_wait(monkeypatch) -> None:
    """The argument is checked by ``wait`` itself, before the context is asked:
    the error names ``asyncgpu.torch.wait``, not ``create_external_stream``."""
    monkeypatch.setitem(sys.modules, "torch", _torch(cuda=True))
    ctx = _Recorder()
    names_wait = r"asyncgpu\.torch\.wait takes a torch\.cuda\.Stream, not "
    with pytest.raises(TypeError, match=names_wait + "int"):
        agt.wait(0xA, ctx=ctx)  # type: ignore[arg-type]
    assert ctx.wrapped == []
    with ag.DeviceContext(api="cpu") as cpu, pytest.raises(TypeError, match=names_wait + "object"):
        agt.wait(object(), ctx=cpu)


def test_an_event_never_recorded_is_done_at_once(monkeypatch) -> None:
    """PyTorch makes an event's driver event at its first record (``cuda_event``
    is 0 until then): nothing to wait for, as ``torch.cuda.Event().query()``."""
    monkeypatch.setitem(sys.modules, "torch", _torch(cuda=True))
    done = agt.wait_event(_Event(0))
    assert done.query()
    asyncio.run(_await(done))


async def _await(awaitable) -> None:
    await awaitable


class _Recorder:
    """A CUDA context as ``wait`` uses it: what it wraps, and the fences asked."""

    def __init__(self) -> None:
        self.wrapped: list[object] = []
        self.fences = 0

    def create_external_stream(self, s: object) -> types.SimpleNamespace:
        self.wrapped.append(s)
        return types.SimpleNamespace(_impl=self)

    def fence(self) -> str:
        self.fences += 1
        return "the fence's event"

    state = types.SimpleNamespace(closed=False)


def test_the_current_stream_is_fenced_at_each_call_through_its_devices_context(
    monkeypatch,
) -> None:
    """``wait()`` is the current stream's fence, wrapped by the process-wide
    context of the stream's device (whose ``create_external_stream`` wraps each
    ``CUstream`` once: ``torch.cuda.current_stream()`` is a new object at each
    call); a stream of another device goes to that device's context."""
    ctxs: dict[int, _Recorder] = {}
    monkeypatch.setattr(agt, "_default_context", lambda api, d: ctxs.setdefault(d, _Recorder()))
    monkeypatch.setitem(sys.modules, "torch", _torch(cuda=True, current=_Stream(0xA)))
    assert agt.wait() == "the fence's event"
    assert agt.wait() == "the fence's event"
    assert agt.wait(_Stream(0xA)) == "the fence's event"
    assert len(ctxs[0].wrapped) == 3 and ctxs[0].fences == 3
    agt.wait(_Stream(0xB, device=1))
    assert len(ctxs[1].wrapped) == 1 and ctxs[1].fences == 1


def test_a_given_context_wraps_through_its_own_table(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", _torch(cuda=True, current=_Stream(0xA)))
    ctx = _Recorder()
    agt.wait(ctx=ctx)  # type: ignore[arg-type]
    agt.wait(ctx=ctx)  # type: ignore[arg-type]
    assert len(ctx.wrapped) == 2 and ctx.fences == 2  # (its create_external_stream caches)


def test_a_cpu_context_cannot_wrap_pytorchs_stream(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", _torch(cuda=True, current=_Stream(0xA)))
    with ag.DeviceContext(api="cpu") as cpu, pytest.raises(ag.UnsupportedError):
        agt.wait(ctx=cpu)


# -- GPU: PyTorch's CUDA work ----------------------------------------------------------------


needs_gpu = pytest.mark.skipif(cuda_device_count() == 0, reason="no CUDA device on this machine")


@pytest.fixture
def torch():
    t = pytest.importorskip("torch")
    if not t.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device here")
    return t


SPIN = 100_000_000  # GPU cycles of torch.cuda._sleep: long enough to be pending at the call


@pytest.mark.gpu
@needs_gpu
class TestOnTheGpu:
    def test_wait_covers_what_was_queued_on_the_stream_before_the_call(self, torch) -> None:
        s = torch.cuda.Stream()
        t = torch.zeros(1 << 12, device="cuda")
        agt.wait(s).synchronize()  # (makes the process-wide context first: slower than SPIN)
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            torch.cuda._sleep(SPIN)
            t.fill_(7)
            done = agt.wait()  # the current stream: s
        assert not done.query()
        asyncio.run(_await(done))
        assert s.query()
        assert float(t.sum()) == 7 * (1 << 12)

    def test_wait_of_a_given_stream_and_context(self, torch) -> None:
        s = torch.cuda.Stream()
        with ag.DeviceContext(api="cuda") as ctx:
            with torch.cuda.stream(s):
                torch.cuda._sleep(SPIN)
            asyncio.run(_await(agt.wait(s, ctx=ctx)))
            assert s.query()
            # one wrapper per CUstream: another Python object for the same stream
            assert ctx.create_external_stream(s) == ctx.create_external_stream(
                torch.cuda.ExternalStream(s.cuda_stream)
            )

    def test_wait_event_covers_the_events_latest_record(self, torch) -> None:
        s = torch.cuda.Stream()
        ev = torch.cuda.Event()
        with torch.cuda.stream(s):
            torch.cuda._sleep(SPIN)
            ev.record()
        done = agt.wait_event(ev)
        asyncio.run(_await(done))
        assert ev.query()

    def test_synchronize_and_query_work_on_the_result_too(self, torch) -> None:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(SPIN)
        done = agt.wait(s)
        done.synchronize()
        assert done.query() and s.query()

    def test_wrapping_pytorchs_streams_keeps_asyncgpus_own_streams_eager(self, torch) -> None:
        """A wrapped stream adds no stream to the device, so wrapping PyTorch's
        streams never counts as sharing the device's hardware queues (which
        would turn eager markers off for every stream of the device)."""
        with ag.DeviceContext(api="cuda") as ctx:
            own = ctx._state.stream(0)
            solo = own._queues.solo
            for _ in range(16):
                ctx.create_external_stream(torch.cuda.Stream())
            assert own._queues.solo == solo

    def test_many_concurrent_awaits_over_a_pool_of_streams(self, torch) -> None:
        """The serving pattern: tasks each queue work on one of a few PyTorch
        streams and await it; every await sees its own result."""
        streams = [torch.cuda.Stream() for _ in range(4)]
        n = 64

        async def one(i: int) -> float:
            s = streams[i % len(streams)]
            with torch.cuda.stream(s):
                x = torch.full((256,), float(i), device="cuda")
                y = (x * 2).to("cpu", non_blocking=True)
                done = agt.wait()
            await done
            return float(y[0])

        async def main() -> list[float]:
            return await asyncio.gather(*(one(i) for i in range(n)))

        assert asyncio.run(main()) == [2.0 * i for i in range(n)]


def test_the_process_wide_context_is_the_interop_one() -> None:
    """(The contexts ``wait`` uses without ``ctx`` are ``from_dlpack``'s.)"""
    assert agt._default_context is _api_interop._default_context
