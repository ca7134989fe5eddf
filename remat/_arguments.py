"""Argument types the command line's subcommands share (lists of registered names, budget ratios),
the device an API is given, and a library error's advice in a command's flags."""

from __future__ import annotations

import argparse
import contextlib
import math
import re
from collections.abc import Iterator, Sequence

import torch

from remat._errors import RematError, RematTypeError, RematValueError, message


def names_in(spec: str, known: Sequence[str], api: str, what: str) -> list[str]:
    """``"a,b"`` -> ["a", "b"], each one of ``known`` (an argparse error naming them otherwise)."""
    chosen = [name.strip() for name in spec.split(",") if name.strip()]
    if not chosen or any(name not in known for name in chosen):
        raise argparse.ArgumentTypeError(
            message(api, f"unknown {what}", f"got {spec!r}", f"use {', '.join(known)}")
        )
    return chosen


_MOST_RATIOS = 1000


def ratio_range(spec: str, api: str = "sim.cli") -> list[float]:
    """``"0.2:0.9:0.1"`` -> [0.2, 0.3, ..., 0.9] (both ends included); ``"0.3,0.5"`` -> [0.3, 0.5]."""
    try:
        if ":" in spec:
            start, stop, step = (float(x) for x in spec.split(":"))
            if step <= 0 or stop < start:
                raise ValueError
            count = math.floor((stop - start) / step + 1e-9) + 1
            if count > _MOST_RATIOS:  # each ratio is a simulation of every trace and policy
                raise argparse.ArgumentTypeError(
                    message(
                        api,
                        f"a range gives at most {_MOST_RATIOS} ratios",
                        f"got {count} from {spec!r}",
                        "raise STEP",
                    )
                )
            ratios = [round(start + i * step, 10) for i in range(count)]
        else:
            ratios = [float(x) for x in spec.split(",")]
    except (ValueError, OverflowError):  # an infinite or vanishing range: no count
        raise argparse.ArgumentTypeError(
            message(api, "cannot read the ratios", f"got {spec!r}", "write START:STOP:STEP or a,b,c")
        ) from None
    if not all(0.0 < r <= 1.0 for r in ratios):
        raise argparse.ArgumentTypeError(
            message(api, "ratios must lie in (0, 1]", f"got {spec!r}", "pass fractions of the peak")
        )
    return ratios


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1 (got {text!r})") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1 (got {value})")
    return value


def device_of(value: object, api: str) -> torch.device:
    """``value`` (a ``torch.device`` or its name) as a device this torch can run on; ``"cuda"``
    alone as the current CUDA device (tensors say ``cuda:0``, never ``cuda``)."""
    if not isinstance(value, (str, torch.device)):
        rule = "device must be a torch.device or its name"
        raise RematTypeError(message(api, rule, repr(value), 'pass "cpu"'))
    try:
        device = torch.device(value)
    except RuntimeError:
        raise RematValueError(message(api, "unknown device", repr(value), 'pass "cpu" or "cuda"')) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        hint = 'pass device="cpu", or run on a GPU with a CUDA build of torch'
        raise RematValueError(message(api, "no CUDA device here", repr(value), hint))
    if device.type not in ("cpu", "cuda"):
        rule = "the device must be a CPU or a CUDA device"
        raise RematValueError(message(api, rule, repr(value), 'pass "cpu"'))
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def in_flags(text: str, rewrites: Sequence[tuple[str, str]]) -> str:
    """``text`` with each ``(pattern, replacement)`` of ``rewrites`` applied in turn (``re.sub``)."""
    for pattern, replacement in rewrites:
        text = re.sub(pattern, replacement, text)
    return text


@contextlib.contextmanager
def advice_in_flags(rewrites: Sequence[tuple[str, str]]) -> Iterator[None]:
    """A remat error raised inside has its text ``in_flags``: the Python API's arguments it names
    (``n_microbatches``, ``solver='auto'``) as the command's flags (``--microbatches``,
    ``--solver auto``)."""
    try:
        yield
    except RematError as error:
        error.args = tuple(in_flags(a, rewrites) if isinstance(a, str) else a for a in error.args)
        raise
