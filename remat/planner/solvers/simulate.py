"""The cost and memory model every solver is judged by: simulate a schedule, get its peak and cost.

Why one simulator: a solver's own arithmetic (a DP's memory table, an MILP's accounting rows) is
where bugs hide. Every Solution's figures come from simulating the schedule the solver returned,
and the tests compare each solver with brute force run through this same simulator. The
single-level schedules an executor can run with plain checkpointing (``chain_segments``,
``graph_from_saved``) are built here too, so that heuristics and brute force share them.

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

NOTE [graph model] (Checkmate's, with the backward order fixed). Stage t < n computes forward node t
and may first recompute earlier nodes; stage n + j may recompute any forward nodes, then runs
backward step j, which needs its ``reads`` in memory and holds ``live_bytes`` throughout the stage.
A stage starts with what the previous one left alive; it computes its nodes in index order, each
needing its deps present, and names the values it drops (those alive at its start or computed in
it that are not alive at the next stage's start). A dropped value is freed right after its last
use in the stage (its last computing consumer, or the backward step), one never used in the stage
when the stage ends. A node alive at a stage's start is never computed again in it. Memory is
sampled after each computation (before the frees it allows) and at the backward step; the peak is
the largest sample. Cost is the sum of the costs of all computations and backward steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Container, Iterable
from typing import NamedTuple

from remat._errors import RematValueError, message
from remat.planner.problem import (
    Action,
    Chain,
    ChainOp,
    ChainSchedule,
    ChainStep,
    Decision,
    Graph,
    GraphSchedule,
    GraphStage,
    Problem,
    Schedule,
    Solution,
)

__all__ = [
    "Simulation",
    "chain_segments",
    "closure",
    "graph_from_saved",
    "graph_stage",
    "lower_bound",
    "simulate",
    "solution",
]


class Simulation(NamedTuple):
    """What a schedule costs: its peak bytes and where it is first reached, its total compute, and
    how many times each stage (chain) or forward node (graph) ran its forward."""

    peak_bytes: int
    peak_at: str
    total_cost: float
    runs: tuple[int, ...]


def _invalid(rule: str, given: object) -> RematValueError:
    return RematValueError(message("plan", rule, given, "fix the schedule (or the solver that made it)"))


def simulate(problem: Problem, schedule: Schedule) -> Simulation:
    """Run ``schedule`` on ``problem`` under NOTE [chain model] or NOTE [graph model]."""
    if isinstance(problem, Chain) and isinstance(schedule, ChainSchedule):
        return _simulate_chain(problem, schedule)
    if isinstance(problem, Graph) and isinstance(schedule, GraphSchedule):
        return _simulate_graph(problem, schedule)
    raise _invalid(
        "a schedule must match its problem", f"{type(schedule).__name__} for {type(problem).__name__}"
    )


def _simulate_chain(chain: Chain, schedule: ChainSchedule) -> Simulation:
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
    return Simulation(peak, peak_at, math.fsum(cost), tuple(runs))


def graph_stage(graph: Graph, t: int, live: Container[int], held: int, stage: GraphStage) -> tuple[int, str]:
    """Peak bytes of stage ``t`` starting with ``live`` in memory (``held`` bytes), and where."""
    n = len(graph.nodes)
    step = graph.backward[t - n] if t >= n else None
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
        for d in graph.nodes[k].deps:
            last[d] = pos
    for r in step.reads if step is not None else ():
        last[r] = len(compute)
    gone: set[int] = set()
    made.clear()
    mem = (step.live_bytes if step is not None else 0) + held
    peak, where = -1, ""
    for pos, k in enumerate(compute):
        node = graph.nodes[k]
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
                mem -= graph.nodes[i].bytes
    if step is not None:
        if any(r in gone or (r not in live and r not in made) for r in step.reads):
            raise _invalid(
                "a backward step runs with its reads in memory", f"step {t - n} reads {step.reads}"
            )
        if mem > peak:
            peak, where = mem, f"backward step {t - n} ({step.name})"
    return peak, where


def _simulate_graph(graph: Graph, schedule: GraphSchedule) -> Simulation:
    n = len(graph.nodes)
    if len(schedule.stages) != n + len(graph.backward):
        raise _invalid("a graph schedule has one stage per node and backward step", f"{len(schedule.stages)}")
    live: set[int] = set()
    held = 0
    peak, peak_at = 0, "start"
    runs = [0] * n
    for t, stage in enumerate(schedule.stages):
        mem, where = graph_stage(graph, t, live, held, stage)
        if mem > peak:
            peak, peak_at = mem, where
        for k in stage.compute:
            runs[k] += 1
        live.update(stage.compute)
        live.difference_update(stage.drop)
        held += sum(graph.nodes[k].bytes for k in stage.compute) - sum(
            graph.nodes[k].bytes for k in stage.drop
        )
    cost = math.fsum([graph.nodes[k].cost * r for k, r in enumerate(runs)] + [s.cost for s in graph.backward])
    return Simulation(peak, peak_at, cost, tuple(runs))


# -- single-level schedules (what plain checkpointing runs) --------------------------------------


def chain_segments(chain: Chain, segments: Iterable[tuple[int, int]]) -> ChainSchedule:
    """Checkpointing of the stage ranges ``[start, end)`` in ``segments`` (disjoint): each runs
    without grad keeping only its input, and again with grad just before its backward; every other
    stage runs once with grad (``remat.checkpoint_sequential``'s schedule). The last stage always
    runs with grad: its backward comes first, so a checkpoint there would be recomputed at once."""
    last = len(chain) - 1
    starts = {s: min(e, last) for s, e in segments if min(e, last) > s}
    forward: list[ChainStep] = []
    backward: list[ChainStep] = []
    k = 0
    while k < len(chain):
        end = starts.get(k, k)
        if end > k:
            forward += [ChainStep(ChainOp.F_CHECK, k)] + [
                ChainStep(ChainOp.F_NOGRAD, j) for j in range(k + 1, end)
            ]
            again = [ChainStep(ChainOp.F_ALL, j) for j in range(k, end)]
            backward = again + [ChainStep(ChainOp.BACKWARD, j) for j in reversed(range(k, end))] + backward
            k = end
        else:
            forward.append(ChainStep(ChainOp.F_ALL, k))
            backward.insert(0, ChainStep(ChainOp.BACKWARD, k))
            k += 1
    return ChainSchedule(tuple(forward + backward))


def closure(graph: Graph, targets: Iterable[int], present: Callable[[int], bool]) -> set[int]:
    """The nodes to compute so that ``targets`` exist, given which nodes are ``present``."""
    out: set[int] = set()
    stack = [t for t in targets if not present(t)]
    while stack:
        i = stack[-1]
        if i in out:
            stack.pop()
            continue
        missing = [d for d in graph.nodes[i].deps if not present(d) and d not in out]
        if missing:
            stack += missing
        else:
            out.add(i)
            stack.pop()
    return out


def graph_from_saved(graph: Graph, saved: Collection[int]) -> GraphSchedule:
    """The schedule of an executor that keeps the nodes ``saved`` from the forward pass to their
    last use in backward and recomputes any other value a backward step reads just before it (with
    the ancestors it needs that are not in memory). A recomputed value stays until the last step
    that reads it; everything else is freed after its last use. Linear in the graph's size plus
    the recomputation."""
    n, steps = len(graph.nodes), graph.backward
    kept = set(saved)
    last_read = [-1] * n
    for j, step in enumerate(steps):
        for r in step.reads:
            last_read[r] = j
    last_use: dict[int, int] = {}  # node -> last stage that reads it or recomputes from it
    computes: list[tuple[int, ...]] = []
    drops: list[list[int]] = [[] for _ in range(n + len(steps))]
    cached: set[int] = set()  # recomputed values still to be read by a later step
    for j, step in enumerate(steps):
        made = closure(graph, step.reads, lambda i: i in kept or i in cached)  # noqa: B023 (called now)
        for i in [*step.reads, *(d for c in made for d in graph.nodes[c].deps)]:
            last_use[i] = n + j
        computes.append(tuple(sorted(made)))
        for i in made:
            if last_read[i] > j:
                cached.add(i)
                drops[n + last_read[i]].append(i)  # kept until the last step that reads it
            else:
                drops[n + j].append(i)
        cached.difference_update(i for i in step.reads if last_read[i] == j)
    for i in range(n):
        if i in kept and i in last_use:
            drops[last_use[i]].append(i)
        else:
            drops[max((i, *graph.users[i]))].append(i)
    stages = [GraphStage(((t,) if t < n else computes[t - n]), tuple(sorted(d))) for t, d in enumerate(drops)]
    return GraphSchedule(tuple(stages))


def lower_bound(graph: Graph) -> tuple[int, str]:
    """A peak no schedule can beat, and where: each forward node with its deps, and each backward
    step with its reads and its live bytes."""
    best, where = 0, "start"
    for k, node in enumerate(graph.nodes):
        need = node.bytes + sum(graph.nodes[d].bytes for d in set(node.deps))
        if need > best:
            best, where = need, f"forward {k} ({node.name})"
    for j, step in enumerate(graph.backward):
        need = step.live_bytes + sum(graph.nodes[r].bytes for r in set(step.reads))
        if need > best:
            best, where = need, f"backward step {j} ({step.name})"
    return best, where


# -- the answer ---------------------------------------------------------------------------------


def solution(
    problem: Problem, schedule: Schedule, solver: str, budget: int, gap: float | None, notes: str = ""
) -> Solution:
    """The Solution for ``schedule``: its simulated figures and one decision per stage (chain) or
    per node backward reads (graph): SAVE when its forward ran once, RECOMPUTE otherwise."""
    sim = simulate(problem, schedule)
    base = problem.base_cost
    if isinstance(problem, Chain):
        assert isinstance(schedule, ChainSchedule)
        decisions = _chain_decisions(problem, schedule, sim.runs)
    else:
        decisions = tuple(
            Decision(
                i,
                problem.nodes[i].name,
                *_verdict(sim.runs[i], "kept from its forward"),
                problem.nodes[i].ops,
            )
            for i in problem.saved
        )
    overhead = sim.total_cost / base if base > 0 else 1.0
    return Solution(
        solver,
        budget,
        sim.peak_bytes,
        overhead,
        base,
        sim.total_cost,
        sim.peak_at,
        decisions,
        schedule,
        gap,
        notes,
    )


def _verdict(runs: int, saved: str) -> tuple[Action, str]:
    if runs == 1:
        return Action.SAVE, f"computed once, {saved}"
    return Action.RECOMPUTE, f"computed {runs} times"


def _chain_decisions(chain: Chain, schedule: ChainSchedule, runs: tuple[int, ...]) -> tuple[Decision, ...]:
    first: dict[int, ChainOp] = {}
    for step in schedule.steps:
        first.setdefault(step.stage, step.op)
    out = []
    for k, stage in enumerate(chain.stages):
        action, reason = _verdict(runs[k], "with grad")
        if first[k] is ChainOp.F_CHECK:
            reason += ", input kept as a checkpoint"
        out.append(Decision(k, stage.name, action, reason, stage.ops))
    return tuple(out)
