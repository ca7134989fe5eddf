"""``remat.plan``: trace one training step, solve for the cheapest recomputation under a budget, and
return a Plan the executor runs.

Why a loop around the solver: a solver optimizes over a coarse model of the step (blocks of a
chain, nodes of a DAG) that leaves out what does not depend on the plan (parameter gradients,
backward temporaries) and approximates what does. The plan it returns is checked on the captured
step itself (``remat.planner.predict``, NOTE [region model]); when that peak is over the budget the
solver runs again with its budget lowered by the excess, a few times, so that what is promised is
the peak of the step the executor runs, not of the model. The problem a solver gets: a chain of
blocks (``chain_from_trace``) for ``chain``, ``sqrt``, ``greedy`` and ``auto``; a DAG of ops,
coarsened to blocks (``dag_from_trace``, then ``coarsen`` inside the MILP) for ``milp``. Plans
are single-level (a region is recomputed once, from its inputs), which is what runs in eager
PyTorch without re-entering the model's code. The search itself lives in ``remat.planner.search``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from remat._errors import RematTypeError, RematValueError, message
from remat._state import Leaves, ParametersBack, untouched
from remat._units import format_bytes
from remat.host.link import Link
from remat.manual.buffers import reached
from remat.planner.arguments import MIN, check_flags, check_step, read_budget
from remat.planner.cost_model import ExecutorCost
from remat.planner.frontier import Frontier, floors, frontier
from remat.planner.loss import Inputs, LossFn, step_loss
from remat.planner.lowering import stage_key
from remat.planner.offload_lowering import offload_problem
from remat.planner.offload_model import OffloadProblem
from remat.planner.offload_search import (
    OffloadCandidate,
    check_host,
    mark,
    offload_arguments,
    offload_frontier,
)
from remat.planner.plan import Plan, trainable
from remat.planner.results import first_result
from remat.planner.search import Step, best, decisions, fail
from remat.planner.solvers import get
from remat.trace import capture
from remat.trace.let_go import with_let_go
from remat.trace.types import Trace
from remat.trace.unseen import with_unseen

__all__ = ["BudgetTooSmall", "LossFn", "block_key", "plan", "plan_at", "plan_trace", "trace_step"]


class BudgetTooSmall(RematValueError):
    """No plan fits the budget: ``minimum_bytes`` is the smallest peak a plan reaches, ``where``
    the op that needs it."""

    def __init__(self, text: str, minimum_bytes: int, where: str) -> None:
        super().__init__(text)
        self.minimum_bytes = minimum_bytes
        self.where = where


def trace_step(model: nn.Module, inputs: Inputs, loss_fn: LossFn | None = None, repeats: int = 3) -> Trace:
    """One step of ``model`` (as ``plan`` runs it) under the trace capture, leaving the model's buffers,
    gradients, the RNG and the parameters and inputs its ops write in place as they were (the step's
    batch-norm updates, dropout draws and an embedding's max_norm renorm are undone), and so the gradients
    of every other leaf the backward reaches (an input's, a loss head's) and the buffers of the modules
    ``loss_fn`` holds or is given. On CUDA an untimed step runs first: a kernel's first launch loads its
    module and the allocator is cold, which made the ops that run once in the capture (batch norm,
    in-place ReLU, dropout) cost 0.5 ms each instead of 0.1 (NOTE [CUDA op time] in ``remat.trace.op_time``);
    elsewhere an untimed forward. Either builds what a module builds at its first call and keeps for
    the next (NOTE [built at first call] in ``remat._state``), so that the step traced is the one
    that repeats.
    The forward then runs once more, saving nothing, for when the program lets go of what autograd saved
    (``let_go``, NOTE [let go] in ``remat.trace.let_go``). On CPU the whole step also runs once under the
    allocator's account, for the memory no op made (``unseen_bytes``, NOTE [unseen bytes] in
    ``remat.trace.types``)."""
    check_step(model, loss_fn, repeats)
    if any(torch.nn.parameter.is_lazy(t) for t in [*model.parameters(), *model.buffers()]):
        raise fail(
            "a model is planned with its parameters made (a lazy module makes them at its first call)",
            f"{type(model).__name__} has uninitialized parameters",
            "run one forward first (model(x)), then plan",
        )
    given = (
        list(inputs.values())
        if isinstance(inputs, Mapping)
        else [inputs]
        if isinstance(inputs, torch.Tensor)
        else list(inputs)
    )
    modules = [model, *(reached(loss_fn, given) if loss_fn is not None else ())]
    leaves = Leaves()  # an input's gradient, a loss head's weights': put back too
    # the weights its ops write (an embedding's max_norm), and the inputs, are copied before the first
    # write, in the first step, and written back at the end; the later runs write only what that one wrote
    back = ParametersBack(modules, [t for t in tree_leaves(given) if isinstance(t, torch.Tensor)])

    def first() -> None:
        with back:
            step()

    def step() -> None:
        leaves.note(step_loss(model, inputs, loss_fn)).backward()

    try:
        if any(p.is_cuda for p in model.parameters()):
            with untouched(modules, leaves):
                model.zero_grad(set_to_none=True)
                first()
        else:  # what a module builds at its first call is built before the step is traced
            with untouched(modules), back:
                step_loss(model, inputs, loss_fn)
        torch.clear_autocast_cache()  # the traced step casts the weights again, as each step does
        with untouched(modules, leaves):
            model.zero_grad(set_to_none=True)
            trace = capture(first, name=type(model).__name__, repeats=repeats)
        with untouched(modules):  # the same forward again, from the same state (NOTE [let go])
            trace = with_let_go(trace, lambda: step_loss(model, inputs, loss_fn))
        with untouched(modules, leaves):  # the allocator's own count of the step (NOTE [unseen bytes])
            model.zero_grad(set_to_none=True)
            return with_unseen(trace, step)
    finally:
        back.restore()


def block_key(model: nn.Module) -> Callable[[str], str]:
    """The block a module path (as the capture names it) belongs to, from the model's structure:
    the child of the first container (``nn.ModuleList``, ``nn.ModuleDict``, plain ``nn.Sequential``)
    on the path, so ``transformer.h.3.attn`` -> ``transformer.h.3``; a subclass of ``nn.Sequential``
    (a block written as a Sequential, such as a U-Net's double convolution) is a block itself, so
    ``inc.0`` -> ``inc``. Paths the model does not have fall back to ``stage_key``."""
    modules = dict(model.named_modules())
    containers = (nn.ModuleList, nn.ModuleDict)

    def key(path: str) -> str:
        if not path or path not in modules:
            return stage_key(path)
        parts = path.split(".")
        for i in range(len(parts)):
            parent = modules[".".join(parts[:i])] if i else model
            if isinstance(parent, containers) or type(parent) is nn.Sequential:
                return ".".join(parts[: i + 1]) if i else parts[0]
            if isinstance(parent, nn.Sequential) and i:
                return ".".join(parts[:i])
        return stage_key(path)

    return key


def plan_trace(
    trace: Trace,
    budget: int | float | str,
    *,
    solver: str = "auto",
    block_key: Callable[[str], str] | None = None,
    link: Link | None = None,
    host_budget: int | str | None = None,
    executor_cost: ExecutorCost | None = None,
    rerun_modules: bool = False,
    within_blocks: bool = False,
    **options: Any,
) -> Plan:
    """The plan for a captured step (see ``plan``); ``options`` go to the solver. Each solver's
    candidates are found for every budget at once (``remat.planner.frontier``, NOTE [monotone
    plans]), so more budget never gives a costlier plan. ``auto`` weighs the chain DP's and
    greedy's plans on the chain of blocks (and on a finer chain), plain checkpointing (every
    block, every layer, sqrt(n) segments), each also keeping matmul, convolution and attention
    outputs, and those (lowest first) keeping what they would replay wherever the step's peak
    leaves room (``remat.planner.room``). ``block_key`` maps a module path to its block (default
    ``stage_key``; ``plan`` passes ``block_key(model)``).

    Of the plans that fit, the one with the least predicted overhead wins, with a stable tie rule
    (NOTE [plan ties]): of two plans within a relative 0.1% of each other, the one of the first
    solver in the fixed order chain, greedy, milp, sqrt, then plain checkpointing, then the one
    with the lower predicted peak, then the first tried, is preferred where it fits. So for a
    given trace, and so for given op costs, the pick is always the same.

    ``executor_cost``: the executor's own per-op figures every plan is predicted with (NOTE
    [executor cost]); by default those measured on the trace's device once per process
    (``remat.planner.executor_cost``). Pass fixed figures for a pick that depends on the trace
    alone, ``ExecutorCost()`` to leave the executor out."""
    if not isinstance(trace, Trace):
        raise fail(
            "plan_trace takes a captured step",
            f"got {type(trace).__name__}",
            "pass remat.planner.trace_step(model, inputs)'s trace, or call remat.plan(model, inputs, budget)",
            RematTypeError,
        )
    check_flags(rerun_modules=rerun_modules, within_blocks=within_blocks)
    if block_key is not None and not callable(block_key):
        raise fail("block_key maps a module path to its block", repr(block_key), "pass a function, or None")
    if executor_cost is not None and not isinstance(executor_cost, ExecutorCost):
        given = type(executor_cost).__name__
        raise fail(
            "executor_cost must be an ExecutorCost", given, "pass remat.planner's ExecutorCost, or None"
        )
    three_way = OffloadProblem in get(solver).problems
    host = offload_arguments(solver, three_way, link, host_budget)
    flags = {"rerun_modules": rerun_modules, "within_blocks": within_blocks}
    if not three_way:
        found = frontier(trace, solver, block_key, executor_cost=executor_cost, **flags, **options)
        return plan_at(found, budget, link=link, host_budget=host)
    # a three-way solver adds its moves to recomputation's plans too (``offload_search``)
    found = frontier(trace, "auto", block_key, executor_cost=executor_cost, **flags)
    return plan_at(found, budget, link=link, host_budget=host, options=options, solver=solver)


def plan_at(
    found: Frontier,
    budget: int | float | str,
    *,
    link: Link | None = None,
    host_budget: int | None = None,
    options: dict[str, Any] | None = None,
    solver: str | None = None,
) -> Plan:
    """The plan ``plan_trace`` returns at ``budget`` from ``found``'s candidates: the cheapest that
    fits (NOTE [monotone plans]); the Pareto sweep finds the candidates once and picks per point.
    With ``link``, offload's plans over it compete too, found once for every budget
    (``remat.planner.offload_search.offload_frontier``; pass a frontier made by it to pick at many
    budgets); ``solver`` names the three-way solver that finds them (default ``found``'s own)."""
    solver = solver or found.solver
    if link is not None and (found.link, found.host_budget) != (link, host_budget):
        found = offload_frontier(found, link, host_budget, solver, options)
    step, chain, baseline, link = found.step, found.chain, found.baseline, found.link
    limit, tried = read_budget(budget), list(found.candidates)
    if limit == MIN and not tried:
        raise fail(f"solver {solver!r} found no plan", 'budget "min"', "use solver='auto'")
    if limit == MIN:  # the lowest plan of this search (NOTE in ``remat.planner.arguments``)
        budget_bytes = min(c.pred.peak_bytes for c in tried)
    else:
        budget_bytes = int(limit * baseline) if isinstance(limit, float) else limit
    fits = [c for c in tried if c.pred.peak_bytes <= budget_bytes]
    if not fits and link is not None:
        problem = offload_problem(step.trace, link, host_budget=found.host_budget, key=step.key)
        check_host(step, problem, budget_bytes, baseline, solver, options or {})
    if not fits:
        # another solver than auto names auto's minimum too: the step's, whoever plans it
        known = tried if solver == "auto" else [*tried, *floors(step, chain), *_auto(step).candidates]
        lowest = min(known, key=lambda c: c.pred.peak_bytes).pred
        if budget_bytes < lowest.peak_bytes:
            own = min((c.pred.peak_bytes for c in tried), default=None)  # the solver's own plans
            theirs = ""
            if solver != "auto" and (own is None or own > lowest.peak_bytes):
                reach = "finds no plan" if own is None else f"itself reaches {own} bytes at least"
                theirs = f"; solver {solver!r} {reach} (solver='auto' reaches the minimum)"
            host = found.host_budget
            text = message(
                "plan",
                "budget below the smallest feasible peak",
                f"budget {budget_bytes} < {lowest.peak_bytes} bytes, {format_bytes(lowest.peak_bytes)}"
                + (f", host_budget {host} bytes" if host is not None else ""),
                f"the minimum is {lowest.peak_bytes} bytes (needed by {lowest.peak_at}){theirs}; "
                + ("raise the budget or host_budget" if host is not None else "raise the budget")
                + " or shrink the batch",
            )
            raise BudgetTooSmall(text, lowest.peak_bytes, lowest.peak_at)
        found_text = (
            f"its lowest peak was {min(c.pred.peak_bytes for c in tried)} bytes" if tried else "it found none"
        )
        raise fail(
            f"solver {solver!r} found no plan within the budget",
            f"budget {budget_bytes} bytes; {found_text}",
            f"use solver='auto' (plans from {lowest.peak_bytes} bytes) or raise the budget",
        )
    chosen = best(fits)
    tensors = decisions(step, chosen.regions, chosen.pred, chosen.solver)
    notes = chosen.notes
    if solver == "auto":
        picked = chosen.solver if chosen.solver != "auto" else chosen.notes
        notes = f"auto picked {picked} of {len(tried)} plans; {notes}"
    return Plan(
        name=step.trace.name,
        solver=chosen.solver,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=chosen.pred.peak_bytes,
        predicted_overhead=chosen.pred.overhead,
        baseline_peak_bytes=baseline,
        peak_at=chosen.pred.peak_at,
        solve_seconds=found.seconds,
        gap=chosen.gap,
        regions=tuple(r for r, _ in chosen.regions),
        tensors=mark(step, tensors, chosen) if isinstance(chosen, OffloadCandidate) else tensors,
        ops=tuple(op.name for op in step.forward),
        modules=tuple(op.module for op in step.forward),
        shapes=tuple(first_result(step.trace, op) for op in step.forward),
        notes=notes,
        predicted_held_bytes=chosen.pred.held_bytes,
        link=link,
        host_budget=found.host_budget if link is not None else None,
        predicted_stall=chosen.stall if isinstance(chosen, OffloadCandidate) else 0.0,
        predicted_executor_overhead=chosen.pred.executor_overhead,
        device=step.trace.device,
    )


def plan(
    model: nn.Module,
    example_inputs: Inputs,
    budget: int | float | str,
    *,
    loss_fn: LossFn | None = None,
    solver: str = "auto",
    repeats: int = 3,
    link: Link | None = None,
    host_budget: int | str | None = None,
    executor_cost: ExecutorCost | None = None,
    rerun_modules: bool = False,
    within_blocks: bool = False,
    **options: Any,
) -> Plan:
    """Plan the recomputation of one training step of ``model`` under ``budget``.

    ``budget`` is bytes (an int or a string such as ``"2GB"``), a ratio (a float in (0, 1]) of
    the step's peak with no recomputation, or ``"min"``: the plan of the smallest peak the search
    finds (the minimum a ``BudgetTooSmall`` names, taken from this capture's plans); the peak
    counted is that of the memory the step adds, tensors and kernels' scratch buffers
    (``remat.memory.track(allocator=True)`` around forward and backward).
    ``loss_fn(model, *example_inputs)``
    (``**example_inputs`` for a mapping) returns the scalar loss; by default the model's output
    or its ``.loss``. ``solver`` is a name from ``remat.planner.solvers.names()`` and ``options``
    go to it (``time_limit`` and ``max_nodes`` for ``milp``, ``slots`` for ``chain``).

    ``link=remat.Link(...)`` lets the plan offload saved tensors to host memory as well (SAVE,
    RECOMPUTE or OFFLOAD per saved tensor, ``remat.planner.offload_model``), with at most
    ``host_budget`` bytes on the host (default: no limit); without ``link`` it only recomputes.

    The predicted overhead counts the executor's own time besides the kernels (its per-op check,
    the regions' tapes and replays, the offloader's per-tensor bookkeeping), at ``executor_cost``
    (``remat.planner.ExecutorCost``) or, by default, at figures measured once per process on the model's
    device (see ``plan_trace``).

    ``rerun_modules=True``: a region that is exactly one call of one module (a transformer layer,
    a block) and keeps nothing runs as ``torch.utils.checkpoint`` runs it, the module called again
    in backward, with no Python call per op in forward or backward (NOTE [module re-run]); other
    regions replay their ops from a tape. As with ``torch.utils.checkpoint``, the module's forward
    must do the same when called again: no Python state it changes or reads that changes between
    the calls (pass ``use_cache=False`` to a ``transformers`` model: its cache grows at every
    call). Random numbers of the default generators are drawn again the same; a tensor the call
    read and that was written since, or a tensor made again with another shape or dtype than the
    forward's, raises RecomputationError.

    The step runs once on the example inputs, ``repeats`` times per op to time it; the model's
    parameters, buffers, gradients, the RNG and the example inputs (a model may write its input in
    place) are left as they were. Run the plan with
    ``with plan.apply(model): ...``.
    """
    check_step(model, loss_fn, repeats)
    if not isinstance(example_inputs, (torch.Tensor, Sequence, Mapping)) or isinstance(example_inputs, str):
        raise fail(
            "example_inputs must be a tensor, a sequence or a mapping",
            f"got {type(example_inputs).__name__}",
            "pass the inputs of one step as a tuple",
            RematTypeError,
        )
    read_budget(budget)
    get(solver)
    check_flags(rerun_modules=rerun_modules, within_blocks=within_blocks)
    trace, flags = trace_step(model, example_inputs, loss_fn, repeats), trainable(model)
    made = plan_trace(
        trace,
        budget,
        solver=solver,
        block_key=block_key(model),
        link=link,
        host_budget=host_budget,
        executor_cost=executor_cost,
        rerun_modules=rerun_modules,
        within_blocks=within_blocks,
        **options,
    )
    return dataclasses.replace(made, trainable=flags)


def _auto(step: Step) -> Frontier:
    """``auto``'s candidates on ``step``'s trace, as ``step`` plans (its blocks, executor figures
    and module re-runs): where another solver was asked, what its error names as the minimum."""
    return frontier(
        step.trace, "auto", step.key, executor_cost=step.executor, rerun_modules=step.rerun_modules
    )
