"""Keep what a plan would replay wherever the step's peak leaves room: a plan filled up to its own peak.

Why after the solvers: a solver's model of the step is coarse (no parameter gradients, one block
per stage; NOTE [chain model]) and a plain checkpointing plan has no model at all, so a region is
recomputed whole even where the step never comes near its peak while the region's tensors are
alive. In a transformer the peak is in the first layers' backward, where every parameter
gradient exists; the last layers' backward runs first, beside few gradients, so the last regions
can keep part or all of what they would replay at no cost in peak. Per-layer checkpointing leaves
that room unused; here the plan is checked on the step itself (``predict``, exact to the byte
where measured) as it keeps more.

NOTE [room under the peak] For each region, last first (its backward comes first, beside the
fewest gradients): a region where not even its smallest storage fits keeps nothing more, one
where all of them fit keeps all; otherwise it ranks the storages it would replay two ways, by
the replay time keeping each spares per byte (its own op and the ops that lead only to it: a
rotary embedding's sum spares the projection under it) and by its own op's time per byte, and
keeps the cheaper of the two longest heads that leave the plan's predicted peak no higher than its
own (found by bisection). A region left keeping everything it saves is dropped where that is no
dearer. The result's peak is at most the plan's own, whatever the budget, so the candidates stay
independent of the budget (NOTE [monotone plans]), and the filled plan is picked over the plan
only where it is predicted cheaper.
"""

from __future__ import annotations

from collections.abc import Sequence

from remat.planner.predict import Prediction
from remat.planner.region_model import RegionOps
from remat.planner.regions import Region
from remat.planner.search import Candidate, Step, predicted

__all__ = ["filled", "filled_all"]

# the step-level predictions all the fills of one frontier may make (tens per plan: two bisections
# per region), the plans of lowest peak first: a count, not a time, so that the candidates are the
# same on every run
_PREDICTIONS = 300


class _Predictions:
    """``predicted`` on the step, counting down what ``filled_all`` may still spend."""

    def __init__(self, step: Step, left: int) -> None:
        self.step, self.left = step, left

    def __call__(self, regions: list[tuple[Region, RegionOps]]) -> Prediction:
        self.left -= 1
        return predicted(self.step, regions)


def _spare(step: Step, ops: RegionOps) -> list[int]:
    """The ops of a region that make a storage autograd saves and that it does not keep yet."""
    trace = step.trace
    saved = trace.saved_roots
    return [
        i
        for i in ops.ops
        if i in step.makers and i not in ops.save and any(t in saved for t in trace.ops[i].outputs)
    ]


def _size(step: Step, i: int) -> int:
    trace = step.trace
    return sum(trace.tensors[t].nbytes for t in trace.ops[i].outputs if trace.tensors[t].alias_of is None)


def _rankings(step: Step, ops: RegionOps, spare: list[int]) -> list[list[int]]:
    """The spare storages in two orders, the first of most replay spared per byte kept: keeping one
    spares its op and the ops that lead only to it (a rotary embedding's sum spares its products
    and the projection under them), so per storage, the replay's cost keeping it as well against
    the replay's cost now, each the ops that lead to the storages the region hands autograd,
    stopping at kept ones (roughly: in-place writes left out, since each fill a ranking leads to
    is checked on the prediction). The second, where it differs, is by the time of the storage's
    own op per byte: a head of either fits under the peak (bisection) where the other's may not
    (the first may put a large storage first)."""
    trace, root = step.trace, step.trace.root
    timed = trace.total_cost > 0
    maker = {t: i for i in ops.ops for t in trace.ops[i].outputs if t in step.maker}  # storage -> op
    # per op, last first: its index, its time, the storages it makes, those of the region it reads
    graph: list[tuple[int, float, set[int], list[int]]] = []
    for i in reversed(ops.ops):
        op = trace.ops[i]
        reads = [r for t in op.inputs if (r := root(t)) in maker]
        graph.append((i, op.cost if timed else op.est_cost, {root(t) for t in op.outputs}, reads))
    # what the region hands autograd: saved while its tape records (NOTE [region model]), not its
    # output that the next block saves and holds anyway; all it saves where saves are not placed
    first, last = ops.ops[0], ops.ops[-1]
    packed = (
        {root(t) for t, p in trace.saved_at if first < p <= last} if trace.saved_at else trace.saved_roots
    )
    saved = [r for r in maker if r in packed]

    def replayed(keep: frozenset[int]) -> float:
        wanted = {r for r in saved if maker[r] not in keep}
        cost = 0.0
        for i, seconds, outs, ins in graph:
            if i in keep or outs.isdisjoint(wanted):
                continue
            cost += seconds
            wanted.update(r for r in ins if maker[r] not in keep)
        return cost

    now = replayed(ops.save)
    spared = {i: now - replayed(ops.save | {i}) for i in spare}
    by_chain = sorted(spare, key=lambda i: -spared[i] / max(_size(step, i), 1))
    own = {i: seconds for i, seconds, _, _ in graph}
    by_op = sorted(spare, key=lambda i: -own[i] / max(_size(step, i), 1))
    return [by_chain] if by_op == by_chain else [by_chain, by_op]


