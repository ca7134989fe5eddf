"""Lowering a captured step to a planner problem: its forward ops grouped into a Chain or a Dag.

Why group at all: a plan should speak of blocks a user recognises, and the exact solvers are
cubic (the chain DP) or worse (the MILP) in the size of their problem. ``chain_from_trace`` groups
the forward ops into one stage per block (``stage_key``); ``dag_from_trace`` keeps one node per op
and ``coarsen`` merges them into blocks until the MILP can take them. Costs are the measured op
times when the trace has them, else the capture's estimates.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from remat._errors import RematValueError, message
from remat.planner import given
from remat.planner.types import BackwardStep, Chain, Dag, Node, Stage
from remat.trace.types import Op, Phase, Trace

__all__ = ["chain_from_trace", "coarsen", "dag_from_trace", "stage_key"]


def _check(ok: bool, rule: str, given: object, todo: str) -> None:
    if not ok:
        raise RematValueError(message("plan", rule, given, todo))


def stage_key(module: str, depth: int | None = None) -> str:
    """The stage a module path belongs to: its first ``depth`` components, or by default the path
    up to its first list index (``transformer.h.3.attn.c_attn`` -> ``transformer.h.3``,
    ``layer1.0.conv1`` -> ``layer1.0``, ``2`` -> ``2``), else its first component."""
    if not isinstance(module, str) or not (depth is None or (type(depth) is int and depth >= 0)):
        given.a(module, str, "planner.stage_key", "module", "pass a module's path such as 'layer1.0.conv1'")
        given.whole(depth, "planner.stage_key", "depth", 0, none=True)
    parts = module.split(".") if module else []
    if depth is not None:
        return ".".join(parts[:depth])
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if parts else ""


def _forward_ops(trace: Trace) -> tuple[Op, ...]:
    ops = tuple(op for op in trace.ops if op.phase is Phase.FORWARD)
    _check(
        bool(ops),
        "a trace needs forward ops to plan",
        f"{trace.name or 'trace'}: 0",
        "capture a training step",
    )
    return ops


def _op_cost(trace: Trace, measured: bool | None) -> Callable[[Op], float]:
    """Measured times when the trace has them (and ``measured`` is not False), else estimates."""
    use = trace.total_cost > 0 if measured is None else measured
    return (lambda op: op.cost) if use else (lambda op: op.est_cost)


def chain_from_trace(
    trace: Trace,
    *,
    depth: int | None = None,
    measured: bool | None = None,
    key: Callable[[str], str] | None = None,
) -> Chain:
    """Group the forward ops into stages by ``stage_key(op.module, depth)``, or by ``key(op.module)``
    when given (a caller that knows the model's blocks), (consecutive ops with the
    same key form a stage). A stage's output bytes are the storages made up to it that later stages
    read (skip connections count at every boundary they cross); its saved bytes are the storages it
    makes that autograd saved and that do not cross; its backward cost is that of the backward ops
    attributed to its key (ops of an ambiguous key go with the previous backward op's stage)."""
    given.a(trace, Trace, "planner.chain_from_trace", "trace", "pass remat.planner.trace_step(...)'s trace")
    given.whole(depth, "planner.chain_from_trace", "depth", 0, none=True)
    if key is not None and not callable(key):
        given.a(
            key, type(None), "planner.chain_from_trace", "key", "pass key(module_path) -> stage name, or None"
        )
    ops = _forward_ops(trace)
    cost = _op_cost(trace, measured)
    block = key if key is not None else functools.partial(stage_key, depth=depth)
    keys = [block(op.module) for op in ops]
    stage_of = [0] * len(ops)
    for i in range(1, len(ops)):
        stage_of[i] = stage_of[i - 1] + (keys[i] != keys[i - 1])
    n = stage_of[-1] + 1
    made_in: dict[int, int] = {}  # storage (root tensor) -> stage that made it
    last_read: dict[int, int] = {}
    input_roots: set[int] = set()
    for op, s in zip(ops, stage_of, strict=True):
        for t in op.inputs:
            r = trace.root(t)
            if r in made_in:
                last_read[r] = max(last_read.get(r, s), s)
            elif not trace.tensors[r].constant:
                input_roots.add(r)
        for t in op.outputs:
            if trace.tensors[t].alias_of is None and not trace.tensors[t].constant:
                made_in.setdefault(t, s)
    out = [0] * n
    for r, p in made_in.items():
        for k in range(p, last_read.get(r, p)):
            out[k] += trace.tensors[r].nbytes
    out[-1] += sum(trace.tensors[t].nbytes for t in ops[-1].outputs if t in made_in)
    saved = [0] * n
    for r in trace.saved_roots:
        if r in made_in and last_read.get(r, made_in[r]) == made_in[r]:
            saved[made_in[r]] += trace.tensors[r].nbytes
    stages_by_key: dict[str, list[int]] = {}
    for i, name in enumerate(keys):
        if stage_of[i] not in stages_by_key.setdefault(name, []):
            stages_by_key[name].append(stage_of[i])
    back = [0.0] * n
    current = n - 1
    for op in trace.ops:
        if op.phase is Phase.BACKWARD:
            owners = stages_by_key.get(block(op.module), [])
            current = owners[0] if len(owners) == 1 else current
            back[current] += cost(op)
    stages = []
    for s in range(n):
        members = [i for i in range(len(ops)) if stage_of[i] == s]
        name = keys[members[0]] or "(top level)"
        forward = math.fsum(cost(ops[i]) for i in members)
        stages.append(Stage(name, forward, back[s], out[s], saved[s], tuple(ops[i].index for i in members)))
    return Chain(tuple(stages), sum(trace.tensors[r].nbytes for r in input_roots), trace.name)


def dag_from_trace(trace: Trace, *, max_nodes: int | None = 500, measured: bool | None = None) -> Dag:
    """One node per forward op, or per owned output of a forward op with several (the op's cost on
    the first, each later one reading the one before: recomputing any output runs the op, and each
    output lives as long as its own readers need it, as a batch norm's output and saved statistics
    do). Deps are the last forward writer of each storage an op reads, so an in-place op orders its
    readers and holds the bytes of what it wrote. One backward step per backward op that reads
    forward storages (the ops between them are folded into the previous step), then ``coarsen`` to
    ``max_nodes``. A step's ``live_bytes`` are the storages backward-phase ops made that are alive
    after it (activation and parameter gradients). Forward storages the program itself holds past
    their last use (returned logits, a KV cache) are not modelled."""
    given.a(trace, Trace, "planner.dag_from_trace", "trace", "pass remat.planner.trace_step(...)'s trace")
    given.whole(max_nodes, "planner.dag_from_trace", "max_nodes", 1, none=True)
    ops = _forward_ops(trace)
    cost = _op_cost(trace, measured)
    writer: dict[int, int] = {}
    nodes: list[Node] = []
    for op in ops:
        deps = sorted({writer[r] for r in map(trace.root, op.inputs) if r in writer})
        owned = [t for t in op.outputs if trace.tensors[t].alias_of is None and not trace.tensors[t].constant]
        # an in-place op holds the storage it writes: the value later ops read (a dropout mask
        # filled by bernoulli_) is its; the maker's copy dies with its last reader, this op
        rewritten = sorted({r for r in map(trace.root, op.mutates) if r in writer} - set(owned))
        parts = [[t] for t in owned] if len(owned) > 1 else [[*owned, *rewritten]]
        where = f"{op.packet}@{op.module or '(top level)'}"
        for j, part in enumerate(parts):
            name = where if len(parts) == 1 else f"{where}#{j}"
            inputs = tuple(deps) if j == 0 else (len(nodes) - 1,)
            size = sum(trace.tensors[t].nbytes for t in part)
            nodes.append(Node(name, cost(op) if j == 0 else 0.0, size, inputs, (op.index,), op.module))
            for r in part:
                writer[r] = len(nodes) - 1
        for r in map(trace.root, op.mutates):
            writer[r] = len(nodes) - 1
    handles: dict[int, int] = {}  # storages made outside the forward pass -> live handles
    live = 0
    steps: list[BackwardStep] = []
    for event in trace.events:
        if isinstance(event, Op):
            if event.phase is not Phase.FORWARD:
                for r in map(trace.root, event.outputs):
                    if r not in writer and not trace.tensors[r].constant:
                        live += trace.tensors[r].nbytes if handles.get(r, 0) == 0 else 0
                        handles[r] = handles.get(r, 0) + 1
            if event.phase is Phase.BACKWARD:
                reads = tuple(sorted({writer[r] for r in map(trace.root, event.inputs) if r in writer}))
                step = BackwardStep(event.module or event.packet, reads, cost(event), live, (event.index,))
                steps.append(_merge_steps(steps.pop(), step) if steps and not reads else step)
        elif handles.get(r := trace.root(event.tensor), 0) > 0:
            handles[r] -= 1
            live -= trace.tensors[r].nbytes if handles[r] == 0 else 0
    if len(steps) > 1 and not steps[0].reads:
        steps[:2] = [_merge_steps(steps[0], steps[1])]
    dag = Dag(tuple(nodes), tuple(steps), trace.name)
    return dag if max_nodes is None else coarsen(dag, max_nodes)


def _merge_steps(a: BackwardStep, b: BackwardStep) -> BackwardStep:
    """Two consecutive backward steps as one: what either reads is read, the larger live bytes."""
    reads = tuple(sorted(set(a.reads) | set(b.reads)))
    return BackwardStep(
        b.name if b.reads else a.name, reads, a.cost + b.cost, max(a.live_bytes, b.live_bytes), a.ops + b.ops
    )


def coarsen(dag: Dag, max_nodes: int) -> Dag:
    """At most ``max_nodes`` nodes: merge consecutive nodes of the same module into blocks, then of
    the same parent module (``a.b.c`` -> ``a.b``), and as a last resort equal runs of blocks; then,
    while blocks are left to spend, halve the largest (one module of many ops is split). A block
    costs the sum of its members and holds the bytes of the members read outside it or by backward
    (its internal temporaries are not modelled); backward steps are mapped onto blocks and
    consecutive steps whose latest read is the same block are merged (their reads held together)."""
    given.a(dag, Dag, "planner.coarsen", "dag", "pass remat.planner.dag_from_trace(...)'s graph")
    given.whole(max_nodes, "planner.coarsen", "max_nodes", 1)
    if len(dag.nodes) <= max_nodes:
        return dag
    keys = [n.module for n in dag.nodes]
    groups = _runs(keys)
    while len(groups) > max_nodes:
        shorter = [k.rsplit(".", 1)[0] for k in keys]
        if shorter == keys:
            break
        keys = shorter
        groups = _runs(keys)
    if len(groups) > max_nodes:
        per = math.ceil(len(groups) / max_nodes)
        groups = [[i for g in groups[k : k + per] for i in g] for k in range(0, len(groups), per)]
    while len(groups) < max_nodes and max(map(len, groups)) > 1:  # use the blocks left: halve the largest
        k = max(range(len(groups)), key=lambda g: len(groups[g]))
        half = len(groups[k]) // 2
        groups[k : k + 1] = [groups[k][:half], groups[k][half:]]
    block_of = [0] * len(dag.nodes)
    for b, members in enumerate(groups):
        for i in members:
            block_of[i] = b
    blocks = []
    for b, members in enumerate(groups):
        first, last = dag.nodes[members[0]], dag.nodes[members[-1]]
        held = [i for i in members if dag.readers[i] or any(block_of[u] != b for u in dag.users[i])]
        blocks.append(
            Node(
                first.name
                if len(members) == 1
                else f"{keys[members[0]] or first.name}[{first.name}..{last.name}]",
                math.fsum(dag.nodes[i].cost for i in members),
                sum(dag.nodes[i].bytes for i in held),
                tuple(sorted({block_of[d] for i in members for d in dag.nodes[i].deps} - {b})),
                tuple(op for i in members for op in dag.nodes[i].ops),
                keys[members[0]],
            )
        )
    steps: list[BackwardStep] = []
    for step in dag.backward:
        mapped = BackwardStep(
            step.name, tuple(sorted({block_of[r] for r in step.reads})), step.cost, step.live_bytes, step.ops
        )
        if steps and (not mapped.reads or not steps[-1].reads or max(mapped.reads) == max(steps[-1].reads)):
            steps[-1] = _merge_steps(steps[-1], mapped)
        else:
            steps.append(mapped)
    return Dag(tuple(blocks), tuple(steps), dag.name)


def _runs(keys: list[str]) -> list[list[int]]:
    """Indices grouped into runs of equal consecutive keys."""
    runs: list[list[int]] = []
    for i, key in enumerate(keys):
        if runs and keys[runs[-1][0]] == key:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
