"""``remat.plan``'s arguments, checked before any work: the model and loss, the flags, the budget.

A budget is bytes (an int or a size string such as ``"2GB"``), a ratio in (0, 1] of the step's
plain peak, or ``"min"``: the smallest peak any plan reaches, the figure a ``BudgetTooSmall``
error names. That figure depends on the op times the step was captured with (the search keeps
the cheapest plans at each peak, and a capture measures the times anew), so a minimum read from
one error may not be met by the next capture's plans; ``"min"`` takes the lowest plan of the
search that runs, whatever it is.
"""

from __future__ import annotations

from typing import Final, Literal

from torch import nn

from remat._errors import RematTypeError, RematValueError
from remat._units import parse_budget
from remat._units import whole as as_whole
from remat.planner.search import fail

MIN: Final = "min"
"""The budget of the plan with the smallest predicted peak."""

Budget = int | float | Literal["min"]


def read_budget(budget: object, api: str = "plan") -> Budget:
    """Bytes (int), a ratio (float) or :data:`MIN`; a clear error for anything else."""
    if isinstance(budget, str) and budget.strip().lower() == MIN:
        return MIN
    try:
        return parse_budget(budget, api=api)
    except RematValueError as error:  # the size parser's own rule, and the third form named
        raise type(error)(f'{error}; or "min" for the smallest peak a plan reaches') from None


def check_step(model: object, loss_fn: object, repeats: object) -> None:
    if not isinstance(model, nn.Module):
        raise fail(
            "model must be an nn.Module", f"got {type(model).__name__}", "pass the model", RematTypeError
        )
    if loss_fn is not None and not callable(loss_fn):
        raise fail(
            "loss_fn must be callable",
            f"got {type(loss_fn).__name__}",
            "pass loss_fn(model, *inputs)",
            RematTypeError,
        )
    repeats = as_whole(repeats)  # NumPy's integers as Python's
    whole = isinstance(repeats, int) and not isinstance(repeats, bool)
    if not whole or repeats < 1:  # type: ignore[operator]
        raise fail(
            "repeats (timed runs per op) must be a whole number of at least 1",
            f"got {repeats!r}",
            "pass e.g. repeats=3",
            RematValueError if whole else RematTypeError,
        )


def check_flags(**flags: object) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            rule, todo = f"{name} must be True or False", f"pass {name}=True, or leave it out"
            raise fail(rule, f"got {value!r}", todo, RematTypeError)
