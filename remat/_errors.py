"""Error types of remat, and the one message format they all use.

Every error remat raises reads ``remat.<api>: <rule> (<what was given>); <what to do>`` so that a
user sees which entry point refused, why, with which value, and how to fix it.
"""

from __future__ import annotations


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class RematValueError(RematError, ValueError):
    """A value is outside what the API accepts (a budget, a segment count, a file line)."""


class RematTypeError(RematError, TypeError):
    """An argument has the wrong type (a non-callable function, a ratio where bytes are needed)."""


class RematRuntimeError(RematError, RuntimeError):
    """What was asked cannot be done in the current state (another profiler session is running)."""


class RecomputationError(RematError, RuntimeError):
    """A recomputation did not reproduce what the forward pass computed."""


def message(api: str, rule: str, given: object, todo: str) -> str:
    """Format an error in remat's house style."""
    return f"remat.{api}: {rule} ({given}); {todo}"
