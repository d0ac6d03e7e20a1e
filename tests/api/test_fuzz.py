"""Bad input, fuzzed: every call does what NumPy says, or raises a documented
exception at the call, and touches no memory but its operands.

Property-based tests (hypothesis) on the CPU device over copies, memsets and
fills, sub-buffers, launch geometry and kernel arguments. For every case the
test works out, from the documented contract alone, either the exact bytes the
call must produce (what NumPy does) or the set of documented exceptions it may
raise (``TypeError``, ``ValueError``, ``IndexError``, ``UnsupportedError``,
``ContextClosedError``: one per problem the arguments have). Then:

* a call that must succeed returns an event that completes (a hang fails the
  case after ``TIMEOUT_S``) without an error, and its operands hold exactly the
  expected bytes;
* a call that must fail raises one of the allowed exceptions before anything
  runs; any other exception, or an error that shows up only at the await, fails
  the case;
* nothing else changes: every buffer under test is carved out of a larger
  parent (device or host memory, or a NumPy array) between guard bytes holding a
  random pattern, next to a sibling buffer, and after each case the whole parent
  is compared byte for byte with a NumPy model of what it must hold.

The runs are deterministic (``derandomize=True``). ``ASYNCGPU_FUZZ_SCALE`` (a
factor, default 1) scales the number of cases. The last test prints how many
cases ran and which exception types they reached, and writes them to
``benchmarks/results/fuzz-cpu.json`` when ``ASYNCGPU_FUZZ_REPORT`` is set.
"""

from __future__ import annotations

import datetime
import json
import math
import numbers
import os
import platform
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _kernels import TIMEOUT_S

hypothesis = pytest.importorskip("hypothesis")  # not on every machine (the GPU host)

from hypothesis import HealthCheck, assume, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra.numpy import from_dtype  # noqa: E402

import asyncgpu  # noqa: E402
from asyncgpu import (  # noqa: E402
    ContextClosedError,
    DeviceBuffer,
    DeviceContext,
    Dim,
    HostBuffer,
    Kernel,
    LaunchAttribute,
    ThreadBlock,
    UnsupportedError,
)

#: The exceptions bad input may raise, at the call (docs/guarantees.md).
DOCUMENTED: tuple[type[BaseException], ...] = (
    TypeError,
    ValueError,
    IndexError,
    UnsupportedError,
    ContextClosedError,
)

#: Cases run per test, and exceptions raised per type, over the whole session.
CASES: Counter[str] = Counter()
RAISED: Counter[str] = Counter()

SCALE = float(os.environ.get("ASYNCGPU_FUZZ_SCALE") or 1)
STREAMS = 4
GUARD = 32  # guard bytes on each side of every buffer under test


def fuzz(examples: int) -> settings:
    """Deterministic settings: the same cases on every run and every machine."""
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


# -- contexts ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dev():
    """The CPU context under test, shared by all cases (state carries over between
    cases, as in a real program: launch caches, stream owners, pools)."""
    c = DeviceContext(api="cpu", num_streams=STREAMS)
    yield c
    c.close()


@pytest.fixture(scope="module")
def foreign():
    """A second open CPU context: its buffers are valid operands here."""
    c = DeviceContext(api="cpu")
    yield c
    c.close()


@pytest.fixture(scope="module")
def closed():
    """Buffers of a context that has been closed: any use raises ContextClosedError."""
    c = DeviceContext(api="cpu")
    bufs = {
        "device": c.enqueue_create_buffer(np.int32, 8),
        "host": c.enqueue_create_host_buffer(np.int32, 8),
    }
    c.close()
    return bufs


# -- completing and checking -------------------------------------------------------------


def settle(ev: Any) -> Any:
    """Wait for ``ev`` (failing, not hanging, after TIMEOUT_S); its value or error."""
    done = threading.Event()
    ev.add_done_callback(lambda _e: done.set())
    assert done.wait(TIMEOUT_S), f"{ev!r} did not complete within {TIMEOUT_S} s"
    return ev.synchronize()


def _noop() -> None:
    pass


def drain(ctx: DeviceContext) -> None:
    """Wait until every stream of ``ctx`` has run everything enqueued so far."""
    for i in range(ctx.num_streams()):
        settle(ctx.select_stream(i).enqueue_cpu_function(_noop))


