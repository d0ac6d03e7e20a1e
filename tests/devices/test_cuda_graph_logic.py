"""The CUDA device's graphs without a GPU: how a graph definition becomes
cuda.core graph nodes (against a stand-in ``GraphDefinition`` that records the
calls), and how a replay is sequenced on a stream (against a stand-in stream):
one ``cuGraphLaunch`` per stretch between CPU nodes, the CPU stages as host work
in between, the first CPU error at the end."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest

pytest.importorskip("asyncgpu._devices.cuda.backend", reason="cuda-python is not installed")

from asyncgpu import DeviceContext, UnsupportedError
from asyncgpu._core.graph import (
    COPY,
    CPU,
    EMPTY,
    KERNEL,
    MEMSET,
    CopyOp,
    CpuOp,
    GraphDefinition,
    KernelOp,
    MemsetOp,
)
from asyncgpu._devices.cuda import graph as _graph
from asyncgpu._devices.cuda.launch import _LaunchCfg

PLAIN = _LaunchCfg("config", False, None, (1, 1, 1, 256, 1, 1, 0))


class _Node:
    """A stand-in cuda.core graph node: records what is added after it."""

    def __init__(self, log: list[tuple[Any, ...]], name: str, after: tuple[str, ...]) -> None:
        self.log, self.name, self.after = log, name, after

    def _add(self, what: str, *args: Any) -> _Node:
        node = _Node(self.log, f"{what}{len(self.log)}", (self.name,) if self.name else ())
        self.log.append((node.name, node.after, *args))
        return node

    def launch(self, config: Any, kernel: Any, *args: Any) -> _Node:
        return self._add("launch", config, kernel, *args)

    def memcpy(self, dst: int, src: int, size: int) -> _Node:
        return self._add("memcpy", dst, src, size)

    def memset(self, dst: int, value: bytes, width: int, height: int = 1, pitch: int = 0) -> _Node:
        return self._add("memset", dst, value, width, height, pitch)

    def join(self, *nodes: _Node) -> _Node:
        node = _Node(self.log, f"join{len(self.log)}", (self.name, *(n.name for n in nodes)))
        self.log.append((node.name, node.after))
        return node


class _Definition(_Node):
    made: ClassVar[list[_Definition]] = []

    def __init__(self) -> None:
        super().__init__([], "", ())
        _Definition.made.append(self)

    def empty(self) -> _Node:
        return self._add("empty")

    def instantiate(self) -> Any:
        return type("Exec", (), {"handle": self})()


class _Backend:
    def make_current(self) -> None:
        pass


class _Fn:
    """A compiled function as the graph reads it: its name, loaded kernel and
    context (whose buffers its arguments are)."""

    def __init__(self, sizes: tuple[int, ...], ctx: Any = None) -> None:
        self.name = "k"
        self._ctx = ctx
        self._impl = type(
            "Impl", (), {"name": "k", "param_sizes": sizes, "kernel": "kernel", "plans": {}}
        )()


@pytest.fixture
def fake_core(monkeypatch: pytest.MonkeyPatch) -> type[_Definition]:
    import cuda.core.graph

    _Definition.made = []
    monkeypatch.setattr(cuda.core.graph, "GraphDefinition", _Definition)
    return _Definition


def test_nodes_and_edges_become_cuda_core_calls(fake_core: type[_Definition]) -> None:
    with DeviceContext(api="cpu") as cpu:
        x = cpu.enqueue_create_buffer(np.int64, 10)
        y = cpu.enqueue_create_buffer(np.int64, 10)
        g = GraphDefinition()
        a = g.add(KERNEL, KernelOp(_Fn((8, 4), cpu), (x, np.int32(10)), PLAIN), ())
        b = g.add(MEMSET, MemsetOp(y, np.int64(-2), 10), ())  # 8-byte elements
        c = g.add(COPY, CopyOp(x, y, 80), (a._index, b._index))
        g.add(COPY, CopyOp(x, y, 0), (c._index,))  # nothing to copy: a join
        g.add(EMPTY, None, ())
        _graph.CudaGraph(_Backend(), g)
        (made,) = fake_core.made
        names = [entry[0] for entry in made.log]
        log = {entry[0]: entry[1:] for entry in made.log}
    launch = log[names[0]]
    assert launch[0] == () and launch[1:] == ("config", "kernel", x._ptr, np.int32(10))
    lo, hi, both = names[1], names[2], names[3]
    raw = np.int64(-2).tobytes()
    assert log[lo] == ((), y._ptr, raw[:4], 1, 10, 8)
    assert log[hi] == ((), y._ptr + 4, raw[4:], 1, 10, 8)
    assert log[both][0] == (lo, hi)
    join, copy = names[4], names[5]
    assert set(log[join][0]) == {names[0], both}
    assert log[copy] == ((join,), x._ptr, y._ptr, 80)
    assert log[names[6]][0] == (copy,)  # the empty copy: an empty node after the copy
    assert log[names[7]][0] == ()  # a root join


def test_kernel_nodes_refuse_what_a_graph_node_cannot_launch(fake_core: type[_Definition]) -> None:
    with DeviceContext(api="cpu") as cpu:
        x = cpu.enqueue_create_buffer(np.float32, 10)
        cluster = _LaunchCfg("config", False, None, None)
        g = GraphDefinition()
        g.add(KERNEL, KernelOp(_Fn((8,)), (x,), cluster), ())
        with pytest.raises(UnsupportedError, match="plain launch"):
            _graph.CudaGraph(_Backend(), g)
        pair = np.dtype([("a", "<f8"), ("b", "<i4")], align=True)
        g = GraphDefinition()
        g.add(KERNEL, KernelOp(_Fn((16,)), (np.zeros((), pair)[()],), PLAIN), ())
        with pytest.raises(UnsupportedError, match="structured scalar"):
            _graph.CudaGraph(_Backend(), g)


class _Stream:
    """A stand-in stream: records launches and runs host work at once."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def graph_launch(self, exe: Any, keep: Any) -> str:
        self.calls.append(("launch", exe))
        return "launched"

    def cpu_call(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.calls.append("cpu")
        try:
            fn(*args, **kwargs)
        except Exception as e:
            return e
        return "cpu done"

    def wait_event(self, ev: Any) -> str:
        self.calls.append("point")
        return "point"


def test_a_replay_launches_each_stretch_with_the_cpu_stages_between(
    fake_core: type[_Definition],
) -> None:
    ran: list[str] = []

    def boom() -> None:
        ran.append("boom")
        raise KeyError("boom")

    g = GraphDefinition()
    k1 = g.add(EMPTY, None, ())
    k1 = g.add(COPY, CopyOp(_Ptr(1), _Ptr(2), 8), (k1._index,))
    c1 = g.add(CPU, CpuOp(boom, ()), (k1._index,))
    c2 = g.add(CPU, CpuOp(ran.append, ("second",)), (c1._index,))
    g.add(COPY, CopyOp(_Ptr(3), _Ptr(4), 8), (c2._index,))
    graph = _graph.CudaGraph(_Backend(), g)
    first, second = (exe for exe, _ in graph.steps if exe is not None)
    s = _Stream()
    out = graph.replay(s)
    assert s.calls == [("launch", first), "cpu", "cpu", ("launch", second), "cpu"]
    assert ran == ["boom", "second"]
    assert isinstance(out, KeyError)  # the replay's event carries the first CPU error

    s = _Stream()
    assert _graph.CudaGraph(_Backend(), GraphDefinition()).replay(s) == "point"
    g = GraphDefinition()
    g.add(COPY, CopyOp(_Ptr(1), _Ptr(2), 8), ())
    single = _graph.CudaGraph(_Backend(), g)
    assert single.replay(s) == "launched"
    assert s.calls == ["point", ("launch", single.steps[0][0])]


class _Ptr:
    def __init__(self, p: int) -> None:
        self._ptr = p
