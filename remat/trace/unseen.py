"""What the CPU allocator holds at a step's peak beyond what its trace counts (NOTE [unseen bytes]
in ``remat.trace.types``).

Why a run of its own: the capture measures each op's scratch with the profiler, one op at a time,
and the profiler runs one session at a time; the allocator's account of a whole step needs a run
in which nothing else asks for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from remat import _allocator
from remat.trace.types import Trace

__all__ = ["with_unseen"]


def with_unseen(trace: Trace, step: Callable[[], object]) -> Trace:
    """``trace`` with ``unseen_bytes`` measured by running ``step()`` (the step ``trace`` captured,
    from the same state) under the CPU allocator's account; ``trace`` unchanged on another device
    or where the profiler is busy."""
    if trace.device != "cpu" or not _allocator.available():
        return trace
    with _allocator.account() as account:
        step()
    unseen = max(0, account.peak_bytes - trace.activation_peak_bytes)
    return dataclasses.replace(trace, unseen_bytes=unseen) if unseen else trace
