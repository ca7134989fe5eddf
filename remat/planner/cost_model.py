"""The planner's cost model: what a schedule of a Chain or a Dag costs and the peak it holds.

Why one cost model: a solver's own arithmetic (a DP's memory table, an MILP's accounting rows) is
where bugs hide. Every Solution's figures come from evaluating the schedule the solver returned
here (``solution``), and the tests compare each solver with brute force evaluated by this same
model.

How it differs from ``remat.planner.predict``, and why both exist: this model is coarse on purpose
(a stage's internals or a node's bytes as one value, no parameter gradients, no kernels' scratch,
no tape bookkeeping) so that solvers can optimize over it and a schedule evaluates in time linear
in its length; ``predict`` replays the captured step op by op with the executor's semantics, which
is what a user's byte budget is about, but says nothing about schedules a solver has not chosen.
``remat.plan`` solves with this model and checks (and corrects) every plan with ``predict``.

NOTE [chain model] (rotor's model with gradients). Values: a_0 (the input, never freed), a_k+1 (the
output of stage k, ``output_bytes``), x_k (stage k's internals, ``saved_bytes``), d_k (the gradient
of a_k, as large as a_k; d_0 is not made: the input needs no gradient). Actions:
- ``F_n k`` / ``F_ck k``: forward of k without grad; makes a_k+1; ``F_n`` then frees a_k
  (unless k = 0), ``F_ck`` keeps it as a checkpoint.
- ``F_all k``: forward of k with grad; makes a_k+1 and x_k, keeps a_k.
- ``B k``: backward of k, in order n-1 ... 0; needs a_k, x_k and d_k+1 (for k = n-1 it makes d_n,
  the seed); makes d_k; then frees x_k, d_k+1, a_k+1 and a_k (unless k = 0).
Memory is sampled after each action has made its outputs and before it frees anything; the peak
is the largest sample. Cost is the sum of the forward and backward costs of the actions run.

NOTE [DAG model] (Checkmate's, with the backward order fixed). Stage t < n computes forward node t
and may first recompute earlier nodes; stage n + j may recompute any forward nodes, then runs
backward step j, which needs its ``reads`` in memory and holds ``live_bytes`` throughout the stage.
A stage starts with what the previous one left alive; it computes its nodes in index order, each
needing its deps present, and names the values it drops (those alive at its start or computed in
it that are not alive at the next stage's start). A dropped value is freed right after its last
use in the stage (its last computing consumer, or the backward step), one never used in the stage
when the stage ends. A node alive at a stage's start is never computed again in it. Memory is
sampled after each computation (before the frees it allows) and at the backward step; the peak is
the largest sample. Cost is the sum of the costs of all computations and backward steps.

NOTE [executor cost] What running a plan costs beyond its kernels (``ExecutorCost``), which a plan
pays and the plain step does not: the executor's dispatch mode counts and checks every forward op
of the model (``check``), a region's tape records each of its forward ops (``record``, beyond the
check), a replay runs each of its ops from Python (``replay``, beyond the op's own time in the
trace), and each tensor offloaded goes through the saved-tensor hooks and the offloader's
bookkeeping (``offload``, beyond the copy the link model charges). Seconds per op (per tensor),
measured on tiny tensors once per process and device (``remat.planner.executor_cost``); the
step-level prediction (``remat.planner.predict``) charges them per op it counts, so of two plans
that replay the same kernels the one with fewer ops under the executor is the cheaper. The chain
and DAG models above leave them out: the prediction weighs every candidate with them.
"""

from __future__ import annotations

import math
from collections.abc import Container
from dataclasses import dataclass
from typing import NamedTuple

from remat._errors import RematValueError, message
from remat.planner.types import (
    Chain,
    ChainOp,
    ChainSchedule,
    ChainStep,
    Dag,
    DagSchedule,
    DagStage,
    Problem,
    Schedule,
    Solution,
    SolverDecision,
)
from remat.policy import Decision

__all__ = [
    "NO_EXECUTOR_COST",
    "ExecutorCost",
    "ExecutorWork",
    "ScheduleCost",
    "dag_stage",
    "schedule_cost",
    "solution",
]


class ExecutorWork(NamedTuple):
    """What a plan puts through the executor in one step (NOTE [executor cost]): the forward ops
    its dispatch mode checks, those its regions' tapes record, the ops its replays run, and the
    tensors it offloads."""

    checked: int = 0
    recorded: int = 0
    replayed: int = 0
    moved: int = 0

    def __str__(self) -> str:
        return (
            f"{self.checked} forward ops checked, {self.recorded} recorded, {self.replayed} replayed, "
            f"{self.moved} tensors offloaded"
        )


