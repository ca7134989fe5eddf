"""Checks of one JSON record of a trace file: its fields, and the type of each value, each failure
an ``Invalid`` naming the rule and what was found (the reader adds the file and line).

Why apart from ``remat.trace.codec``: the reader's rules per kind of line (header, tensor, op,
release) use the same few checks of a value; these are those checks.
"""

from __future__ import annotations

from typing import Any

from remat.trace.validator import Invalid

__all__ = ["count", "fields", "ids", "is_count", "number", "typed"]


def fields(record: dict[str, Any], allowed: set[str], what: str) -> None:
    unknown = sorted(set(record) - allowed)
    if unknown:
        raise Invalid(f"unknown field in a {what}", f"{', '.join(map(repr, unknown))}")


def is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def count(record: dict[str, Any], key: str, what: str) -> int:
    value = record.get(key)
    if not is_count(value):
        raise Invalid(f'"{key}" must be a non-negative integer', f"{what} has {key} {value!r}")
    return int(value)  # type: ignore[arg-type]


_MISSING = object()


def typed(record: dict[str, Any], key: str, kind: type, what: str, default: Any = _MISSING) -> Any:
    if key not in record:
        if default is _MISSING:
            raise Invalid(f'"{key}" is required', f"{what} has no {key}")
        return default
    value = record[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise Invalid(f'"{key}" must be of type {kind.__name__}', f"{what} has {key} {value!r}")
    return value


def number(record: dict[str, Any], key: str, what: str) -> float:
    value = record.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Invalid(f'"{key}" must be a number of seconds', f"{what} has {key} {value!r}")
    return float(value)


def ids(record: dict[str, Any], key: str, what: str, required: bool = True) -> tuple[int, ...]:
    if key not in record and not required:
        return ()
    value = record.get(key)
    if not isinstance(value, list) or not all(is_count(v) for v in value):
        raise Invalid(f'"{key}" must be a list of tensor ids', f"{what} has {key} {value!r}")
    return tuple(value)
