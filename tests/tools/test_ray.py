"""asyncgpu workers on Ray (``asyncgpu.ray``): a ``GPUWorker`` async actor on a local
Ray cluster the module starts itself (``ray.init(num_cpus=2)``, the CPU device),
and the same worker class driven directly without Ray on every device (the GPU
side, where Ray does not travel).

Ray pickles the test's actor classes by value (``register_pickle_by_value``), so
its worker processes need only asyncgpu, not this folder, on their path. What
could hang (an actor killed mid-call, a device fault) runs in a child process
under a timeout; calls on the shared cluster are bounded with ``ray.get(...,
timeout=...)``.
"""

from __future__ import annotations

import asyncio
import gc
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
from _kernels import TRAP_AND_SPIN, Gate

import asyncgpu
from asyncgpu import DeviceError, Kernel, ThreadBlock
from asyncgpu.ray import GPUWorker, assigned_device, cuda_ordinal

ROOT = Path(__file__).resolve().parents[2]
CALL_TIMEOUT_S = 60
CHILD_TIMEOUT_S = 180

try:
    import ray
    import ray.cloudpickle
    import ray.exceptions

    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False


def needs_ray(test):
    """Marked ``ray`` (it starts a Ray cluster) and skipped without Ray."""
    reason = "Ray is not installed (pip install asyncgpu[ray]; CI installs it)"
    return pytest.mark.ray(pytest.mark.skipif(not HAVE_RAY, reason=reason)(test))


def _scale_cpu(b: ThreadBlock, y: np.ndarray, x: np.ndarray, a: np.float32, n: np.int32) -> None:
    i = b.global_idx.x
    i = i[i < n]
    y[i] = a * x[i]


# Defined here rather than taken from tests/_kernels.py: Ray's workers import
# nothing from this folder.
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


class Scaler(GPUWorker):
    """The worker under test: y = a * x on the device, and probes of where it runs."""

    def __init__(self, marker: str | None = None, **kw) -> None:
        super().__init__(**kw)
        self.marker = marker
        self.arrived = 0
        self.all_in: asyncio.Event | None = None

    def enqueue_scale(self, xd: asyncgpu.DeviceBuffer, a: float) -> asyncgpu.DeviceBuffer:
        """A new buffer with a * xd, enqueued (not awaited) on the current stream."""
        yd = self.ctx.enqueue_create_buffer(np.float32, len(xd))
        fn = self.ctx.compile_function(SCALE)
        n = len(xd)
        self.ctx.enqueue_function(
            fn, yd, xd, np.float32(a), np.int32(n), grid_dim=(n + 255) // 256, block_dim=256
        )
        return yd

    async def scale(self, x: np.ndarray, a: float) -> np.ndarray:
        xd = await self.upload(np.asarray(x, np.float32))
        return await self.download(self.enqueue_scale(xd, a), np.shape(x))

    async def scaled_tensor(self, x: np.ndarray, a: float):
        """a * x computed into a buffer and handed over as a tensor of that buffer
        (for Ray Direct Transport); the buffer is watched, not kept."""
        yd = self.enqueue_scale(await self.upload(np.asarray(x, np.float32)), a)
        self.handed_over = weakref.ref(yd)
        return await self.to_tensor(yd, np.shape(x))

    async def handed_over_alive(self) -> bool:
        return self.handed_over() is not None

    async def scale_tensor(self, t, a: float) -> np.ndarray:
        """a * t, with the tensor Ray delivered wrapped in place as a buffer."""
        xd = self.from_tensor(t)
        assert xd.unsafe_ptr() == t.data_ptr()  # the received memory itself
        return await self.download(self.enqueue_scale(xd, a), tuple(t.shape))

    async def where(self) -> dict:
        loop = asyncio.get_running_loop()
        api, dev = self.device()
        cpu_thread = await self.ctx.enqueue_cpu_function(threading.get_ident)
        return {
            "device": (api, dev),
            "pid": os.getpid(),
            "loop_thread": threading.get_ident(),
            "cpu_function_thread": cpu_thread,
            "loop_running": loop.is_running(),
        }

    async def meet(self, n: int) -> int:
        """Returns once ``n`` calls are inside it at the same time."""
        if self.all_in is None:
            self.all_in = asyncio.Event()
        self.arrived += 1
        if self.arrived == n:
            self.all_in.set()
        await self.all_in.wait()
        await self.ctx  # a device await among the concurrent calls
        return self.arrived

    async def allocate(self, nbytes: int) -> None:
        self.ctx.enqueue_create_buffer(np.uint8, nbytes)

    async def host_buffer(self) -> asyncgpu.HostBuffer:
        h = self.ctx.enqueue_create_host_buffer(np.float32, 4)
        await self.ctx.enqueue_memset(h, 2.0)
        return h

    async def host_values(self) -> np.ndarray:
        h = self.ctx.enqueue_create_host_buffer(np.float32, 4)
        await self.ctx.enqueue_memset(h, 2.0)
        return h.as_numpy()

    def close(self) -> None:
        had = self._ctx is not None
        super().close()
        if self.marker is not None:
            tmp = Path(f"{self.marker}.tmp")
            tmp.write_text(f"closed {had}")
            tmp.replace(self.marker)


