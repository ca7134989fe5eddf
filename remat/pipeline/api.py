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
each rank needs under the cut (a balanced cut is not searched again for the budget:
``balance_by="step"`` searches the cuts with the plans, ``remat.pipeline.cut_search``).
No stage after the first starts with a module that writes its input in place (NOTE [a stage's
input is a leaf] in ``remat.pipeline.split``): the cut avoids one, a given cut is refused.
``checkpoint="always" | "except_last" | "never"`` gives uniform per-block checkpointing instead, in
torchgpipe's micro-batch patterns: every block of every stage checkpointed in every micro-batch, in
all but the last, or in none. (torchgpipe itself checkpoints a whole stage as one region; per block
is what ``torch.utils.checkpoint`` around each layer does.)

Under interleaved 1F1B a rank runs several stages, each holding its own count of micro-batches
(``Schedule.in_flight``), and shares one budget among them: the stages are planned twice, first
each as if the rank's other stages cost what it costs, then in order beside the others' latest
plans, and the rank's peak is checked with every stage's final plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from remat._errors import RematTypeError, RematValueError, message
from remat._state import untouched
from remat._units import format_bytes, parse_bytes
from remat.pipeline.choose import choose
from remat.pipeline.cut_search import searched
from remat.pipeline.measure import measure, one_thread
from remat.pipeline.plan import PipelinePlan
from remat.pipeline.schedule import Schedule, build
from remat.pipeline.split import (
    BALANCES,
    balance,
    chained,
    check_modules,
    children_of,
    cut_points,
    leaf_safe,
    loose,
    profile,
    trainable_from,
    untied,
)
from remat.pipeline.stage_plan import StagePlan
from remat.pipeline.timeline import ActionCost, _walk

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
        if len(stages) != p:  # modules: ``check_modules``
            raise _fail(
                "stages must be n_stages modules", f"{len(stages)} for {p} stages", "pass one per stage"
            )
        dense, writes = chained(stages, example)
        loose([s for s, d in enumerate(dense) if not d])
        leaf_safe(
            [(s, f"stage {s} ({type(stages[s]).__name__}) writes its input") for s in range(1, p)], writes
        )
        return stages, ()
    children = children_of(model)
    dense, writes = chained(children, example, model)
    if boundaries is not None:
        cuts = (0, *boundaries, len(children))
        if len(cuts) != p + 1 or any(a >= b for a, b in zip(cuts, cuts[1:], strict=False)):
            raise _fail(
                "boundaries are the first child of each stage after the first, increasing",
                f"{list(boundaries)} for {p} stages of {len(children)} children",
                f"pass {p - 1} increasing indices between 1 and {len(children) - 1}",
            )
        named = [
            (k, f"stage {s + 1} starts with child {k} ({type(children[k]).__name__})")
            for s, k in enumerate(boundaries)
        ]
        leaf_safe(named, writes)
    else:
        costs, first = profile(children, example), trainable_from(children, example)
        if by == "time":
            cuts = balance([c.seconds for c in costs], [1] * p, barred=writes, first=first)
        else:
            held = [order.in_flight(s) for s in range(p)]
            cuts = balance([c.saved_bytes for c in costs], held, [c.grad_bytes for c in costs], writes, first)
    loose([s for s in range(p) if not dense[cuts[s + 1] - 1]])
    return [nn.Sequential(*children[cuts[s] : cuts[s + 1]]) for s in range(p)], tuple(cuts)


