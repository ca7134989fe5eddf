"""The floating-point operations a piece of code runs, as torch's profiler counts them: a measure of
the work recomputation adds that does not depend on how busy the machine is.

The profiler counts the matrix products and convolutions (``mm``, ``addmm``, ``bmm``, ``conv*``,
...), from each op's shapes. An op that a dispatch mode sees (remat's executor, a tape recording)
appears twice, nested: the call that enters the mode, and the mode's call of the op below it.
Each op is counted once, at its outermost appearance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["counted_flops"]


def counted_flops(fn: Callable[[], Any]) -> int:
    """The floating-point operations of the matrix products and convolutions ``fn()`` runs on the
    CPU's thread (and launches on CUDA), each op once."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, with_flops=True) as prof:
        fn()
    return sum(event.flops for event in prof.events() if event.flops and not _inside_itself(event))


def _inside_itself(event: Any) -> bool:
    """Whether ``event`` runs inside an event of the same op (a dispatch mode's call below it)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == event.name:
            return True
        parent = parent.cpu_parent
    return False
