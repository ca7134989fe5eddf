"""Run a Plan's OFFLOAD decisions: the saved outputs of the planned ops wait in host memory.

Why beside ``remat.planner.execute`` and not in it: recomputation works through regions' tapes,
offload through saved-tensor hooks around the whole forward, and the two meet only in the op count
(the executor's dispatch mode knows which op of the traced step is running). So this module gives
the executor a dispatch mode that also notes the storages the planned ops make, and wraps the run
in the pack and unpack hooks of ``remat.host`` (``OffloadRegion``, ``Offloader``): a saved tensor
whose storage a planned op made goes to the host pool when autograd saves it, and comes back when
backward unpacks it. Regions' own hooks are innermost while they record, so what a region packs
stays its own (the planner never offloads a tensor a recomputed region reads).

NOTE [plan prefetch] The offloader brings tensors back ``PREFETCH`` ahead in backward order: when
backward first unpacks a moved storage, the copies back of the ``PREFETCH`` storages moved out just
before it that backward has not unpacked yet start (on CUDA on the side stream, behind backward's
compute; on CPU at once). The plan's prediction walks the same rule over the step's first unpacks
(``remat.planner.offload_timing``, NOTE [moves on the step]), so the device holds at most what the
plan predicts.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from remat import aten
from remat._dispatch import saved_hooks
from remat.host.link import Link
from remat.host.offloader import Offloader
from remat.host.parcel import unmovable
from remat.host.region import Makers, OffloadRegion
from remat.manual.fused import ReplayMode
from remat.planner.execute import _Runner, apply
from remat.planner.regions import Region
from remat.policy import Decision

__all__ = ["PREFETCH", "apply_offload"]

PREFETCH = 2  # storages brought back ahead of backward's demand (NOTE [plan prefetch])


class _PlannedMakers(Makers):
    """The storages the planned ops made, each decided OFFLOAD (filled by ``_OffloadRunner``, not
    run as a dispatch mode)."""

    def note(self, func: Any, out: Any) -> None:
        fresh = aten.facts(func).fresh_returns
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and (i >= len(fresh) or fresh[i]) and unmovable(o) is None:
                storage = o.untyped_storage()
                self.made[o.device, storage.data_ptr()] = (weakref.ref(storage), Decision.OFFLOAD)


class _Hooks:
    """The pack and unpack hooks of ``remat.host``, with the executor's op count paused while a
    tensor moves: the copy's own ops are no ops of the model."""

    steps_aside = True  # the executor lets these hooks run around the model (``remat.planner.foreign``)

    def __init__(self, region: OffloadRegion) -> None:
        self.region = region
        self.runner: _Runner | None = None

    def pack(self, t: torch.Tensor) -> Any:
        runner = self.runner
        active = runner is not None and runner.active
        if runner is not None:
            runner.active = False
        try:
            return self.region.pack(t)
        finally:
            if runner is not None:
                runner.active = active

    def unpack(self, packed: Any) -> torch.Tensor:
        return self.region.unpack(packed)


class _OffloadRunner(_Runner):
    """The executor's dispatch mode, noting the outputs of the ops at ``positions``."""

    def __init__(self, *args: Any, positions: frozenset[int], makers: _PlannedMakers, hooks: _Hooks) -> None:
        super().__init__(*args)
        self.positions = positions
        self.makers = makers
        hooks.runner = self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        position = self.position
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.position == position + 1 and position in self.positions:
            self.makers.note(func, out)
        return out


@contextlib.contextmanager
def apply_offload(
    regions: Sequence[Region],
    ops: Sequence[str],
    modules: Sequence[str],
    model: torch.nn.Module,
    replay: ReplayMode,
    positions: frozenset[int],
    link: Link | None,
    shapes: Sequence[str] = (),
    host_budget: int | None = None,
) -> Iterator[None]:
    """``remat.planner.execute.apply`` with the saved outputs of the forward ops at ``positions``
    offloaded over ``link``, the host holding at most ``host_budget`` bytes (None: no limit)."""
    makers = _PlannedMakers(None)
    offloader = Offloader(link=link, prefetch=PREFETCH, host_budget=host_budget)
    offloader.pool.api = "plan.apply"
    offloader.pool.todo = "plan again with a larger host_budget=, or host_budget=None"
    hooks = _Hooks(OffloadRegion(makers, offloader, demanded=True))
    make = functools.partial(_OffloadRunner, positions=positions, makers=makers, hooks=hooks)
    with (
        saved_hooks(hooks.pack, hooks.unpack),
        apply(regions, ops, modules, model, replay, make, shapes),
    ):
        yield