def attempt(case: str, call: Callable[[], Any], allowed: set[type[BaseException]]) -> Any:
    """Make the call. ``allowed`` empty: it must succeed, and its event must complete
    without an error (returned). Else it must raise one of ``allowed`` (None)."""
    CASES[case] += 1
    try:
        ev = call()
    except DOCUMENTED as e:
        RAISED[type(e).__name__] += 1
        note(f"raised {type(e).__name__}: {e}")
        assert allowed, f"raised {type(e).__name__}: {e}, but the call is valid"
        names = sorted(t.__name__ for t in allowed)
        assert isinstance(e, tuple(allowed)), (
            f"raised {type(e).__name__}: {e}; the contract allows {names}"
        )
        return None
    assert not allowed, (
        f"succeeded, but the contract says one of {sorted(t.__name__ for t in allowed)}"
    )
    return ev


class Arena:
    """A parent buffer cut into [guard | buffer under test | guard | sibling | guard].

    ``kind`` is ``"device"``, ``"host"`` (buffers of ``ctx``, the parent owned by
    stream ``owner``) or ``"numpy"`` (a NumPy array). ``model`` holds what every
    byte of the parent must contain; ``pad`` shifts the buffer under test off
    alignment.
    """

    def __init__(
        self, ctx: DeviceContext, kind: str, nbytes: int, pad: int, owner: int, seed: int
    ) -> None:
        rng = np.random.default_rng(seed)
        self.ctx = ctx
        self.kind = kind
        self.start = GUARD + pad
        self.nbytes = nbytes
        sibling = int(rng.integers(1, 48))
        self.sib_start = self.start + nbytes + GUARD
        total = self.sib_start + sibling + GUARD
        self.model = rng.integers(0, 256, total, dtype=np.uint8)
        if kind == "numpy":
            self.parent: Any = self.model.copy()
        else:
            view = ctx.select_stream(owner % ctx.num_streams())
            make = (
                view.enqueue_create_buffer if kind == "device" else view.enqueue_create_host_buffer
            )
            self.parent = make(np.uint8, total)
            settle(view.enqueue_copy(self.parent, self.model.copy()))
            self.sibling = self.parent.create_sub_buffer(np.uint8, self.sib_start, sibling)

    def buffer(self, dtype: Any, count: int) -> Any:
        """The buffer under test: ``count`` elements of ``dtype`` (a sub-buffer of a
        sub-buffer of the parent)."""
        dt = np.dtype(dtype)
        assert count * dt.itemsize <= self.nbytes
        if self.kind == "numpy":
            return self.parent[self.start : self.start + count * dt.itemsize].view(dt)
        window = self.parent.create_sub_buffer(np.uint8, self.start, self.nbytes)
        return window.create_sub_buffer(dt, 0, count)

    def address(self) -> int:
        if self.kind == "numpy":
            return int(self.parent[self.start :].ctypes.data)
        return self.parent.unsafe_ptr() + self.start

    def bytes(self, n: int) -> np.ndarray:
        """What the first ``n`` bytes of the buffer under test hold (per the model)."""
        return self.model[self.start : self.start + n].copy()

    def expect(self, data: np.ndarray | bytes, at: int = 0) -> None:
        """The buffer under test must now hold ``data`` from byte ``at`` on."""
        raw = np.frombuffer(bytes(data), np.uint8)
        self.model[self.start + at : self.start + at + raw.size] = raw

    def check(self) -> None:
        """Compare every byte of the parent with the model."""
        if self.kind == "numpy":
            got = self.parent
        else:
            got = np.empty_like(self.model)
            settle(self.ctx.enqueue_copy(got, self.parent))
        bad = np.flatnonzero(got != self.model)
        if bad.size:
            regions = sorted({self._region(int(i)) for i in bad})
            raise AssertionError(
                f"{bad.size} bytes of the {self.kind} parent differ from the model, in "
                f"{', '.join(regions)} (first at byte {bad[0]}: got {got[bad[0]]}, "
                f"want {self.model[bad[0]]})"
            )

    def _region(self, i: int) -> str:
        if i < self.start:
            return "the leading guard"
        if i < self.start + self.nbytes:
            return "the buffer under test"
        if i < self.sib_start:
            return "the middle guard"
        if i < self.sib_start + (self.model.size - self.sib_start - GUARD):
            return "the sibling buffer"
        return "the trailing guard"


# -- the contract, written out ---------------------------------------------------------------


def dtype_contract(dtype: Any) -> tuple[np.dtype[Any] | None, set[type[BaseException]]]:
    """A dtype is anything ``numpy.dtype`` accepts that can live in device memory."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None, {TypeError}
    if dt.hasobject or dt.itemsize == 0:
        return None, {TypeError}
    return dt, set()


def count_contract(v: Any) -> tuple[int | None, set[type[BaseException]]]:
    """Sizes and offsets are ints or NumPy integers (not bools)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        return None, {TypeError}
    return int(v), set()


