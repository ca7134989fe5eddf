"""What an op holds beside its tensors, as the dynamic runtime counts it for the core.

NOTE [recompute bytes] Beside its tensors an op accounts, as ``Op.scratch`` (held while it runs),
its kernel's own buffers (learned per op signature on its first run, where the allocator's account
can run: ``remat.aten.scratch``; inside ``remat.memory.track(allocator=True)`` when the track ends,
NOTE [held back] in ``remat._allocator``; until the next region, the reserve covers them, so that the
core and its trace see one figure per op), the generator state a recomputation of a random op saves for the
caller's stream, and the scratch copies of running statistics a recomputed batch norm writes
(NOTE [hidden writes] in ``remat.aten.schema``); and as ``Op.state`` (held to the end of the
region, like a constant) the generator states its recipe keeps. Generator states are host tensors:
they count only in a region on the CPU.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from remat import _allocator, aten
from remat._errors import RematValueError, message
from remat.dynamic.homes import aligned


def recompute_bytes(
    func: Any,
    args: Sequence[Any],
    default: torch.device | None,
    device: torch.device,
    managed: Callable[[torch.Tensor], bool],
) -> int:
    """Bytes a recomputation of ``func`` allocates beside its kernel in a region on ``device``
    (NOTE [recompute bytes]); ``default``: the device whose default generator it draws from;
    ``managed``: whether a tensor is the region's."""
    extra = 0
    if default is not None and device.type == "cpu":
        extra += aligned(aten.state_nbytes(default))
    for i, _ in aten.facts(func).hidden_writes:
        if i < len(args) and isinstance(args[i], torch.Tensor) and managed(args[i]):
            extra += aligned(args[i].untyped_storage().nbytes())
    return extra


def state_bytes(
    default: torch.device | None, explicit: tuple[torch.Generator, ...], device: torch.device
) -> int:
    """Bytes an op's recipe keeps to the end in a region on ``device`` (NOTE [recompute bytes])."""
    if device.type != "cpu":
        return 0  # generator states are host tensors
    sources: list[aten.Source] = [*explicit, *([default] if default is not None else [])]
    return sum(aligned(aten.state_nbytes(source)) for source in sources)


def warn_unmeasured(ops: int, device: torch.device) -> None:
    """Say that ``ops`` ops of the step ran with their kernel's scratch unknown, counted as nothing:
    the allocator's count may pass the budget by it (the reserve is all that covers it)."""
    if not ops:
        return
    if device.type != "cpu":
        why = f"kernels' scratch is not measured on {device.type}; raise reserve= to cover it"
    elif _allocator.ours():
        why = (
            "remat.memory.track(allocator=True) runs the profiler, and learns it when it ends, for the "
            "steps after it; run a step outside the track first, or raise reserve="
        )
    else:
        why = "another profiler session was running; run a step outside it first, or raise reserve="
    warnings.warn(
        f"remat.dynamic: {ops} {'op' if ops == 1 else 'ops'} of this step ran with their kernels' "
        f"scratch unknown, counted as nothing, so the allocator's count may pass the budget by it "
        f"beyond the reserve: {why}",
        stacklevel=3,
    )


def warn_unsized(made: tuple[int, str], reserve: int) -> None:
    """Say that an op ran before its results could be sized (NOTE [room first] in
    ``remat.dynamic.engine``) and made more, with its scratch, than the reserve that covers it."""
    nbytes, op = made
    if nbytes > reserve:
        warnings.warn(
            f"remat.dynamic: {op} ran before its results could be sized (their size depends on the data, "
            f"or no meta kernel tells it) and made {nbytes} bytes with its scratch, more than the reserve "
            f"of {reserve} bytes that covers such ops, so the allocator's count may have passed the budget "
            "by the difference; raise reserve=",
            stacklevel=3,
        )


def resized(func: Any, counted: int, now: int) -> RematValueError:
    """The error for an op that resized a storage the pool counts (``resize_``, ``out=``)."""
    return RematValueError(
        message(
            "dynamic",
            "an op changed the size of a tensor's storage in place, which the budget cannot follow",
            f"{func} took a storage of {counted} bytes to {now}",
            "make the tensor at its final size (not resize_, nor an out= tensor of another size)",
        )
    )
