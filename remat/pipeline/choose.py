"""Choosing one stage's plan on its rank: every plan the static planner offers the stage is weighed
by the pipeline model with the micro-batches the schedule makes the rank hold at once, and the
cheapest that fits the rank's budget wins (NOTE [stage plans from the frontier]).

``rerun_modules`` (as ``remat.plan``'s): a region that is exactly one call of one module (a block of
the stage) may run as that module called again, as ``torch.utils.checkpoint`` runs it, instead of
being replayed op by op from a tape (NOTE [module re-run] in ``remat.planner.rerun_regions``). The
plans are then found both ways and weighed together; uniform per-block checkpointing
(``checkpoint="always"`` and ``"except_last"``) runs its blocks again as modules wherever they
qualify, which is what torchgpipe and ``torch.utils.checkpoint`` do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from remat._errors import RematValueError, message
from remat.pipeline.schedule import Schedule
from remat.pipeline.stage_plan import StagePlan
from remat.pipeline.timeline import _walk
from remat.planner.api import block_key, plan_at
from remat.planner.frontier import Frontier, frontier
from remat.planner.plan import Plan
from remat.planner.predict import predict
from remat.planner.rerun_regions import rerun_of
from remat.planner.search import Candidate, Step, chain_regions, floor, predicted
from remat.planner.single_level import chain_segments
from remat.trace.types import Trace

__all__ = ["choose", "rank_peak"]


def rank_peak(order: Schedule, sp: StagePlan, others: Sequence[StagePlan | None]) -> int:
    """The pipeline model's peak on ``sp``'s rank with ``sp`` for its stage and ``others[s]`` for
    the other stages (a rank's memory depends on its own stages, and on its neighbours' outputs
    for its receive buffers; where ``others[s]`` is None, ``sp``'s costs stand in)."""
    m = order.n_microbatches
    plans = [sp if s == sp.stage else (others[s] or sp) for s in range(order.n_stages)]
    costs = tuple(tuple(each.cost(i, m) for i in range(m)) for each in plans)
    return _walk(order, costs).peak_bytes[sp.rank]


def _per_block(found: Frontier, module: nn.Module, step: Step | None = None) -> Candidate:
    """Uniform per-block checkpointing of the stage as a plan: each block of ``module`` its own
    region (what ``torch.utils.checkpoint`` around each block does), on ``step`` (by default the
    frontier's: with ``rerun_modules``, each block that qualifies runs again as its module). The
    blocks are the chain's stages that name a module of ``module``: its children, or the members
    of its containers (``nn.ModuleList``, ``nn.ModuleDict``, plain ``nn.Sequential``:
    ``remat.planner.block_key``)."""
    step = found.step if step is None else step
    modules = {name for name, _ in module.named_modules() if name}
    blocks = [(k, k + 1) for k, stage in enumerate(found.chain.stages) if stage.name in modules]
    regions = chain_regions(step, found.chain, chain_segments(found.chain, blocks))
    return Candidate("auto", None, "every block checkpointed", regions, predicted(step, regions))


def _candidates(found: Frontier, module: nn.Module) -> list[Candidate]:
    """The plans weighed for a stage: the frontier's, plain checkpointing's and the chain DP's
    plans near the smallest peak (``floor``), and uniform per-block checkpointing, less each one
    another matches or beats in peak, held bytes and overhead at once (the first of equal ones
    kept). NOTE [stage plans from the frontier] the frontier keeps only the plans no other beats
    in one step's peak and overhead; on a rank holding several micro-batches the bytes a plan
    holds from its forward to its backward count once per micro-batch, so a plan the frontier
    drops (per-block checkpointing beside "every block but the last" at the same peak) may be the
    only one that fits. With ``rerun_modules`` (the frontier's step runs modules again) the
    plain and per-block plans are weighed both ways: on the tape too, since running a module again
    holds what its call holds, which can be more than the tape's replay holds."""
    steps = [found.step]
    if found.step.rerun_modules:
        s = found.step
        steps.insert(0, Step(s.trace, s.key, s.executor, rerun_modules=False))
    tried = [*found.candidates]
    for step in steps:
        tried += [*floor(step, found.chain), _per_block(found, module, step)]

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
    (NOTE [later backwards] in ``remat.pipeline.measure``): its forward ops are the same, and a
    region run again as its module holds that trace's storages of the call's inputs."""
    if later is None:
        return 0
    regions = [
        replace(ops, rerun=rerun_of(later, ops.ops, ops.save)) if ops.rerun else ops
        for _, ops in candidate.regions
    ]
    return predict(later, regions).peak_bytes


def choose(
    order: Schedule,
    base: StagePlan,
    traces: tuple[Trace, Trace | None],
    module: nn.Module,
    budget: int,
    others: Sequence[StagePlan | None],
    checkpoint: str,
    rerun_modules: bool = False,
) -> tuple[StagePlan | None, int]:
    """The stage's plan with the least predicted overhead that fits ``budget`` on its rank beside
    ``others`` (the other stages' plans, as for ``rank_peak``), or None, and the least peak found
    on the rank, from ``base`` (nothing planned). Under a uniform ``checkpoint`` mode, that mode's
    plan and its peak. ``rerun_modules``: see the module doc."""
    lowest = rank_peak(order, base, others)
    if checkpoint == "never" or (checkpoint == "planned" and lowest <= budget):
        return (base if lowest <= budget else None), lowest
    trace, later = traces
    found = frontier(trace, "auto", block_key(module), rerun_modules=rerun_modules)
    # the plan that recomputes nothing, as the stage's figures count it: not the cheapest plan at
    # the plain peak, which may run a module again (the tape checks every op it does not run again)
    nothing = Candidate("auto", None, "nothing recomputed", [], predicted(found.step, []))
    plain = _as_plan(found, nothing)
    if checkpoint != "planned":
        uniform = _per_block(found, module)
        if not uniform.regions:
            raise RematValueError(
                message(
                    "pipeline.plan",
                    f"checkpoint={checkpoint!r} checkpoints each block of a stage, and this one has none",
                    f"stage {base.stage}: {type(module).__name__}",
                    "pass stages made of child modules (an nn.Sequential, or blocks in an nn.ModuleList),"
                    " or checkpoint='planned'",
                )
            )
        sp = replace(_with_plan(base, _as_plan(found, uniform), plain, _later(later, uniform)),
                     except_last=checkpoint == "except_last")  # fmt: skip
        need = rank_peak(order, sp, others)
        return (sp if need <= budget else None), need
    # NOTE [stage plans from the frontier] every plan weighed (``_candidates``: found once, for any
    # one-micro-batch budget) is run on the rank as the schedule runs it; the cheapest that fits
    # wins. A rank budget that one plan meets is then met at every larger budget, and the least
    # peak named in a refusal does not depend on the budget.
    fits = []
    for candidate in _candidates(found, module):
        sp = _with_plan(base, _as_plan(found, candidate), plain, _later(later, candidate))
        need = rank_peak(order, sp, others)
        lowest = min(lowest, need)
        if need <= budget:
            fits.append(sp)
    if not fits:
        return None, lowest
    chosen = min(fits, key=lambda sp: sp.recompute_s)
    last = replace(chosen, except_last=True)
    return (last if rank_peak(order, last, others) <= budget else chosen), lowest