# -- without Ray: the mapping and the worker driven directly (every device) -----------


def test_cuda_ordinal_is_the_position_in_cuda_visible_devices():
    assert cuda_ordinal(3, "3") == 0
    assert cuda_ordinal("5", "2,5") == 1
    assert cuda_ordinal("GPU-1a2b", "GPU-9f,GPU-1a2b") == 1
    assert cuda_ordinal(2, None) == 2  # Ray left CUDA_VISIBLE_DEVICES alone


def test_cuda_ordinal_refuses_a_gpu_that_is_not_visible():
    with pytest.raises(ValueError, match="not in CUDA_VISIBLE_DEVICES"):
        cuda_ordinal(1, "0,2")
    with pytest.raises(ValueError, match="not an index"):
        cuda_ordinal("GPU-1a2b", None)


def test_outside_an_actor_the_device_is_the_default_one():
    assert assigned_device() == (asyncgpu.default_api(), 0)


def test_bad_arguments_are_refused_at_construction():
    with pytest.raises(TypeError, match="api"):
        GPUWorker(api=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device_id"):
        GPUWorker(device_id="0")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"api": "gpu"}, ValueError),
        ({"api": ""}, ValueError),
        ({"num_streams": 0}, ValueError),
        ({"num_streams": -2}, ValueError),
        ({"num_streams": 2.0}, TypeError),
        ({"num_streams": True}, TypeError),
    ],
)
def test_bad_values_fail_at_construction_as_a_device_context_refuses_them(kwargs, error):
    """Not at the first ``self.ctx``, inside a remote call: the worker raises
    the very error ``DeviceContext`` gives for the same value."""
    with pytest.raises(error) as by_context:
        asyncgpu.DeviceContext(**kwargs)
    with pytest.raises(error) as by_worker:
        GPUWorker(**kwargs)
    assert str(by_worker.value) == str(by_context.value)


def test_the_api_is_taken_in_any_case_and_num_streams_as_given():
    w = GPUWorker(api="CPU", num_streams=3)
    assert w._ctx is None  # still nothing opened
    assert w.ctx.api() == "cpu"
    assert w.ctx.num_streams() == 3
    w.close()


@pytest.mark.asyncio
async def test_the_worker_driven_directly_opens_on_first_use_and_closes(api):
    w = Scaler(api=api)
    assert w._ctx is None  # nothing opened at construction
    x = np.arange(1000, dtype=np.float32).reshape(10, 100)
    x.flags.writeable = False  # as Ray hands arguments over from its object store
    y = await w.scale(x, 2.0)
    assert y.shape == (10, 100)
    np.testing.assert_array_equal(y, 2 * x)
    assert w.device() == (api, 0)
    ctx = w.ctx
    w.__ray_shutdown__()
    with pytest.raises(asyncgpu.ContextClosedError):
        ctx.enqueue_create_buffer(np.float32, 1)
    w.close()  # a second close does nothing


