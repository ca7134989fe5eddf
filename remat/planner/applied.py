"""The hooks a plan puts on a model for the block of ``Plan.apply``, which copies of the model made
meanwhile leave behind.

A copy made inside the block (``copy.deepcopy``, an EMA's ``torch.optim.swa_utils.AveragedModel``,
``torch.save`` of the whole model) would otherwise take the hooks with it: a deep copy a copy of
the plan's runner, which then checked every later forward of the copy against the traced step,
outside any block and for good; a pickle the runner's local functions, which it cannot write.
The plan belongs to the model for the block, not to its copies: theirs are inert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from remat._errors import RematValueError, message

__all__ = ["Applied", "refuse_second"]


class Applied:
    """A hook of the plan's: calls ``fn``; copied or pickled, an inert hook."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Inert:
        return Inert()

    def __reduce__(self) -> tuple[type[Inert], tuple[()]]:
        return Inert, ()


class Inert:
    """What a copy of the model holds in place of a plan's hook: nothing."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None


def refuse_second(model: nn.Module) -> None:
    """One plan at a time: a second ``apply`` block on a model one holds already would count its
    ops twice (and was refused as a forward that diverged from the traced step)."""
    if any(isinstance(hook, Applied) for hook in model._forward_pre_hooks.values()):
        rule = "a model runs under one plan at a time"
        hint = "leave the open apply block first, or make one plan for both uses"
        raise RematValueError(
            message("plan.apply", rule, f"{type(model).__name__} is in an apply block", hint)
        )
