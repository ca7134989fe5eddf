"""How ``remat.plan`` weighs offload: three-way solver answers as plans of the captured step.

Why apart from ``remat.planner.search``: a three-way answer is a recomputation plan (single-stage
regions, as ``search`` makes them) plus storages that leave the device and come back, and its time
has a part no op costs: the stalls where the link is slower than the compute it hides behind. This
module maps an ``OffloadSolution`` onto the step: its regions, and each moved storage's op after
which it leaves and the op before which it is back, as the executor moves them
(``remat.planner.offload_timing``, NOTE [moves on the step]); it predicts
the step with both (``predict(..., moved=...)``), adds the solver's stalls, and lowers the solver's
budget while the step's peak is over the budget, as ``search`` does. The candidates go beside the
recompute-only ones, so the plan picked is never predicted slower than recomputation alone.

They are found once for every budget (``offload_frontier``, NOTE [monotone plans]): the search runs
down a ladder of step budgets that depends on the step and the link only, from the plain peak to the
least peak it reaches, and a budget picks the cheapest candidate that fits; so more budget never
gives a costlier three-way plan either.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from remat._errors import RematTypeError, RematValueError, message
from remat._units import parse_bytes
from remat.host.link import Link
from remat.planner.frontier import Frontier, pareto
from remat.planner.offload_lowering import offload_problem
from remat.planner.offload_model import (
    OffloadProblem,
    OffloadSchedule,
    OffloadSolution,
    evaluate,
)
from remat.planner.offload_timing import moves_on_step
from remat.planner.predict import predict
from remat.planner.regions import TensorDecision
from remat.planner.search import Candidate, Step, chain_regions, untied
from remat.planner.single_level import chain_segments
from remat.planner.solvers import get
from remat.policy import Decision

__all__ = [
    "OffloadCandidate",
    "check_host",
    "mark",
    "offload_arguments",
    "offload_frontier",
    "offload_search",
    "on_top",
]

_ATTEMPTS = 6
# ``solver="auto"`` tries the three-way MILP up to this many binaries (three per movable tensor and
# step it may move in, NOTE [offload MILP]): HiGHS takes about 0.5 s on a tiny BERT's 49 movable
# tensors in 18 steps (1,260 binaries), 2-3 s on a tiny GPT-2's 50 in 46 (3,063), and stops at the
# time limit on a tiny BiLSTM's 255 in 26 (9,162)
_MILP_COLUMNS = 4000
_AUTO_TIME_LIMIT = 2.0  # seconds per MILP solve when ``solver="auto"`` tries it
_ON_TOP = 4  # recompute-only plans ``solver="auto"`` adds offload to (``on_top``)
# the ladder of step budgets ``offload_frontier`` searches at, beside recomputation's peaks: rungs
# at least 1/_RUNGS of the span from the plain peak to recomputation's least peak apart, at most
# _MAX_RUNGS of them
_RUNGS = 12
_MAX_RUNGS = 36
_MILP_RUNGS = 3  # rungs the MILP runs at (the greedy rule alone at the others): each solve takes seconds


@dataclass(frozen=True)
class OffloadCandidate(Candidate):
    """A three-way plan checked on the step: its moved storages (root, gone after op, back before
    op), why each moves, the bytes it puts on the host and the stalls it predicts (seconds)."""

    moved: tuple[tuple[int, int, int], ...] = ()
    reasons: tuple[tuple[int, str], ...] = ()
    host_bytes: int = 0
    stall: float = 0.0


def offload_arguments(solver: str, three_way: bool, link: object, host_budget: object) -> int | None:
    """Check ``remat.plan``'s offload arguments; the host budget in bytes (None: unlimited)."""
    if link is not None and not isinstance(link, Link):
        raise RematTypeError(
            message(
                "plan",
                "link must be a remat.Link",
                f"got {type(link).__name__} {link!r}",
                'pass link=remat.Link(d2h="25GB/s", h2d="25GB/s")',
            )
        )
    if link is None and (three_way or host_budget is not None):
        given = f"solver={solver!r}" if three_way else f"host_budget={host_budget!r}"
        raise RematValueError(
            message(
                "plan", "offload needs a link model", f"{given} without link", "pass link=remat.Link(...)"
            )
        )
    if link is not None and not three_way and solver != "auto":  # its frontier has no moves to add
        raise RematValueError(
            message(
                "plan",
                f"solver {solver!r} plans recomputation only, with no moves over a link",
                f"solver={solver!r} with link={link!r}",
                "pass solver='auto', 'offload_greedy' or 'offload_milp' with link, or drop link",
            )
        )
    return None if host_budget is None else parse_bytes(host_budget, api="plan")