Entry = tuple[Region, RegionOps]
Kept = tuple[Prediction, Entry]


def _keeping(
    step: Step, regions: list[Entry], g: int, more: Sequence[int], peak: int, predict: _Predictions
) -> Kept | None:
    """Region ``g`` keeping ``more`` as well, where the plan's predicted peak stays within ``peak``."""
    region, ops = regions[g]
    made = step.region(region.name, ops.ops, [*ops.save, *more])
    assert made is not None
    pred = predict([*regions[:g], made, *regions[g + 1 :]])
    return (pred, made) if pred.peak_bytes <= peak else None


def _longest(
    step: Step, regions: list[Entry], g: int, ranking: Sequence[int], peak: int, predict: _Predictions
) -> Kept | None:
    """Region ``g`` keeping the longest head of ``ranking`` within ``peak``, found by bisection, or
    None: a heuristic, since keeping more can lower a peak too (a kept tensor spares its replay),
    but each head it returns is checked on the prediction."""
    best, lo, hi = None, 0, len(ranking)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        found = _keeping(step, regions, g, ranking[:mid], peak, predict)
        if found is None:
            hi = mid - 1
        else:
            lo, best = mid, found
    return best


def _fill(
    step: Step, regions: list[Entry], g: int, spare: list[int], peak: int, predict: _Predictions
) -> Kept | None:
    """The most region ``g`` keeps within ``peak`` (NOTE [room under the peak]): nothing where not
    even its smallest spare storage fits, everything where all of it fits, else the cheaper of the
    longest heads of its two rankings that fit and the smallest alone."""
    smallest = _keeping(step, regions, g, [min(spare, key=lambda i: _size(step, i))], peak, predict)
    if smallest is None:
        return None
    whole = _keeping(step, regions, g, spare, peak, predict)
    if whole is not None:
        return whole
    heads = [_longest(step, regions, g, r, peak, predict) for r in _rankings(step, regions[g][1], spare)]
    return min([*(h for h in heads if h is not None), smallest], key=lambda h: h[0].overhead)


def filled(step: Step, candidate: Candidate, predict: _Predictions | None = None) -> Candidate | None:
    """``candidate`` with its regions keeping what fits under its own predicted peak (NOTE [room
    under the peak]), or None where that spares nothing; ``predict`` counts the predictions."""
    predict = predict or _Predictions(step, 0)
    regions = list(candidate.regions)
    pred, peak = candidate.pred, candidate.pred.peak_bytes
    kept = 0
    for g in reversed(range(len(regions))):
        spare = _spare(step, regions[g][1])
        best = _fill(step, regions, g, spare, peak, predict) if spare else None
        if best is None or best[0].overhead >= pred.overhead:
            continue
        kept += len(best[1][1].save) - len(regions[g][1].save)
        pred, regions[g] = best
        if not _spare(step, regions[g][1]):
            rest = [*regions[:g], *regions[g + 1 :]]
            alone = predict(rest)
            if alone.peak_bytes <= peak and alone.overhead <= pred.overhead:
                pred, regions = alone, rest
    if pred is candidate.pred:
        return None
    notes = f"{candidate.notes}, then keeping {kept} more saved tensors where its peak leaves room"
    return Candidate(candidate.solver, candidate.gap, notes, regions, pred)


def filled_all(step: Step, candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates with regions, each filled where it has room under its peak (``filled``), the
    lowest in peak first, while ``_PREDICTIONS`` last (the plan being filled when they run out is
    finished): the tight budgets, where plans recompute the most, gain the most."""
    predict = _Predictions(step, _PREDICTIONS)
    out = []
    for c in sorted((c for c in candidates if c.regions), key=lambda c: c.pred.peak_bytes):
        if predict.left <= 0:
            break
        if (f := filled(step, c, predict)) is not None:
            out.append(f)
    return out