def _plan_stages(
    modules: Sequence[nn.Module],
    order: Schedule,
    example: torch.Tensor,
    target: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    budget: int,
    checkpoint: str,
    op_costs: str,
    rerun_modules: bool,
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
            sp, needs[s] = choose(order, base, traces, modules[s], budget, others, checkpoint, rerun_modules)
            chosen[s] = sp if sp is not None or not rounds else chosen[s]
    if all(sp is not None for sp in chosen):
        # a stage that found no plan beside the others kept its first one: check the whole rank
        m = order.n_microbatches
        peaks = _walk(order, tuple(tuple(sp.cost(i, m) for i in range(m)) for sp in chosen if sp)).peak_bytes
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
    balance_by: str = "auto",
    checkpoint: str = "planned",
    op_costs: str = "measured",
    action_cost: ActionCost | None = None,
    rerun_modules: bool = False,
) -> PipelinePlan:
    """Plan a pipeline step of ``model_or_stages`` on ``n_stages`` ranks, ``stages_per_rank``
    stages each (more than one under ``"interleaved-1f1b"``: rank r runs stages r, r + P, ...;
    under ``"zbv"`` always two: stages r and 2P - 1 - r).

    ``model_or_stages`` is a chain (an ``nn.Sequential`` or any module whose children run in
    order), cut into stages (``balance_by``) at the cut whose stages' plans give the shortest
    predicted step within the budget (``"step"``, one stage per rank: searched by
    ``remat.pipeline.cut_search``, every cut of a chain with few, else a descent from the even and
    the two balanced cuts; each stage traced and planned once per place, so planning takes
    longer), or balanced by ``"memory"`` (the saved bytes weighed by the micro-batches each
    stage holds, plus the gradients) or ``"time"``; ``"auto"``: ``"step"`` where each rank runs
    one stage, else ``"memory"``. ``boundaries`` (the first child of each stage after the first)
    fix the cut instead; or the list of stage modules itself. ``example_microbatch`` and
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

    ``rerun_modules=True`` (as ``remat.plan``'s): a region that is exactly one call of one block of
    a stage may run as that block called again, as ``torch.utils.checkpoint`` runs it, instead of
    from remat's tape (no Python per op in backward); the plans are weighed both ways. Under a
    uniform ``checkpoint`` mode, every block that qualifies runs again as its module.
    """
    todo = "pass the model (an instance, not its class), or one module per stage"
    rule = "model_or_stages is an nn.Module to cut, or a list of the stage modules"
    check_modules(model_or_stages, "pipeline.plan", rule, todo)
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
    if not isinstance(rerun_modules, bool):
        raise _fail(
            "rerun_modules must be True or False",
            f"got {rerun_modules!r}",
            "pass rerun_modules=True, or leave it out",
            RematTypeError,
        )
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
    if balance_by == "auto":  # the cut searched with the plans where each rank runs one stage
        balance_by = "step" if order.n_stages == order.n_ranks else "memory"
    searching = balance_by == "step" and boundaries is None and isinstance(model_or_stages, nn.Module)
    with one_thread():
        if searching:
            assert isinstance(model_or_stages, nn.Module)
            with untouched(children_of(model_or_stages)):
                modules, cuts, chosen, needs = searched(
                    model_or_stages,
                    example_microbatch,
                    order,
                    target,
                    loss_fn,
                    budget,
                    checkpoint,
                    op_costs,
                    rerun_modules,
                    per_action,
                )
        else:
            modules, cuts = _cut(model_or_stages, example_microbatch, order, boundaries, balance_by)
            untied(modules, model_or_stages if isinstance(model_or_stages, nn.Module) else None, cuts)
            with untouched(modules):
                chosen, needs = _plan_stages(
                    modules,
                    order,
                    example_microbatch,
                    target,
                    loss_fn,
                    budget,
                    checkpoint,
                    op_costs,
                    rerun_modules,
                )
    if any(sp is None for sp in chosen):
        most: dict[int, int] = {}  # per rank, the most one of its stages needs
        for s, n in enumerate(needs):
            most[order.rank_of(s)] = max(most.get(order.rank_of(s), 0), n)
        if checkpoint != "planned" and order.n_stages > order.n_ranks:  # one plan per stage: walk it
            with one_thread(), untouched(modules):
                every, _ = _plan_stages(
                    modules,
                    order,
                    example_microbatch,
                    target,
                    loss_fn,
                    2**62,
                    checkpoint,
                    op_costs,
                    rerun_modules,
                )
            m = order.n_microbatches
            most = dict(
                enumerate(
                    _walk(
                        order, tuple(tuple(sp.cost(i, m) for i in range(m)) for sp in every if sp)
                    ).peak_bytes
                )
            )
        each = ", ".join(f"rank {r} needs {n} bytes ({format_bytes(n)})" for r, n in sorted(most.items()))
        planned = checkpoint == "planned"
        # the needs are this cut's: another cut may need less (``boundaries=`` fixes one)
        how = f"balanced by {balance_by}" if boundaries is None else "given"
        how = "of all cuts searched, the one needing least beyond the budget" if searching else how
        cut = f"; the cut before children {list(cuts[1:-1])} ({how})"
        raise _fail(
            "budget_per_rank below what some rank needs under any plan of the stages"
            if planned
            else f"budget_per_rank below what some rank needs with checkpoint={checkpoint!r}",
            f"budget {budget} bytes; {each}" + (cut if cuts else ""),
            "raise budget_per_rank, "
            + ("" if searching else "cut elsewhere (boundaries=), ")
            + (
                ""
                if searching or order.n_stages != order.n_ranks
                else "search the cuts (balance_by='step'), "
            )
            + "or use more stages or smaller micro-batches"
            + ("" if planned else ", or checkpoint='planned'"),
        )
    plans = tuple(sp for sp in chosen if sp is not None)
    model = model_or_stages if isinstance(model_or_stages, nn.Module) else tuple(model_or_stages)
    given = balance_by if boundaries is None else "given"
    return PipelinePlan(order, cuts, budget, plans, given, per_action, model)
