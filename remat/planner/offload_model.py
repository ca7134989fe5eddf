"""The planner's offload model: what a plan that saves, recomputes or offloads each saved tensor costs.

Why a model of its own beside ``remat.planner.cost_model``: recomputation costs compute, offload
costs link time, and link time is free while it hides behind compute. So time is no longer a sum of
op costs: the model keeps a timeline of compute steps (the forward of each stage of a Chain, then
the backward of each, a recomputed stage replaying just before its backward) and charges a step the
longer of its compute and the transfers each direction of the link (``remat.Link``) carries during
it. The formulation follows Rockmate's offload extension (transfers beside the compute steps they
overlap), with each direction of the link one stream of copies in issue order, as one side stream
per direction runs them: a copy spreads over as many steps as it takes.

NOTE [offload model] Steps s = 0 .. 2n-1: step k < n is stage k's forward, step 2n-1-k its
backward (``backward_step(n, k)``). A saved tensor (``Item``) is made in step ``stage``, read by
the forward up to step ``until``, first read by backward in step ``need`` and last in step
``freed``; it is on the device in steps ``stage`` .. ``freed`` unless
- RECOMPUTE (its stage replays alone, single-level checkpointing; only for a tensor internal to its
  stage, first read by the stage's own backward): absent between its forward step and ``need``;
- OFFLOAD (``Move(item, out, back, gone)``): its device-to-host copy is issued at the start of
  step ``out`` (after the step that made it, ``stage < out``) and runs on the d2h stream when the
  copies issued before it are done; the tensor leaves the device after step ``max(gone, until)``:
  the copy and the forward's reads are over. ``gone=None``: the step the copy completes in (the
  compute never waits for it); a given ``gone``: the compute waits at that step's end until the
  copy is done (a stall). Its host-to-device copy is issued at the start of step ``back``
  (``out < back < need``), runs on the h2d stream once the copy out and the copies back issued
  before it are done, and the tensor counts again from step ``back``; step ``need`` starts when
  it is back (a stall where it is late).
Time: the steps run one after another, each its compute c_s (a backward step adds its stage's
forward when the stage is recomputed, a step ``out`` the host's ``per_move`` seconds for each copy
issued in it: the executor's bookkeeping per tensor moved, NOTE [executor cost] in
``remat.planner.cost_model``) after the waits above; the step's time is the end of the
last step, compute plus stalls. Memory of a step: the items on the device in it plus the
backward's gradients (the chain's activation bytes of the stage's output and input). Host bytes:
the sum of the offloaded items (each stays on the host until the end of the step, the most the host
pool can hold). A tensor a recomputed stage reads in its forward, other than its own, cannot move:
the stage's replay keeps a reference to it.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass, field

from remat._errors import RematValueError, message
from remat.host.link import Link
from remat.planner.single_level import chain_segments
from remat.planner.types import Chain, Solution, SolverDecision
from remat.policy import Decision

__all__ = [
    "Item",
    "Move",
    "OffloadCost",
    "OffloadProblem",
    "OffloadSchedule",
    "OffloadSolution",
    "backward_step",
    "evaluate",
    "offload_solution",
]


def backward_step(n: int, stage: int) -> int:
    """The step of stage ``stage``'s backward in a chain of ``n`` stages (NOTE [offload model])."""
    return 2 * n - 1 - stage


@dataclass(frozen=True)
class Item:
    """One saved tensor (a trace storage, ``root``) as NOTE [offload model] sees it: its steps,
    its bytes, the stages other than its own whose forward reads it (``readers``), whether it is
    dropped when its stage is recomputed, and the trace ops that make it."""

    name: str
    root: int
    nbytes: int
    stage: int
    until: int
    need: int
    freed: int
    readers: frozenset[int] = frozenset()
    recomputable: bool = False
    ops: tuple[int, ...] = ()
    pinned: bool = False

    @property
    def movable(self) -> bool:
        """Not ``pinned`` (a recomputed region's replay reads it), and a copy out (after the step
        that made it) and back (before ``need``) fit in between."""
        return not self.pinned and self.need - self.stage >= 3


