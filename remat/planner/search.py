"""How ``remat.plan`` turns solver answers into regions of the step and picks one: the search.

Why apart from the API: a solver answers over a coarse model of the step (NOTE [chain model], [DAG
model]), and a Plan must hold for the step itself. This module maps a Solution to regions of the
model's forward ops (NOTE [written after the region]), predicts each candidate on the step
(``remat.planner.predict``), corrects the solver's budget while the step's peak is over it, finds
the smallest peak any plan reaches (told for too small a budget), picks the plan (NOTE [plan ties]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from remat._errors import RematValueError, message
from remat.planner.chain_recursion import minimum_peak
from remat.planner.cost_model import NO_EXECUTOR_COST, ExecutorCost
from remat.planner.execute import UNCOUNTED
from remat.planner.lowering import stage_key
from remat.planner.predict import Prediction, predict
from remat.planner.region_model import RegionOps, always_kept, writes, written_after
from remat.planner.regions import Region, TensorDecision
from remat.planner.rerun_regions import module_of, rerun_of
from remat.planner.single_level import chain_segments, model_peak
from remat.planner.solvers import get
from remat.planner.solvers.sqrt import split
from remat.planner.types import Chain, ChainOp, ChainSchedule, Problem, Solution
from remat.policy import COMPUTE_INTENSIVE_OPS, Decision
from remat.trace.types import Phase, Trace

__all__ = ["Candidate", "Step", "best", "decisions", "fail", "floor", "keeping_compute", "layers"]
__all__ += ["predicted", "search", "simple", "untied"]

_ATTEMPTS = 6
_REFINE_STEPS = 6
_BISECTED = frozenset({"chain", "greedy"})  # fast enough to call a few times more
_FLOOR_STEPS = 12
# NOTE [plan ties] of two plans whose predicted overheads are within this fraction, the one of the
# first solver of ``_SOLVER_ORDER`` (the exact one first; "auto" made the plain checkpointing
# plans), then the one with the lower predicted peak, then the first tried, is preferred: the
# other is dropped from the candidates (``untied``) when its peak is no lower, whatever the
# budget, so that the pick among those left (the least overhead, ``best``) stays monotone in the
# budget (NOTE [monotone plans]). Op costs are measured on a machine doing other work too, so two
# plans a few ulps or a few microseconds apart must not swap from run to run on a rounding.
_TIE = 1e-3
_SOLVER_ORDER = ("chain", "greedy", "milp", "sqrt", "auto")


def fail(rule: str, given: object, todo: str, kind: type[Exception] = RematValueError) -> Exception:
    """A ``remat.plan:`` error."""
    return kind(message("plan", rule, given, todo))


class Step:
    """The captured step seen by the planner: the model's forward ops, and regions in both
    numberings (trace op indices for the prediction, forward positions for the Plan); every plan
    of it is predicted with the executor's per-op figures ``executor`` (NOTE [executor cost]);
    with ``rerun_modules``, a region that is one call of a module runs as it called again."""

    def __init__(
        self,
        trace: Trace,
        block_key: Callable[[str], str] | None = None,
        executor: ExecutorCost = NO_EXECUTOR_COST,
        rerun_modules: bool = False,
    ) -> None:
        self.trace, self.key, self.executor = trace, block_key or stage_key, executor
        self.rerun_modules = rerun_modules
        self.forward = [
            op for op in trace.ops if op.phase is Phase.FORWARD and op.module and op.name not in UNCOUNTED
        ]
        if not self.forward:
            raise fail(
                "the traced step ran no op inside the model",
                f"{len(trace.ops)} ops in all",
                "make loss_fn call the model",
            )
        self.position = {op.index: p for p, op in enumerate(self.forward)}
        # NOTE [kept views] ``maker``: storage -> the op that made it; those ops, the only ones a
        # region keeps: an output sharing its input's storage though the schema does not say so
        # (``_unsafe_view``) is new to the tape, which keeps it and its base's whole storage, that
        # the prediction counts as dropped and replayed; replayed from its base it costs nothing
        made, tensors = [(t, op.index) for op in self.forward for t in op.outputs], trace.tensors
        self.maker = {t: i for t, i in made if tensors[t].alias_of is None and not tensors[t].constant}
        self.makers = frozenset(self.maker.values())
        self.held = always_kept(trace, self.maker)
        self.last_write = {trace.roots[t]: op.index for op in self.forward for t in writes(op)}

    def region(
        self, name: str, ops: Sequence[int], save: Sequence[int] = ()
    ) -> tuple[Region, RegionOps] | None:
        """A region over the model's forward ops among trace ops ``ops`` (contiguous), or None;
        of ``save`` it keeps the ``makers`` only (NOTE [kept views])."""
        spots = sorted(self.position[i] for i in ops if i in self.position)
        if not spots:
            return None
        first, last = spots[0], spots[-1]
        members = tuple(self.forward[p].index for p in range(first, last + 1))
        stale, fixed = written_after(self.trace, self.last_write, self.maker, members)
        if stale - self.makers or stale & fixed:
            return None  # an op the replay would run on a stale value, and that cannot be kept
        keep_ops = frozenset(i for i in save if i in self.makers) - fixed
        again = rerun_of(self.trace, members, keep_ops) if self.rerun_modules and not stale else None
        if again is None:  # a tape keeps what the program holds anyway (NOTE [held past the step])
            keep_ops = (keep_ops | self.held.intersection(members) | stale) - fixed
        keep = frozenset(self.position[i] for i in keep_ops)
        module = again.module if again else ""  # NOTE [module re-run]
        anchor = module or module_of(self.trace, members[0], members[-1]) or ""  # NOTE [bare forward]
        region = Region(name, first, last, keep, module, anchor)
        return region, RegionOps(members, keep_ops, again, bool(anchor))

    def blocks(self) -> list[list[int]]:
        """The model's forward ops in runs of one block each (``stage_key``), as trace indices."""
        runs: list[list[int]] = []
        key = None
        for op in self.forward:
            k = self.key(op.module)
            if runs and k == key:
                runs[-1].append(op.index)
            else:
                runs.append([op.index])
            key = k
        return runs


