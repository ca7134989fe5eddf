"""What the planner's solvers read and write: a Chain or a Graph in, a Solution out.

Why a problem type apart from the Trace: a solver should not care how its input was made (a
capture, a hand-written benchmark chain, a coarsened graph), and a test should state a five-stage
chain in one line. There are two shapes because the exact solvers need different ones: rotor's
dynamic program works on a chain of stages (forward cost, backward cost, output bytes, saved bytes),
Checkmate's MILP on a DAG of forward nodes with the backward pass as a fixed sequence of steps
that read saved forward values. What a schedule costs and how much memory it holds is defined once,
by the simulator (NOTE [chain model] and NOTE [graph model] in ``remat.planner.solvers.simulate``),
so every solver is judged by the same rules.

A Solution answers an executor's one question per stage (chain) or saved forward node (graph):
SAVE or RECOMPUTE (``solution.action(k)``), and carries the full schedule for executors that run
multi-level plans. ``chain_from_trace`` and ``graph_from_trace`` build problems from a captured
step, grouping ops by module so that a plan speaks of blocks a user recognises.
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from remat._errors import RematValueError, message
from remat._units import format_bytes
from remat.trace.types import Op, Phase, Trace

__all__ = [
    "Action",
    "BackwardStep",
    "Chain",
    "ChainOp",
    "ChainSchedule",
    "ChainStep",
    "Decision",
    "Graph",
    "GraphSchedule",
    "GraphStage",
    "Node",
    "Problem",
    "Schedule",
    "Solution",
    "Stage",
    "chain_from_trace",
    "coarsen",
    "graph_from_trace",
    "stage_key",
]


def _check(ok: bool, rule: str, given: object, todo: str) -> None:
    if not ok:
        raise RematValueError(message("plan", rule, given, todo))


def _check_amounts(what: str, cost: float, *sizes: int) -> None:
    _check(
        math.isfinite(cost) and cost >= 0,
        "costs must be finite and non-negative",
        f"{what}: {cost}",
        "fix the cost",
    )
    _check(
        all(s >= 0 for s in sizes), "byte counts must be non-negative", f"{what}: {sizes}", "fix the sizes"
    )


# -- the chain ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One stage of a chain. ``output_bytes`` is the activation the next stage reads;
    ``saved_bytes`` the internals its backward needs when its forward ran with grad (its input and
    output not included); ``ops`` the trace ops it groups, for executors."""

    name: str
    forward_cost: float
    backward_cost: float
    output_bytes: int
    saved_bytes: int
    ops: tuple[int, ...] = ()

    def __str__(self) -> str:
        return (
            f"{self.name or 'stage'}: f={self.forward_cost:g} b={self.backward_cost:g} "
            f"out={format_bytes(self.output_bytes)} saved={format_bytes(self.saved_bytes)}"
        )


@dataclass(frozen=True)
class Chain:
    """A chain of heterogeneous stages (the rotor model); stage 0 reads ``input_bytes``."""

    stages: tuple[Stage, ...]
    input_bytes: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        _check(len(self.stages) > 0, "a chain needs at least one stage", "got 0", "pass one Stage per block")
        _check_amounts("input", 0.0, self.input_bytes)
        for k, s in enumerate(self.stages):
            _check_amounts(f"stage {k}", s.forward_cost + s.backward_cost, s.output_bytes, s.saved_bytes)

    @classmethod
    def of(
        cls,
        forward: list[float],
        backward: list[float],
        outputs: list[int],
        saved: list[int],
        input_bytes: int = 0,
    ) -> Chain:
        """A chain from per-stage lists (stages named by index): for tests and benchmarks."""
        _check(
            len(forward) == len(backward) == len(outputs) == len(saved),
            "per-stage lists must have one entry per stage",
            f"lengths {len(forward)}, {len(backward)}, {len(outputs)}, {len(saved)}",
            "pass lists of equal length",
        )
        rows = zip(forward, backward, outputs, saved, strict=True)
        return cls(
            tuple(Stage(str(k), float(f), float(b), a, x) for k, (f, b, a, x) in enumerate(rows)), input_bytes
        )

    def __len__(self) -> int:
        return len(self.stages)

    @functools.cached_property
    def activation_bytes(self) -> tuple[int, ...]:
        """Bytes of a_0 (the input) ... a_n (the last stage's output): ``n + 1`` entries."""
        return (self.input_bytes, *(s.output_bytes for s in self.stages))

    @property
    def base_cost(self) -> float:
        """Compute of one step with nothing recomputed."""
        return math.fsum(s.forward_cost + s.backward_cost for s in self.stages)

    def __str__(self) -> str:
        lines = [
            f"Chain({self.name or 'unnamed'}: {len(self)} stages, input {format_bytes(self.input_bytes)})"
        ]
        lines += [f"  {k} {s}" for k, s in enumerate(self.stages)]
        return "\n".join(lines)