def is_number(v: Any) -> bool:
    if isinstance(v, (str, bytes)):
        return False
    return isinstance(v, (numbers.Number, np.generic))


def memset_contract(dt: np.dtype[Any], v: Any) -> tuple[Any, set[type[BaseException]]]:
    """The element a memset of ``v`` writes (a 0-d array of ``dt``), or the errors."""
    errs: set[type[BaseException]] = set()
    if dt.itemsize not in (1, 2, 4, 8):
        errs.add(TypeError)
    if isinstance(v, np.ndarray) and v.ndim == 0:
        v = v[()]
    if not is_number(v):
        return None, errs | {TypeError, ValueError}
    if dt.kind != "c" and isinstance(v, (complex, np.complexfloating)):
        return None, errs | {ValueError}
    if dt.kind in "iu":
        if isinstance(v, (float, np.floating)) and not math.isfinite(float(v)):
            return None, errs | {ValueError}
        i = int(v)
        info = np.iinfo(dt)
        if i != v or not info.min <= i <= info.max:
            return None, errs | {ValueError}
        return np.array(i, dtype=dt), errs
    if dt.kind == "b":
        return np.array(bool(v), dtype=dt), errs
    if dt.kind in "fc":
        try:
            with np.errstate(over="raise"):
                return np.array(v, dtype=dt), errs
        except (OverflowError, FloatingPointError, TypeError):
            return None, errs | {ValueError}
    return None, errs | {TypeError, ValueError}  # other kinds: not a memset element


def dim_contract(v: Any) -> tuple[Dim | None, set[type[BaseException]]]:
    """A launch dimension: a positive int, a tuple of one to three of them, or a Dim."""
    if isinstance(v, bool):
        return None, {TypeError}
    if isinstance(v, tuple):
        comps = tuple(v)
        if not 1 <= len(comps) <= 3:
            return None, {TypeError}
    elif isinstance(v, (int, np.integer)):
        comps = (v,)
    else:
        return None, {TypeError}
    for c in comps:
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
            return None, {TypeError}
    if any(int(c) <= 0 for c in comps):
        return None, {ValueError}
    comps = tuple(int(c) for c in comps) + (1,) * (3 - len(comps))
    return Dim(*comps), set()


# CUDA's limits, which the CPU device enforces too (asyncgpu._devices.cpu._LIMITS).
MAX_THREADS = 1024
MAX_BLOCK = (1024, 1024, 64)
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_SHMEM = 1024 * 1024


def geometry_contract(
    grid: Any, block: Any, shmem: Any, cluster: Any, attributes: list[Any]
) -> tuple[tuple[Dim, Dim] | None, set[type[BaseException]]]:
    errs: set[type[BaseException]] = set()
    g, e = dim_contract(grid)
    errs |= e
    b, e = dim_contract(block)
    errs |= e
    if b is not None and (b.size() > MAX_THREADS or any(map(int.__gt__, b, MAX_BLOCK))):
        errs.add(ValueError)
    if g is not None and any(map(int.__gt__, g, MAX_GRID)):
        errs.add(ValueError)
    if shmem is not None:
        if isinstance(shmem, bool) or not isinstance(shmem, (int, np.integer)):
            errs.add(TypeError)
        elif not 0 <= shmem <= MAX_SHMEM:
            errs.add(ValueError)
    if cluster is not None:
        _, e = dim_contract(cluster)
        errs |= e or {UnsupportedError}  # the CPU device has no clusters
    for a in attributes:
        if not isinstance(a, LaunchAttribute):
            errs.add(TypeError)
        elif a == LaunchAttribute.cooperative():
            errs.add(UnsupportedError)  # nor cooperative launches
    if errs:
        return None, errs
    assert g is not None and b is not None
    return (g, b), errs


# -- strategies --------------------------------------------------------------------------

NUMERIC = [
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.int32,
    np.uint32,
    np.int64,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
    ">i4",
    ">u2",
    ">f8",
    ">c8",
]
dtypes = st.sampled_from([np.dtype(d) for d in NUMERIC])
#: For copies: byte copies of any element type, odd sizes included.
copy_dtypes = st.sampled_from([np.dtype(d) for d in [*NUMERIC, "V3", "S5", "<U2", "M8[s]"]])
#: What users pass as a dtype, good and bad.
any_dtype = st.one_of(
    st.sampled_from(NUMERIC),
    st.sampled_from(["V3", "S5", None, "float32", "i2"]),
    st.sampled_from(["no such dtype", 42, object, "O", "V0", "U0", [("a", "O")], 3.5]),
)
junk = st.sampled_from([None, 3.5, "buffer", b"xy", [1, 2], (1, 2), True, {}, object()])
counts = st.integers(0, 48)