def checked(
    step: Step, problem: OffloadProblem, solution: OffloadSolution, base: Candidate | None = None
) -> OffloadCandidate:
    """A three-way answer as regions and moves of the step, with the step's predicted figures;
    on top of the regions of ``base`` when given (``on_top``)."""
    trace, chain, schedule, cost = step.trace, problem.chain, solution.offload, solution.cost
    assert cost is not None
    segments = [(k, k + 1) for k in sorted(schedule.recompute)]
    regions = chain_regions(step, chain, chain_segments(chain, segments))
    if base is not None:
        regions = base.regions + regions
    planned, reasons = [], []
    for m in schedule.moves:
        it = problem.items[m.item]
        planned.append((it.root, problem.bounds[cost.gone_step(m.item)][1]))
        why = (
            f"{solution.solver}: to host in {problem.step_name(m.out)}, back in "
            f"{problem.step_name(m.back)} for {problem.step_name(it.need)}"
        )
        reasons.append((it.root, why))
    moved = moves_on_step(step, planned)  # as the executor moves them (NOTE [moves on the step])
    host = sum(trace.tensors[r].nbytes for r, _, _ in moved)  # the planned op's other outputs too
    chosen = {r for r, _ in planned}
    with_op = f"{solution.solver}: to host in forward of its op, with the output moved; back when read"
    reasons += [(r, with_op) for r, _, _ in moved if r not in chosen]
    pred = predict(trace, [r for _, r in regions], [r.name for r, _ in regions], moved, step.executor)
    pred = dataclasses.replace(pred, stall_cost=cost.stall)
    notes = solution.notes if base is None else f"{solution.notes}, on top of {base.solver}: {base.notes}"
    return OffloadCandidate(
        solution.solver,
        solution.gap,
        notes,
        regions,
        pred,
        tuple(moved),
        tuple(reasons),
        host,
        cost.stall,
    )


