"""``remat.pipeline.plan``: cut a model into stages and plan each stage's recomputation within its
rank's budget, given how many micro-batches the schedule makes that rank hold at once.

Why per stage: under 1F1B, rank s of P holds up to P - s micro-batches (under GPipe all M), so
one policy for every stage recomputes too much on late stages and may not fit early ones. Each
stage's step on one micro-batch is traced (``remat.planner.trace_step``), and every plan the
static planner offers it at any budget (``remat.planner.frontier``) is weighed on the rank by the
pipeline model (``remat.pipeline.timeline``): the micro-batches the rank holds at once each keep
what the plan saves, and the one running its step adds the plan's own peak. The fitting plan that
recomputes least wins (NOTE [stage plans from the frontier]); plain checkpointing's plans (every
block its own region, as ``torch.utils.checkpoint`` per block) are always among those weighed, so
a rank budget that uniform per-block checkpointing meets is met. Where the budget allows, the
last micro-batch runs without recomputation (torchgpipe's ``except_last``: its backward follows at
once). A budget that no plan meets on some rank raises before any process starts, naming what
each rank needs. ``checkpoint="always" | "except_last" | "never"`` gives uniform per-block
checkpointing instead, in torchgpipe's micro-batch patterns: every block of every stage
checkpointed in every micro-batch, in all but the last, or in none. (torchgpipe itself checkpoints
a whole stage as one region; per block is what ``torch.utils.checkpoint`` around each layer does.)

Under interleaved 1F1B a rank runs several stages, each holding its own count of micro-batches
(``Schedule.in_flight``), and shares one budget among them: the stages are planned twice, first
each as if the rank's other stages cost what it costs, then in order beside the others' latest
plans, and the rank's peak is checked with every stage's final plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn

from remat._errors import RematTypeError, RematValueError, message
from remat._state import untouched
from remat._units import format_bytes, parse_bytes
from remat.pipeline.measure import measure, one_thread
from remat.pipeline.plan import PipelinePlan
from remat.pipeline.schedule import Schedule, build
from remat.pipeline.split import BALANCES, balance, chained, children_of, cut_points, profile, untied
from remat.pipeline.stage_plan import StagePlan
from remat.pipeline.timeline import ActionCost, walk
from remat.planner.api import block_key, plan_at
from remat.planner.frontier import Frontier, frontier
from remat.planner.plan import Plan
from remat.planner.predict import predict
from remat.planner.search import Candidate, chain_regions, floor, predicted
from remat.planner.single_level import chain_segments
from remat.trace.types import Trace

__all__ = ["CHECKPOINT_MODES", "OP_COSTS", "plan"]

# "planned" per stage; uniform per-block checkpointing in torchgpipe's micro-batch patterns: every
# block checkpointed in every micro-batch, in all but the last, in none
CHECKPOINT_MODES: tuple[str, ...] = ("planned", "always", "except_last", "never")
# the op times the plans are weighed with: as measured on the example, or the cost model's
# estimates (the same on every machine and every run)
OP_COSTS: tuple[str, ...] = ("measured", "model")


def _fail(rule: str, given: object, todo: str, kind: type[Exception] = RematValueError) -> Exception:
    return kind(message("pipeline.plan", rule, given, todo))


def _cut(
    model: nn.Module | Sequence[nn.Module],
    example: torch.Tensor,
    order: Schedule,
    boundaries: Sequence[int] | None,
    by: str,
) -> tuple[list[nn.Module], tuple[int, ...]]:
    """The stage modules and the cut points (empty for given stages)."""
    p = order.n_stages
    if not isinstance(model, nn.Module):
        stages = list(model)
        if len(stages) != p or not all(isinstance(s, nn.Module) for s in stages):
            raise _fail(
                "stages must be n_stages modules", f"{len(stages)} for {p} stages", "pass one per stage"
            )
        chained(stages, example)
        return stages, ()
    children = children_of(model)
    chained(children, example, model)
    if boundaries is not None:
        cuts = (0, *boundaries, len(children))
        if len(cuts) != p + 1 or any(a >= b for a, b in zip(cuts, cuts[1:], strict=False)):
            raise _fail(
                "boundaries are the first child of each stage after the first, increasing",
                f"{list(boundaries)} for {p} stages of {len(children)} children",
                f"pass {p - 1} increasing indices between 1 and {len(children) - 1}",
            )
    else:
        costs = profile(children, example)
        if by == "time":
            cuts = balance([c.seconds for c in costs], [1] * p)
        else:
            held = [order.in_flight(s) for s in range(p)]
            cuts = balance([c.saved_bytes for c in costs], held, [c.grad_bytes for c in costs])
    return [nn.Sequential(*children[cuts[s] : cuts[s + 1]]) for s in range(p)], tuple(cuts)


def _rank_peak(order: Schedule, sp: StagePlan, others: Sequence[StagePlan | None]) -> int:
    """The pipeline model's peak on ``sp``'s rank with ``sp`` for its stage and ``others[s]`` for
    the other stages (a rank's memory depends on its own stages, and on its neighbours' outputs
    for its receive buffers; where ``others[s]`` is None, ``sp``'s costs stand in)."""
    m = order.n_microbatches
    plans = [sp if s == sp.stage else (others[s] or sp) for s in range(order.n_stages)]
    costs = tuple(tuple(each.cost(i, m) for i in range(m)) for each in plans)
    return walk(order, costs).peak_bytes[sp.rank]


def _per_block(found: Frontier, module: nn.Module) -> Candidate:
    """Uniform per-block checkpointing of the stage as a plan: each block of ``module`` its own
    region (what ``torch.utils.checkpoint`` around each block does). The blocks are the chain's
    stages that name a module of ``module``: its children, or the members of its containers
    (``nn.ModuleList``, ``nn.ModuleDict``, plain ``nn.Sequential``: ``remat.planner.block_key``)."""
    modules = {name for name, _ in module.named_modules() if name}
    blocks = [(k, k + 1) for k, stage in enumerate(found.chain.stages) if stage.name in modules]
    regions = chain_regions(found.step, found.chain, chain_segments(found.chain, blocks))
    return Candidate("auto", None, "every block checkpointed", regions, predicted(found.step, regions))


def _candidates(found: Frontier, module: nn.Module) -> list[Candidate]:
    """The plans weighed for a stage: the frontier's, plain checkpointing's and the chain DP's
    plans near the smallest peak (``floor``), and uniform per-block checkpointing, less each one
    another matches or beats in peak, held bytes and overhead at once (the first of equal ones
    kept). NOTE [stage plans from the frontier] the frontier keeps only the plans no other beats
    in one step's peak and overhead; on a rank holding several micro-batches the bytes a plan
    holds from its forward to its backward count once per micro-batch, so a plan the frontier
    drops (per-block checkpointing beside "every block but the last" at the same peak) may be the
    only one that fits."""
    tried = [*found.candidates, *floor(found.step, found.chain), _per_block(found, module)]

    def figures(c: Candidate) -> tuple[int, int, float]:
        return c.pred.peak_bytes, c.pred.held_bytes, c.pred.overhead

    def beaten(k: int) -> bool:
        mine = figures(tried[k])
        for j, other in enumerate(tried):
            theirs = figures(other)
            if (
                j != k
                and all(a <= b for a, b in zip(theirs, mine, strict=True))
                and (theirs != mine or j < k)
            ):
                return True
        return False

    return [c for k, c in enumerate(tried) if not beaten(k)]


def _as_plan(found: Frontier, candidate: Candidate) -> Plan:
    """``candidate`` as the ``remat.Plan`` the static planner returns for it, noted by who made it."""
    one = plan_at(replace(found, candidates=(candidate,)), candidate.pred.peak_bytes)
    return replace(one, notes=f"{candidate.solver}: {candidate.notes}")


def _with_plan(base: StagePlan, plan: Plan, plain: Plan, later: int) -> StagePlan:
    """``base`` (nothing planned) running ``plan`` on its micro-batches; ``plain``: the stage's plan
    that recomputes nothing, from which the base's figures differ as the pipeline counts them;
    ``later``: the plan's peak once the gradients exist (0: not known)."""
    return replace(
        base,
        plan=plan,
        recompute_s=max(plan.predicted_overhead - 1.0, 0.0) * (base.forward_s + base.backward_s),
        # what a micro-batch in flight holds: the plain step's saved bytes (as the pipeline model
        # counts them) less what the plan frees by the forward's end, or plus what its regions hold
        # (their inputs, generator states)
        saved_bytes=base.plain_saved_bytes + plan.predicted_held_bytes - plain.predicted_held_bytes,
        peak_bytes=base.plain_peak_bytes + plan.predicted_peak_bytes - plain.predicted_peak_bytes,
        later_peak_bytes=later,
    )


def _later(later: Trace | None, candidate: Candidate) -> int:
    """The peak of ``candidate``'s regions on the step traced with the gradients there already
    (NOTE [later backwards] in ``remat.pipeline.measure``): its forward ops are the same."""
    return 0 if later is None else predict(later, [ops for _, ops in candidate.regions]).peak_bytes


def _choose(
    order: Schedule,
    base: StagePlan,
    traces: tuple[Trace, Trace | None],
    module: nn.Module,
    budget: int,
    others: Sequence[StagePlan | None],
    checkpoint: str,
) -> tuple[StagePlan | None, int]:
    """The stage's plan with the least predicted overhead that fits ``budget`` on its rank beside
    ``others`` (the other stages' plans, as for ``_rank_peak``), or None, and the least peak found
    on the rank, from ``base`` (nothing planned). Under a uniform ``checkpoint`` mode, that mode's
    plan and its peak."""
    lowest = _rank_peak(order, base, others)
    if checkpoint == "never" or (checkpoint == "planned" and lowest <= budget):
        return (base if lowest <= budget else None), lowest
    trace, later = traces
    found = frontier(trace, "auto", block_key(module))
    plain = plan_at(found, found.baseline)
    if checkpoint != "planned":
        uniform = _per_block(found, module)
        if not uniform.regions:
            raise _fail(
                f"checkpoint={checkpoint!r} checkpoints each block of a stage, and this one has none",
                f"stage {base.stage}: {type(module).__name__}",
                "pass stages made of child modules (an nn.Sequential, or blocks in an nn.ModuleList),"
                " or checkpoint='planned'",
            )
        sp = replace(_with_plan(base, _as_plan(found, uniform), plain, _later(later, uniform)),
                     except_last=checkpoint == "except_last")  # fmt: skip
        need = _rank_peak(order, sp, others)
        return (sp if need <= budget else None), need
    # NOTE [stage plans from the frontier] every plan weighed (``_candidates``: found once, for any
    # one-micro-batch budget) is run on the rank as the schedule runs it; the cheapest that fits
    # wins. A rank budget that one plan meets is then met at every larger budget, and the least
    # peak named in a refusal does not depend on the budget.
    fits = []
    for candidate in _candidates(found, module):
        sp = _with_plan(base, _as_plan(found, candidate), plain, _later(later, candidate))
        need = _rank_peak(order, sp, others)
        lowest = min(lowest, need)
        if need <= budget:
            fits.append(sp)
    if not fits:
        return None, lowest
    chosen = min(fits, key=lambda sp: sp.recompute_s)
    last = replace(chosen, except_last=True)
    return (last if _rank_peak(order, last, others) <= budget else chosen), lowest


def _plan_stages(
    modules: Sequence[nn.Module],
    order: Schedule,
    example: torch.Tensor,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    budget: int,
    checkpoint: str,
    op_costs: str,
) -> tuple[list[StagePlan | None], list[int]]:
    """Each stage's plan (None where none fits) and the least peak found on its rank, the stages
    fed one after another from ``example``. Where a rank runs several stages, each is first planned
    as if the rank's other stages cost what it costs, then again in order beside the others'
    latest plans, so that the last one planned on a rank sees the rank as it will run."""
    measured = []
    x = example.detach()
    for s, module in enumerate(modules):
        base, trace, x, later = measure(order, s, module, x, target, loss_fn, op_costs)
        measured.append((base, (trace, later)))
    chosen: list[StagePlan | None] = [None] * order.n_stages
    needs = [0] * order.n_stages
    alike: list[StagePlan | None] = [None] * order.n_stages
    for rounds in range(1 if order.n_stages == order.n_ranks else 2):
        for s, (base, traces) in enumerate(measured):
            # a stage of another rank not planned yet stands in as measured: its output is what
            # this rank's receive buffers hold (NOTE [receive buffers] in ``remat.pipeline.timeline``)
            others = [
                o if o is not None or order.rank_of(k) == order.rank_of(s) else measured[k][0]
                for k, o in enumerate(chosen if rounds else alike)
            ]
            sp, needs[s] = _choose(order, base, traces, modules[s], budget, others, checkpoint)
            chosen[s] = sp if sp is not None or not rounds else chosen[s]
    if all(sp is not None for sp in chosen):
        # a stage that found no plan beside the others kept its first one: check the whole rank
        m = order.n_microbatches
        peaks = walk(order, tuple(tuple(sp.cost(i, m) for i in range(m)) for sp in chosen if sp)).peak_bytes
        over = [s for s in range(order.n_stages) if peaks[order.rank_of(s)] > budget]
        for s in over:
            chosen[s], needs[s] = None, peaks[order.rank_of(s)]
    return chosen, needs


def plan(
    model_or_stages: nn.Module | Sequence[nn.Module],
    example_microbatch: torch.Tensor,
    *,
    n_stages: int,
    n_microbatches: int,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
    budget_per_rank: int | str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    target: torch.Tensor,
    boundaries: Sequence[int] | None = None,
    balance_by: str = "memory",
    checkpoint: str = "planned",
    op_costs: str = "measured",
    action_cost: ActionCost | None = None,
) -> PipelinePlan:
    """Plan a pipeline step of ``model_or_stages`` on ``n_stages`` ranks, ``stages_per_rank``
    stages each (more than one under ``"interleaved-1f1b"``: rank r runs stages r, r + P, ...;
    under ``"zbv"`` always two: stages r and 2P - 1 - r).

    ``model_or_stages`` is a chain (an ``nn.Sequential`` or any module whose children run in
    order), cut into stages balanced by ``"memory"`` (the saved bytes weighed by the
    micro-batches each stage holds, plus the gradients) or ``"time"`` (``balance_by``) unless
    ``boundaries`` (the first child of each stage after
    the first) fix the cut; or the list of stage modules itself. ``example_microbatch`` and
    ``target`` are one micro-batch's input and target; ``loss_fn(output, target)`` is the loss the
    torch schedule computes on the last stage. ``budget_per_rank`` (bytes, or ``"2GB"``) bounds
    the bytes a step adds on each rank: activations, gradients, the plan's recomputation, and in
    the first step torch's receive buffers (``remat.memory.track(allocator=True)`` around
    ``schedule.step``; NOTE [receive buffers] in ``remat.pipeline.timeline``), parameters not
    counted.
    ``schedule`` is one of ``remat.pipeline.SCHEDULES``. The model's buffers, gradients and the
    RNG are left as they were.

    ``checkpoint`` is ``"planned"`` (each stage's plan chosen within the budget, see the module
    doc) or uniform per-block checkpointing in one of torchgpipe's micro-batch patterns, each block
    of every stage its own checkpointed region: ``"always"`` in every micro-batch,
    ``"except_last"`` in all but the last, ``"never"`` in none (a mode the budget cannot hold is
    refused, naming each rank's need). ``op_costs`` is ``"measured"`` (the op times of the
    example's step on one intra-op thread, as each rank runs: NOTE [stage times on one thread]) or
    ``"model"`` (the cost model's estimates: the same per-stage plans on every run and machine, for
    a given cut; ``balance_by="time"`` still cuts by measured times). ``action_cost`` is what
    each action of the schedule costs a rank beyond its stage's compute, as
    ``remat.pipeline.calibrate`` measures it (NOTE [per-action cost] in
    ``remat.pipeline.timeline``); by default none, and the predicted makespan has op times only.
    It changes the predicted times, not the plans.
    """
    if not isinstance(example_microbatch, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise _fail(
            "example_microbatch and target must be tensors",
            f"got {type(example_microbatch).__name__}, {type(target).__name__}",
            "pass one micro-batch's input and target",
            RematTypeError,
        )
    if not callable(loss_fn):
        raise _fail(
            "loss_fn must be callable", type(loss_fn).__name__, "pass loss_fn(output, target)", RematTypeError
        )
    if balance_by not in BALANCES:
        raise _fail("unknown balance", repr(balance_by), f"use one of {', '.join(BALANCES)}")
    if checkpoint not in CHECKPOINT_MODES:
        raise _fail("unknown checkpoint mode", repr(checkpoint), f"use one of {', '.join(CHECKPOINT_MODES)}")
    if op_costs not in OP_COSTS:
        raise _fail("unknown op costs", repr(op_costs), f"use one of {', '.join(OP_COSTS)}")
    if action_cost is not None and not isinstance(action_cost, ActionCost):
        raise _fail(
            "action_cost must be an ActionCost",
            type(action_cost).__name__,
            "pass remat.pipeline.calibrate()'s figures, or an ActionCost",
            RematTypeError,
        )
    per_action = ActionCost() if action_cost is None else action_cost
    if (bad := per_action.bad()) is not None:
        raise _fail(
            "action_cost's figures are seconds (and seconds per byte): finite and not negative",
            bad,
            "pass remat.pipeline.calibrate()'s figures",
        )
    budget = parse_bytes(budget_per_rank, "pipeline.plan")
    boundaries = cut_points(boundaries)
    per_rank = 2 if schedule == "zbv" and stages_per_rank == 1 else stages_per_rank  # zbv: two, in a V
    order = build(schedule, n_stages, n_microbatches, per_rank, api="pipeline.plan")
    with one_thread():
        modules, cuts = _cut(model_or_stages, example_microbatch, order, boundaries, balance_by)
        untied(modules)
        with untouched(modules):
            chosen, needs = _plan_stages(
                modules, order, example_microbatch, target, loss_fn, budget, checkpoint, op_costs
            )
    if any(sp is None for sp in chosen):
        most: dict[int, int] = {}  # per rank, the most one of its stages needs
        for s, n in enumerate(needs):
            most[order.rank_of(s)] = max(most.get(order.rank_of(s), 0), n)
        if checkpoint != "planned" and order.n_stages > order.n_ranks:  # one plan per stage: walk it
            with one_thread(), untouched(modules):
                every, _ = _plan_stages(
                    modules, order, example_microbatch, target, loss_fn, 2**62, checkpoint, op_costs
                )
            m = order.n_microbatches
            most = dict(
                enumerate(
                    walk(
                        order, tuple(tuple(sp.cost(i, m) for i in range(m)) for sp in every if sp)
                    ).peak_bytes
                )
            )
        each = ", ".join(f"rank {r} needs {n} bytes ({format_bytes(n)})" for r, n in sorted(most.items()))
        planned = checkpoint == "planned"
        raise _fail(
            "budget_per_rank below what some rank needs under any plan"
            if planned
            else f"budget_per_rank below what some rank needs with checkpoint={checkpoint!r}",
            f"budget {budget} bytes; {each}",
            "raise budget_per_rank, or use more stages or smaller micro-batches"
            + ("" if planned else ", or checkpoint='planned'"),
        )
    plans = tuple(sp for sp in chosen if sp is not None)
    model = model_or_stages if isinstance(model_or_stages, nn.Module) else tuple(model_or_stages)
    given = balance_by if boundaries is None else "given"
    return PipelinePlan(order, cuts, budget, plans, given, per_action, model)