# -- the graph ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """A forward node: an op or a block of ops making ``bytes`` of values from its ``deps``
    (earlier nodes; constants are not nodes). ``module`` is the module path ``coarsen`` groups by."""

    name: str
    cost: float
    bytes: int
    deps: tuple[int, ...] = ()
    ops: tuple[int, ...] = ()
    module: str = ""


@dataclass(frozen=True)
class BackwardStep:
    """One step of the backward pass: it needs the forward nodes ``reads`` in memory. ``live_bytes``
    is what the backward pass itself holds during the step (gradients, temporaries): the same
    whatever is recomputed, so it is a constant of the step."""

    name: str
    reads: tuple[int, ...]
    cost: float = 0.0
    live_bytes: int = 0
    ops: tuple[int, ...] = ()


@dataclass(frozen=True)
class Graph:
    """A DAG of forward nodes in topological order (``deps`` point to lower indices), then the
    backward steps in the order they run (the Checkmate model with a fixed backward order)."""

    nodes: tuple[Node, ...]
    backward: tuple[BackwardStep, ...]
    name: str = ""

    def __post_init__(self) -> None:
        _check(
            len(self.nodes) > 0, "a graph needs at least one forward node", "got 0", "pass one Node per op"
        )
        for i, node in enumerate(self.nodes):
            _check_amounts(f"node {i}", node.cost, node.bytes)
            _check(
                all(0 <= d < i for d in node.deps),
                "a node's deps must be earlier nodes (topological order)",
                f"node {i} deps {node.deps}",
                "order the nodes so that every dep comes first",
            )
        for j, step in enumerate(self.backward):
            _check_amounts(f"backward step {j}", step.cost, step.live_bytes)
            _check(
                all(0 <= r < len(self.nodes) for r in step.reads),
                "a backward step reads forward nodes",
                f"step {j} reads {step.reads} of {len(self.nodes)} nodes",
                "index reads into Graph.nodes",
            )

    @functools.cached_property
    def users(self) -> tuple[tuple[int, ...], ...]:
        """For each node, the later nodes that read it."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for k, node in enumerate(self.nodes):
            for d in set(node.deps):
                out[d].append(k)
        return tuple(tuple(u) for u in out)

    @functools.cached_property
    def readers(self) -> tuple[tuple[int, ...], ...]:
        """For each node, the backward steps that read it (empty: not saved for backward)."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for j, step in enumerate(self.backward):
            for r in set(step.reads):
                out[r].append(j)
        return tuple(tuple(r) for r in out)

    @functools.cached_property
    def saved(self) -> tuple[int, ...]:
        """The nodes some backward step reads: the ones a plan saves or recomputes."""
        return tuple(i for i, r in enumerate(self.readers) if r)

    @property
    def base_cost(self) -> float:
        """Compute of one step with nothing recomputed."""
        return math.fsum([n.cost for n in self.nodes] + [s.cost for s in self.backward])

    def __str__(self) -> str:
        edges = sum(len(n.deps) for n in self.nodes)
        return (
            f"Graph({self.name or 'unnamed'}: {len(self.nodes)} forward nodes, {edges} edges, "
            f"{len(self.backward)} backward steps, {len(self.saved)} saved for backward)"
        )


Problem = Chain | Graph


# -- schedules ----------------------------------------------------------------------------------


class ChainOp(enum.StrEnum):
    """A chain action (see NOTE [chain model]): forward without grad dropping its input, forward
    without grad keeping its input as a checkpoint, forward with grad, backward."""

    F_NOGRAD = "F_n"
    F_CHECK = "F_ck"
    F_ALL = "F_all"
    BACKWARD = "B"


class ChainStep(NamedTuple):
    op: ChainOp
    stage: int

    def __str__(self) -> str:
        return f"{self.op} {self.stage}"


_RUN = re.compile(r"^(F_n|F_ck|F_all|B) (\d+)(?:-(\d+))?$")


@dataclass(frozen=True)
class ChainSchedule:
    """A chain schedule as plain data; ``str()`` writes runs (``F_all 0-3, B 3-0``) and
    ``ChainSchedule.parse`` reads them back."""

    steps: tuple[ChainStep, ...]

    def __str__(self) -> str:
        runs: list[str] = []
        i = 0
        while i < len(self.steps):
            op, start = self.steps[i]
            j = i + 1
            direction = 0
            while j < len(self.steps) and self.steps[j].op == op:
                d = self.steps[j].stage - self.steps[j - 1].stage
                if d not in (1, -1) or (direction and d != direction):
                    break
                direction = d
                j += 1
            end = self.steps[j - 1].stage
            runs.append(f"{op} {start}" if j == i + 1 else f"{op} {start}-{end}")
            i = j
        return ", ".join(runs)

    @classmethod
    def parse(cls, text: str) -> ChainSchedule:
        """The schedule ``str()`` wrote."""
        steps: list[ChainStep] = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            match = _RUN.match(part)
            _check(
                match is not None, "a chain schedule is runs such as 'F_all 0-3'", repr(part), "fix the text"
            )
            assert match is not None
            a = int(match.group(2))
            b = int(match.group(3)) if match.group(3) is not None else a
            step = 1 if b >= a else -1
            steps += [ChainStep(ChainOp(match.group(1)), k) for k in range(a, b + step, step)]
        return cls(tuple(steps))


@dataclass(frozen=True)
class GraphStage:
    """One stage of a graph schedule: the forward nodes computed in it (in index order) and the
    values it drops, those alive in it that are not alive at the next stage's start (Checkmate's
    R[t] and S[t] minus S[t+1], stored as a change so that a schedule stays linear in size)."""

    compute: tuple[int, ...]
    drop: tuple[int, ...]


@dataclass(frozen=True)
class GraphSchedule:
    """Stage t < n computes forward node t (and may recompute earlier ones); stage n + j
    recomputes what backward step j needs, then runs it."""

    stages: tuple[GraphStage, ...]

    def __str__(self) -> str:
        return "; ".join(
            f"{' '.join(map(str, s.compute)) or '-'} | drop {' '.join(map(str, s.drop)) or '-'}"
            for s in self.stages
        )


Schedule = ChainSchedule | GraphSchedule


# -- the answer ---------------------------------------------------------------------------------


class Action(enum.StrEnum):
    """What a plan does with a stage's saved tensors (chain) or a saved forward node (graph)."""

    SAVE = "save"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Decision:
    """The plan for stage or node ``index``; ``ops`` are its trace ops (empty for hand-made
    problems), so an executor can map a coarsened plan back to the step."""

    index: int
    name: str
    action: Action
    reason: str
    ops: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.index} {self.name}: {self.action} ({self.reason})"