def index_like(hi: int) -> st.SearchStrategy[Any]:
    """An offset or size: in range, at the edges, beyond them, or not an integer."""
    return st.one_of(
        st.integers(0, max(hi, 0)),
        st.sampled_from([-1, hi, hi + 1, 2**31, 2**63, 2**64, -(2**63)]),
        st.integers(0, max(hi, 0)).map(np.int64),
        st.integers(0, max(hi, 0)).map(np.uint16),
        st.sampled_from([1.0, 2.5, "1", None, True, False, [1]]),
    )


memset_values = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 127, 128, 255, 256, -128, -129, 2**15, 2**16, 2**31 - 1]),
    st.sampled_from([2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1]),
    st.floats(),
    st.floats(width=16),
    st.sampled_from([0.5, -0.0, 1e300, -1e300, 65504.0, 65520.0, 3.4e38, 3.5e38, 5e-324]),
    st.booleans(),
    st.complex_numbers(max_magnitude=1e6),
    st.sampled_from(NUMERIC).flatmap(lambda d: from_dtype(np.dtype(d).newbyteorder("="))),
    st.sampled_from([np.array(3), np.array(2.5), np.array([1, 2]), [1], "1", b"\x01", None]),
)

grid_component = st.one_of(
    st.integers(1, 3),
    st.sampled_from([0, -1, -(2**31), 65536, 2**31, 2**32, 2**63]),
    st.integers(1, 3).map(np.int32),
)
block_component = st.one_of(
    st.integers(1, 40),
    st.sampled_from([0, -1, 64, 65, 1024, 1025, 2048, 2**31]),
    st.integers(1, 40).map(np.int64),
)
wrong_dim = st.sampled_from([2.0, "4", None, [2], (), (1, 1, 1, 1), b"x", 1.5, (2.0,), ("1",)])