@pytest.mark.asyncio
async def test_the_worker_driven_directly_runs_concurrent_calls(api):
    w = Scaler(api=api)
    try:
        xs = [np.full(4096, i, np.float32) for i in range(16)]
        ys = await asyncio.gather(*(w.scale(x, 0.5) for x in xs))
        for x, y in zip(xs, ys, strict=True):
            np.testing.assert_array_equal(y, 0.5 * x)
    finally:
        w.close()


def test_a_worker_whose_init_skips_super_still_opens_its_context():
    class Forgetful(GPUWorker):
        def __init__(self) -> None:
            pass

    w = Forgetful()
    try:
        assert w.device() == (asyncgpu.default_api(), 0)
    finally:
        w.close()


def test_errors_pickle_with_their_fields():
    """What an actor raises reaches its caller pickled: every field survives."""
    for e in [
        asyncgpu.DeviceError("m", code=2, name="CUDA_ERROR_OUT_OF_MEMORY"),
        asyncgpu.DeviceFaultError("f", code=719, name="CUDA_ERROR_LAUNCH_FAILED"),
        asyncgpu.HealthCheckError("h", check="ecc"),
        asyncgpu.CompileError("c", log="error: x"),
        asyncgpu.ContextClosedError("closed"),
    ]:
        e2 = pickle.loads(pickle.dumps(e))
        assert type(e2) is type(e)
        assert str(e2) == str(e)
        assert vars(e2) == vars(e)


def test_buffers_refuse_pickling_and_say_what_to_send():
    with asyncgpu.DeviceContext(api="cpu") as ctx:
        with pytest.raises(TypeError, match=r"as_numpy\(\)"):
            pickle.dumps(ctx.enqueue_create_host_buffer(np.float32, 4))
        with pytest.raises(TypeError, match="copy it to the host first"):
            pickle.dumps(ctx.enqueue_create_buffer(np.float32, 4))


def test_importing_asyncgpu_or_its_ray_module_does_not_import_ray():
    code = "import sys, asyncgpu, asyncgpu.ray; print('ray' in sys.modules)"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter under a timeout: a hang fails the test."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    try:
        return subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code), *args],
            capture_output=True,
            text=True,
            timeout=CHILD_TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the program hung (no exit in {CHILD_TIMEOUT_S} s): {e.stdout!r} {e.stderr!r}")