@dataclass(frozen=True)
class Solution:
    """A solver's answer. Figures are the simulator's for ``schedule`` (NOTE [chain model],
    NOTE [graph model]): ``predicted_peak_bytes`` is the peak of the modelled live bytes (constants
    excluded), reached at ``peak_at``; ``predicted_overhead`` is total compute including
    recomputation ÷ ``base_cost``. ``gap`` is the proven optimality gap (0.0 exact, None for a
    heuristic)."""

    solver: str
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_overhead: float
    base_cost: float
    total_cost: float
    peak_at: str
    decisions: tuple[Decision, ...]
    schedule: Schedule
    gap: float | None
    notes: str = ""
    solve_seconds: float = 0.0

    def action(self, index: int) -> Action:
        """SAVE or RECOMPUTE for stage (chain) or saved forward node (graph) ``index``."""
        for d in self.decisions:
            if d.index == index:
                return d.action
        known = ", ".join(str(d.index) for d in self.decisions)
        raise RematValueError(
            message("plan", "no decision for this index", f"got {index}", f"ask about one of {known}")
        )

    @property
    def recomputed(self) -> tuple[int, ...]:
        """Indices the plan recomputes."""
        return tuple(d.index for d in self.decisions if d.action is Action.RECOMPUTE)

    def __str__(self) -> str:
        gap = "heuristic" if self.gap is None else f"gap {self.gap:.2%}"
        lines = [
            f"Solution({self.solver}: peak {format_bytes(self.predicted_peak_bytes)} at {self.peak_at} "
            f"<= budget {format_bytes(self.budget_bytes)}, overhead {self.predicted_overhead:.3f}, "
            f"{len(self.recomputed)}/{len(self.decisions)} recomputed, {gap}, {self.solve_seconds:.3f} s)",
        ]
        if self.notes:
            lines.append(f"  {self.notes}")
        lines += [f"  {d}" for d in self.decisions]
        lines.append(f"  schedule: {self.schedule}")
        return "\n".join(lines)