@dataclass(frozen=True)
class OffloadProblem:
    """A chain's stages (costs in seconds), its saved tensors, the link and the host budget;
    ``bounds`` are the first and last trace op of each step, for a problem made of a trace;
    ``per_move`` the host's seconds per tensor moved besides the copy (NOTE [offload model])."""

    chain: Chain
    items: tuple[Item, ...]
    link: Link
    host_budget: int | None = None
    bounds: tuple[tuple[int, int], ...] = ()
    per_move: float = 0.0

    @property
    def steps(self) -> int:
        return 2 * len(self.chain)

    @property
    def base_cost(self) -> float:
        return self.chain.base_cost

    def compute(self, s: int) -> float:
        """Step ``s``'s compute with nothing recomputed."""
        n = len(self.chain)
        stage = self.chain.stages[s] if s < n else self.chain.stages[2 * n - 1 - s]
        return stage.forward_cost if s < n else stage.backward_cost

    def gradients(self, s: int) -> int:
        """Bytes of the gradients alive in backward step ``s``: of the stage's output and input."""
        n, act = len(self.chain), self.chain.activation_bytes
        if s < n:
            return 0
        k = 2 * n - 1 - s
        return act[k + 1] + (act[k] if k > 0 else 0)

    @functools.cached_property
    def computes(self) -> tuple[float, ...]:
        """Every step's ``compute``."""
        return tuple(self.compute(s) for s in range(self.steps))

    @functools.cached_property
    def held(self) -> tuple[int, ...]:
        """Every step's memory with nothing recomputed or moved: its items and gradients."""
        delta = [0] * (self.steps + 1)
        for s in range(len(self.chain), self.steps):
            delta[s] += self.gradients(s)
            delta[s + 1] -= self.gradients(s)
        for item in self.items:
            delta[item.stage] += item.nbytes
            delta[item.freed + 1] -= item.nbytes
        return tuple(itertools.accumulate(delta[:-1]))

    def step_name(self, s: int) -> str:
        n = len(self.chain)
        if s < n:
            return f"forward of {self.chain.stages[s].name}"
        return f"backward of {self.chain.stages[2 * n - 1 - s].name}"


@dataclass(frozen=True)
class Move:
    """Item ``item``'s copy to the host is issued in step ``out``, its copy back in step ``back``;
    it leaves the device after step ``gone`` (None: the step its copy completes in), NOTE
    [offload model]."""

    item: int
    out: int
    back: int
    gone: int | None = None


@dataclass(frozen=True)
class OffloadSchedule:
    """A three-way plan: the stages recomputed (single-level) and the items moved."""

    recompute: frozenset[int] = frozenset()
    moves: tuple[Move, ...] = ()

    def __str__(self) -> str:
        again = " ".join(map(str, sorted(self.recompute))) or "-"
        moved = " ".join(f"{m.item}:{m.out}>{m.back}" for m in self.moves) or "-"
        return f"recompute {again} | offload {moved}"


@dataclass(frozen=True)
class OffloadCost:
    """What a schedule costs under NOTE [offload model]: the peak, where, the time (compute plus
    stalls), the compute alone, the seconds each way, the bytes on the host; per step the bytes on
    the device and when it ends; per moved item the step after which it leaves."""

    peak_bytes: int
    peak_at: str
    total_cost: float
    compute_cost: float
    stall: float
    d2h_seconds: float
    h2d_seconds: float
    host_bytes: int
    memory: tuple[int, ...] = field(repr=False, default=())
    gone: tuple[tuple[int, int], ...] = field(repr=False, default=())
    ends: tuple[float, ...] = field(repr=False, default=())

    def gone_step(self, item: int) -> int:
        """The last step item ``item`` (a moved one) is on the device before it goes."""
        return dict(self.gone)[item]


def _invalid(rule: str, given: object) -> RematValueError:
    return RematValueError(message("plan", rule, given, "fix the schedule (or the solver that made it)"))


def _timeline(
    problem: OffloadProblem, compute: list[float], moves: dict[int, Move]
) -> tuple[list[float], float, dict[int, int]]:
    """The steps' ends, the seconds the compute waited, and the step after which each moved item
    leaves, under NOTE [offload model]'s streams."""
    if not moves:
        return list(itertools.accumulate(compute)), 0.0, {}
    link, items, steps = problem.link, problem.items, problem.steps
    events: dict[int, list[tuple[int, int]]] = {}  # step -> (kind, item): 0 need, 1 out, 2 back, 3 wait
    for i in sorted(moves):
        m = moves[i]
        for s, kind in ((items[i].need, 0), (m.out, 1), (m.back, 2), (m.gone, 3)):
            if s is not None:
                events.setdefault(s, []).append((kind, i))
    out_done: dict[int, float] = {}
    back_done: dict[int, float] = {}
    ends: list[float] = []
    clock = stalled = d2h_free = h2d_free = 0.0
    for s in range(steps):
        mine = sorted(events.get(s, ()))
        for kind, i in mine:
            if kind == 0 and back_done[i] > clock:
                stalled += back_done[i] - clock
                clock = back_done[i]
            elif kind == 1:
                d2h_free = out_done[i] = max(clock, d2h_free) + link.d2h_seconds(items[i].nbytes)
            elif kind == 2:
                begin = max(clock, h2d_free, out_done[i])
                h2d_free = back_done[i] = begin + link.h2d_seconds(items[i].nbytes)
        clock += compute[s]
        for kind, i in mine:
            if kind == 3 and out_done[i] > clock:
                stalled += out_done[i] - clock
                clock = out_done[i]
        ends.append(clock)
    gone = {}
    for i, m in moves.items():
        if m.gone is None:
            s = bisect.bisect_left(ends, out_done[i], lo=m.out)
            gone[i] = max(min(s, steps - 1), items[i].until)
        else:
            gone[i] = max(m.gone, items[i].until)
    return ends, stalled, gone