def chain_regions(step: Step, chain: Chain, schedule: ChainSchedule) -> list[tuple[Region, RegionOps]]:
    """The checkpointed segments of a single-level chain schedule's forward pass."""
    segments: list[list[int]] = []
    for s in schedule.steps:
        if s.op is ChainOp.BACKWARD:
            break
        if s.op is ChainOp.F_CHECK:
            segments.append([s.stage])
        elif s.op is ChainOp.F_NOGRAD and segments:
            segments[-1].append(s.stage)
    out = []
    for seg in segments:
        stages = [chain.stages[k] for k in seg]
        name = stages[0].name if len(stages) == 1 else f"{stages[0].name}..{stages[-1].name}"
        made = step.region(name, [i for st in stages for i in st.ops])
        if made is not None:
            out.append(made)
    return out


def dag_regions(step: Step, solution: Solution) -> list[tuple[Region, RegionOps]]:
    """Per block with a recomputed node: one region keeping the outputs of its SAVE nodes."""
    trace = step.trace
    recompute = {i for d in solution.decisions if d.action is Decision.RECOMPUTE for i in d.ops}
    # a SAVE block keeps only what autograd saves of it: pinning its other outputs would hold
    # temporaries the plain step frees
    saved = trace.saved_roots
    keep = {
        i
        for d in solution.decisions
        if d.action is Decision.SAVE
        for i in d.ops
        if any(trace.root(t) in saved for t in trace.ops[i].outputs)
    }
    out = []
    for run in step.blocks():
        if recompute.intersection(run):
            made = step.region(step.key(trace.ops[run[0]].module), run, [i for i in run if i in keep])
            if made is not None:
                out.append(made)
    return out


def regions_of(step: Step, problem: Problem, solution: Solution) -> list[tuple[Region, RegionOps]]:
    if isinstance(problem, Chain):
        assert isinstance(solution.schedule, ChainSchedule)
        return chain_regions(step, problem, solution.schedule)
    return dag_regions(step, solution)


def predicted(step: Step, regions: list[tuple[Region, RegionOps]]) -> Prediction:
    return predict(step.trace, [r for _, r in regions], [r.name for r, _ in regions], executor=step.executor)


@dataclass(frozen=True)
class Candidate:
    """A plan checked on the step: who made it and what the step then costs."""

    solver: str
    gap: float | None
    notes: str
    regions: list[tuple[Region, RegionOps]]
    pred: Prediction