# -- problems from a trace ----------------------------------------------------------------------


def stage_key(module: str, depth: int | None = None) -> str:
    """The stage a module path belongs to: its first ``depth`` components, or by default the path
    up to its first list index (``transformer.h.3.attn.c_attn`` -> ``transformer.h.3``,
    ``layer1.0.conv1`` -> ``layer1.0``, ``2`` -> ``2``), else its first component."""
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
    for r in {trace.root(t) for t in trace.saved}:
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


def graph_from_trace(trace: Trace, *, max_nodes: int | None = 500, measured: bool | None = None) -> Graph:
    """One node per forward op, or per owned output of a forward op with several (the op's cost on
    the first, each later one reading the one before: recomputing any output runs the op, and each
    output lives as long as its own readers need it, as a batch norm's output and saved statistics
    do). Deps are the last forward writer of each storage an op reads, so an in-place op orders its
    readers and holds the bytes of what it wrote. One backward step per backward op that reads
    forward storages (the ops between them are folded into the previous step), then ``coarsen`` to
    ``max_nodes``. A step's ``live_bytes`` are the storages backward-phase ops made that are alive
    after it (activation and parameter gradients). Forward storages the program itself holds past
    their last use (returned logits, a KV cache) are not modelled."""
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
    graph = Graph(tuple(nodes), tuple(steps), trace.name)
    return graph if max_nodes is None else coarsen(graph, max_nodes)


def _merge_steps(a: BackwardStep, b: BackwardStep) -> BackwardStep:
    """Two consecutive backward steps as one: what either reads is read, the larger live bytes."""
    reads = tuple(sorted(set(a.reads) | set(b.reads)))
    return BackwardStep(
        b.name if b.reads else a.name, reads, a.cost + b.cost, max(a.live_bytes, b.live_bytes), a.ops + b.ops
    )


def coarsen(graph: Graph, max_nodes: int) -> Graph:
    """At most ``max_nodes`` nodes: merge consecutive nodes of the same module into blocks, then of
    the same parent module (``a.b.c`` -> ``a.b``), and as a last resort equal runs of blocks; then,
    while blocks are left to spend, halve the largest (one module of many ops is split). A block
    costs the sum of its members and holds the bytes of the members read outside it or by backward
    (its internal temporaries are not modelled); backward steps are mapped onto blocks and
    consecutive steps whose latest read is the same block are merged (their reads held together)."""
    _check(max_nodes >= 1, "max_nodes must be positive", f"got {max_nodes}", "pass max_nodes >= 1")
    if len(graph.nodes) <= max_nodes:
        return graph
    keys = [n.module for n in graph.nodes]
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
    block_of = [0] * len(graph.nodes)
    for b, members in enumerate(groups):
        for i in members:
            block_of[i] = b
    blocks = []
    for b, members in enumerate(groups):
        first, last = graph.nodes[members[0]], graph.nodes[members[-1]]
        held = [i for i in members if graph.readers[i] or any(block_of[u] != b for u in graph.users[i])]
        blocks.append(
            Node(
                first.name
                if len(members) == 1
                else f"{keys[members[0]] or first.name}[{first.name}..{last.name}]",
                math.fsum(graph.nodes[i].cost for i in members),
                sum(graph.nodes[i].bytes for i in held),
                tuple(sorted({block_of[d] for i in members for d in graph.nodes[i].deps} - {b})),
                tuple(op for i in members for op in graph.nodes[i].ops),
                keys[members[0]],
            )
        )
    steps: list[BackwardStep] = []
    for step in graph.backward:
        mapped = BackwardStep(
            step.name, tuple(sorted({block_of[r] for r in step.reads})), step.cost, step.live_bytes, step.ops
        )
        if steps and (not mapped.reads or not steps[-1].reads or max(mapped.reads) == max(steps[-1].reads)):
            steps[-1] = _merge_steps(steps[-1], mapped)
        else:
            steps.append(mapped)
    return Graph(tuple(blocks), tuple(steps), graph.name)


def _runs(keys: list[str]) -> list[list[int]]:
    """Indices grouped into runs of equal consecutive keys."""
    runs: list[list[int]] = []
    for i, key in enumerate(keys):
        if runs and keys[runs[-1][0]] == key:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
