"""The device-neutral graph definition: how a DAG with CPU function nodes is cut
into the CPU and device stages that a device without host nodes (CUDA) replays
one after another in stream order. Every edge must point forward or stay inside
one device stage, whatever the DAG."""

from __future__ import annotations

import numpy as np
import pytest

from asyncgpu._core.graph import CPU, EMPTY, KERNEL, GraphDefinition


def _random_dag(rng: np.random.Generator, n: int, p_cpu: float) -> GraphDefinition:
    g = GraphDefinition()
    for i in range(n):
        k = int(rng.integers(0, min(i, 3) + 1))
        deps = tuple(sorted({int(d) for d in rng.choice(i, size=k, replace=False)})) if i else ()
        kind = CPU if rng.random() < p_cpu else (EMPTY if rng.random() < 0.1 else KERNEL)
        g.add(kind, None, deps)
    return g


@pytest.mark.parametrize("p_cpu", [0.0, 0.2, 0.5, 1.0])
def test_every_edge_keeps_its_order_across_the_stages(
    rng: np.random.Generator, p_cpu: float
) -> None:
    for _ in range(50):
        g = _random_dag(rng, int(rng.integers(1, 40)), p_cpu)
        stages = g.stages()
        where = {n._index: (k, kind) for k, (kind, nodes) in enumerate(stages) for n in nodes}
        # Every node runs once, except joins of stages that hold nothing else.
        placed = set(where)
        for n in g.nodes:
            assert n._index in placed or n.kind == EMPTY
        for n in g.nodes:
            if n._index not in where:
                continue
            k, kind = where[n._index]
            for d in n._deps:
                if d not in where:  # (a dropped join: its own dependencies are earlier still)
                    continue
                kd, dkind = where[d]
                if kind == "device" and dkind == "device":
                    assert kd <= k  # the same driver graph, or an earlier one
                else:
                    assert kd < k, (d, n._index, stages)


def test_a_graph_without_cpu_nodes_is_one_device_stage() -> None:
    g = GraphDefinition()
    a = g.add(KERNEL, None, ())
    b = g.add(KERNEL, None, (a._index,))
    g.add(KERNEL, None, (a._index, b._index))
    assert [kind for kind, _ in g.stages()] == ["device"]


def test_cpu_nodes_cut_the_graph_where_they_stand() -> None:
    g = GraphDefinition()
    k1 = g.add(KERNEL, None, ())
    c = g.add(CPU, None, (k1._index,))
    k2 = g.add(KERNEL, None, (c._index,))
    root_cpu = g.add(CPU, None, ())
    assert [(kind, [n._index for n in nodes]) for kind, nodes in g.stages()] == [
        ("cpu", [root_cpu._index]),
        ("device", [k1._index]),
        ("cpu", [c._index]),
        ("device", [k2._index]),
    ]