def checked(step: Step, problem: Problem, solution: Solution) -> Candidate:
    """A solver's plan as regions of the step, with the step's predicted figures."""
    regions = regions_of(step, problem, solution)
    return Candidate(solution.solver, solution.gap, solution.notes, regions, predicted(step, regions))


def layers(chain: Chain) -> list[int]:
    """The stages that are layers of the model: children of a container, named ``<list>.<index>``
    (``model.layers.3``, ``layer1.0``) — what per-layer checkpointing (transformers' switch, a loop
    of ``torch.utils.checkpoint``) wraps."""
    return [k for k, stage in enumerate(chain.stages) if stage.name.rpartition(".")[2].isdigit()]


def simple(step: Step, chain: Chain) -> list[Candidate]:
    """The plans of plain checkpointing: every block its own region (with or without the model's
    own ops between blocks), every layer its own region (with or without the last), and sqrt(n)
    segments. NOTE [checkpointing in the plan space] each is predicted like any solver's plan and
    weighed beside them, so the plan returned is never worse, under the same prediction, than
    per-layer checkpointing at a budget that checkpointing meets, and the smallest peak found is
    never above checkpointing's."""
    last = len(chain) - 1
    # ops the model's own forward runs between blocks (pooling, concatenation) save little, and
    # replaying them costs their whole output again: leave them out as well
    inner = [(k, k + 1) for k in range(last) if chain.stages[k].name not in (step.trace.name, "(top level)")]
    each = [(k, k + 1) for k in layers(chain)]
    out = []
    for what, segments in (
        ("every block checkpointed", [(k, k + 1) for k in range(last)]),
        ("every block checkpointed but the model's own ops", inner),
        ("every layer checkpointed", each),
        ("every layer checkpointed but the last", each[:-1]),
        ("sqrt(n) segments", split(len(chain))[:-1]),
    ):
        if not segments and what.startswith("every layer"):
            continue
        regions = chain_regions(step, chain, chain_segments(chain, segments))
        out.append(Candidate("auto", None, what, regions, predicted(step, regions)))
    return out


def keeping_compute(step: Step, candidates: Sequence[Candidate]) -> list[Candidate]:
    """Each plan again, its regions keeping what autograd saves of matmul, convolution and
    attention outputs (``COMPUTE_INTENSIVE_OPS``): selective checkpointing as plans, where replay
    costs only the cheap ops between them, at the memory of what they keep."""
    trace = step.trace
    saved = trace.saved_roots
    intensive = {
        op.index
        for op in step.forward
        if op.name.rsplit(".", 1)[0] in COMPUTE_INTENSIVE_OPS
        and any(trace.root(t) in saved for t in op.outputs)
    }
    out = []
    for c in candidates:
        if not c.regions or not any(intensive.intersection(ops.ops) - ops.save for _, ops in c.regions):
            continue
        regions = []
        for region, ops in c.regions:
            made = step.region(region.name, ops.ops, [*ops.save, *intensive.intersection(ops.ops)])
            if made is not None:
                regions.append(made)
        notes = f"{c.notes}, keeping matmul, convolution and attention outputs"
        out.append(Candidate(c.solver, c.gap, notes, regions, predicted(step, regions)))
    return out


def floor(step: Step, chain: Chain) -> list[Candidate]:
    """Plans near the smallest peak: the chain DP's single-level plans for budgets bisected
    between its model's minimum and its plain peak (the lowest budget each time that it still
    solves), and plain checkpointing. Independent of any budget asked for, so that the minimum an
    error names is the same whatever the budget was, and a budget of that minimum is met."""
    out = simple(step, chain)
    solver = get("chain")
    lo, hi = minimum_peak(chain)[0], model_peak(chain)
    for _ in range(_FLOOR_STEPS):
        if lo >= hi:
            break
        mid = (lo + hi) // 2
        try:
            solution = solver.solve(chain, mid, single_level=True)
        except RematValueError:
            lo = mid + 1
            continue
        hi = mid
        out.append(checked(step, chain, solution))
    return out


def _preference(c: Candidate) -> tuple[int, int]:
    rank = {name: k for k, name in enumerate(_SOLVER_ORDER)}
    return rank.get(c.solver, len(rank)), c.pred.peak_bytes


