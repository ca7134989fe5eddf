"""The registry of plan solvers, by name; the CLI and ``remat.planner`` list it rather than a hand-kept list.

A solver is one function ``solve(problem, budget_bytes, **options) -> Solution`` in its own module.
The registry does what every solver would otherwise repeat: it parses the budget, refuses a problem
shape or an option the solver does not take, times the solve, and refuses a plan over the budget.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from remat._errors import RematTypeError, RematValueError, message
from remat._units import parse_bytes
from remat.planner.offload_model import OffloadProblem
from remat.planner.types import Chain, Dag, Problem, Solution

__all__ = ["Solver", "check_options", "get", "names", "register"]

SolveFunction = Callable[..., Solution]


@dataclass(frozen=True)
class Solver:
    """A registered solver: its name, a one-line summary, the problem types it takes."""

    name: str
    summary: str
    problems: tuple[type, ...]
    function: SolveFunction

    def solve(
        self, problem: Problem | OffloadProblem, budget_bytes: int | str, **options: object
    ) -> Solution:
        """Solve ``problem`` under ``budget_bytes`` (an int or a string such as ``"6GB"``)."""
        budget = parse_bytes(budget_bytes, api="plan")
        if not isinstance(problem, self.problems):
            takes = " or ".join(p.__name__ for p in self.problems)
            others = ", ".join(n for n in names() if isinstance(problem, _SOLVERS[n].problems))
            raise RematTypeError(
                message(
                    "plan",
                    f"solver {self.name!r} takes a {takes}",
                    f"got {type(problem).__name__}",
                    f"use {others}",
                )
            )
        check_options(self.name, self.function, options)
        start = time.perf_counter()
        result = self.function(problem, budget, **options)
        if result.predicted_peak_bytes > budget:
            raise RematValueError(
                message(
                    "plan",
                    f"solver {self.name!r} returned a plan over the budget",
                    f"peak {result.predicted_peak_bytes} > {budget} bytes",
                    "report this as a bug and use another solver meanwhile",
                )
            )
        return dataclasses.replace(result, solve_seconds=time.perf_counter() - start)


def check_options(solver: str, function: Callable[..., Any], options: dict[str, object]) -> None:
    """Refuse an option ``function`` (a solver's) does not take, or a value unlike its default's:
    an int option (or an optional one, ``int | None``) takes a whole number of at least 1, a float
    one a number of at least 0 (inf: no limit), a bool one a bool."""
    params = inspect.signature(function).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    known = [p for p, v in params.items() if v.kind is v.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise RematTypeError(
            message(
                "plan",
                f"unknown option for solver {solver!r}",
                f"got {', '.join(unknown)}",
                f"use {', '.join(known) or 'no options'}",
            )
        )
    for name, value in options.items():
        default = params[name].default
        optional_int = str(params[name].annotation).replace(" ", "") in (
            "int|None",
            "None|int",
            "Optional[int]",
        )
        if default is None and value is not None and optional_int:
            default = 1  # an optional whole number (sqrt's ``segments``): None, or as an int option
        if isinstance(default, bool):
            bad = not isinstance(value, bool)
        elif isinstance(default, int):
            bad = isinstance(value, bool) or not isinstance(value, int) or value < 1
        elif isinstance(default, float):
            real = isinstance(value, (int, float)) and not isinstance(value, bool)
            bad = not real or math.isnan(value) or value < 0  # type: ignore[arg-type,operator]
        else:
            continue
        if bad:
            least = "of at least 0" if isinstance(default, float) else "of at least 1"
            kind = "True or False" if isinstance(default, bool) else f"{_a(type(default).__name__)} {least}"
            raise RematValueError(
                message(
                    "plan",
                    f"option {name} of solver {solver!r} must be {kind}",
                    repr(value),
                    f"e.g. {default!r}",
                )
            )


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


_SOLVERS: dict[str, Solver] = {}


def register(
    name: str, summary: str, problems: tuple[type, ...] = (Chain, Dag)
) -> Callable[[SolveFunction], SolveFunction]:
    """Decorator: make the function a solver known as ``name``."""

    def add(function: SolveFunction) -> SolveFunction:
        if name in _SOLVERS:
            raise ValueError(f"a plan solver named {name!r} is already registered")
        _SOLVERS[name] = Solver(name, summary, problems, function)
        return function

    return add


def names() -> tuple[str, ...]:
    """The registered solver names, sorted."""
    return tuple(sorted(_SOLVERS))


def get(name: str) -> Solver:
    """The solver registered as ``name``; a RematValueError listing the known names otherwise (a
    RematTypeError where ``name`` is no string)."""
    if not isinstance(name, str):
        raise RematTypeError(
            message(
                "plan", "a solver is named by a string", f"got {name!r}", f"use one of {', '.join(names())}"
            )
        )
    try:
        return _SOLVERS[name]
    except KeyError:
        raise RematValueError(
            message("plan", "unknown solver", f"got {name!r}", f"use one of {', '.join(names())}")
        ) from None
