"""remat inside torch.distributed's data parallelism: FSDP2's forward hooks kept out of remat's view,
and one plan for every rank.

DDP (``DistributedDataParallel``) needs nothing: its collectives run in backward, from autograd
hooks on the parameters, and remat's forms recompute inside the wrapped module. FSDP2
(``fully_shard``) all-gathers a module's parameters in a forward pre-hook and frees them again in a
forward hook (``reshard_after_forward=True``). Those hooks run inside whatever dispatch modes are
active, so ``remat.scope`` records the all-gather and its copies on its tape, and ``plan.apply``
counts them as ops of the model, which the traced step (of the plain model) does not have.
``hide_fsdp_hooks`` runs FSDP2's forward hooks outside every dispatch mode: remat then sees the
module's own ops only, and the parameters as tensors from outside the region, as with no FSDP.

Why recomputation stays exact under resharding: a recomputation of a region that lies inside one
FSDP unit runs in that unit's backward, after FSDP2's pre-backward hook has all-gathered its
parameters again into the same tensors (their storage is reallocated, their version counters are
kept). A region that spans units (a scope around two sharded blocks, or a plan region across a
block boundary) replays in the backward of its last unit, when the earlier units' parameters are
freed: keep each region inside one unit (per-block ``remat.checkpoint`` or ``remat.scope``), or
shard with ``reshard_after_forward=False``.

Plans are solved from measured op times, which differ from rank to rank; ``broadcast_plan`` gives
every rank the plan one rank solved, so that all ranks recompute the same regions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from remat._errors import RematTypeError, RematValueError, message
from remat.planner.plan import Plan

__all__ = ["broadcast_plan", "hide_fsdp_hooks"]

_FSDP = "torch.distributed.fsdp"


class _Hidden:
    """An FSDP2 forward hook, run outside every dispatch mode."""

    def __init__(self, hook: Callable[..., Any]) -> None:
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return self.hook(*args, **kwargs)


def _from_fsdp(hook: Any) -> bool:
    return not isinstance(hook, _Hidden) and str(getattr(hook, "__module__", "")).startswith(_FSDP)


def hide_fsdp_hooks(model: nn.Module) -> nn.Module:
    """Run the forward hooks ``fully_shard`` put on ``model`` and its sub-modules outside every
    dispatch mode, so that ``remat.scope`` and ``plan.apply`` see only the model's own ops. Call it
    after the last ``fully_shard``; it returns the model, and a second call changes nothing.

    Dispatch modes of the user's own (``remat.memory.track`` without ``allocator=True``) do not see
    the all-gather buffers either; the allocator's account (``allocator=True``) does."""
    if not isinstance(model, nn.Module):
        raise RematTypeError(
            message(
                "integrations.distributed.hide_fsdp_hooks",
                "model must be an nn.Module",
                f"got {type(model).__name__}",
                "pass the model after fully_shard",
            )
        )
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key, hook in list(hooks.items()):
                if _from_fsdp(hook):
                    hooks[key] = _Hidden(hook)
    return model


def broadcast_plan(plan: Plan | None, src: int = 0, group: dist.ProcessGroup | None = None) -> Plan:
    """Every rank of ``group`` gets the plan of rank ``src`` (a global rank); the other ranks may
    pass None, so that only ``src`` plans: ``plan = broadcast_plan(remat.plan(...) if rank == 0
    else None)``."""
    api = "integrations.distributed.broadcast_plan"
    if not dist.is_initialized():
        raise RematValueError(
            message(
                api, "torch.distributed must be initialized", "no process group", "call init_process_group"
            )
        )
    mine = dist.get_rank() == src
    if mine and not isinstance(plan, Plan):
        raise RematTypeError(
            message(
                api,
                "the source rank must pass a Plan",
                f"rank {src} got {type(plan).__name__}",
                "pass remat.plan(...)",
            )
        )
    box: list[Any] = [plan.to_json() if mine and plan is not None else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return Plan.from_json(box[0])
