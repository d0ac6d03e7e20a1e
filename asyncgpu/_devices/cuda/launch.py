"""Kernels of the CUDA device and what their launches pass.

* ``_CudaFunction``: a loaded kernel (cuda.core's ``ObjectCode.get_kernel``: a
  ``CUkernel`` of a library, and the ``CUfunction`` that ``cuLaunchKernel``
  takes), with its parameter sizes read from its PTX (``_ptx_param_sizes``; the
  driver is not asked, which can block while a stream is held back for host
  work) and its argument plans; it subclasses ``asyncgpu._native.KernelCore``,
  whose field ``last`` (the plan of its last launch) the compiled launch reads.
* ``_LaunchCfg``: a validated launch geometry.
* Argument plans: per tuple of argument types, checked once against the
  kernel's signature (``_ArgPlan``, ``_plan``): the codes by which the compiled
  launch packs the arguments into the 8-byte slots that ``cuLaunchKernel``
  reads (``_NATIVE_CODES``), and which positions become device addresses for
  cuda.core's launch (``_kernel_args``); a stream's parameter memory for one
  plan (``_ParamMemory``).

The launches themselves are the stream's (``stream.CudaStream.launch``: the
compiled ``cuLaunchKernel``, else cuda.core's ``launch``) and the backend's
(``launch_raw``: ``cuLaunchKernelEx``); each enqueues the kernel and returns
without waiting for it.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

from cuda.bindings import driver as cu

from ... import _accel
from ..._core.function import (
    ARG_BUFFER,
    ARG_FOREIGN,
    ARG_SCALAR,
    check_scalar_sizes,
    kernel_arg_kind,
)
from ..._core.ops import check_kernel_buffer
from .driver import _check

_SHMEM_DEFAULT_LIMIT = 48 * 1024


class _CudaFunction(_accel.native.KernelCore):
    """The loaded kernel and what is cached for launching it."""

    __slots__ = (
        "fn",
        "handle",
        "kernel",
        "library",
        "name",
        "param_sizes",
        "plans",
        "raw",
        "shmem_optin",
    )

    def __init__(self, objcode: Any, name: str, ptx: str | None = None) -> None:
        self.library = objcode
        self.kernel = objcode.get_kernel(name)
        self.name = name
        self.raw = cu.CUkernel(int(self.kernel.handle))
        self.fn = cu.CUfunction(int(self.kernel.handle))  # what cuLaunchKernel takes
        self.handle = int(self.kernel.handle)
        # The signature comes from the PTX, not from the driver: asking the driver
        # (cuda.core's Kernel.arguments_info) can block while a stream of the
        # context is held back for host work.
        self.param_sizes: tuple[int, ...] | None = _ptx_param_sizes(ptx, name) if ptx else None
        self.plans: dict[tuple[type, ...], _ArgPlan] = {}
        self.last = None  # the plan of the last launch (the one the compiled launch tries)
        self.shmem_optin = _SHMEM_DEFAULT_LIMIT


def load_now(impl: _CudaFunction) -> None:
    """Load ``impl``'s kernel into the current context now (``cuKernelGetFunction``,
    then ``cuFuncLoad``; both return once it is loaded). Under the driver's lazy
    module loading (CUDA 12.2 and later by default) a kernel is otherwise loaded
    at its first launch, which waits for the kernels running on every stream of
    the context: the first launch of a fresh kernel would start only once they
    have finished, and not run beside them. Loading belongs to
    ``compile_function`` and ``load_function``, which block anyway."""
    fn = _check(cu.cuKernelGetFunction(impl.raw), "cuKernelGetFunction")
    _check(cu.cuFuncLoad(fn), "cuFuncLoad")


_PTX_TYPE = re.compile(r"\.(?:b|s|u|f)(8|16|32|64)\b")


def _ptx_param_sizes(ptx: str, name: str) -> tuple[int, ...] | None:
    """Byte sizes of the parameters of ``.entry name`` in PTX text (None if the
    entry or a parameter's type cannot be read)."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\(([^)]*)\)", ptx)
    if m is None:
        return () if re.search(r"\.entry\s+" + re.escape(name) + r"\b", ptx) else None
    sizes = []
    for decl in m.group(1).split(","):
        decl = decl.strip()
        if not decl:
            continue
        t = _PTX_TYPE.search(decl)
        if t is None:
            return None
        count = re.search(r"\[(\d+)\]", decl)
        sizes.append(int(t.group(1)) // 8 * (int(count.group(1)) if count else 1))
    return tuple(sizes)


class _LaunchCfg:
    """A validated launch geometry: cuda.core's LaunchConfig, and for plain
    launches (no cluster, cooperation or priority) the seven numbers
    ``cuLaunchKernel`` takes."""

    __slots__ = ("cc", "coop", "dims", "priority")

    def __init__(
        self, cc: Any, coop: bool, priority: int | None, dims: tuple[int, ...] | None = None
    ) -> None:
        self.cc = cc
        self.coop = coop
        self.priority = priority
        self.dims = dims


class _ArgPlan:
    """How one tuple of argument types (``types``) is passed to one kernel, worked
    out once (``_plan``): the positions cuda.core's launch needs converted
    (``conv``: ``_BUFFER``, a buffer's address; ``_CAI``, the address in a
    ``__cuda_array_interface__``), whether any is another library's array
    (``foreign``), and ``codes``, one byte per argument (``_NATIVE_CODES``), by
    which the compiled launch packs the arguments 8 bytes apart for
    ``cuLaunchKernel``: None where it cannot (no signature to confirm the sizes,
    another library's array, a cuda.core object, a float16 or bool), and then
    cuda.core's launch takes the arguments."""

    __slots__ = ("codes", "conv", "foreign", "structs", "types")

    def __init__(
        self,
        conv: tuple[tuple[int, int], ...],
        types: tuple[type, ...] = (),
        codes: bytes | None = None,
        structs: bool = False,
    ) -> None:
        self.conv = conv
        self.foreign = any(kind == _CAI for _, kind in conv)
        self.types = types
        self.codes = codes
        # A structured scalar (a C struct by value): cuda.core's launch cannot pass
        # one, so the launch goes through cuLaunchKernelEx with its bytes.
        self.structs = structs


_BUFFER, _CAI = 0, 1
# The compiled launch's codes of NumPy scalar kinds and sizes (``asyncgpu._native``'s
# argument codes; a buffer is b"P").
_NATIVE_CODES = {
    ("f", 4): b"f", ("f", 8): b"d",
    ("i", 1): b"b", ("i", 2): b"h", ("i", 4): b"i", ("i", 8): b"q",
    ("u", 1): b"B", ("u", 2): b"H", ("u", 4): b"I", ("u", 8): b"Q",
}  # fmt: skip


class _ParamMemory:
    """A stream's parameter memory for one plan: 8 bytes per argument and the
    array of pointers to them that ``cuLaunchKernel`` reads (the compiled launch
    packs into it under the stream's submit lock; the driver copies the values
    during the call)."""

    __slots__ = ("_ptrs", "addr", "data", "pointers")

    def __init__(self, nbytes: int) -> None:
        n = max(nbytes // 8, 1)
        self.data = (ctypes.c_uint64 * n)()
        base = self.addr = ctypes.addressof(self.data)
        self._ptrs = (ctypes.c_uint64 * n)(*(base + 8 * i for i in range(n)))
        self.pointers = ctypes.addressof(self._ptrs) if nbytes else 0


def _plan(impl: _CudaFunction, args: tuple[Any, ...]) -> _ArgPlan:
    """The plan of ``args``' types for ``impl``, now its last (``impl.last``, which
    the compiled launch tries first). What each position needs is worked out, and
    the kernel's signature checked, once per tuple of types (``_arg_plan``)."""
    key = tuple(map(type, args))
    plan = impl.plans.get(key)
    if plan is None:
        plan = impl.plans[key] = _arg_plan(impl, args)
    impl.last = plan
    return plan


def _kernel_args(plan: _ArgPlan, args: tuple[Any, ...], state: Any) -> tuple[Any, ...] | list[Any]:
    """The arguments of a launch of ``state``'s context as cuda.core's launch
    takes them: buffers and other libraries' arrays become their addresses (a
    buffer that cannot be used, or one of another context that this one may not
    use, ``check_kernel_buffer``, raises why)."""
    if not plan.conv:
        return args
    out = list(args)
    for i, kind in plan.conv:
        a = out[i]
        if kind == _BUFFER:
            if a._ctx._state is not state or a._alloc is None or state.closed:
                check_kernel_buffer(state, a, f"kernel argument {i}")
            out[i] = a._ptr
        else:
            out[i] = int(a.__cuda_array_interface__["data"][0])
    return out


def _arg_plan(impl: _CudaFunction, args: tuple[Any, ...]) -> _ArgPlan:
    """Validate one tuple of argument types (by the rule every device applies,
    ``kernel_arg_kind``, then against the kernel's parameter sizes) and plan how
    to pass it."""
    conv: list[tuple[int, int]] = []
    codes: bytes | None = b""
    structs = False
    for n, a in enumerate(args):
        kind = kernel_arg_kind(n, a)
        code: bytes | None
        if kind == ARG_BUFFER:
            conv.append((n, _BUFFER))
            code = b"P"
        elif kind == ARG_SCALAR:
            structs = structs or a.dtype.kind == "V"
            code = _NATIVE_CODES.get((a.dtype.kind, a.dtype.itemsize))
        elif kind == ARG_FOREIGN:
            conv.append((n, _CAI))
            code = None
        else:
            code = None  # cuda.core's launch knows its own objects
        codes = None if codes is None or code is None else codes + code
    want = impl.param_sizes
    if want is not None:
        check_scalar_sizes(impl.name, args, want)
    if structs and impl.param_sizes is None:
        raise TypeError(
            f"kernel {impl.name} has no signature to check a structured scalar's size "
            "against (its PTX could not be read): pass the struct's fields instead"
        )
    return _ArgPlan(
        tuple(conv),
        tuple(map(type, args)),
        codes if want is not None and not structs else None,
        structs,
    )
