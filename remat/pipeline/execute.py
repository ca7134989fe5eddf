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

NOTE [whole backward at I] Under a schedule that splits the backward (``zbv``: ``I`` for the input
gradient, ``W`` for the weights), each stage runs a micro-batch's whole backward at ``I`` and has
nothing left for ``W``: torch's stage does that when given a ``dw_builder``, here one that builds a
runner with nothing to do. torch's own split (``stage_backward_input`` keeping the autograd graph,
``stage_backward_weight`` running it again from the nodes where parameters join) replays a
recomputed region once in ``I`` and once more for every parameter group that reads it in ``W``
(each is an ``autograd.grad`` call of its own), and holds from ``I`` to ``W`` every tensor the
forward saved and the gradient at each of those nodes, figures the pipeline model would need
measured. Whole at ``I``, a micro-batch's plan recomputes once, frees its saved tensors at ``I`` as
a ``B`` does, and the order of every stage's actions is still ZBV's.

torch.distributed.pipelining is imported here only, when stages are built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from remat._errors import RematValueError, message
from remat.aten import describe, dtype_name
from remat.pipeline.stage_plan import StagePlan

__all__ = ["PlannedStage", "pipeline_stages", "sendable", "torch_schedule", "torch_stage"]


class PlannedStage(nn.Module):
    """A stage's module (``body``) whose forwards run under ``stage_plan``, by micro-batch.
    ``forwards`` counts the forwards run since construction."""

    def __init__(self, body: nn.Module, stage_plan: StagePlan, n_microbatches: int) -> None:
        super().__init__()
        self.body = body
        self.stage_plan = stage_plan
        self.n_microbatches = n_microbatches
        self.forwards = 0
        self.trained = [m for m in body.modules() if m.training]  # the modules that train as planned

    def forward(self, *args: Any) -> Any:
        microbatch = self.forwards % self.n_microbatches
        self.forwards += 1
        shape, dtype = self.stage_plan.inputs
        if (
            args
            and isinstance(x := args[0], torch.Tensor)
            and (tuple(x.shape), dtype_name(x.dtype)) != (shape, dtype)
        ):
            raise RematValueError(
                message(
                    "pipeline",
                    "each micro-batch has the shape and dtype the plan was made for",
                    f"stage {self.stage_plan.stage}: {describe(x.dtype, x.shape)}, planned {dtype}{[*shape]}",
                    "pass a batch that splits into n_microbatches micro-batches of that shape, or plan again",
                )
            )
        plan = self.stage_plan.plan
        # a module put in eval mode since (validation, torch's ``schedule.eval``, which runs with
        # grad enabled): no backward follows, and the plan's step, traced in training, is not what
        # the stage runs
        evaluating = not all(m.training for m in self.trained)
        if plan is None or evaluating or not self.stage_plan.recomputes(microbatch, self.n_microbatches):
            return sendable(self.body(*args))
        with plan.apply(self.body):
            return sendable(self.body(*args))


def sendable(out: Any) -> Any:
    """The stage's output as torch sends it: one contiguous tensor (a transpose or a slice is copied)."""
    return out.contiguous() if isinstance(out, torch.Tensor) else out


def _nothing_left() -> Callable[[], None]:
    """The weight-gradient runner of a micro-batch whose backward ran whole (NOTE [whole backward
    at I])."""
    return _no_weights


def _no_weights() -> None:
    return None


def torch_stage(
    module: nn.Module,
    stage_plan: StagePlan,
    n_stages: int,
    device: torch.device,
    group: torch.distributed.ProcessGroup | None = None,
    split_backward: bool = False,
) -> Any:
    """A torch ``PipelineStage`` running ``module`` as ``stage_plan``'s stage, told the shapes it
    receives and sends (a stage left to infer them runs a forward on empty tensors, which would
    count as a micro-batch and update batch norm's statistics with garbage). Under a schedule
    that splits the backward (``split_backward``), the whole backward runs at ``I`` (NOTE [whole
    backward at I])."""
    from torch.distributed.pipelining import PipelineStage

    def meta(end: tuple[tuple[int, ...], str], grad: bool) -> torch.Tensor:
        t = torch.empty(end[0], dtype=getattr(torch, end[1]), device="meta")
        return t.requires_grad_(grad and t.is_floating_point())

    extra: dict[str, Any] = {"dw_builder": _nothing_left} if split_backward else {}  # torch 2.6 on
    return PipelineStage(
        module,
        stage_plan.stage,
        n_stages,
        device,
        input_args=meta(stage_plan.inputs, stage_plan.stage > 0),
        output_args=meta(stage_plan.outputs, True),
        group=group,
        **extra,
    )


def pipeline_stages(
    stages: Sequence[tuple[nn.Module, StagePlan]],
    n_stages: int,
    n_microbatches: int,
    device: torch.device,
    group: torch.distributed.ProcessGroup | None,
    split_backward: bool = False,
) -> list[Any]:
    """A torch ``PipelineStage`` per ``(module, stage plan)``, running the plan (``split_backward``:
    as for ``torch_stage``)."""
    return [
        torch_stage(PlannedStage(m, sp, n_microbatches), sp, n_stages, device, group, split_backward)
        for m, sp in stages
    ]


def _compact(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``loss_fn`` returning its loss in a storage of its own size.

    NOTE [compact losses] The schedule keeps every micro-batch's loss until the step ends (and
    hands them to the caller), and ``mse_loss`` or ``smooth_l1_loss`` return theirs in the storage
    of their elementwise losses, as large as their input: a copy (one scalar, its gradient passed
    through unchanged) lets that go at once, as the pipeline model counts."""

    def compact(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(output, target)
        return loss.clone() if loss.untyped_storage().nbytes() > loss.nbytes else loss

    return compact


def torch_schedule(
    name: str, stages: Sequence[Any], n_microbatches: int, loss_fn: Callable[..., torch.Tensor]
) -> Any:
    """The torch schedule class for ``name``, over ``stages`` (this rank's, in stage order), its
    losses from ``loss_fn`` (NOTE [compact losses])."""
    from torch.distributed import pipelining
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    loss_fn = _compact(loss_fn)
    if name == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(list(stages), n_microbatches, loss_fn=loss_fn)
    if name == "zbv":
        zbv = getattr(pipelining, "ScheduleZBVZeroBubble", None)  # torch 2.6 on
        if zbv is None:
            raise RematValueError(
                message(
                    "pipeline.PipelinePlan.schedule",
                    "the zbv schedule needs torch.distributed.pipelining.ScheduleZBVZeroBubble",
                    f"torch {torch.__version__}",
                    "install torch 2.6 or later, or plan another schedule",
                )
            )
        return zbv(list(stages), n_microbatches, loss_fn=loss_fn)
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
