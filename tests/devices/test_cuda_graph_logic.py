"""The CUDA device's graphs without a GPU: how a graph definition becomes
cuda.core graph nodes (against a stand-in ``GraphDefinition`` that records the
calls), how a replay is sequenced on a stream (against a stand-in stream):
one ``cuGraphLaunch`` per stretch between CPU nodes, the CPU stages as host work
in between, the first CPU error at the end; and how an update reaches the
instantiated graph (its executable-node views), with each launch made with
the parameters of its own replay."""

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

    def __int__(self) -> int:  # (as the handle of its executable graph)
        return id(self)

    def instantiate(self) -> Any:
        return _Exec(self)


class _Exec:
    """A stand-in executable graph: ``exe[node].update(...)`` is logged."""

    def __init__(self, definition: _Definition) -> None:
        self.handle = definition
        self.updates: list[tuple[str, dict[str, Any]]] = []

    def __getitem__(self, node: _Node) -> Any:
        updates = self.updates

        class View:
            def update(self, **params: Any) -> None:
                updates.append((node.name, params))

        return View()


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
        _graph.CudaGraph(_Backend(), g, g.seal())
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
            _graph.CudaGraph(_Backend(), g, g.seal())
        pair = np.dtype([("a", "<f8"), ("b", "<i4")], align=True)
        g = GraphDefinition()
        g.add(KERNEL, KernelOp(_Fn((16,)), (np.zeros((), pair)[()],), PLAIN), ())
        with pytest.raises(UnsupportedError, match="structured scalar"):
            _graph.CudaGraph(_Backend(), g, g.seal())


class _Stream:
    """A stand-in stream: records launches (the graph's ``launch`` is made at
    once, or later while the stream is held) and runs host work at once."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.held: list[Any] | None = None

    def graph_launch(self, graph: Any, exe: Any, handle: int, params: Any) -> str:
        assert handle == int(exe)
        self.calls.append(("launch", exe))
        if self.held is not None:
            self.held.append(lambda: graph.launch(exe, params, "raw"))
        else:
            graph.launch(exe, params, "raw")
        return "launched"

    def release(self) -> None:
        held, self.held = self.held or [], None
        for launch in held:
            launch()

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


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ``cuGraphLaunch`` calls the graphs make (the driver stood in for)."""
    made: list[Any] = []

    class _Driver:
        @staticmethod
        def cuGraphLaunch(exe: Any, stream: Any) -> tuple[int]:
            made.append(exe)
            return (0,)

    monkeypatch.setattr(_graph, "cu", _Driver)
    return made


def test_a_replay_launches_each_stretch_with_the_cpu_stages_between(
    fake_core: type[_Definition], launches: list[Any]
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
    graph = _graph.CudaGraph(_Backend(), g, g.seal())
    first, second = (exe for exe, _ in graph.steps if exe is not None)
    s = _Stream()
    out = graph.replay(s)
    assert s.calls == [("launch", first), "cpu", "cpu", ("launch", second), "cpu"]
    assert ran == ["boom", "second"]
    assert isinstance(out, KeyError)  # the replay's event carries the first CPU error

    s = _Stream()
    assert _graph.CudaGraph(_Backend(), *_sealed(GraphDefinition())).replay(s) == "point"
    g = GraphDefinition()
    g.add(COPY, CopyOp(_Ptr(1), _Ptr(2), 8), ())
    single = _graph.CudaGraph(_Backend(), g, g.seal())
    assert single.replay(s) == "launched"
    assert s.calls == ["point", ("launch", single.steps[0][0])]


def _sealed(g: GraphDefinition) -> tuple[GraphDefinition, Any]:
    return g, g.seal()


class _Ptr:
    def __init__(self, p: int) -> None:
        self._ptr = p


def test_an_update_sets_the_nodes_in_the_instantiated_graph(
    fake_core: type[_Definition], launches: list[Any]
) -> None:
    with DeviceContext(api="cpu") as cpu:
        x, y, z = (cpu.enqueue_create_buffer(np.int64, 10) for _ in range(3))
        g = GraphDefinition()
        k = g.add(KERNEL, KernelOp(_Fn((8, 4), cpu), (x, np.int32(10)), PLAIN), (), (x,))
        m = g.add(MEMSET, MemsetOp(y, np.int64(-2), 10), (k._index,), (y,))
        c = g.add(COPY, CopyOp(x, y, 80), (m._index,), (x, y))
        graph = _graph.CudaGraph(_Backend(), g, g.seal())
        (exe,) = graph._graphs
        names = [entry[0] for entry in fake_core.made[0].log]

        graph.update(k._index, KernelOp(_Fn((8, 4), cpu), (z, np.int32(3)), PLAIN), (z,))
        assert exe.updates == [
            (names[0], {"config": "config", "kernel": "kernel", "args": (z._ptr, np.int32(3))})
        ]
        exe.updates.clear()
        graph.update(m._index, MemsetOp(y, np.int64(7), 10), (y,))
        raw = np.int64(7).tobytes()
        assert (
            exe.updates
            == [  # 8-byte elements: both halves
                (names[1], {"dst": y._ptr, "value": raw[:4], "width": 1, "height": 10, "pitch": 8}),
                (
                    names[2],
                    {"dst": y._ptr + 4, "value": raw[4:], "width": 1, "height": 10, "pitch": 8},
                ),
            ]
        )
        exe.updates.clear()
        graph.update(c._index, CopyOp(z, y, 80), (z, y))
        assert exe.updates == [(names[4], {"dst": z._ptr, "src": y._ptr, "size": 80})]
        assert graph.params.ops[c._index].dst is z


def test_a_held_launch_uses_the_parameters_of_its_own_replay(
    fake_core: type[_Definition], launches: list[Any]
) -> None:
    """A launch that reaches the driver after a later update (held behind host
    work) sets its replay's parameters again first; the next launch sets the
    new ones back. Launches with the parameters in place set nothing."""
    with DeviceContext(api="cpu") as cpu:
        x, y, z = (cpu.enqueue_create_buffer(np.int32, 10) for _ in range(3))
        g = GraphDefinition()
        c = g.add(COPY, CopyOp(x, y, 40), (), (x, y))
        graph = _graph.CudaGraph(_Backend(), g, g.seal())
        (exe,) = graph._graphs
        s = _Stream()
        s.held = []
        graph.replay(s)  # (held: the copy x <- y)
        graph.update(c._index, CopyOp(z, y, 40), (z, y))  # set now
        graph.replay(s)  # (held: the copy z <- y)
        assert [u[1]["dst"] for u in exe.updates] == [z._ptr]
        s.release()
        assert [u[1]["dst"] for u in exe.updates] == [z._ptr, x._ptr, z._ptr]
        assert len(launches) == 2
        graph.replay(s)
        assert len(exe.updates) == 3 and len(launches) == 3


def test_a_refused_update_leaves_the_graph_as_it_was(
    fake_core: type[_Definition], launches: list[Any]
) -> None:
    with DeviceContext(api="cpu") as cpu:
        x = cpu.enqueue_create_buffer(np.float32, 10)
        g = GraphDefinition()
        k = g.add(KERNEL, KernelOp(_Fn((8, 4), cpu), (x, np.int32(10)), PLAIN), (), (x,))
        graph = _graph.CudaGraph(_Backend(), g, g.seal())
        before = graph.params
        with pytest.raises(TypeError):  # a 8-byte scalar where the kernel takes 4
            graph.update(k._index, KernelOp(_Fn((8, 4), cpu), (x, np.int64(10)), PLAIN), (x,))
        assert graph.params is before and graph._graphs[0].updates == []
