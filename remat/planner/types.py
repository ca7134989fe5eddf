"""The planner's data: the problems solvers read (a Chain or a Dag), their schedules, the Solution.

Why a problem type apart from the Trace: a solver should not care how its input was made (a
capture, a hand-written benchmark chain, a coarsened DAG), and a test should state a five-stage
chain in one line. There are two shapes because the exact solvers need different ones: rotor's
dynamic program works on a chain of stages (forward cost, backward cost, output bytes, saved bytes),
Checkmate's MILP on a DAG of forward nodes with the backward pass as a fixed sequence of steps that
read saved forward values. What a schedule costs and how much memory it holds is defined once, by
``remat.planner.cost_model`` (NOTE [chain model], NOTE [DAG model]): one rule for every solver.

A Solution answers one question per stage (chain) or saved forward node (DAG): SAVE or RECOMPUTE
(``solution.action(k)``, a ``remat.policy.Decision``), and carries the full schedule for executors
that run multi-level plans. ``remat.planner.lowering`` builds problems from a captured step.
"""

from __future__ import annotations

import enum
import functools
import math
import re
from dataclasses import dataclass
from numbers import Integral, Real
from typing import NamedTuple

from remat._errors import RematValueError, message
from remat._units import format_bytes
from remat.policy import Decision

__all__ = [
    "BackwardStep",
    "Chain",
    "ChainOp",
    "ChainSchedule",
    "ChainStep",
    "Dag",
    "DagSchedule",
    "DagStage",
    "Node",
    "Problem",
    "Schedule",
    "Solution",
    "SolverDecision",
    "Stage",
]


def _check(ok: bool, rule: str, given: object, todo: str) -> None:
    if not ok:
        raise RematValueError(message("plan", rule, given, todo))


def _check_amounts(what: str, cost: float, *sizes: int) -> None:
    finite = isinstance(cost, Real) and not isinstance(cost, bool) and math.isfinite(cost) and cost >= 0
    _check(finite, "costs must be finite and non-negative", f"{what}: {cost}", "fix the cost")
    whole = all(isinstance(s, Integral) and s >= 0 for s in sizes)
    _check(whole, "byte counts must be non-negative", f"{what}: {sizes}", "fix the sizes")


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
            _check_amounts(f"stage {k}", s.forward_cost, s.output_bytes, s.saved_bytes)  # each cost apart:
            _check_amounts(f"stage {k}'s backward", s.backward_cost)  # -1 and 1 summed to a free stage

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


# -- the DAG ------------------------------------------------------------------------------------


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
class Dag:
    """A DAG of forward nodes in topological order (``deps`` point to lower indices), then the
    backward steps in the order they run (the Checkmate model with a fixed backward order)."""

    nodes: tuple[Node, ...]
    backward: tuple[BackwardStep, ...]
    name: str = ""

    def __post_init__(self) -> None:
        _check(len(self.nodes) > 0, "a DAG needs at least one forward node", "got 0", "pass one Node per op")
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
                "index reads into Dag.nodes",
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
            f"Dag({self.name or 'unnamed'}: {len(self.nodes)} forward nodes, {edges} edges, "
            f"{len(self.backward)} backward steps, {len(self.saved)} saved for backward)"
        )


Problem = Chain | Dag


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
class DagStage:
    """One stage of a DAG schedule: the forward nodes computed in it (in index order) and the
    values it drops, those alive in it that are not alive at the next stage's start (Checkmate's
    R[t] and S[t] minus S[t+1], stored as a change so that a schedule stays linear in size)."""

    compute: tuple[int, ...]
    drop: tuple[int, ...]


@dataclass(frozen=True)
class DagSchedule:
    """Stage t < n computes forward node t (and may recompute earlier ones); stage n + j
    recomputes what backward step j needs, then runs it."""

    stages: tuple[DagStage, ...]

    def __str__(self) -> str:
        return "; ".join(
            f"{' '.join(map(str, s.compute)) or '-'} | drop {' '.join(map(str, s.drop)) or '-'}"
            for s in self.stages
        )


Schedule = ChainSchedule | DagSchedule


# -- the answer ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SolverDecision:
    """A solver's decision for stage or node ``index``, and why; ``ops`` are its trace ops (empty
    for hand-made problems), so an executor can map a coarsened plan back to the step."""

    index: int
    name: str
    action: Decision
    reason: str
    ops: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.index} {self.name}: {self.action.value} ({self.reason})"


@dataclass(frozen=True)
class Solution:
    """A solver's answer. Figures are the cost model's for ``schedule`` (NOTE [chain model],
    NOTE [DAG model]): ``predicted_peak_bytes`` is the peak of the modelled live bytes (constants
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
    decisions: tuple[SolverDecision, ...]
    schedule: Schedule
    gap: float | None
    notes: str = ""
    solve_seconds: float = 0.0

    def action(self, index: int) -> Decision:
        """SAVE or RECOMPUTE for stage (chain) or saved forward node (DAG) ``index``."""
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
        return tuple(d.index for d in self.decisions if d.action is Decision.RECOMPUTE)

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