def offload_search(
    step: Step,
    problem: OffloadProblem,
    budget: int,
    baseline: int,
    solver: str,
    options: dict[str, Any],
    recomputing: Sequence[Candidate] = (),
    exact: bool = True,
) -> list[Candidate]:
    """The three-way plans of ``solver`` (for ``"auto"``: the greedy rule, and the MILP up to
    ``_MILP_COLUMNS`` binaries; without ``exact``, the greedy rule alone), then ``on_top`` of the
    recompute-only plans ``recomputing``, each solver's budget lowered by what the step's peak was
    over ``budget`` until one fits (see the module doc)."""
    if not exact:
        solvers = ["offload_greedy"]
    elif solver == "auto":
        size = sum(3 * max(0, it.need - it.stage - 2) for it in problem.items if it.movable)
        solvers = ["offload_greedy"] + (["offload_milp"] if size <= _MILP_COLUMNS else [])
        options = {"time_limit": _AUTO_TIME_LIMIT, **options}
    else:
        solvers = [solver]
    top = evaluate(problem, OffloadSchedule()).peak_bytes
    out: list[Candidate] = []
    for name in solvers:
        target = budget - (baseline - top)
        for _ in range(_ATTEMPTS):
            if target <= 0:
                break
            try:
                mine = options if name == "offload_milp" or solver == name else {}
                solution = get(name).solve(problem, target, **mine)
            except RematValueError:
                break
            assert isinstance(solution, OffloadSolution)
            made = checked(step, problem, solution)
            if not _on_host(made, problem):
                break
            out.append(made)
            if out[-1].pred.peak_bytes <= budget:
                break
            target -= max(out[-1].pred.peak_bytes - budget, budget // 100)
    out += on_top(step, problem, budget, recomputing)
    return out


def on_top(
    step: Step, problem: OffloadProblem, budget: int, recomputing: Sequence[Candidate]
) -> list[Candidate]:
    """Offload added to recompute-only plans cheaper than any that fits (up to ``_ON_TOP`` of
    them, spread over their overheads): what they recompute leaves the problem, what their replays
    read stays on the device (``Item.pinned``), and the greedy rule offloads, without recomputing,
    until the step fits. So multi-stage regions (a chain DP's, plain checkpointing's), which the
    three-way solvers' single-stage recomputation cannot make, meet offload too. The stalls are
    reckoned without the replays' compute to hide behind (an upper bound)."""
    trace = step.trace
    fitting = [c.pred.overhead for c in recomputing if c.pred.peak_bytes <= budget]
    bar = min(fitting, default=math.inf)
    cheaper = sorted((c for c in recomputing if c.pred.overhead < bar), key=lambda c: c.pred.overhead)
    picks = cheaper[:: max(1, math.ceil(len(cheaper) / _ON_TOP))]
    out: list[Candidate] = []
    for base in picks:
        dropped = set().union(*base.pred.recomputed)
        read = {trace.root(t) for _, ops in base.regions for i in ops.ops for t in trace.ops[i].inputs}
        items = tuple(
            dataclasses.replace(it, pinned=it.pinned or it.root in read)
            for it in problem.items
            if it.root not in dropped
        )
        sub = dataclasses.replace(problem, items=items)
        target = budget - (base.pred.peak_bytes - evaluate(sub, OffloadSchedule()).peak_bytes)
        for _ in range(_ATTEMPTS):
            if target <= 0:
                break
            try:
                solution = get("offload_greedy").solve(sub, target, recompute=False)
            except RematValueError:
                break
            assert isinstance(solution, OffloadSolution)
            made = checked(step, sub, solution, base)
            if not _on_host(made, problem):
                break
            out.append(made)
            if out[-1].pred.peak_bytes <= budget:
                break
            target -= max(out[-1].pred.peak_bytes - budget, budget // 100)
    return out


def _on_host(candidate: OffloadCandidate, problem: OffloadProblem) -> bool:
    """Whether what ``candidate`` moves fits the host budget, counting the outputs the executor
    moves beside the planned ones (NOTE [moves on the step]), which the solver does not."""
    return problem.host_budget is None or candidate.host_bytes <= problem.host_budget


def check_host(
    step: Step, problem: OffloadProblem, budget: int, baseline: int, solver: str, options: dict[str, Any]
) -> None:
    """When no plan fits: raise that the host budget is too small if, without it, one would."""
    if problem.host_budget is None:
        return
    free = dataclasses.replace(problem, host_budget=None)
    fits = [
        c
        for c in offload_search(step, free, budget, baseline, solver, options)
        if c.pred.peak_bytes <= budget
    ]
    if fits:
        need = min(c.host_bytes for c in fits if isinstance(c, OffloadCandidate))
        raise RematValueError(
            message(
                "plan",
                "host_budget too small for this budget: no plan fits the device within it",
                f"host_budget {problem.host_budget} bytes; a plan fits with {need} bytes on the host",
                f"raise host_budget to at least {need} bytes, or the budget",
            )
        )


def mark(
    step: Step, tensors: tuple[TensorDecision, ...], chosen: OffloadCandidate
) -> tuple[TensorDecision, ...]:
    """``tensors`` (as ``search.decisions`` lists them: one per saved storage a forward op of the
    model made, by storage) with the moved ones OFFLOAD."""
    trace = step.trace
    made = {r for op in step.forward for r in op.outputs}
    roots = [r for r in sorted(trace.saved_roots) if not trace.tensors[r].constant and r in made]
    why = dict(chosen.reasons)
    return tuple(
        dataclasses.replace(t, action=Decision.OFFLOAD, reason=why[r]) if r in why else t
        for r, t in zip(roots, tensors, strict=True)
    )


def offload_frontier(
    found: Frontier,
    link: Link,
    host_budget: int | None = None,
    solver: str | None = None,
    options: dict[str, Any] | None = None,
) -> Frontier:
    """``found`` with the three-way plans of ``solver`` (default ``found``'s own) over ``link``
    among its candidates, for every budget at once (see the module doc): ``offload_search`` at the
    peak of each recompute-only candidate (the three-way plan at equal device peak) and at rungs a
    stride apart from the plain peak down, each below the least peak that fit the rung before,
    going on below recomputation's least peak until the search finds no plan that fits (the MILP
    at ``_MILP_RUNGS`` of them, spread out)."""
    start = time.perf_counter()
    step, baseline = found.step, found.baseline
    problem = offload_problem(step.trace, link, host_budget=host_budget, key=step.key)
    problem = dataclasses.replace(problem, per_move=step.executor.offload)
    least = min((c.pred.peak_bytes for c in found.candidates), default=baseline)
    stride = max(1, (baseline - least) // _RUNGS)
    peaks = sorted(
        {c.pred.peak_bytes for c in found.candidates if c.pred.peak_bytes < baseline}, reverse=True
    )
    every = max(1, math.ceil((_RUNGS + len(peaks)) / _MILP_RUNGS))  # the MILP's rungs: one in ``every``
    tried = list(found.candidates)
    budget, rung = baseline - stride, 0
    for _ in range(_MAX_RUNGS):
        while peaks and peaks[0] > budget:  # a recompute-only peak above this rung: search it first
            _rung(step, problem, peaks.pop(0), found, solver, options, rung % every == 0, tried)
            rung += 1
        lowest = _rung(step, problem, budget, found, solver, options, rung % every == 0, tried)
        rung += 1
        if lowest is None:
            break
        budget = min(lowest - 1, budget - stride)
    for peak in peaks:  # those below the last rung
        _rung(step, problem, peak, found, solver, options, False, tried)
    return dataclasses.replace(
        found,
        candidates=tuple(pareto(untied(tried))),
        seconds=found.seconds + time.perf_counter() - start,
        link=link,
        host_budget=host_budget,
    )


def _rung(
    step: Step,
    problem: OffloadProblem,
    budget: int,
    found: Frontier,
    solver: str | None,
    options: dict[str, Any] | None,
    exact: bool,
    tried: list[Candidate],
) -> int | None:
    """Add to ``tried`` the plans ``offload_search`` makes at ``budget`` (``exact``: with the
    MILP); the least peak of those that fit it (None: none does)."""
    name, given = solver or found.solver, options or {}
    made = offload_search(step, problem, budget, found.baseline, name, given, found.candidates, exact)
    tried += made
    return min((c.pred.peak_bytes for c in made if c.pred.peak_bytes <= budget), default=None)