def dims(component: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # (Bool components are pinned by test_bool_launch_dimension_components_are_type_errors.)
    return st.one_of(
        component,
        st.tuples(component),
        st.tuples(component, component),
        st.tuples(component, component, component),
        st.tuples(component, component, component).map(lambda t: Dim(*t)),
        st.just(True),
        wrong_dim,
    )


# -- copies ------------------------------------------------------------------------------


@dataclass
class Operand:
    """One side of a copy, as drawn: what kind of thing it is and its shape."""

    kind: str  # device, host, foreign, array, address, closed, junk
    dtype: np.dtype[Any]
    count: int
    variant: str  # arrays: flat, 2d, strided, readonly; addresses: int, np, null, negative, huge
    arena: str = "device"  # the memory behind an address
    pad: int = 0
    owner: int = 0


def operands() -> st.SearchStrategy[Operand]:
    return st.builds(
        Operand,
        kind=st.sampled_from(["device", "host", "foreign", "array", "address", "closed", "junk"]),
        dtype=copy_dtypes,
        count=counts,
        variant=st.sampled_from(["flat", "2d", "strided", "readonly", "int", "np", "null"])
        | st.sampled_from(["negative", "huge"]),
        arena=st.sampled_from(["device", "host", "numpy"]),
        pad=st.integers(0, 7),
        owner=st.integers(0, STREAMS - 1),
    )


class Made:
    """A drawn operand turned into a real one, with what it means for the contract."""

    def __init__(self) -> None:
        self.value: Any = None
        self.arena: Arena | None = None
        self.is_address = False
        self.is_buffer = False
        self.array: np.ndarray | None = None
        self.problems: set[type[BaseException]] = set()


def make_operand(
    op: Operand, capacity: int, dst: bool, ctx: DeviceContext, foreign: Any, closed: Any, seed: int
) -> Made:
    """``capacity``: bytes an address must be able to take (the other side's size)."""
    m = Made()
    if op.kind == "junk":
        m.value = [None, 3.5, "buffer", b"xy", [1, 2], True, object()][op.count % 7]
        m.problems.add(TypeError)
    elif op.kind == "closed":
        m.value = closed["device" if op.count % 2 else "host"]
        m.is_buffer = True
        m.problems.add(ContextClosedError)
    elif op.kind in ("device", "host", "foreign"):
        nbytes = op.count * op.dtype.itemsize
        c = foreign if op.kind == "foreign" else ctx
        m.arena = Arena(
            c, "host" if op.kind == "host" else "device", nbytes, op.pad, op.owner, seed
        )
        m.value = m.arena.buffer(op.dtype, op.count)
        m.is_buffer = True
    elif op.kind == "array":
        item = op.dtype.itemsize
        strided = op.variant == "strided"
        nbytes = op.count * item * (2 if strided else 1)
        m.arena = Arena(ctx, "numpy", nbytes, op.pad, 0, seed)
        a = m.arena.buffer(op.dtype, op.count * (2 if strided else 1))
        if strided:
            a = a[::2]
        elif op.variant == "2d" and op.count % 2 == 0 and op.count:
            a = a.reshape(2, op.count // 2)
        elif op.variant == "readonly":
            a.flags.writeable = False
        m.value = m.array = a
        if not a.flags.c_contiguous or (dst and not a.flags.writeable):
            m.problems.add(ValueError)
    else:  # an address
        m.is_address = True
        if op.variant == "null":
            m.value = 0
        elif op.variant == "negative":
            m.value = -(1 + op.count)
        elif op.variant == "huge":
            m.value = 2**64 + op.count
        else:
            m.arena = Arena(ctx, op.arena, capacity, op.pad, op.owner, seed)
            addr = m.arena.address()
            m.value = np.uint64(addr) if op.variant == "np" else addr
        if m.value < 0 or m.value >= 2**64 or (m.value == 0 and capacity):
            m.problems.add(ValueError)
    return m


def element_count(m: Made) -> int:
    return m.array.size if m.array is not None else len(m.value)


def element_dtype(m: Made) -> np.dtype[Any]:
    return m.array.dtype if m.array is not None else m.value.dtype


@fuzz(1400)
@given(
    dst=operands(),
    src=operands(),
    size=st.one_of(st.none(), st.none(), counts, st.sampled_from([-1, 2.0, "3", True])),
    dtype=st.one_of(st.none(), st.none(), copy_dtypes, st.sampled_from(["nope", object])),
    how=st.sampled_from(["ctx", "ctx", "no_sync", "copy_to", "copy_from"]),
    stream=st.integers(0, STREAMS - 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_enqueue_copy(dev, foreign, closed, dst, src, size, dtype, how, stream, seed) -> None:
    """Every operand pairing: device and host buffers (of this or another context,
    or of a closed one), NumPy arrays (flat, 2-D, strided, read-only), raw
    addresses (valid, null, negative, beyond 64 bits) and junk; random dtypes,
    lengths, offsets and owning streams."""
    if how in ("copy_to", "copy_from"):
        size = dtype = None  # the buffer methods take only the other operand
        receiver = src if how == "copy_to" else dst
        assume(receiver.kind in ("device", "host", "foreign", "closed"))
    elif how == "no_sync":
        size = dtype = None
    # Work out, from the contract, how many bytes a valid copy moves, so that
    # addresses can be given memory of that size.
    both_addr = dst.kind == "address" and src.kind == "address"
    allowed: set[type[BaseException]] = set()
    nbytes = 0
    if both_addr:
        dt, e = dtype_contract(dtype) if dtype is not None else (None, {TypeError})
        n, e2 = count_contract(size) if size is not None else (None, {TypeError})
        allowed |= e | e2
        if n is not None and n < 0:
            allowed.add(ValueError)
        if dt is not None and n is not None and n >= 0:
            nbytes = n * dt.itemsize
    else:
        buf_side = src if dst.kind == "address" else dst if src.kind == "address" else None
        for side in (dst, src):
            if side.kind in ("device", "host", "foreign"):
                nbytes = max(nbytes, side.count * side.dtype.itemsize)
        if buf_side is not None and buf_side.kind not in ("device", "host", "foreign"):
            nbytes = 0
    d = make_operand(dst, nbytes, True, dev, foreign, closed, seed)
    s = make_operand(src, nbytes, False, dev, foreign, closed, seed + 1)
    allowed |= d.problems | s.problems
    moved = 0  # bytes a successful copy moves
    if both_addr:
        moved = nbytes
    elif d.is_address or s.is_address:
        other = s if d.is_address else d
        if size is not None:
            allowed.add(TypeError)
        if not other.is_buffer:
            allowed.add(TypeError)  # an address pairs with a buffer
        elif other.value is not None and not isinstance(other.value, np.ndarray):
            if dtype is not None:
                dt, e = dtype_contract(dtype)
                allowed |= e
                if dt is not None and dt != other.value.dtype:
                    allowed.add(TypeError)
            moved = other.value.nbytes if not allowed & {ContextClosedError} else 0
    else:
        if size is not None:
            allowed.add(TypeError)  # size= goes with addresses only
        want = None
        if dtype is not None:
            want, e = dtype_contract(dtype)
            allowed |= e
        if d.array is not None and s.array is not None:
            allowed.add(TypeError)  # a copy needs a buffer on one side
        elif not (d.problems or s.problems):
            dd, sd = element_dtype(d), element_dtype(s)
            if dd != sd or (want is not None and want != dd):
                allowed.add(TypeError)
            dn, sn = element_count(d), element_count(s)
            if (d.is_buffer and s.is_buffer) or d.is_buffer:  # the destination's length
                if sn < dn:
                    allowed.add(ValueError)
                moved = d.value.nbytes
            else:
                if dn < sn:
                    allowed.add(ValueError)
                moved = s.value.nbytes
    view = dev.select_stream(stream)
    note(f"dst={dst} src={src} size={size!r} dtype={dtype!r} how={how} moved={moved}")

    def call() -> Any:
        if how == "copy_to":
            return s.value.enqueue_copy_to(d.value)
        if how == "copy_from":
            return d.value.enqueue_copy_from(s.value)
        if how == "no_sync":
            return view.enqueue_copy_no_cross_stream_sync(d.value, s.value)
        kwargs = {k: v for k, v in (("size", size), ("dtype", dtype)) if v is not None}
        return view.enqueue_copy(d.value, s.value, **kwargs)

    ev = attempt("enqueue_copy", call, allowed)
    if ev is not None:
        assert settle(ev) is None
        assert s.arena is not None or moved == 0
        if moved:
            assert d.arena is not None and s.arena is not None
            d.arena.expect(s.arena.bytes(moved))
    else:
        drain(dev)
        drain(foreign)
    for m in (d, s):
        if m.arena is not None:
            m.arena.check()


# -- memsets and fills ----------------------------------------------------------------------


@fuzz(1200)
@given(
    kind=st.sampled_from(["device", "host", "device", "host", "closed", "array", "junk"]),
    dtype=st.one_of(dtypes, st.sampled_from([np.dtype("V3"), np.dtype(np.longdouble)])),
    count=counts,
    value=memset_values,
    how=st.sampled_from(["memset", "fill"]),
    pad=st.integers(0, 7),
    owner=st.integers(0, STREAMS - 1),
    stream=st.integers(0, STREAMS - 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_enqueue_memset_and_fill(
    dev, closed, kind, dtype, count, value, how, pad, owner, stream, seed
) -> None:
    """``enqueue_memset(buf, v)`` and ``buf.enqueue_fill(v)`` write ``np.full(len,
    v, dtype)``'s bytes when ``v`` is a number that fits the dtype exactly (byte
    order included), and raise ``ValueError`` for one that does not (out of range,
    fractional for an integer dtype, overflowing a float, complex for a real one, not
    a single number) and ``TypeError`` for elements that are not 1, 2, 4 or 8 bytes."""
    arena = None
    allowed: set[type[BaseException]] = set()
    element = None
    if kind in ("device", "host"):
        arena = Arena(dev, kind, count * dtype.itemsize, pad, owner, seed)
        target: Any = arena.buffer(dtype, count)
        element, allowed = memset_contract(dtype, value)
    elif kind == "closed":
        target = closed["device" if count % 2 else "host"]
        allowed = {ContextClosedError}
        if how == "memset":
            allowed |= memset_contract(target.dtype, value)[1]
    elif kind == "array":
        target = np.zeros(count, dtype)
        allowed = {TypeError}  # memset takes a buffer
        how = "memset"
    else:
        target = [None, "buf", 3, 2.5, [1], object()][count % 6]
        allowed = {TypeError}
        how = "memset"
    note(f"kind={kind} dtype={dtype} count={count} value={value!r} how={how}")
    view = dev.select_stream(stream)
    if how == "memset":
        ev = attempt("enqueue_memset", lambda: view.enqueue_memset(target, value), allowed)
    else:
        ev = attempt("enqueue_fill", lambda: target.enqueue_fill(value), allowed)
    if ev is not None:
        assert settle(ev) is None
        assert arena is not None and element is not None
        arena.expect(np.full(count, element, dtype).tobytes())
    else:
        drain(dev)
    if arena is not None:
        arena.check()


# -- sub-buffers --------------------------------------------------------------------------


@fuzz(1000)
@given(
    kind=st.sampled_from(["device", "host", "device", "host", "closed"]),
    parent_dtype=dtypes,
    parent_count=counts,
    data=st.data(),
    pad=st.integers(0, 7),
    owner=st.integers(0, STREAMS - 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_create_sub_buffer(
    dev, closed, kind, parent_dtype, parent_count, data, pad, owner, seed
) -> None:
    """``create_sub_buffer(dtype, offset, size)``: ``size`` elements of ``dtype``
    from element ``offset`` (counted in ``dtype``), of the same kind as the parent;
    ``IndexError`` outside the parent, ``TypeError`` for a bad dtype or a
    non-integer offset or size, ``ValueError`` for a negative size. A valid one is
    a window: what is written through it lands there in the parent, and nowhere
    else."""
    dtype = data.draw(any_dtype, "dtype")
    dt, allowed = dtype_contract(dtype)
    item = dt.itemsize if dt is not None else 1
    pbytes = parent_count * parent_dtype.itemsize
    offset = data.draw(index_like(pbytes // item), "offset")
    size = data.draw(index_like(pbytes // item), "size")
    arena = None
    if kind == "closed":
        parent: Any = closed["device" if parent_count % 2 else "host"]
        allowed.add(ContextClosedError)
        pbytes = parent.nbytes
    else:
        arena = Arena(dev, kind, pbytes, pad, owner, seed)
        parent = arena.buffer(parent_dtype, parent_count)
    o, e = count_contract(offset)
    allowed |= e
    n, e = count_contract(size)
    allowed |= e
    if n is not None and n < 0:
        allowed.add(ValueError)
    if o is not None and n is not None and (o < 0 or (o + max(n, 0)) * item > pbytes):
        allowed.add(IndexError)
    note(f"parent={parent!r} dtype={dtype!r} offset={offset!r} size={size!r}")
    sub = attempt(
        "create_sub_buffer", lambda: parent.create_sub_buffer(dtype, offset, size), allowed
    )
    if sub is not None:
        assert arena is not None and dt is not None and o is not None and n is not None
        assert type(sub) is type(parent)
        assert isinstance(sub, (DeviceBuffer, HostBuffer))
        assert (len(sub), sub.dtype, sub.nbytes) == (n, dt, n * item)
        assert sub.unsafe_ptr() == parent.unsafe_ptr() + o * item
        assert sub.context() == parent.context()
        # Write through the window, on another stream than the parent's owner.
        payload = np.random.default_rng(seed).integers(0, 256, n * item, dtype=np.uint8)
        view = dev.select_stream((owner + 1) % STREAMS)
        settle(view.enqueue_copy(sub, payload.view(dt)))
        arena.expect(payload, at=o * item)
        # ... and through a window of the window: its first element, as bytes.
        if n:
            inner = sub.create_sub_buffer(np.uint8, 0, item)
            settle(view.enqueue_memset(inner, 0xA5))
            arena.expect(b"\xa5" * item, at=o * item)
    if arena is not None:
        arena.check()


# -- launches: geometry and arguments -----------------------------------------------------


def _stamp_cpu(b: ThreadBlock, out: np.ndarray, n: np.int32, base: np.int32) -> None:
    """out[t] = base + t for every linear thread id t < n (CUDA's thread order)."""
    g, d, bi, t = b.grid_dim, b.block_dim, b.block_idx, b.thread_idx
    block = bi.x + g.x * (bi.y + g.y * bi.z)
    thread = t.x + d.x * (t.y + d.y * t.z)
    i = block * (d.x * d.y * d.z) + thread
    i = i[i < n]
    out[i] = base + i


STAMP = Kernel(
    "stamp",
    cuda=r"""
extern "C" __global__ void stamp(int* out, int n, int base) {
    long long block = blockIdx.x + (long long)gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    int thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    long long i = block * (blockDim.x * blockDim.y * blockDim.z) + thread;
    if (i < n) out[i] = base + (int)i;
}
""",
    cpu=_stamp_cpu,
)


@pytest.fixture(scope="module")
def stamp(dev):
    """One compiled function for all cases, so its cache of validated geometries
    grows across them as in a real program."""
    return dev.compile_function(STAMP)


python_scalars = st.sampled_from([3, 2.5, True, 1 + 1j, -(2**40)])


@fuzz(900)
@given(
    grid=dims(grid_component),
    block=dims(block_component),
    shmem=st.one_of(
        st.none(),
        st.none(),
        st.integers(0, 4096),
        st.sampled_from([-1, MAX_SHMEM, MAX_SHMEM + 1, 1.5, "8", True, np.int32(16)]),
    ),
    cluster=st.one_of(st.none(), st.none(), st.none(), dims(grid_component)),
    attributes=st.lists(
        st.sampled_from([LaunchAttribute.priority(0), LaunchAttribute.cooperative(), "fast"]),
        max_size=2,
    ),
    out_kind=st.sampled_from(["device", "host", "numpy"]),
    count=counts,
    n_frac=st.floats(0, 1),
    base=st.integers(-1000, 1000),
    bad_arg=st.one_of(st.none(), st.none(), st.tuples(st.integers(1, 2), python_scalars)),
    how=st.sampled_from(["function", "kernel", "stream"]),
    stream=st.integers(0, STREAMS - 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_enqueue_function_geometry_and_arguments(
    dev,
    stamp,
    grid,
    block,
    shmem,
    cluster,
    attributes,
    out_kind,
    count,
    n_frac,
    base,
    bad_arg,
    how,
    stream,
    seed,
) -> None:
    """Launch geometry (ints, tuples, ``Dim``, NumPy integers; zero, negative,
    beyond the device's limits, wrong types), shared memory, clusters and launch
    attributes, and kernel arguments (a Python int, float, bool or complex must
    raise ``TypeError``: the C type would be a guess; so must a NumPy array). A
    valid launch runs every thread once in CUDA's linear order."""
    geom, allowed = geometry_contract(grid, block, shmem, cluster, attributes)
    if geom is not None:
        # Valid but huge grids are valid: they would only take long on the CPU.
        assume(geom[0].size() <= 256)
    arena = Arena(dev, out_kind, count * 4, 0, stream, seed)
    out = arena.buffer(np.int32, count)
    n = int(count * n_frac)
    args: list[Any] = [out, np.int32(n), np.int32(base)]
    if bad_arg is not None:
        args[bad_arg[0]] = bad_arg[1]
        allowed.add(TypeError)
    if out_kind == "numpy":
        # A NumPy array is pageable host memory: CUDA cannot pass it, so no device
        # does.
        allowed.add(TypeError)
    launch: dict[str, Any] = {"grid_dim": grid, "block_dim": block}
    if shmem is not None:
        launch["shared_mem_bytes"] = shmem
    if cluster is not None:
        launch["cluster_dim"] = cluster
    if attributes:
        launch["attributes"] = attributes
    note(f"args={args!r} launch={launch!r}")
    view = dev.select_stream(stream)

    def call() -> Any:
        if how == "kernel":
            return view.enqueue_function(STAMP, *args, **launch)
        if how == "stream":
            return view.stream().enqueue_function(stamp, *args, **launch)
        return view.enqueue_function(stamp, *args, **launch)

    ev = attempt("enqueue_function", call, allowed)
    if ev is not None:
        assert settle(ev) is None
        assert geom is not None
        threads = geom[0].size() * geom[1].size()
        k = min(n, threads)
        arena.expect((base + np.arange(k)).astype(np.int32).tobytes())
    else:
        drain(dev)
    arena.check()


def test_bool_launch_dimension_components_are_type_errors(dev, stamp) -> None:
    out = dev.enqueue_create_buffer(np.int32, 4)
    with pytest.raises(TypeError):
        dev.enqueue_function(stamp, out, np.int32(4), np.int32(0), grid_dim=(True,), block_dim=4)


# -- the report --------------------------------------------------------------------------

FUZZ_TESTS = (
    "enqueue_copy",
    "enqueue_memset",
    "enqueue_fill",
    "create_sub_buffer",
    "enqueue_function",
)


def test_zz_fuzz_report(capsys: pytest.CaptureFixture[str]) -> None:
    """Runs last: how many cases ran and which exception types they reached (all
    five documented ones). Written to benchmarks/results/fuzz-cpu.json when
    ASYNCGPU_FUZZ_REPORT is set."""
    if not all(CASES[t] for t in FUZZ_TESTS):
        pytest.skip("the fuzz tests did not all run in this session")
    total = sum(CASES.values())
    report = {
        "device": "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cases": total,
        "cases_per_call": dict(sorted(CASES.items())),
        "distinct_exception_types": len(RAISED),
        "exceptions": dict(sorted(RAISED.items())),
        "settings": {"derandomize": True, "scale": SCALE},
        "versions": {
            "asyncgpu": asyncgpu.__version__,
            "hypothesis": hypothesis.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
    }
    with capsys.disabled():
        print(
            f"\nfuzz: {total} cases ({', '.join(f'{k} {v}' for k, v in sorted(CASES.items()))}); "
            f"{len(RAISED)} distinct exception types: "
            + ", ".join(f"{k} x{v}" for k, v in sorted(RAISED.items()))
        )
    if os.environ.get("ASYNCGPU_FUZZ_REPORT"):
        path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "fuzz-cpu.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    assert {t.__name__ for t in DOCUMENTED} <= set(RAISED), RAISED
