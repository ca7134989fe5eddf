"""``remat.checkpoint_sequential``: cut a chain of modules into segments, keep only their borders.

Chen et al.'s sublinear-memory recipe: with n layers in k segments, forward keeps the k segment
inputs and backward recomputes one segment at a time, so activation memory is about
``k + n/k`` layers' worth — least at ``k = sqrt(n)`` (``segments="sqrt"``), for one extra forward.
The last segment is not checkpointed: backward needs its activations at once. The keywords of
``torch.utils.checkpoint.checkpoint_sequential`` are accepted and mean what they mean for
``remat.checkpoint`` (``remat.manual.keywords``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn

from remat._errors import RematTypeError, RematValueError, message
from remat._units import whole
from remat.host.offloader import Offloader
from remat.manual import keywords
from remat.manual.checkpoint import run
from remat.manual.checks import Check
from remat.policy import Policy

__all__ = ["checkpoint_sequential", "segment_bounds"]


def segment_bounds(n: int, segments: int | Literal["sqrt"]) -> list[tuple[int, int]]:
    """Split ``n`` modules into ``segments`` contiguous, near-equal ``[start, stop)`` ranges."""
    segments = whole(segments)
    if segments == "sqrt":
        count = max(1, round(math.sqrt(n)))
    elif isinstance(segments, int) and not isinstance(segments, bool):
        count = segments
    else:
        raise RematTypeError(
            message(
                "checkpoint_sequential",
                "segments must be a positive int or 'sqrt'",
                f"got {segments!r}",
                "pass e.g. segments=4 or segments='sqrt'",
            )
        )
    if not 1 <= count <= n:
        raise RematValueError(
            message(
                "checkpoint_sequential",
                "segments must lie between 1 and the number of modules",
                f"got {count} for {n} modules",
                f"pass 1 <= segments <= {n}, or 'sqrt'",
            )
        )
    base, extra = divmod(n, count)
    bounds, start = [], 0
    for k in range(count):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _run_segment(modules: list[nn.Module], x: Any) -> Any:
    for module in modules:
        x = module(x)
    return x


def checkpoint_sequential(
    functions: nn.Sequential | Iterable[nn.Module],
    segments: int | Literal["sqrt"],
    input: Any,  # noqa: A002 - torch's name for it
    use_reentrant: bool | None = None,
    *,
    policy: Policy | None = None,
    check: Check = "shapes",
    offloader: Offloader | None = None,
    **torch_keywords: Any,
) -> Any:
    """Run ``input`` through ``functions`` (modules) in order, checkpointing every segment but the
    last. The arguments are named as torch's ``checkpoint_sequential`` names them.

    ``use_reentrant`` and the other keywords of ``torch.utils.checkpoint.checkpoint``, ``policy``,
    ``check`` and ``offloader`` mean what they mean for ``remat.checkpoint``.
    """
    ours, unknown = keywords.split(torch_keywords)
    if unknown:
        raise RematTypeError(
            message(
                "checkpoint_sequential",
                "unknown keyword",
                f"got {', '.join(sorted(unknown))}",
                "pass policy=, check=, offloader= or a keyword of torch.utils.checkpoint.checkpoint",
            )
        )
    s = keywords.settings(
        "checkpoint_sequential", {**ours, "use_reentrant": use_reentrant}, policy, check, offloader
    )
    iterable = isinstance(functions, Iterable) and not isinstance(functions, torch.Tensor)
    # iterating an nn.Sequential gives each entry as its forward runs them: a module it holds twice
    # (weights tied) twice, where ``children()`` gives it once
    layers = list(functions) if iterable else []
    classes = [m.__name__ for m in layers if isinstance(m, type) and issubclass(m, torch.nn.Module)]
    if not layers or not all(callable(m) for m in layers) or classes:
        raise RematTypeError(
            message(
                "checkpoint_sequential",
                "functions must be a non-empty sequence of callables (modules, not their classes)",
                f"got the classes {', '.join(classes)}"
                if classes
                else f"got {len(layers)} items, not callable: "
                + ", ".join(sorted({type(m).__name__ for m in layers if not callable(m)}))
                if layers and not isinstance(functions, (str, bytes))
                else f"got an empty {type(functions).__name__}"
                if iterable and not layers
                else f"got {functions!r}"[:120]
                if isinstance(functions, (int, float, str, bytes))
                else f"got a {type(functions).__name__}",
                "pass an nn.Sequential or a list of modules",
            )
        )
    bounds = segment_bounds(len(layers), segments)
    x = input
    for start, stop in bounds[:-1]:
        segment = functools.partial(_run_segment, layers[start:stop])  # its modules' buffers shielded
        x = run(segment, (x,), {}, s.policy, s.check, s.preserve_rng, s.offloader, functions)
    start, stop = bounds[-1]
    return _run_segment(layers[start:stop], x)
