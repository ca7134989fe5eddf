"""Running a PipelinePlan on torch.distributed.pipelining: stage modules that apply their plan per
micro-batch, wrapped in torch's ``PipelineStage`` and driven by torch's schedule classes.

Why a module around each stage rather than a runtime of our own: torch's schedules already
receive, send, order and backward the micro-batches; what they cannot do is vary the recomputation
by micro-batch. A ``PlannedStage`` knows which micro-batch a forward is for by counting its
forwards (every torch schedule runs a stage's forwards in micro-batch order, 0 to M-1, once per
step), and runs it under its ``remat.Plan`` (``Plan.apply``) or plainly (the last one, with
``except_last``). Recomputation happens in backward through the plan's saved-tensor hooks, not
through the module's forward, so the count is that of the schedule's forwards only; batch norm's
statistics are updated once per micro-batch forward (the replay shields buffers).

torch.distributed.pipelining is imported here only, when stages are built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat._errors import RematValueError, message
from remat.pipeline.plan import StagePlan

__all__ = ["PlannedStage", "pipeline_stages", "torch_schedule"]


class PlannedStage(nn.Module):
    """A stage's module (``body``) whose forwards run under ``stage_plan``, by micro-batch.
    ``forwards`` counts the forwards run since construction."""

    def __init__(self, body: nn.Module, stage_plan: StagePlan, n_microbatches: int) -> None:
        super().__init__()
        self.body = body
        self.stage_plan = stage_plan
        self.n_microbatches = n_microbatches
        self.forwards = 0

    def forward(self, *args: Any) -> Any:
        microbatch = self.forwards % self.n_microbatches
        self.forwards += 1
        plan = self.stage_plan.plan
        if plan is None or not self.stage_plan.recomputes(microbatch, self.n_microbatches):
            return self.body(*args)
        with plan.apply(self.body):
            return self.body(*args)


def pipeline_stages(
    stages: Sequence[tuple[int, nn.Module, StagePlan]],
    n_stages: int,
    n_microbatches: int,
    device: torch.device,
    group: torch.distributed.ProcessGroup | None,
) -> list[Any]:
    """A torch ``PipelineStage`` per ``(stage index, module, stage plan)``."""
    from torch.distributed.pipelining import PipelineStage

    return [
        PipelineStage(PlannedStage(module, sp, n_microbatches), index, n_stages, device, group=group)
        for index, module, sp in stages
    ]


def torch_schedule(
    name: str, stages: Sequence[Any], n_microbatches: int, loss_fn: Callable[..., torch.Tensor]
) -> Any:
    """The torch schedule class for ``name``, over ``stages`` (one per rank)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    if len(stages) != 1 or name not in classes:
        raise RematValueError(
            message(
                "pipeline.PipelinePlan.schedule",
                "a single-stage schedule takes one stage per rank",
                f"{name!r} with {len(stages)} stages",
                "pass the list PipelinePlan.stages returned",
            )
        )
    return classes[name](stages[0], n_microbatches, loss_fn=loss_fn)
