"""asyncgpu workers on Ray: one ``DeviceContext`` per async actor.

``GPUWorker`` is a base class for Ray async actors (``pip install
asyncgpu[ray]``)::

    @ray.remote(num_gpus=1, max_concurrency=16)
    class Scaler(GPUWorker):
        async def scale(self, x: np.ndarray) -> np.ndarray:
            buf = await self.upload(x)
            ...  # kernels on self.ctx, awaited on the actor's own event loop
            return await self.download(buf)

The actor's context is opened on its first use (``self.ctx``), on the device Ray
assigned to the actor (``ray.get_gpu_ids()``; the CPU device when the actor has
no GPU), and closed when the actor ends gracefully (Ray calls
``__ray_shutdown__``). Its awaits run on the actor's event loop (uvloop by
default), and the actor's ``max_concurrency`` bounds how many calls await at
once: the worker adds no queue or thread of its own.

This module never imports Ray itself: it asks Ray only when Ray is already
loaded in the process (an actor's process always has it), so ``import
asyncgpu.ray`` works without Ray, and a ``GPUWorker`` subclass is an ordinary
class that can be driven directly (``await Scaler().scale(x)``), on a machine
without Ray, on the device ``default_api()`` picks.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import numpy as np

from . import DeviceBuffer, DeviceContext, default_api
from . import from_dlpack as _from_dlpack
from ._api.context import check_options
from ._config import read_cuda_visible_devices
from ._core.dlpack import kDLCPU, kDLCUDA
from ._types import check_int

__all__ = ["GPUWorker", "assigned_device", "cuda_ordinal"]


def cuda_ordinal(gpu_id: int | str, visible_devices: str | None) -> int:
    """The CUDA ordinal of the GPU Ray calls ``gpu_id`` in a process whose
    ``CUDA_VISIBLE_DEVICES`` is ``visible_devices``.

    Ray sets ``CUDA_VISIBLE_DEVICES`` in each actor to the GPUs it assigned, so
    the CUDA driver numbers them from 0 in that order: the ordinal is the
    position of ``gpu_id`` in that list (0 for an actor's only GPU), whatever the
    node calls the GPU (an index or a UUID). Where the variable is unset (Ray
    told not to set it, ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``), every
    GPU is visible and Ray's id is the ordinal itself. Raises ``ValueError``
    when ``gpu_id`` is not among the visible devices."""
    if visible_devices is None:
        try:
            return int(gpu_id)
        except ValueError:
            raise ValueError(
                f"GPU {gpu_id!r} is not an index, and CUDA_VISIBLE_DEVICES is not set to "
                "map it to one"
            ) from None
    visible = [v.strip() for v in visible_devices.split(",") if v.strip()]
    try:
        return visible.index(str(gpu_id).strip())
    except ValueError:
        raise ValueError(
            f"GPU {gpu_id!r} assigned by Ray is not in CUDA_VISIBLE_DEVICES={visible_devices!r}"
        ) from None


def _ray_actor() -> Any:
    """The ``ray`` module when this process runs a Ray actor, else ``None``. Only
    a Ray that is already loaded is asked: importing it would cost seconds, and an
    actor's process has always loaded it."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    if ray.get_runtime_context().get_actor_id() is None:  # the driver or a task
        return None
    return ray


def assigned_device() -> tuple[str, int]:
    """``(api, device_id)`` for a ``DeviceContext`` of the current process.

    In a Ray actor: ``("cuda", ordinal)`` of the first GPU ``ray.get_gpu_ids()``
    lists (mapped by ``cuda_ordinal``), ``("cpu", 0)`` when the actor has none.
    Anywhere else (no Ray, Ray's driver): ``(default_api(), 0)``."""
    ray = _ray_actor()
    if ray is None:
        return default_api(), 0
    ids = ray.get_gpu_ids()
    if not ids:
        return "cpu", 0
    return "cuda", cuda_ordinal(ids[0], read_cuda_visible_devices())


class GPUWorker:
    """Base class of an async actor that works on one device.

    ``GPUWorker(*, api=None, device_id=None, num_streams=None)``: by default the
    device is ``assigned_device()`` (Ray's GPU of the actor, the CPU device for
    an actor without one); ``api`` and ``device_id`` choose it instead, and
    ``num_streams`` sizes the context's stream pool (``DeviceContext``'s
    default otherwise). They are checked here as ``DeviceContext`` checks them
    (``TypeError`` for a non-string ``api`` or a non-integer ``device_id`` or
    ``num_streams``, ``ValueError`` for an unknown ``api`` or ``num_streams``
    below 1). A subclass with an ``__init__`` of its own calls
    ``super().__init__(...)``.

    Nothing is opened at construction: ``ctx`` opens the context on first use,
    in the thread that uses it (an async actor's methods all run on its event
    loop's thread). ``close()`` (called by Ray's ``__ray_shutdown__`` when the
    actor ends gracefully: its handles gone out of scope,
    ``actor.__ray_terminate__.remote()``, ``ray.actor.exit_actor()``) waits for
    the context's work and releases it. ``ray.kill`` ends the process without
    it; the driver releases the device's resources with the process.
    """

    # Class-level defaults, so that a subclass whose __init__ forgets super()
    # still gets a worker that opens its context on first use.
    _api: str | None = None
    _device_id: int | None = None
    _num_streams: int | None = None
    _ctx: DeviceContext | None = None

    def __init__(
        self,
        *,
        api: str | None = None,
        device_id: int | None = None,
        num_streams: int | None = None,
    ) -> None:
        # DeviceContext's own checks, so that a bad value fails here, in the
        # caller, rather than at the first self.ctx inside a remote call.
        api, num_streams = check_options(api, num_streams)
        if device_id is not None:
            device_id = check_int(device_id, "device_id")
        self._api = api
        self._device_id = device_id
        self._num_streams = num_streams
        self._ctx = None

    @property
    def ctx(self) -> DeviceContext:
        """The worker's ``DeviceContext``, opened on first use (see the class)."""
        ctx = self._ctx
        if ctx is None:
            api, device_id = assigned_device()
            if self._api is not None:
                api = self._api
            if self._device_id is not None:
                device_id = self._device_id
            ctx = DeviceContext(device_id, api=api, num_streams=self._num_streams)
            self._ctx = ctx
        return ctx

    async def upload(self, array: Any) -> DeviceBuffer:
        """A new device buffer holding ``array``'s elements (flattened, C order), on
        the current stream: ``cuMemAllocAsync`` and ``cuMemcpyHtoDAsync``, awaited.
        A contiguous array, read-only too (as Ray hands arguments over from its
        object store), is copied from as it is, with no host copy of its own."""
        a = np.ascontiguousarray(array)
        buf = self.ctx.enqueue_create_buffer(a.dtype, a.size)
        await self.ctx.enqueue_copy(buf, a.reshape(-1))
        return buf

    async def download(self, buf: DeviceBuffer, shape: Any = None) -> np.ndarray:
        """A new NumPy array (of ``shape`` if given, else 1-D) holding ``buf``'s
        elements once the owning stream's work so far has finished:
        ``cuMemcpyDtoHAsync`` on the current stream, awaited. Returned from a
        remote call, the array travels through Ray's object store."""
        out = np.empty(len(buf), buf.dtype)
        await self.ctx.enqueue_copy(out, buf)
        return out if shape is None else out.reshape(shape)

    async def to_tensor(self, buf: DeviceBuffer, shape: Any = None) -> Any:
        """A ``torch.Tensor`` over ``buf``'s memory, no copy (``torch.from_dlpack``),
        of ``shape`` if given (else 1-D): what an actor method returns for Ray
        Direct Transport to carry (``@ray.method(tensor_transport="nccl")`` for a
        CUDA buffer, ``"gloo"`` for one of the CPU device), or what it passes to
        ``ray.put(tensor, _tensor_transport=...)``.

        Ordered: first awaits everything enqueued so far on ``buf``'s owning
        stream (its writes there, and copies into it from other streams; a kernel
        on another stream is ordered by the caller, as for any read). Ray's
        transports read the tensor on streams DLPack's stream argument does not
        name (NCCL's own) or outside any stream (Gloo, on the host), so the
        tensor is made complete before Ray sees it, at the cost of one wait.
        (On CUDA, ``torch.from_dlpack`` also orders PyTorch's current stream
        after the buffer's, by DLPack's stream rule.)

        Kept alive: the tensor holds ``buf`` (its DLPack capsule's deleter lets
        it go), and Ray's RDT store holds the tensor until every ``ObjectRef`` to
        it is gone, so the buffer lives until then even after the worker drops
        it; its memory then goes back to the pool on its owning stream, after
        PyTorch's current stream (CUDA). Ray sends the tensor, not a copy of it:
        do not write ``buf`` again before then
        (``ray.experimental.wait_tensor_freed(tensor)`` blocks until it is).

        ``TypeError`` for anything but a ``DeviceBuffer``; ``ImportError``
        without PyTorch."""
        if not isinstance(buf, DeviceBuffer):
            raise TypeError(f"to_tensor takes a DeviceBuffer, not {type(buf).__name__}")
        torch = importlib.import_module("torch")  # (only the hand-offs need it)
        await buf.context()
        t = torch.from_dlpack(buf)
        return t if shape is None else t.reshape(shape)

    def from_tensor(self, tensor: Any) -> DeviceBuffer:
        """The memory of ``tensor`` (one Ray Direct Transport delivered to this
        actor, or any array with ``__dlpack__`` on the worker's device) as a 1-D
        ``DeviceBuffer`` of the worker's context, no copy
        (``asyncgpu.from_dlpack(tensor, self.ctx)``).

        Ordered: the buffer is owned by the context's current stream, which
        ``tensor.__dlpack__(stream=...)`` makes wait, on the device, for
        PyTorch's current stream of the tensor's device (CUDA): the stream that
        CUDA IPC's receive waits on, and PyTorch's default one, the legacy
        default stream, that implicitly follows the legacy or blocking streams
        NCCL receives on. (An actor that makes another PyTorch stream current
        orders NCCL's receive itself.) Gloo (CPU tensors) has received the data
        before the method runs: there is nothing to wait for.

        Kept alive: the buffer holds the tensor's memory (the DLPack capsule)
        for as long as the buffer, and every operation that uses it, live; it
        frees nothing.

        ``ValueError`` for a tensor on another device than the worker's (copy it
        instead: ``await self.upload(tensor.numpy())`` for a CPU tensor) or one
        that is not C-contiguous; ``TypeError`` without ``__dlpack__``."""
        if not hasattr(tensor, "__dlpack__"):
            raise TypeError(f"{type(tensor).__name__} does not implement __dlpack__")
        ctx = self.ctx
        api, device_id = ctx.api(), ctx.id()
        want = (kDLCUDA, device_id) if api == "cuda" else (kDLCPU, 0)
        where = tuple(int(v) for v in tensor.__dlpack_device__())
        if where != want:
            raise ValueError(
                f"the tensor is on DLPack device {where}, the worker on {api}:{device_id} "
                f"{want}: copy it to the worker's device instead (a CPU tensor: "
                "await self.upload(tensor.numpy()))"
            )
        buf = _from_dlpack(tensor, ctx)
        assert isinstance(buf, DeviceBuffer)  # (device memory, or the CPU device's)
        return buf

    def device(self) -> tuple[str, int]:
        """``(api, device_id)`` of the worker's context (opening it if needed)."""
        ctx = self.ctx
        return ctx.api(), ctx.id()

    def close(self) -> None:
        """Wait for the context's work (blocking) and release it; a later use of
        ``ctx`` opens a new one. Does nothing when no context is open."""
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()

    def __ray_shutdown__(self) -> None:
        """Ray's hook at a graceful end of the actor: closes the context."""
        self.close()