def test_a_device_fault_fails_the_workers_pending_calls(api):
    """The GPU side of a fault, driven directly: a trap fails every call awaiting
    on the worker's context with DeviceFaultError, which pickles whole, as Ray
    carries it to each caller (wrapped in RayTaskError)."""
    if api != "cuda":
        pytest.skip("a sticky device fault needs a GPU (the CPU device has none)")
    proc = run_child(
        """
        import asyncio, pickle, sys
        import numpy as np
        import asyncgpu as ag
        from asyncgpu.ray import GPUWorker

        class Faulty(GPUWorker):
            def prepare(self):
                # Loaded before any kernel runs, as a real worker would at start.
                self.trap_fn = self.ctx.compile_function(sys.argv[1], "trap")
                self.spin_fn = self.ctx.compile_function(sys.argv[1], "spin")

            async def trap(self):
                await self.ctx.enqueue_function(self.trap_fn, grid_dim=1, block_dim=1)

            async def work(self, i):
                s = self.ctx.select_stream(i)
                khz = self.ctx.default_device_info.clock_rate_khz
                cycles = np.int64(khz * 2000)  # ~2 s: still running when the trap strikes
                await s.enqueue_function(self.spin_fn, cycles, grid_dim=1, block_dim=1)

        async def main():
            w = Faulty(api="cuda", num_streams=4)
            w.prepare()
            calls = [w.work(i) for i in range(1, 4)] + [w.trap()]
            res = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
            kinds = {type(r).__name__ for r in res}
            assert kinds == {"DeviceFaultError"}, res
            e = pickle.loads(pickle.dumps(res[-1]))
            assert isinstance(e, ag.DeviceFaultError) and e.name, vars(e)
            print("OK", kinds, e.name)

        asyncio.run(main())
        """,
        TRAP_AND_SPIN,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


# -- tensors for Ray Direct Transport, without Ray (PyTorch) ------------------------------


@pytest.fixture
def torch(api):
    """PyTorch, with CUDA for the cuda cases (skipped otherwise)."""
    torch = pytest.importorskip("torch")
    if api == "cuda" and not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device here")
    return torch


@pytest.fixture
def worker(api):
    """A ``Scaler`` driven directly on the device under test, closed after the test."""
    w = Scaler(api=api)
    yield w
    w.close()


@pytest.mark.asyncio
async def test_to_tensor_is_a_view_of_the_buffer_that_keeps_it_alive(api, torch, worker):
    buf = await worker.upload(np.arange(12, dtype=np.float32))
    t = await worker.to_tensor(buf, (3, 4))
    assert t.shape == (3, 4) and t.dtype == torch.float32
    assert t.device.type == ("cuda" if api == "cuda" else "cpu")
    assert t.data_ptr() == buf.unsafe_ptr()  # the buffer's memory, no copy
    watch = weakref.ref(buf)
    del buf
    gc.collect()
    assert watch() is not None  # the tensor holds the buffer...
    np.testing.assert_array_equal(t.cpu().numpy(), np.arange(12).reshape(3, 4))
    del t
    gc.collect()
    assert watch() is None  # ...and lets it go with itself


@pytest.mark.asyncio
async def test_to_tensor_waits_for_the_buffers_pending_writes(api, torch, worker):
    buf = worker.ctx.enqueue_create_buffer(np.int32, 64)
    gate = Gate()
    worker.ctx.enqueue_cpu_function(gate)  # holds the buffer's owning stream
    worker.ctx.enqueue_memset(buf, 7)
    handing = asyncio.ensure_future(worker.to_tensor(buf))
    try:
        await asyncio.to_thread(gate.entered.wait, CALL_TIMEOUT_S)
        assert not handing.done()  # the write has not run: no tensor yet
    finally:
        gate.open()
    t = await asyncio.wait_for(handing, CALL_TIMEOUT_S)
    np.testing.assert_array_equal(t.cpu().numpy(), np.full(64, 7))


@pytest.mark.asyncio
async def test_from_tensor_wraps_a_tensor_in_place_for_a_kernel(api, torch, worker):
    t = torch.arange(1000, dtype=torch.float32, device="cuda" if api == "cuda" else "cpu")
    t = t.reshape(10, 100)
    xd = worker.from_tensor(t)
    assert isinstance(xd, asyncgpu.DeviceBuffer)
    assert len(xd) == 1000 and xd.unsafe_ptr() == t.data_ptr()  # no copy
    del t
    gc.collect()  # the buffer holds the tensor's memory
    y = await worker.download(worker.enqueue_scale(xd, 0.5))
    np.testing.assert_array_equal(y, 0.5 * np.arange(1000, dtype=np.float32))


class _OnGpu0:
    """Stands for a CUDA tensor: all that from_tensor asks before wrapping."""

    def __dlpack__(self, stream=None):
        raise AssertionError("not to be consumed")

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0


def test_tensor_hand_offs_refuse_what_they_cannot_carry():
    torch = pytest.importorskip("torch")
    w = GPUWorker(api="cpu")
    try:
        with pytest.raises(ValueError, match=r"upload\(tensor.numpy\(\)\)"):
            w.from_tensor(_OnGpu0())  # another device than the worker's
        with pytest.raises(ValueError, match="C-contiguous"):
            w.from_tensor(torch.zeros(3, 4).t())
        with pytest.raises(TypeError, match="__dlpack__"):
            w.from_tensor([1.0, 2.0])
        with pytest.raises(TypeError, match="DeviceBuffer"):
            asyncio.run(w.to_tensor(np.zeros(3)))  # type: ignore[arg-type]
    finally:
        w.close()


# -- on a local Ray cluster (the CPU device) ---------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for this module; Ray pickles this module by value."""
    if not HAVE_RAY:
        pytest.skip("Ray is not installed (pip install asyncgpu[ray]; CI installs it)")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield ray
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()


def get(ref):
    return ray.get(ref, timeout=CALL_TIMEOUT_S)


def wait_for_text(path: Path) -> str:
    """The text another process writes into ``path`` (written elsewhere and
    renamed there, so it appears whole); fails after ``CALL_TIMEOUT_S``."""
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)
    return path.read_text()