@dataclass(frozen=True)
class ExecutorCost:
    """Seconds the plan executor spends per op beyond the kernels (NOTE [executor cost]): per
    forward op checked, per op recorded on a tape, per op replayed, per tensor offloaded. The
    default, all zero, is the model without the executor (the plain step's own op times only)."""

    check: float = 0.0
    record: float = 0.0
    replay: float = 0.0
    offload: float = 0.0

    def __post_init__(self) -> None:
        figures = (self.check, self.record, self.replay, self.offload)
        if not all(isinstance(f, (int, float)) and math.isfinite(f) and f >= 0 for f in figures):
            raise RematValueError(
                message(
                    "plan",
                    "an executor cost is a finite number of seconds, 0 or more",
                    f"{self!r}",
                    "pass seconds per op, e.g. ExecutorCost(check=2e-6, record=1e-5)",
                )
            )

    def seconds(self, work: ExecutorWork) -> float:
        """The executor's time for ``work``."""
        return math.fsum(
            (
                work.checked * self.check,
                work.recorded * self.record,
                work.replayed * self.replay,
                work.moved * self.offload,
            )
        )

    def __str__(self) -> str:
        return (
            f"executor cost: check {self.check * 1e6:.2f} us, record {self.record * 1e6:.2f} us, "
            f"replay {self.replay * 1e6:.2f} us per op, offload {self.offload * 1e6:.2f} us per tensor"
        )


NO_EXECUTOR_COST = ExecutorCost()
"""The figures of a prediction that leaves the executor out (the plain step's op times only)."""


class ScheduleCost(NamedTuple):
    """What a schedule costs: its peak bytes and where it is first reached, its total compute, and
    how many times each stage (chain) or forward node (DAG) ran its forward."""

    peak_bytes: int
    peak_at: str
    total_cost: float
    runs: tuple[int, ...]


def _invalid(rule: str, given: object) -> RematValueError:
    return RematValueError(message("plan", rule, given, "fix the schedule (or the solver that made it)"))


def schedule_cost(problem: Problem, schedule: Schedule) -> ScheduleCost:
    """Evaluate ``schedule`` on ``problem`` under NOTE [chain model] or NOTE [DAG model]."""
    if isinstance(problem, Chain) and isinstance(schedule, ChainSchedule):
        return _chain_cost(problem, schedule)
    if isinstance(problem, Dag) and isinstance(schedule, DagSchedule):
        return _dag_cost(problem, schedule)
    raise _invalid(
        "a schedule must match its problem", f"{type(schedule).__name__} for {type(problem).__name__}"
    )


def _chain_cost(chain: Chain, schedule: ChainSchedule) -> ScheduleCost:
    n, act = len(chain), chain.activation_bytes
    live: dict[tuple[str, int], int] = {("a", 0): act[0]}
    mem = peak = act[0]
    peak_at = "start"
    runs = [0] * n
    cost: list[float] = []
    next_backward = n - 1

    def make(key: tuple[str, int], size: int, step: ChainStep) -> None:
        nonlocal mem
        if key in live:
            raise _invalid("a step makes a value that is still alive", f"{step} remakes {key[0]}_{key[1]}")
        live[key] = size
        mem += size

    def free(*keys: tuple[str, int]) -> None:
        nonlocal mem
        for key in keys:
            mem -= live.pop(key, 0)

    for step in schedule.steps:
        k = step.stage
        if not 0 <= k < n:
            raise _invalid("a step names a stage of the chain", f"{step} in a chain of {n}")
        stage = chain.stages[k]
        if step.op is ChainOp.BACKWARD:
            needs = [("a", k), ("x", k)] + ([("d", k + 1)] if k < n - 1 else [])
            if k != next_backward or any(v not in live for v in needs):
                raise _invalid("B k runs in order n-1 ... 0 with a_k, x_k and d_k+1 alive", f"{step}")
            if k == n - 1:
                make(("d", n), act[n], step)
            if k > 0:
                make(("d", k), act[k], step)
        else:
            if ("a", k) not in live:
                raise _invalid("a forward step needs its input alive", f"{step} without a_{k}")
            make(("a", k + 1), act[k + 1], step)
            if step.op is ChainOp.F_ALL:
                make(("x", k), stage.saved_bytes, step)
        if mem > peak:
            peak, peak_at = mem, f"{step} ({stage.name})"
        if step.op is ChainOp.BACKWARD:
            free(("x", k), ("d", k + 1), ("a", k + 1), *([("a", k)] if k > 0 else []))
            next_backward -= 1
            cost.append(stage.backward_cost)
        else:
            if step.op is ChainOp.F_NOGRAD and k > 0:
                free(("a", k))
            runs[k] += 1
            cost.append(stage.forward_cost)
    if next_backward != -1:
        raise _invalid("a chain schedule runs every backward step", f"stopped before B {next_backward}")
    return ScheduleCost(peak, peak_at, math.fsum(cost), tuple(runs))


