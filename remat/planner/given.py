"""Checks of what the planner's lower-level public functions are given (``chain_from_trace``,
``dag_from_trace``, ``coarsen``, ``predict``, ``stage_key``): each wrong value a clear error in the
planner's words, not an ``AttributeError`` or a ``TypeError`` from deep inside."""

from __future__ import annotations

from numbers import Integral

from remat._errors import RematTypeError, RematValueError, message

__all__ = ["a", "whole"]


def a(value: object, kind: type | tuple[type, ...], api: str, name: str, todo: str) -> None:
    """Refuse ``value`` unless it is a ``kind``."""
    if not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        rule = f"{name} must be {' or '.join(k.__name__ for k in kinds)}"
        raise RematTypeError(message(api, rule, f"got {type(value).__name__}", todo))


def whole(value: object, api: str, name: str, least: int, none: bool = False) -> None:
    """Refuse ``value`` unless it is a whole number of at least ``least`` (or None, if ``none``)."""
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, Integral) or value < least:
        more = " or None" if none else ""
        raise RematValueError(
            message(
                api,
                f"{name} is a whole number of at least {least}{more}",
                f"got {value!r}",
                f"pass {name}={least}",
            )
        )