@needs_ray
def test_an_actor_computes_on_its_own_device_and_loop(cluster):
    actor = ray.remote(Scaler).remote()
    try:
        x = np.linspace(-1, 1, 5000, dtype=np.float32)
        np.testing.assert_array_equal(get(actor.scale.remote(x, 4.0)), 4 * x)
        where = get(actor.where.remote())
        # No GPU assigned: the CPU device, in the actor's own process. The CPU
        # function ran on the device's thread, off the actor's loop, and the await
        # resumed on that loop.
        assert where["device"] == ("cpu", 0)
        assert where["pid"] != os.getpid()
        assert where["loop_running"]
        assert where["cpu_function_thread"] != where["loop_thread"]
    finally:
        ray.kill(actor)


def rdt_actor_options(transport: str) -> dict:
    """The actor options of a transport's end-to-end case, or a skip saying what
    the machine lacks: Gloo carries CPU tensors (CPU-device actors), NCCL CUDA
    tensors between GPU actors (one GPU each)."""
    torch = pytest.importorskip("torch")
    if transport == "gloo":
        return {}
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL between two GPU actors needs PyTorch with CUDA and two GPUs")
    from ray.util.collective import nccl_available

    if not nccl_available():
        pytest.skip("Ray's NCCL backend needs CuPy (pip install cupy-cuda12x)")
    return {"num_gpus": 1}


@needs_ray
@pytest.mark.parametrize("transport", ["gloo", "nccl"])
def test_a_buffer_travels_to_another_actor_by_ray_direct_transport(cluster, transport):
    """Actor A computes into a buffer and returns it as a tensor through Ray Direct
    Transport (actor to actor, no object store); actor B wraps the tensor it
    receives as a buffer and runs a kernel on it. A's buffer lives while Ray holds
    the tensor, after A dropped it, and goes once the ref does."""
    options = rdt_actor_options(transport)
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    rdt = ray.remote(enable_tensor_transport=True)(Scaler).options(**options)
    a, b = rdt.remote(), rdt.remote()
    group = create_collective_group([a, b], backend=transport)
    try:
        if transport == "nccl":  # each actor on its own GPU, the tensors CUDA ones
            assert get(a.device.remote()) == get(b.device.remote()) == ("cuda", 0)
        x = np.arange(4096, dtype=np.float32).reshape(64, 64)
        ref = a.scaled_tensor.options(tensor_transport=transport).remote(x, 2.0)
        np.testing.assert_array_equal(get(b.scale_tensor.remote(ref, 3.0)), 6 * x)
        assert get(a.handed_over_alive.remote())  # Ray's store holds the tensor, it the buffer
        del ref
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while get(a.handed_over_alive.remote()):  # Ray frees the tensor asynchronously
            assert time.monotonic() < deadline, "the buffer outlived its last ObjectRef"
            time.sleep(0.05)
    finally:
        destroy_collective_group(group)
        ray.kill(a)
        ray.kill(b)


@needs_ray
def test_max_concurrency_sets_how_many_calls_await_at_once(cluster):
    n = 4
    actor = ray.remote(max_concurrency=n)(Scaler).remote()
    try:
        # Each call returns only once all n are inside the actor together.
        assert get([actor.meet.remote(n) for _ in range(n)]) == [n] * n
    finally:
        ray.kill(actor)


@needs_ray
def test_arrays_travel_through_the_object_store_and_outlive_the_actor(cluster):
    actor = ray.remote(Scaler).remote()
    x = np.arange(100_000, dtype=np.float32)
    ref = actor.scale.remote(ray.put(x), 3.0)
    y = get(ref)
    # The caller's array is a read-only view of the object store, no copy...
    assert not y.flags.writeable
    del ref
    ray.kill(actor)
    gc.collect()
    # ...which Ray keeps alive for as long as the array lives, actor gone or not.
    np.testing.assert_array_equal(y, 3 * x)


