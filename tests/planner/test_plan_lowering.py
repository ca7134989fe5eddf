"""Lowering a captured step to a planner problem (``remat.planner.lowering``): stages by block,
one DAG node per forward op (or per output), coarsening by module."""

from __future__ import annotations

from remat.planner import (
    BackwardStep,
    Dag,
    Node,
    chain_from_trace,
    coarsen,
    dag_from_trace,
    solve,
    solvers,
    stage_key,
)
from remat.planner.search import model_peak
from remat.trace import Op, Phase, Release, TensorInfo, Trace


def mlp_trace() -> Trace:
    """x -> [mm, gelu] (module 0) -> [mm, relu] (module 1) -> [mm, sum] (module 2), then backward."""
    f, b = Phase.FORWARD, Phase.BACKWARD
    sizes = {4: 40, 5: 40, 6: 40, 7: 40, 8: 8, 9: 4, 10: 4, 11: 40, 12: 40, 13: 40, 14: 40, 15: 16}
    tensors = [TensorInfo(i, 16 if i < 4 else sizes[i], constant=i < 4) for i in range(16)]
    events: list[Op | Release] = [
        Op(0, "aten.mm.default", (0, 1), (4,), cost=1.0, phase=f, module="0.lin"),
        Op(1, "aten.gelu.default", (4,), (5,), cost=1.0, phase=f, module="0.act"),
        Op(2, "aten.mm.default", (5, 2), (6,), cost=1.0, phase=f, module="1.lin"),
        Op(3, "aten.relu.default", (6,), (7,), cost=1.0, phase=f, module="1.act"),
        Release(6),
        Op(4, "aten.mm.default", (7, 3), (8,), cost=1.0, phase=f, module="2"),
        Op(5, "aten.sum.default", (8,), (9,), cost=1.0, phase=f, module="2"),
        Release(8),
        Op(6, "aten.ones_like.default", (9,), (10,), cost=2.0, phase=b, module="2"),
        Op(7, "aten.mm.default", (10, 3), (11,), cost=2.0, phase=b, module="2"),
        Release(10),
        Op(8, "aten.threshold_backward.default", (11, 7), (12,), cost=2.0, phase=b, module="1.act"),
        Release(11),
        Op(9, "aten.mm.default", (12, 5), (13,), cost=2.0, phase=b, module="1.lin"),
        Release(12),
        Op(10, "aten.gelu_backward.default", (13, 4), (14,), cost=2.0, phase=b, module="0.act"),
        Release(13),
        Op(11, "aten.mm.default", (14, 0), (15,), cost=2.0, phase=b, module="0.lin"),
        Release(14),
    ]
    return Trace(tuple(tensors), tuple(events), frozenset({4, 5, 7}), name="mlp")


def test_stage_keys_stop_at_the_first_list_index() -> None:
    assert stage_key("transformer.h.3.attn.c_attn") == "transformer.h.3"
    assert stage_key("layer1.0.conv1") == "layer1.0"
    assert stage_key("2") == "2" and stage_key("encoder.norm") == "encoder" and stage_key("") == ""
    assert stage_key("transformer.h.3.attn", depth=2) == "transformer.h"


def test_a_chain_from_a_trace_groups_ops_by_block() -> None:
    chain = chain_from_trace(mlp_trace())
    assert [s.name for s in chain.stages] == ["0", "1", "2"]
    assert [s.ops for s in chain.stages] == [(0, 1), (2, 3), (4, 5)]
    assert [s.output_bytes for s in chain.stages] == [40, 40, 4]  # gelu out, relu out, the loss
    assert [s.saved_bytes for s in chain.stages] == [40, 0, 0]  # gelu's input stays inside block 0
    assert [s.forward_cost for s in chain.stages] == [2.0, 2.0, 2.0]
    assert [s.backward_cost for s in chain.stages] == [4.0, 4.0, 4.0]
    assert chain.input_bytes == 0 and chain.name == "mlp"
    assert solve(chain, model_peak(chain)).predicted_overhead == 1.0


def test_a_graph_from_a_trace_has_one_node_per_forward_op_and_coarsens_by_module() -> None:
    dag = dag_from_trace(mlp_trace())
    assert [n.bytes for n in dag.nodes] == [40, 40, 40, 40, 8, 4]
    assert [n.deps for n in dag.nodes] == [(), (0,), (1,), (2,), (3,), (4,)]
    assert [s.reads for s in dag.backward] == [(5,), (3,), (1,), (0,)]
    assert [s.ops for s in dag.backward] == [(6, 7), (8,), (9,), (10, 11)]
    assert dag.saved == (0, 1, 3, 5)
    assert dag.backward[0].live_bytes == 44  # the seed and the gradient of the relu output
    blocks = coarsen(dag, 3)
    assert [n.module for n in blocks.nodes] == ["0", "1", "2"]
    assert [n.bytes for n in blocks.nodes] == [80, 40, 4]  # block 1's relu input is internal
    assert [n.deps for n in blocks.nodes] == [(), (0,), (1,)]
    assert [s.reads for s in blocks.backward] == [(2,), (1,), (0,)]
    assert dag_from_trace(mlp_trace(), max_nodes=3) == blocks
    plan = solvers.get("milp").solve(blocks, model_peak(blocks))
    assert plan.predicted_overhead == 1.0 and plan.decisions[0].ops == (0, 1)


def test_each_output_of_a_multi_output_op_is_a_node_of_its_own() -> None:
    """A batch norm's output dies with its reader; its saved statistics live until backward."""
    f, b = Phase.FORWARD, Phase.BACKWARD
    tensors = [TensorInfo(0, 8, constant=True), TensorInfo(1, 40), TensorInfo(2, 4), TensorInfo(3, 40)]
    events: list[Op | Release] = [
        Op(0, "aten.native_batch_norm.default", (0,), (1, 2), cost=3.0, phase=f, module="bn"),
        Op(1, "aten.relu.default", (1,), (3,), cost=1.0, phase=f, module="act"),
        Release(1),
        Op(2, "aten.threshold_backward.default", (3,), (), cost=1.0, phase=b, module="act"),
        Op(3, "aten.native_batch_norm_backward.default", (0, 2), (), cost=2.0, phase=b, module="bn"),
    ]
    dag = dag_from_trace(Trace(tuple(tensors), tuple(events)))
    assert [(n.name, n.cost, n.bytes, n.deps, n.ops) for n in dag.nodes] == [
        ("native_batch_norm@bn#0", 3.0, 40, (), (0,)),
        ("native_batch_norm@bn#1", 0.0, 4, (0,), (0,)),
        ("relu@act", 1.0, 40, (0,), (1,)),
    ]
    assert dag.saved == (1, 2)
    assert model_peak(dag) == 84  # the output is freed after relu: 4 + 40 kept, not 84 + 40


def test_coarsening_one_module_of_many_ops_splits_it_evenly() -> None:
    dag = Dag(
        tuple(Node(str(i), 1.0, 1, (i - 1,) if i else ()) for i in range(10)),
        tuple(BackwardStep(f"g{i}", (i,)) for i in reversed(range(10))),
    )
    blocks = coarsen(dag, 4)
    assert [n.ops for n in blocks.nodes] == [(), (), (), ()]
    assert [n.cost for n in blocks.nodes] == [2.0, 3.0, 2.0, 3.0]
    assert [s.reads for s in blocks.backward] == [(3,), (2,), (1,), (0,)]
