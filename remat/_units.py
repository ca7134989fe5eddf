"""Parsing of byte sizes and budgets given by users (``"2GB"``, ``"512MiB"``, ``4096``, ``0.5``)."""

from __future__ import annotations

import math
import numbers
import re
from typing import TypeVar, cast

from remat._errors import RematTypeError, RematValueError, message

_T = TypeVar("_T")

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def whole(value: _T) -> _T:
    """``value`` as a Python int where it is a whole number of another integer type (NumPy's
    ``int64``, a 0-dim integer tensor's ``item()`` is one already); anything else as it is, bools
    included, for the caller's own check to refuse."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return cast(_T, int(value))
    return value


def parse_bytes(value: object, api: str = "memory.parse_bytes") -> int:
    """Return a positive byte count from an int or a string such as ``"2GB"`` (10^9), ``"512MiB"``
    (2^20), ``"1.5 GiB"`` or ``"1e9"``. Floats are refused: a ratio is not a byte count."""
    value = whole(value)
    if isinstance(value, (bool, float)):
        raise RematTypeError(
            message(
                api,
                "a byte count is required, not a ratio or a bool",
                f"got {value!r}",
                'pass bytes as an int or a string such as "2GB" or "512MiB"',
            )
        )
    if isinstance(value, int):
        if value <= 0:
            raise RematValueError(
                message(api, "a byte count must be positive", f"got {value}", "pass a size above 0 bytes")
            )
        return _within(value, value, api)
    if not isinstance(value, str):
        raise RematTypeError(
            message(
                api,
                "a byte count must be an int or a string",
                f"got {type(value).__name__}",
                'pass e.g. 2_000_000_000 or "2GB"',
            )
        )
    match = _SIZE.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise RematValueError(
            message(
                api,
                "cannot parse this byte size",
                f"got {value!r}",
                "use a number with an optional unit: B, KB, MB, GB, TB (powers of 1000) "
                "or KiB, MiB, GiB, TiB, and K, M, G, T (powers of 1024)",
            )
        )
    number = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(number):
        raise RematValueError(
            message(api, "cannot parse this byte size", f"got {value!r}", "pass a finite size such as '2GB'")
        )
    if unit in ("", "b") and number != math.floor(number):  # "0.5", "1.5B": a ratio or a typo
        raise RematValueError(
            message(
                api,
                f"a byte count {'in B' if unit else 'with no unit'} is a whole number",
                f"got {value!r}",
                'pass bytes such as "4MB" (a ratio such as 0.5 is taken where a budget may be a fraction)',
            )
        )
    size = math.floor(number)
    if size <= 0:
        raise RematValueError(
            message(api, "a byte count must be positive", f"got {value!r}", "pass a size of at least 1 byte")
        )
    return _within(size, value, api)


def parse_size(value: object, api: str) -> int:
    """``parse_bytes``, where 0 is a size too (a threshold: ``min_bytes``)."""
    value = whole(value)
    if value == "0" or type(value) is int and value == 0:
        return 0
    if type(value) is int and value < 0:
        raise RematValueError(message(api, "a size is 0 bytes or more", f"got {value}", "pass 0 or a size"))
    return parse_bytes(value, api)


_MOST = 1 << 62  # 4 EiB: past every memory, and within the machine's 64-bit sizes


def _within(size: int, value: object, api: str) -> int:
    if size > _MOST:
        raise RematValueError(
            message(
                api,
                "a byte count is at most 4 EiB (no memory holds more)",
                f"got {value!r}",
                "pass the memory you have (remat.dynamic takes None for no budget)",
            )
        )
    return size


def parse_budget(value: object, api: str = "memory.parse_budget") -> int | float:
    """A budget is either bytes (int or size string, see :func:`parse_bytes`) or a ratio: a float in
    (0, 1] of the unconstrained peak, or a string of one with no unit (``"0.5"``, as a command line
    gives it). Returns an int for bytes and a float for a ratio."""
    if isinstance(value, str) and (_RATIO.match(value) or _FRACTION.match(value)):
        value = float(value)
    elif isinstance(value, numbers.Real) and not isinstance(value, (numbers.Integral, float)):
        value = float(value)  # NumPy's float32: a ratio as a Python float is
    if isinstance(value, float):
        if not (0.0 < value <= 1.0) or math.isnan(value):
            raise RematValueError(
                message(
                    api,
                    "a ratio budget must lie in (0, 1]",
                    f"got {value!r}",
                    'pass a fraction of the unconstrained peak such as 0.5, or bytes such as "2GB"',
                )
            )
        return value
    return parse_bytes(value, api)


_FRACTION = re.compile(r"^\s*[0-9]*\.[0-9]*[1-9][0-9]*\s*$")  # a number with a fractional part, no unit
_RATIO = re.compile(r"^\s*(?:0?\.[0-9]+|0|1|1\.0*)\s*$")  # "0.5", ".25", "1.0": no unit, at most 1


_RATE = re.compile(r"^\s*(.*?)\s*/\s*s\s*$")
_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*(s|ms|us|µs|ns)?\s*$")
_SECONDS = {"s": 1.0, "": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_rate(value: object, api: str = "memory.parse_rate") -> float:
    """Return a positive rate in bytes per second from a number or a string such as ``"25GB/s"``
    or ``"12 GiB/s"`` (units as :func:`parse_bytes`)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # numpy's numbers too
        if not (float(value) > 0 and math.isfinite(value)):
            raise RematValueError(
                message(api, "a rate must be positive and finite", f"got {value!r}", 'pass e.g. "25GB/s"')
            )
        return float(value)
    match = _RATE.match(value) if isinstance(value, str) else None
    if match is not None and re.fullmatch(r"\s*[-+]?0*\.?0*\s*[A-Za-z]*\s*", match.group(1)):  # "0GB/s"
        raise RematValueError(
            message(api, "a rate must be positive and finite", f"got {value!r}", 'pass e.g. "25GB/s"')
        )
    if match is None:
        raise RematValueError(
            message(api, "cannot parse this rate", f"got {value!r}", 'pass bytes per second such as "25GB/s"')
        )
    return float(parse_bytes(match.group(1), api))