@needs_ray
def test_host_buffer_contents_cross_as_numpy_and_a_buffer_itself_is_refused(cluster):
    actor = ray.remote(Scaler).remote()
    try:
        np.testing.assert_array_equal(get(actor.host_values.remote()), np.full(4, 2.0))
        with pytest.raises(TypeError, match=r"as_numpy\(\)"):
            get(actor.host_buffer.remote())
    finally:
        ray.kill(actor)


@needs_ray
def test_a_device_error_reaches_the_caller_as_asyncgpus_error(cluster):
    actor = ray.remote(Scaler).remote()
    try:
        with pytest.raises(DeviceError) as info:
            get(actor.allocate.remote(2**62))
        # Ray's RayTaskError, which is also the cause's own class, with its fields.
        assert isinstance(info.value, ray.exceptions.RayTaskError)
        assert isinstance(info.value.cause, DeviceError)
        assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
        # The actor lives on: only that call failed.
        np.testing.assert_array_equal(get(actor.scale.remote(np.ones(8), 2.0)), np.full(8, 2.0))
    finally:
        ray.kill(actor)


@needs_ray
def test_a_graceful_end_closes_the_context(cluster, tmp_path):
    marker = tmp_path / "closed"
    actor = ray.remote(Scaler).remote(str(marker))
    get(actor.scale.remote(np.ones(8), 1.0))
    with pytest.raises(ray.exceptions.RayActorError):
        get(actor.__ray_terminate__.remote())
    # Ray reports the exit to the caller and runs __ray_shutdown__ (which closes
    # the context) in either order: wait for the actor's word, within a deadline.
    assert wait_for_text(marker) == "closed True"


@needs_ray
def test_an_actor_killed_mid_call_and_its_restart_policy():
    """In a child process (its own cluster): a kill while a call awaits fails that
    call with RayActorError instead of hanging; with max_restarts=1 the actor comes
    back once, in a new process with a new context, and a second kill ends it for
    good (ActorDiedError)."""
    proc = run_child(
        """
        import asyncio, os
        import numpy as np
        import ray, ray.exceptions
        from asyncgpu.ray import GPUWorker

        @ray.remote(max_restarts=1)
        class Held(GPUWorker):
            def __init__(self):
                super().__init__()
                self.entered = asyncio.Event()
                self.release = asyncio.Event()

            async def hold(self):
                await self.ctx
                self.entered.set()
                await self.release.wait()  # never set: only a kill ends this call

            async def entered_hold(self):
                await self.entered.wait()

            async def pid(self):
                await self.ctx
                return os.getpid(), self.device()

        def kill_mid_call(a):
            # Kill a while a call awaits inside it; the error that call gets.
            held = a.hold.remote()
            ray.get(a.entered_hold.remote(), timeout=60)  # the call is inside the actor
            ray.kill(a, no_restart=False)
            try:
                ray.get(held, timeout=60)
            except ray.exceptions.RayActorError as e:
                return e
            raise SystemExit("the killed call returned")

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        a = Held.options(max_concurrency=4).remote()
        first = ray.get(a.pid.remote(), timeout=60)
        print("killed call:", type(kill_mid_call(a)).__name__)
        second = ray.get(a.pid.remote(), timeout=60)  # restarted: a new process
        assert second[0] != first[0] and second[1] == ("cpu", 0), (first, second)
        print("last killed call:", type(kill_mid_call(a)).__name__)  # no restarts left
        try:
            ray.get(a.pid.remote(), timeout=60)
            raise SystemExit("a call on a dead actor returned")
        except ray.exceptions.ActorDiedError:
            print("after the last restart: ActorDiedError")
        ray.shutdown()
        print("OK")
        """
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
    # While a restart is coming the killed call's error says so (ActorUnavailableError,
    # a RayActorError); with none left, ActorDiedError.
    assert "last killed call: ActorDiedError" in proc.stdout
