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
kept). NOTE [regions across units]: a region that records one unit's forward and then the next
unit's (a scope around two sharded blocks, or a plan region across a block boundary) replays in
the backward of the later unit, when the earlier unit's parameters are freed; ``hide_fsdp_hooks``
refuses it in forward, naming both units. Keep each region inside one unit (per-block
``remat.checkpoint`` or ``remat.scope``), or shard with ``reshard_after_forward=False``. A region
that starts outside a unit and ends inside it (a plan region from a residual add into the next
block) replays after that unit's parameters are gathered again, and is exact.

Plans are solved from measured op times, which differ from rank to rank; ``broadcast_plan`` gives
every rank the plan one rank solved, so that all ranks recompute the same regions.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from remat._errors import RematRuntimeError, RematTypeError, RematValueError, message
from remat.manual.tape import Tape
from remat.planner.plan import Plan

__all__ = ["broadcast_plan", "hide_fsdp_hooks"]

_FSDP = "torch.distributed.fsdp"


class _Units:
    """What the hooks of one model share: each FSDP2 unit's name, and the open regions in which a
    unit freed its parameters after forward (region tape -> that unit)."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {m: name or type(model).__name__ for name, m in model.named_modules()}
        self.freed_in: weakref.WeakKeyDictionary[Tape, str] = weakref.WeakKeyDictionary()

    def before(self, unit: nn.Module) -> None:
        """A unit's forward starts: refuse it inside a region where another unit freed its
        parameters (NOTE [regions across units])."""
        for tape in _open_tapes():
            freed = self.freed_in.get(tape)
            if freed is not None:
                raise RematRuntimeError(
                    message(
                        "integrations.distributed",
                        "a recomputed region spans FSDP2 units that free their parameters after "
                        "forward; it would recompute from freed parameters in backward",
                        f"{freed} resharded, then {self.names.get(unit, type(unit).__name__)} ran "
                        "in the same region",
                        "recompute each unit in its own region (remat.checkpoint or remat.scope per "
                        "block), or fully_shard with reshard_after_forward=False",
                    )
                )

    def after(self, unit: nn.Module) -> None:
        """A unit's forward ended: note the open regions, if it freed its parameters."""
        from torch.distributed.tensor import DTensor  # imported by fully_shard already

        if any(isinstance(p, DTensor) for p in _own_parameters(unit)):
            for tape in _open_tapes():
                self.freed_in.setdefault(tape, self.names.get(unit, type(unit).__name__))


def _open_tapes() -> list[Tape]:
    """The tapes of the regions recording now: a scope's recorder, or a plan's runner with a
    region open (both keep it as ``tape``)."""
    found = (getattr(mode, "tape", None) for mode in _get_current_dispatch_mode_stack())
    return [tape for tape in found if isinstance(tape, Tape)]


def _own_parameters(unit: nn.Module) -> list[nn.Parameter]:
    """The parameters ``unit`` shards itself: its own and its sub-modules', not those of the FSDP2
    units inside it."""
    from torch.distributed.fsdp import FSDPModule  # imported by fully_shard already

    found = list(unit.parameters(recurse=False))
    for child in unit.children():
        if not isinstance(child, FSDPModule):
            found += _own_parameters(child)
    return found


class _Hidden:
    """An FSDP2 forward hook, run outside every dispatch mode."""

    def __init__(self, hook: Callable[..., Any], units: _Units, pre: bool) -> None:
        self.hook = hook
        self.units = units
        self.pre = pre

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.pre:
            self.units.before(module)
        with _disable_current_modes():
            out = self.hook(module, *args, **kwargs)
        if not self.pre:
            self.units.after(module)
        return out


def _from_fsdp(hook: Any) -> bool:
    return not isinstance(hook, _Hidden) and str(getattr(hook, "__module__", "")).startswith(_FSDP)


def hide_fsdp_hooks(model: nn.Module) -> nn.Module:
    """Run the forward hooks ``fully_shard`` put on ``model`` and its sub-modules outside every
    dispatch mode, so that ``remat.scope`` and ``plan.apply`` see only the model's own ops. Call it
    after the last ``fully_shard``; it returns the model, and a second call changes nothing.

    A region that records past a unit that freed its parameters after forward and into the next
    unit raises RematRuntimeError there, in forward. Dispatch modes of the user's own
    (``remat.memory.track`` without ``allocator=True``) do not see the all-gather buffers; the
    allocator's account (``allocator=True``) does."""
    if not isinstance(model, nn.Module):
        raise RematTypeError(
            message(
                "integrations.distributed.hide_fsdp_hooks",
                "model must be an nn.Module",
                f"got {type(model).__name__}",
                "pass the model after fully_shard",
            )
        )
    units = _Units(model)
    for module in model.modules():
        for hooks, pre in ((module._forward_pre_hooks, True), (module._forward_hooks, False)):
            for key, hook in list(hooks.items()):
                if _from_fsdp(hook):
                    hooks[key] = _Hidden(hook, units, pre)
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