def parse_seconds(value: object, api: str = "memory.parse_seconds") -> float:
    """Return a duration in seconds (at least 0) from a number of seconds or a string such as
    ``"10us"``, ``"1.5ms"`` or ``"0s"``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # numpy's numbers too
        if not (float(value) >= 0 and math.isfinite(value)):
            raise RematValueError(
                message(api, "a duration must be at least 0 and finite", f"got {value!r}", 'pass e.g. "10us"')
            )
        return float(value)
    text = value.strip() if isinstance(value, str) else ""
    if _DURATION.match(text.removeprefix("-")) is not None and text.startswith("-"):  # "-1us"
        raise RematValueError(
            message(api, "a duration must be at least 0 and finite", f"got {value!r}", 'pass e.g. "10us"')
        )
    match = _DURATION.match(text)
    if match is None:
        raise RematValueError(
            message(
                api,
                "cannot parse this duration",
                f"got {value!r}",
                "use a number with an optional unit: s, ms, us or ns (e.g. '10us')",
            )
        )
    number = text[: len(text) - len(match.group(2) or "")].strip()
    seconds = float(number) * _SECONDS[match.group(2) or ""]
    if not math.isfinite(seconds):  # "1e400" parses as infinity
        raise RematValueError(
            message(api, "a duration must be at least 0 and finite", f"got {value!r}", 'pass e.g. "10us"')
        )
    return seconds


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**20) == '3.00 MiB'``."""
    if isinstance(n, bool) or not isinstance(n, numbers.Real) or not math.isfinite(n):
        rule = "a byte count to format is a finite number"
        raise RematTypeError(message("memory.format_bytes", rule, f"got {n!r}"[:80], "pass e.g. 3 * 2**20"))
    if abs(round(n)) < 2**10:
        return f"{round(n)} B"
    for k, unit in enumerate(("KiB", "MiB", "GiB", "TiB", "PiB"), start=1):
        value = n / 2 ** (10 * k)
        if abs(round(value, 2)) < 1024 or unit == "PiB":  # 1023.999 KiB shows as 1.00 MiB
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")