def untied(candidates: Sequence[Candidate]) -> list[Candidate]:
    """``candidates`` without those another one ties with and is preferred to at no higher peak
    (NOTE [plan ties]); in their order."""
    keys = [(*_preference(c), k) for k, c in enumerate(candidates)]
    return [
        c
        for k, c in enumerate(candidates)
        if not any(
            keys[j] < keys[k]
            and d.pred.peak_bytes <= c.pred.peak_bytes
            and d.pred.overhead <= c.pred.overhead * (1 + _TIE)
            for j, d in enumerate(candidates)
        )
    ]


def best(fits: Sequence[Candidate]) -> Candidate:
    """The plan to return of those that fit (``untied`` first): the least predicted overhead, an
    exact tie going to the preferred one (NOTE [plan ties])."""
    return min(fits, key=lambda c: (c.pred.overhead, *_preference(c)))


def search(
    step: Step, solver: str, problem: Problem, budget: int, baseline: int, options: dict[str, Any]
) -> list[Candidate]:
    """The plans ``solver`` returns for ``problem`` as its budget is lowered by what the step's
    peak was over ``budget`` (see the module doc), until one fits (its predicted peak is within
    ``budget``; the caller picks among those that do). For the fast solvers the budget given to
    the solver is then bisected between the highest one whose plan fit and the lowest one above
    it whose plan did not: the solver's model is coarse (a chain has no skip connections), so the
    first plan that fits may be needlessly tight."""
    chosen = get(solver)
    top = model_peak(problem)
    target = budget - (baseline - top)
    out: list[Candidate] = []
    tried: dict[int, bool] = {}  # solver budget -> its plan fit

    def attempt(target: int) -> bool | None:
        try:
            solution = chosen.solve(problem, target, **options)
        except RematValueError:
            return None
        regions = regions_of(step, problem, solution)
        out.append(
            Candidate(solution.solver, solution.gap, solution.notes, regions, predicted(step, regions))
        )
        tried[target] = out[-1].pred.peak_bytes <= budget
        return tried[target]

    step_down = 0
    for _ in range(_ATTEMPTS):
        if target <= 0:
            break
        fit = attempt(target)
        if fit is None or fit:
            break
        over = max(out[-1].pred.peak_bytes - budget, budget // 100)
        # the same plan again: the solver's model needs a bigger cut to change its mind
        same = len(out) > 1 and out[-1].pred.peak_bytes == out[-2].pred.peak_bytes
        step_down = 2 * step_down if same else over
        target -= max(step_down, over)
    if solver not in _BISECTED:
        return out
    for _ in range(_REFINE_STEPS):
        fits = [t for t, ok in tried.items() if ok]
        if not fits:
            break
        low = max(fits)
        high = min([t for t, ok in tried.items() if not ok and t > low] or [top])
        if high - low <= max(budget // 200, 1):
            break
        if attempt((low + high) // 2) is None:
            break
    return out


def decisions(
    step: Step, regions: list[tuple[Region, RegionOps]], pred: Prediction, solver: str
) -> tuple[TensorDecision, ...]:
    trace = step.trace
    recomputed = {r: g for g, rs in enumerate(pred.recomputed) for r in rs}
    region_at = {i: g for g, (_, ops) in enumerate(regions) for i in ops.ops}
    out = []
    for r in sorted(trace.saved_roots):
        info = trace.tensors[r]
        if info.constant:
            continue
        maker = next((op for op in step.forward if r in op.outputs), None)
        if maker is None:
            continue
        g = region_at.get(maker.index, -1)
        region = regions[g][0] if g >= 0 else None
        if r in recomputed and region is not None:
            how = f"{region.rerun} run again" if region.rerun else f"replayed in backward with {region.name}"
            action, reason = Decision.RECOMPUTE, f"{solver}: dropped, {how}"
        elif region is None:
            action, reason = Decision.SAVE, f"{solver}: outside every recomputed region"
        elif maker.index in regions[g][1].save:
            action, reason = Decision.SAVE, f"{solver}: kept inside {region.name}"
        else:
            action, reason = Decision.SAVE, f"saved by ops after {region.name}"
        out.append(
            TensorDecision(
                step.position[maker.index], maker.name, maker.module, info.nbytes, action, reason, maker.cost
            )
        )
    return tuple(out)