def dag_stage(dag: Dag, t: int, live: Container[int], held: int, stage: DagStage) -> tuple[int, str]:
    """Peak bytes of stage ``t`` starting with ``live`` in memory (``held`` bytes), and where."""
    n = len(dag.nodes)
    step = dag.backward[t - n] if t >= n else None
    compute, drop = stage.compute, set(stage.drop)
    if list(compute) != sorted(set(compute)) or any(not 0 <= k < n for k in compute):
        raise _invalid("a stage computes distinct nodes in index order", f"stage {t}: {compute}")
    if step is None and (t not in compute or compute[-1] != t):
        raise _invalid("forward stage t computes node t and no later node", f"stage {t}: {compute}")
    made = set(compute)
    if any(k in live for k in compute) or any(d not in live and d not in made for d in drop):
        raise _invalid("a stage computes only dead nodes and drops only nodes it has", f"stage {t}: {stage}")
    last: dict[int, int] = {}
    for pos, k in enumerate(compute):
        last[k] = max(last.get(k, -1), pos)
        for d in dag.nodes[k].deps:
            last[d] = pos
    for r in step.reads if step is not None else ():
        last[r] = len(compute)
    gone: set[int] = set()
    made.clear()
    mem = (step.live_bytes if step is not None else 0) + held
    peak, where = -1, ""
    for pos, k in enumerate(compute):
        node = dag.nodes[k]
        if any(d in gone or (d not in live and d not in made) for d in node.deps):
            raise _invalid(
                "a node is computed with its deps in memory", f"stage {t}: node {k} deps {node.deps}"
            )
        made.add(k)
        mem += node.bytes
        if mem > peak:
            kind = "forward" if k == t else "recompute"
            peak, where = (
                mem,
                f"{kind} {k} ({node.name})" + (f" before backward step {t - n}" if step else ""),
            )
        for i in {k, *node.deps}:
            if last[i] == pos and i in drop:
                gone.add(i)
                mem -= dag.nodes[i].bytes
    if step is not None:
        if any(r in gone or (r not in live and r not in made) for r in step.reads):
            raise _invalid(
                "a backward step runs with its reads in memory", f"step {t - n} reads {step.reads}"
            )
        if mem > peak:
            peak, where = mem, f"backward step {t - n} ({step.name})"
    return peak, where


def _dag_cost(dag: Dag, schedule: DagSchedule) -> ScheduleCost:
    n = len(dag.nodes)
    if len(schedule.stages) != n + len(dag.backward):
        raise _invalid("a DAG schedule has one stage per node and backward step", f"{len(schedule.stages)}")
    live: set[int] = set()
    held = 0
    peak, peak_at = 0, "start"
    runs = [0] * n
    for t, stage in enumerate(schedule.stages):
        mem, where = dag_stage(dag, t, live, held, stage)
        if mem > peak:
            peak, peak_at = mem, where
        for k in stage.compute:
            runs[k] += 1
        live.update(stage.compute)
        live.difference_update(stage.drop)
        held += sum(dag.nodes[k].bytes for k in stage.compute) - sum(dag.nodes[k].bytes for k in stage.drop)
    cost = math.fsum([dag.nodes[k].cost * r for k, r in enumerate(runs)] + [s.cost for s in dag.backward])
    return ScheduleCost(peak, peak_at, cost, tuple(runs))


# -- the answer ---------------------------------------------------------------------------------


def solution(
    problem: Problem, schedule: Schedule, solver: str, budget: int, gap: float | None, notes: str = ""
) -> Solution:
    """The Solution for ``schedule``: its figures under this model and one decision per stage
    (chain) or per node backward reads (DAG): SAVE when its forward ran once, RECOMPUTE otherwise."""
    cost = schedule_cost(problem, schedule)
    base = problem.base_cost
    if isinstance(problem, Chain):
        assert isinstance(schedule, ChainSchedule)
        decisions = _chain_decisions(problem, schedule, cost.runs)
    else:
        decisions = tuple(
            SolverDecision(
                i,
                problem.nodes[i].name,
                *_verdict(cost.runs[i], "kept from its forward"),
                problem.nodes[i].ops,
            )
            for i in problem.saved
        )
    overhead = cost.total_cost / base if base > 0 else 1.0
    return Solution(
        solver,
        budget,
        cost.peak_bytes,
        overhead,
        base,
        cost.total_cost,
        cost.peak_at,
        decisions,
        schedule,
        gap,
        notes,
    )


def _verdict(runs: int, saved: str) -> tuple[Decision, str]:
    if runs == 1:
        return Decision.SAVE, f"computed once, {saved}"
    return Decision.RECOMPUTE, f"computed {runs} times"


def _chain_decisions(
    chain: Chain, schedule: ChainSchedule, runs: tuple[int, ...]
) -> tuple[SolverDecision, ...]:
    first: dict[int, ChainOp] = {}
    for step in schedule.steps:
        first.setdefault(step.stage, step.op)
    out = []
    for k, stage in enumerate(chain.stages):
        action, reason = _verdict(runs[k], "with grad")
        if first[k] is ChainOp.F_CHECK:
            reason += ", input kept as a checkpoint"
        out.append(SolverDecision(k, stage.name, action, reason, stage.ops))
    return tuple(out)
