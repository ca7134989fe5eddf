"""Cutting a chain where its stages' plans make the step shortest: ``balance_by="step"``.

Why: balancing by time weighs each stage's compute as if nothing were recomputed, and balancing by
memory each stage's saved bytes as if everything were kept. Once each stage has a plan of its own
(recomputing more where its rank holds more micro-batches), neither cut is the one whose step is
shortest, and the cut balanced by memory may need more than the budget where another cut fits
(AdaPipe, ASPLOS'24, chooses the cut and the recomputation together). Here a cut is weighed as the
pipeline runs it: each stage planned within its rank's budget (``remat.pipeline.choose``) and the
step walked by the pipeline model (``remat.pipeline.timeline.walk``, with the per-action cost); the
cut with the shortest predicted step that fits every rank wins, the first of equal ones.

NOTE [cut search] Every cut is weighed where the chain has at most ``EXHAUSTIVE`` of them;
otherwise a descent from the best of the given cuts (``starts``: as many children per stage, and
the cuts balanced by time and by memory) moves one boundary by one child at a time, to the best
neighbour, while the step gets shorter (a cut no rank's budget refuses before one that some rank's
does; among refused cuts, the one that needs the fewest bytes beyond the budgets). A stage is
traced and planned once per (first child, end, position): a rank's memory depends on its own
stage's plan and on the tensors crossing the stage's two boundaries (NOTE [receive buffers] in
``remat.pipeline.timeline``), so a stage planned for one cut is the same stage in every cut that
has it. Schedules with one stage per rank only (``gpipe``, ``1f1b``): with
several stages on a rank, a stage's plan depends on its rank's other stages, which other cuts
change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import combinations

import torch
from torch import nn

from remat._errors import RematValueError, message
from remat._state import untouched
from remat.pipeline.choose import choose
from remat.pipeline.measure import measure
from remat.pipeline.schedule import Schedule
from remat.pipeline.split import balance, chained, children_of, loose, profile, trainable_from, untied
from remat.pipeline.stage_plan import StagePlan
from remat.pipeline.timeline import ActionCost, _walk
from remat.trace.types import Trace

__all__ = ["EXHAUSTIVE", "Found", "search", "searched"]

# the most cuts weighed one by one; a chain with more is searched by descent (NOTE [cut search])
EXHAUSTIVE = 120

Cut = tuple[int, ...]
Measured = tuple[StagePlan, tuple[Trace, Trace | None]]


@dataclass(frozen=True)
class Found:
    """The cut chosen (its points, first 0, last the number of children), each stage's plan there
    (None where none fits) and what each stage's rank needs at least; ``step_s``, the predicted
    step (inf where some rank's budget refuses the cut); ``weighed``, the cuts weighed."""

    cuts: Cut
    plans: tuple[StagePlan | None, ...]
    needs: tuple[int, ...]
    step_s: float
    weighed: int = field(default=0, compare=False)
    # why a stage of this cut cannot run at all (a stage with nothing to differentiate), or None
    refusal: RematValueError | None = field(default=None, compare=False)


def _cuts(n: int, parts: int, forbidden: frozenset[int]) -> Iterator[Cut]:
    for inner in combinations(range(1, n), parts - 1):
        if forbidden.isdisjoint(inner):
            yield (0, *inner, n)


def _exhaustive(n: int, parts: int) -> bool:
    """Whether every cut of ``n`` children into ``parts`` stages is weighed (NOTE [cut search])."""
    return math.comb(n - 1, parts - 1) <= EXHAUSTIVE


def search(
    children: Sequence[nn.Module],
    order: Schedule,
    example: torch.Tensor,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    budget: int,
    *,
    checkpoint: str,
    op_costs: str,
    rerun_modules: bool,
    per_action: ActionCost,
    starts: Sequence[Cut],
    forbidden: frozenset[int],
) -> Found | None:
    """The cut of ``children`` into ``order``'s stages whose plans give the shortest predicted step
    within ``budget`` per rank (NOTE [cut search]); ``starts``: the cuts a descent starts from;
    ``forbidden``: the children no stage may start with (one that writes its input, or one whose
    parameter an earlier child also holds). None where no cut avoids them. The
    children's buffers and the RNG are left as they were."""
    p, n = order.n_stages, len(children)
    # each child's input on the example, as the stages receive it (a child writing its input writes
    # the one before's output, which no stage starts from: ``forbidden``; never the example)
    inputs = [example.detach().clone()]
    with torch.no_grad(), untouched(children):
        for child in children:
            inputs.append(child(inputs[-1]).detach())
    measured: dict[tuple[int, int, int], Measured] = {}
    planned: dict[tuple[int, int, int], tuple[StagePlan | None, int]] = {}

    refused: dict[tuple[int, int, int], RematValueError] = {}

    def stage(a: int, b: int, s: int) -> Measured:
        if (a, b, s) in refused:
            raise refused[a, b, s]
        if (a, b, s) not in measured:
            try:
                with untouched(children):
                    base, trace, _, later = measure(
                        order, s, nn.Sequential(*children[a:b]), inputs[a], target, loss_fn, op_costs
                    )
            except RematValueError as refusal:
                refused[a, b, s] = refusal
                raise
            measured[a, b, s] = (base, (trace, later))
        return measured[a, b, s]

    def weigh(cut: Cut) -> Found:
        spans = [(cut[s], cut[s + 1], s) for s in range(p)]
        try:
            bases = [stage(*span)[0] for span in spans]
        except RematValueError as refusal:  # weighed after every cut that runs (``rank``)
            return Found(cut, (None,) * p, (2**62,) * p, math.inf, refusal=refusal)
        for span in spans:
            if span not in planned:
                a, b, s = span
                others = [None if k == s else bases[k] for k in range(p)]
                with untouched(children):
                    planned[span] = choose(
                        order,
                        bases[s],
                        stage(*span)[1],
                        nn.Sequential(*children[a:b]),
                        budget,
                        others,
                        checkpoint,
                        rerun_modules,
                    )
        plans = tuple(planned[span][0] for span in spans)
        needs = tuple(planned[span][1] for span in spans)
        if any(sp is None for sp in plans):
            return Found(cut, plans, needs, math.inf)
        m = order.n_microbatches
        line = _walk(order, tuple(tuple(sp.cost(i, m) for i in range(m)) for sp in plans if sp), per_action)
        if max(line.peak_bytes) > budget:  # the rank as it runs beside the other stages' plans
            return Found(cut, (None,) * p, tuple(line.peak_bytes), math.inf)
        return Found(cut, plans, needs, line.makespan)

    def rank(found: Found) -> tuple[float, int]:
        return found.step_s, sum(max(need - budget, 0) for need in found.needs)

    weighed: dict[Cut, Found] = {}

    def seen(cut: Cut) -> Found:
        if cut not in weighed:
            weighed[cut] = weigh(cut)
        return weighed[cut]

    exhaustive = _exhaustive(n, p)
    if exhaustive:
        first = list(_cuts(n, p, forbidden))
    else:  # the balanced cuts, or where each starts a stage where none may, the first cut allowed
        first = [cut for cut in dict.fromkeys(starts) if forbidden.isdisjoint(cut[1:-1])]
        first = first or [cut for cut in [next(_cuts(n, p, forbidden), None)] if cut is not None]
    if not first:
        return None
    best = min((seen(cut) for cut in first), key=rank)
    if not exhaustive:
        while True:
            around = []
            for k in range(1, p):
                for move in (-1, 1):
                    cut = list(best.cuts)
                    cut[k] += move
                    if cut[k - 1] < cut[k] < cut[k + 1] and cut[k] not in forbidden:
                        around.append(seen(tuple(cut)))
            step = min(around, key=rank, default=best)
            if rank(step) >= rank(best):
                break
            best = step
    if best.refusal is not None:  # no cut whose every stage runs
        raise best.refusal
    return Found(best.cuts, best.plans, best.needs, best.step_s, len(weighed))


def searched(
    model: nn.Module,
    example: torch.Tensor,
    order: Schedule,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    budget: int,
    checkpoint: str,
    op_costs: str,
    rerun_modules: bool,
    per_action: ActionCost,
) -> tuple[list[nn.Module], tuple[int, ...], list[StagePlan | None], list[int]]:
    """``balance_by="step"``: the stage modules, the cut, each stage's plan and each rank's least
    need, the cut searched with the plans (``remat.pipeline.cut_search``); a descent starts from
    the even cut and the cuts balanced by time and by memory (the children profiled for those)."""
    p = order.n_stages
    if p != order.n_ranks:
        raise RematValueError(
            message(
                "pipeline.plan",
                "balance_by='step' searches cuts with one stage per rank (schedules gpipe and 1f1b)",
                f"{p} stages on {order.n_ranks} ranks",
                "pass balance_by='time' or 'memory', or fix the cut with boundaries=",
            )
        )
    children = children_of(model)
    dense, writes = chained(children, example, model)
    # as many children per stage as can be, as by hand (refusing more stages than children, or a
    # chain no cut of which avoids a module writing its input)
    least = trainable_from(children, example)
    starts = [balance([1.0] * len(children), [1] * p, barred=writes, first=least)]
    if not _exhaustive(len(children), p):  # a descent starts from the balanced cuts too
        costs = profile(children, example)
        held = [order.in_flight(s) for s in range(p)]
        starts.append(balance([c.seconds for c in costs], [1] * p, barred=writes, first=least))
        starts.append(
            balance([c.saved_bytes for c in costs], held, [c.grad_bytes for c in costs], writes, least)
        )
    # no stage starts with a child that writes its input, or that holds a parameter an earlier one does
    forbidden = {k for k, w in enumerate(writes) if w and k > 0}
    first: dict[int, int] = {}
    for k, child in enumerate(children):
        for param in child.parameters():
            forbidden.update(range(first.setdefault(id(param), k) + 1, k + 1))
    found = search(
        children,
        order,
        example,
        target,
        loss_fn,
        budget,
        checkpoint=checkpoint,
        op_costs=op_costs,
        rerun_modules=rerun_modules,
        per_action=per_action,
        starts=starts,
        forbidden=frozenset(forbidden),
    )
    if found is None:  # no cut allowed: the balanced one says why, or both reasons together
        cut = starts[-1]
        untied([nn.Sequential(*children[cut[s] : cut[s + 1]]) for s in range(p)], model, cut)
        raise RematValueError(
            message(
                "pipeline.plan",
                "no stage but the first starts with a module that writes its input in place, and no two "
                "stages share a parameter",
                f"no cut of {len(children)} children into {p} stages avoids children {sorted(forbidden)}",
                "pass fewer stages, make those modules out of place (inplace=False), or untie the parameters",
            )
        )
    cuts = found.cuts
    loose([s for s in range(p) if not dense[cuts[s + 1] - 1]])
    modules: list[nn.Module] = [nn.Sequential(*children[cuts[s] : cuts[s + 1]]) for s in range(p)]
    return modules, tuple(cuts), list(found.plans), list(found.needs)