def evaluate(problem: OffloadProblem, schedule: OffloadSchedule) -> OffloadCost:
    """Evaluate ``schedule`` on ``problem`` under NOTE [offload model]."""
    n, steps = len(problem.chain), problem.steps
    if any(not 0 <= k < n - 1 for k in schedule.recompute):
        raise _invalid("a recomputed stage is a stage of the chain but the last", sorted(schedule.recompute))
    compute = list(problem.computes)
    for k in schedule.recompute:
        compute[backward_step(n, k)] += problem.chain.stages[k].forward_cost
    moved: dict[int, Move] = {}
    for m in schedule.moves:
        if not 0 <= m.item < len(problem.items) or m.item in moved:
            raise _invalid("a move names each item once", m)
        item = problem.items[m.item]
        if not item.movable or not item.stage < m.out < m.back < item.need:
            raise _invalid("an item goes out after the step that made it and back before its need", m)
        if m.gone is not None and not m.out <= m.gone < m.back:
            raise _invalid("an item goes after its copy out is issued and before its copy back", m)
        if item.stage in schedule.recompute and item.recomputable or item.readers & schedule.recompute:
            raise _invalid("an item that a recomputed stage drops or reads stays on the device", m)
        moved[m.item] = m
        compute[m.out] += problem.per_move
    ends, stall, gone = _timeline(problem, compute, moved)
    # memory: the plain step's, less each item's span off the device (recomputed, or between its
    # leaving and its copy back), as differences
    delta = [0] * (steps + 1)
    for i, item in enumerate(problem.items):
        if item.recomputable and item.stage in schedule.recompute:
            away = (item.until + 1, item.need)
        elif i in moved:
            away = (gone[i] + 1, moved[i].back)
        else:
            continue
        if away[0] < away[1]:
            delta[away[0]] -= item.nbytes
            delta[away[1]] += item.nbytes
    memory = [a + b for a, b in zip(problem.held, itertools.accumulate(delta[:-1]), strict=True)]
    peak = max(memory)
    host = sum(problem.items[i].nbytes for i in moved)
    return OffloadCost(
        peak,
        problem.step_name(memory.index(peak)),
        math.fsum(compute) + stall,
        math.fsum(compute),
        stall,
        math.fsum(problem.link.d2h_seconds(problem.items[i].nbytes) for i in moved),
        math.fsum(problem.link.h2d_seconds(problem.items[i].nbytes) for i in moved),
        host,
        tuple(memory),
        tuple(sorted(gone.items())),
        tuple(ends),
    )


@dataclass(frozen=True)
class OffloadSolution(Solution):
    """A Solution of an OffloadProblem: ``schedule`` is its recomputation (a ChainSchedule of
    single-stage segments), ``offload`` the whole three-way schedule and ``cost`` its figures."""

    offload: OffloadSchedule = OffloadSchedule()
    cost: OffloadCost | None = None


def offload_solution(
    problem: OffloadProblem,
    schedule: OffloadSchedule,
    solver: str,
    budget: int,
    gap: float | None,
    notes: str = "",
) -> OffloadSolution:
    """The Solution for ``schedule``: its figures under NOTE [offload model] and one decision per
    item: SAVE, RECOMPUTE or OFFLOAD."""
    cost = evaluate(problem, schedule)
    moved = {m.item: m for m in schedule.moves}
    decisions = []
    for i, item in enumerate(problem.items):
        if i in moved:
            m = moved[i]
            action = Decision.OFFLOAD
            reason = f"to host in {problem.step_name(m.out)}, back in {problem.step_name(m.back)}"
        elif item.recomputable and item.stage in schedule.recompute:
            action, reason = Decision.RECOMPUTE, "its stage replays before its backward"
        else:
            action, reason = Decision.SAVE, "kept on the device"
        decisions.append(SolverDecision(i, item.name, action, reason, item.ops))
    base = problem.base_cost
    segments = [(k, k + 1) for k in sorted(schedule.recompute)]
    return OffloadSolution(
        solver,
        budget,
        cost.peak_bytes,
        cost.total_cost / base if base > 0 else 1.0,
        base,
        cost.total_cost,
        cost.peak_at,
        tuple(decisions),
        chain_segments(problem.chain, segments),
        gap,
        notes,
        offload=schedule,
        cost=cost,
    )
