"""The PipelinePlan: a model cut into stages, each with its recomputation plan per micro-batch, as
plain data that saves and loads.

Why a type apart from ``remat.Plan``: a pipeline step is many one-stage steps on several ranks,
interleaved by the schedule, so what a rank must fit is not one step's peak but that peak plus the
saved bytes of the other micro-batches it holds at once (NOTE [held micro-batches] in
``remat.pipeline.timeline``). A ``PipelinePlan`` keeps, per stage, the static planner's ``Plan``
for one micro-batch (None where nothing is recomputed), whether the last micro-batch runs without
it (``except_last``), the measured costs the pipeline model walks and what each action costs a
rank beyond them (``action_cost``, NOTE [per-action cost]). It holds the model only to
build the stages (``stages``), never in its JSON form: ``load(path, model)`` gives it back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from remat._errors import RematTypeError, RematValueError, message
from remat._files import read_json, writable, write_text
from remat._units import format_bytes, whole
from remat.pipeline.schedule import Schedule, build
from remat.pipeline.split import check_modules, children_of
from remat.pipeline.stage_plan import StagePlan
from remat.pipeline.timeline import ActionCost, Timeline, walk
from remat.planner.plan import Plan

__all__ = ["FORMAT", "PipelinePlan"]

# 2: a stage's transfer_bytes is one micro-batch's output (unless the last stage) and input
# gradient, where /1 stored twice one transfer: a /1 plan's figures would be read wrong, so it is refused
# 3: the per-action cost (action_cost) stored; a /2 plan has none, read as op times only (all zero)
# 4: a stage's sent_bytes (its output as sent); a /3 or /2 plan has none, read as its output_bytes
FORMAT = "remat.pipeline/4"
_READABLE = (FORMAT, "remat.pipeline/3", "remat.pipeline/2")


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline step planned by ``remat.pipeline.plan``: the schedule's ``order`` of actions,
    the cut of the model (``boundaries``: the first child of each stage, then the number of
    children; empty when the stages were given as modules), ``budget_bytes`` per rank and one
    ``StagePlan`` per stage; ``action_cost``, what each action of the schedule costs a rank beyond
    its stage's compute (``remat.pipeline.calibrate``; zero: op times only).
    ``timeline()`` walks the pipeline model; ``stages`` and ``schedule`` run it on torch."""

    order: Schedule
    boundaries: tuple[int, ...]
    budget_bytes: int
    stage_plans: tuple[StagePlan, ...]
    balance: str
    action_cost: ActionCost = ActionCost()
    model: nn.Module | tuple[nn.Module, ...] | None = field(default=None, compare=False, repr=False)

    # -- reading it ---------------------------------------------------------------------------

    def timeline(self) -> Timeline:
        """The pipeline model's walk of the step (makespan, per-rank memory over time, the first
        step's peak and later steps')."""
        m = self.order.n_microbatches
        costs = tuple(tuple(sp.cost(i, m) for i in range(m)) for sp in self.stage_plans)
        return walk(self.order, costs, self.action_cost)

    def __str__(self) -> str:
        line = self.timeline()
        parts = []
        for sp in self.stage_plans:
            what = (
                "no recomputation" if sp.plan is None else f"plan overhead {sp.plan.predicted_overhead:.3f}"
            )
            if sp.plan is not None and sp.except_last:
                what += ", last micro-batch plain"
            parts.append(
                f"rank {sp.rank} stage {sp.stage}: {what}, holds {sp.in_flight}, "
                f"peak {format_bytes(line.peak_bytes[sp.rank])} "
                f"(later steps {format_bytes(line.steady_peak_bytes[sp.rank])})"
            )
        return (
            f"PipelinePlan({self.order.name}, {self.order.n_stages} stages x "
            f"{self.order.n_microbatches} micro-batches, budget {format_bytes(self.budget_bytes)} per rank, "
            f"predicted step {line.makespan * 1e3:.1f} ms"
            + ("" if self.action_cost == ActionCost() else f" with {self.action_cost}")
            + "; "
            + "; ".join(parts)
            + ")"
        )

    def explain(self, file: Any = None) -> None:
        """Print (to ``file``, default stdout) the per-rank table: predicted peak against the
        budget, micro-batches held, ops recomputed, predicted time. It returns nothing."""
        from remat.pipeline.explain import render

        writable(file, "pipeline.explain")
        render(str(self), self.order, self.budget_bytes, self.stage_plans, self.timeline(), file)

    # -- running it ---------------------------------------------------------------------------

    def stage_modules(self) -> tuple[nn.Module, ...]:
        """Each stage's module: a ``nn.Sequential`` of the model's children between the cuts, or
        the module given for it. They share the model's parameters."""
        if self.model is None:
            raise RematValueError(
                message(
                    "pipeline.PipelinePlan",
                    "the plan holds no model to cut",
                    "a plan loaded without one",
                    "pass the model: PipelinePlan.load(path, model)",
                )
            )
        if isinstance(self.model, tuple):
            return self.model
        children, b = children_of(self.model), self.boundaries
        return tuple(nn.Sequential(*children[b[s] : b[s + 1]]) for s in range(len(b) - 1))

    def stages(
        self, rank: int, device: torch.device | str, group: torch.distributed.ProcessGroup | None = None
    ) -> list[Any]:
        """Rank ``rank``'s torch ``PipelineStage``s, whose modules run each micro-batch under its
        stage's plan (``remat.pipeline.execute``)."""
        from remat.pipeline.execute import pipeline_stages

        api = "pipeline.PipelinePlan.stages"
        rank = whole(rank)
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise RematTypeError(
                message(api, "rank is a whole number", f"got {rank!r}", "pass dist.get_rank()")
            )
        try:
            where = torch.device(device)
        except (RuntimeError, TypeError):
            raise RematValueError(
                message(api, "device is a torch device", f"got {device!r}", "pass 'cpu' or 'cuda:0'")
            ) from None
        if where.type == "meta":
            raise RematValueError(
                message(
                    api, "a stage runs on a device that computes", "got meta", "pass 'cpu' or 'cuda:<rank>'"
                )
            )
        mine = [sp for sp in self.stage_plans if sp.rank == rank]
        if not mine:
            raise RematValueError(
                message(
                    "pipeline.PipelinePlan.stages",
                    "no stage runs on this rank",
                    f"rank {rank} of {self.order.n_ranks}",
                    f"pass a rank below {self.order.n_ranks}",
                )
            )
        if group is None and not torch.distributed.is_initialized():
            rule = "stages exchange activations over torch.distributed"
            todo = "call torch.distributed.init_process_group first, or pass group="
            raise RematValueError(message(api, rule, "no process group is initialized", todo))
        if (size := torch.distributed.get_world_size(group)) != self.order.n_ranks:  # gloo aborts later
            rule = "the process group has a process per rank of the plan"
            given = f"the plan runs on {self.order.n_ranks} ranks, the group has {size}"
            todo = f"start {self.order.n_ranks} processes, or plan n_stages for {size} ranks"
            raise RematValueError(message(api, rule, given, todo))
        modules = self.stage_modules()
        return pipeline_stages(
            [(modules[sp.stage], sp) for sp in mine],
            self.order.n_stages,
            self.order.n_microbatches,
            where,
            group,
            split_backward=self.order.split_backward,
        )

    def schedule(self, stages: Sequence[Any], loss_fn: Callable[..., torch.Tensor]) -> Any:
        """The torch schedule object that runs ``stages`` (from ``stages``) as this plan's
        schedule: ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` or
        ``ScheduleZBVZeroBubble``."""
        from remat.pipeline.execute import torch_schedule

        per_rank = self.order.n_stages // self.order.n_ranks
        if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or len(stages) != per_rank:
            listed = isinstance(stages, Sequence) and not isinstance(stages, (str, bytes))
            got = f"{len(stages)} stages" if listed else type(stages).__name__
            raise (RematValueError if listed else RematTypeError)(
                message(
                    "pipeline.PipelinePlan.schedule",
                    f"{self.order.name!r} takes this rank's {per_rank} stage(s)",
                    got,
                    "pass the list PipelinePlan.stages returned for this rank",
                )
            )
        if loss_fn is not None and not callable(loss_fn):  # else torch's schedule calls it mid-step
            rule = "loss_fn must be callable (or None: no loss, as torch's schedules take it)"
            todo = "pass loss_fn(output, target), the function given to remat.pipeline.plan"
            given = f"got {loss_fn!r}"[:200]
            raise RematTypeError(message("pipeline.PipelinePlan.schedule", rule, given, todo))
        from torch.distributed.pipelining.stage import _PipelineStageBase

        if not all(isinstance(stage, _PipelineStageBase) for stage in stages):
            given = ", ".join(sorted({type(st).__name__ for st in stages}))
            raise RematTypeError(
                message(
                    "pipeline.PipelinePlan.schedule",
                    "stages are torch PipelineStage objects",
                    f"got {given}",
                    "pass the list PipelinePlan.stages returned for this rank",
                )
            )
        return torch_schedule(self.order.name, stages, self.order.n_microbatches, loss_fn)

    # -- storing it ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The stable serialized form (``FORMAT``); the model is not part of it."""
        return {
            "format": FORMAT,
            "schedule": self.order.name,
            "n_ranks": self.order.n_ranks,
            "n_stages": self.order.n_stages,
            "n_microbatches": self.order.n_microbatches,
            "boundaries": list(self.boundaries),
            "budget_bytes": self.budget_bytes,
            "balance": self.balance,
            "action_cost": asdict(self.action_cost),
            "stage_plans": [
                {**asdict(sp), "plan": None if sp.plan is None else sp.plan.to_json()}
                for sp in self.stage_plans
            ],
        }

    @classmethod
    def from_json(
        cls, body: dict[str, Any], model: nn.Module | Sequence[nn.Module] | None = None
    ) -> PipelinePlan:
        """The plan ``to_json`` wrote, holding ``model`` to build stages from."""
        if not isinstance(body, dict) or body.get("format") not in _READABLE:
            got = body.get("format") if isinstance(body, dict) else type(body).__name__
            raise RematValueError(
                message(
                    "pipeline.load",
                    f"not a {' or '.join(_READABLE)} plan",
                    f"format {got!r}",
                    "load a file save wrote",
                )
            )
        try:
            # plans written before n_ranks was stored ran one stage per rank
            ranks = int(body["n_ranks"] if "n_ranks" in body else body["n_stages"])
            stage_plans = tuple(
                StagePlan(
                    **{
                        **sp,
                        "plan": None if sp["plan"] is None else Plan.from_json(sp["plan"]),
                        "inputs": (tuple(sp["inputs"][0]), sp["inputs"][1]),
                        "outputs": (tuple(sp["outputs"][0]), sp["outputs"][1]),
                        "parameters": tuple(tuple(shape) for shape in sp.get("parameters", ())),
                    }
                )
                for sp in body["stage_plans"]
            )
            plan = cls(
                build(
                    body["schedule"],
                    ranks,
                    int(body["n_microbatches"]),
                    int(body["n_stages"]) // ranks,
                    api="pipeline.load",
                ),
                tuple(int(b) for b in body["boundaries"]),
                int(body["budget_bytes"]),
                stage_plans,
                str(body["balance"]),
                # /2 plans, written before the per-action cost was stored, had op times only
                ActionCost(**body.get("action_cost", {})),
            )
        except (KeyError, TypeError, ZeroDivisionError, IndexError, ValueError) as err:
            raise RematValueError(
                message("pipeline.load", "the plan file is incomplete or damaged", err, "save the plan again")
            ) from None
        cuts, stages, ranks = plan.boundaries, plan.stage_plans, plan.order.n_ranks
        given_cuts, budget = body["boundaries"], body["budget_bytes"]
        wrong = [
            f"{len(stages)} stage plans for {plan.order.n_stages} stages"
            if len(stages) != plan.order.n_stages
            else "",
            f"budget_bytes {budget!r}" if type(budget) is not int or budget <= 0 else "",
            f"boundaries {list(cuts)} out of order" if cuts != tuple(sorted(cuts)) else "",
            f"boundaries {given_cuts!r}"
            if not isinstance(given_cuts, list) or not all(type(c) is int for c in given_cuts)
            else "",
            *(sp.bad() or "" for sp in stages),
            *(f"stage plan {k} is for stage {sp.stage}" for k, sp in enumerate(stages) if sp.stage != k),
            *(
                f"stage {sp.stage} on rank {sp.rank} of {ranks}"
                for sp in stages
                if sp.rank not in range(ranks)
            ),
        ]
        if given := ", ".join(w for w in wrong if w):
            raise RematValueError(
                message("pipeline.load", "the plan file is incomplete or damaged", given, "save it again")
            )
        if (bad := plan.action_cost.bad()) is not None:
            raise RematValueError(
                message(
                    "pipeline.load",
                    "action_cost's figures are seconds (and seconds per byte): finite and not negative",
                    bad,
                    "save the plan again, or calibrate again",
                )
            )
        return plan.with_model(model) if model is not None else plan

    def with_model(self, model: nn.Module | Sequence[nn.Module]) -> PipelinePlan:
        """This plan holding ``model`` (a module to cut at ``boundaries``, or the stage modules)."""
        rule = "the model is an nn.Module, or a list of the stage modules"
        check_modules(model, "pipeline.PipelinePlan", rule, "pass the model the plan was made for")
        if isinstance(model, nn.Module) and not self.boundaries:
            raise RematTypeError(
                message(
                    "pipeline.PipelinePlan",
                    "this plan was made for stage modules",
                    "one module",
                    "pass the list of stage modules",
                )
            )
        one = isinstance(model, nn.Module)
        given = len(children_of(model)) if isinstance(model, nn.Module) else len(list(model))
        expected, what = (self.boundaries[-1], "children") if one else (self.order.n_stages, "stages")
        if given != expected:
            raise RematValueError(
                message(
                    "pipeline.PipelinePlan",
                    "the model is not the one planned",
                    f"{given} {what} for a plan of {expected}",
                    "pass the model the plan was made for, or plan again",
                )
            )
        held = replace(self, model=model if isinstance(model, nn.Module) else tuple(model))
        for sp, module in zip(self.stage_plans, held.stage_modules(), strict=True):
            shapes = tuple(tuple(p.shape) for p in module.parameters())
            if sp.parameters and shapes != sp.parameters:
                raise RematValueError(
                    message(
                        "pipeline.PipelinePlan",
                        "the model is not the one planned",
                        _unlike(sp.stage, shapes, sp.parameters),
                        "pass the model the plan was made for, or plan again",
                    )
                )
        return held

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON to ``path``."""
        write_text(path, json.dumps(self.to_json(), indent=1) + "\n", "pipeline.save")

    @classmethod
    def load(
        cls, path: str | os.PathLike[str], model: nn.Module | Sequence[nn.Module] | None = None
    ) -> PipelinePlan:
        """The plan ``save`` wrote to ``path``, holding ``model``."""
        body = read_json(path, "pipeline.load", "save")
        return cls.from_json(body, model)


def _unlike(stage: int, shapes: tuple[tuple[int, ...], ...], planned: tuple[tuple[int, ...], ...]) -> str:
    """How stage ``stage``'s parameters' ``shapes`` differ from those ``planned``."""
    if len(shapes) != len(planned):
        return f"stage {stage} has {len(shapes)} parameters, planned {len(planned)}"
    k = next(k for k, (a, b) in enumerate(zip(shapes, planned, strict=True)) if a != b)
    return f"stage {stage}'s parameter {k} is of shape {list(shapes[k])}, planned {list(planned[k])}"
