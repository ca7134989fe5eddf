"""The CPU allocator's own account of a block of code, from PyTorch's profiler.

PyTorch keeps no allocator statistics on CPU, and a dispatch mode sees only the tensors ops return:
not the buffers a kernel allocates for itself and frees before it returns (a convolution's
unfolded input, a batch norm's temporaries), nor anything a compiled graph allocates. The
profiler, with memory profiling on, is told of every allocation and free the CPU allocator makes,
with its address and size. Summed in time order they give the bytes the block held at each
moment; a free counts only when its allocation happened inside the block, so what existed before
(parameters, inputs, a previous step's gradients) is left out, as in ``remat.memory.track``.
``account(timeline=True)`` also keeps those sums, one ``AllocatorSample`` per counted event.

NOTE [profiler clock]: the profiler stamps each event (``start_time_ns``) in the clock of
``time.time_ns()`` (nanoseconds since the Unix epoch; it reads a faster counter and converts).
Measured on torch 2.13 CPU: the allocation of each of 150 ``torch.empty`` calls was stamped between
``time.time_ns()`` read just before and just after the call, a few to a few hundred microseconds
apart, while ``time.monotonic_ns()`` and ``time.perf_counter_ns()`` are off by decades (they count
from boot). So a moment taken with ``time.time_ns()`` (the block's start and end in
``remat.memory.track``, ``remat.dynamic``'s evictions and recomputations) lands among the
allocator's events where it happened.

The profiler's start and stop print a line each on the process's standard error (from C++); those
two calls run with it sent to /dev/null.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._autograd import _profiler_enabled
from torch._C._profiler import (
    ProfilerActivity,
    ProfilerConfig,
    ProfilerState,
    RecordScope,
    _EventType,
    _ExperimentalConfig,
)
from torch.autograd import _disable_profiler, _enable_profiler, _prepare_profiler

__all__ = ["Account", "AllocatorSample", "account", "available", "later", "ours", "scratch_of"]


@dataclass(frozen=True)
class AllocatorSample:
    """Bytes the CPU allocator held beyond what it held before the block, right after its allocation
    or free at ``time_ns`` (the clock of ``time.time_ns()``, NOTE [profiler clock])."""

    time_ns: int
    bytes: int


@dataclass
class Account:
    """What the CPU allocator held during an ``account`` block beyond what it held before; set when
    the block ends. ``timeline`` is None unless asked for."""

    peak_bytes: int = 0
    current_bytes: int = 0
    timeline: list[AllocatorSample] | None = field(default=None, repr=False)


def available() -> bool:
    """Whether an account can start now: the profiler cannot run twice at once, and a session
    another thread started (which this thread's check does not see) is busy too."""
    return not _profiler_enabled() and not _OPEN


def ours() -> bool:
    """Whether the profiler runs now for an account opened on this thread (so that :func:`later`
    can be asked: the account sees this thread's allocations, not another's)."""
    return bool(_OPEN) and _OPEN[-1][0] == threading.get_ident()


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _events(nodes: list[Any]) -> Iterator[Any]:
    for n in nodes:
        yield n
        yield from _events(n.children)


def _counted(allocations: list[Any], live: dict[int, int]) -> Iterator[tuple[Any, int]]:
    """Each allocation or free in ``allocations`` (time order) that counts, with its signed size: a
    free only of what was allocated among them (``live``: pointer -> size, updated)."""
    for e in allocations:
        fields = e.extra_fields
        if fields.device.type != "cpu":
            continue
        size, ptr = fields.alloc_size, fields.ptr
        if size > 0:
            live[ptr] = size
        elif live.pop(ptr, None) is None:
            continue
        yield e, size


# NOTE [held back] A measurement that would need the profiler while an account runs it (a kernel's
# scratch, learned by the dynamic runtime inside ``remat.memory.track(allocator=True)``) cannot open
# a session of its own: the profiler runs one at a time, and a session stopped mid-step loses the
# events of the backward nodes that captured it. It asks ``later`` instead: when the account ends, the
# allocations stamped between ``start_ns`` and ``end_ns`` (the clock of NOTE [profiler clock]) are
# counted as an account of their own would have counted them, and ``then`` gets the bytes held at
# their peak beyond what was held at ``end_ns``.
# per running account: the thread that opened it, and what waits on it
_OPEN: list[tuple[int, list[tuple[int, int, Callable[[int], object]]]]] = []
_CONFIG = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
_ACTIVITIES = {ProfilerActivity.CPU}
# the record-function scopes a session observes: one no eager program enters (TorchScript's static
# runtime). An account reads only the allocator's events, which come whatever the scopes; so no op,
# module or backward node costs an event in a tracked step.
_SCOPES = {RecordScope.STATIC_RUNTIME_MODEL}


def later(start_ns: int, end_ns: int, then: Callable[[int], object]) -> None:
    """NOTE [held back]: call ``then`` with the scratch of ``[start_ns, end_ns]`` when the running
    account ends. Only while :func:`ours`."""
    _OPEN[-1][1].append((start_ns, end_ns, then))


def _held_back(allocations: list[Any], waiting: list[tuple[int, int, Callable[[int], object]]]) -> None:
    stamps = [e.start_time_ns for e in allocations]
    for start_ns, end_ns, then in waiting:
        inside = allocations[bisect.bisect_left(stamps, start_ns) : bisect.bisect_right(stamps, end_ns)]
        current = peak = 0
        for _, size in _counted(inside, {}):
            current += size
            peak = max(peak, current)
        then(max(0, peak - current))


@contextlib.contextmanager
def account(timeline: bool = False) -> Iterator[Account]:
    """Count the CPU allocator's allocations and frees inside the block (see the module docstring);
    ``timeline=True`` keeps one sample per counted event, in time order. The caller checks
    ``available()`` first."""
    result = Account(timeline=[] if timeline else None)
    waiting: list[tuple[int, int, Callable[[int], object]]] = []
    with _quiet_stderr():
        _prepare_profiler(_CONFIG, _ACTIVITIES)
        _enable_profiler(_CONFIG, _ACTIVITIES, _SCOPES)  # type: ignore[call-arg]
    _OPEN.append((threading.get_ident(), waiting))
    try:
        yield result
    finally:  # counted also where the block raised
        _OPEN.pop()
        with _quiet_stderr():
            profile = _disable_profiler()
        allocations = sorted(
            (e for e in _events(profile.experimental_event_tree()) if e.tag == _EventType.Allocation),
            key=lambda e: e.start_time_ns,
        )
        for e, size in _counted(allocations, {}):
            result.current_bytes += size
            result.peak_bytes = max(result.peak_bytes, result.current_bytes)
            if result.timeline is not None:
                result.timeline.append(AllocatorSample(e.start_time_ns, result.current_bytes))
        _held_back(allocations, waiting)


def scratch_of(run: Any, device: torch.device) -> int | None:
    """Bytes ``run()`` allocates beyond what it still holds when it returns, at its peak: the
    buffers a kernel frees before returning. None when it cannot be measured now."""
    return measured(run, device)[1]


def measured(run: Any, device: torch.device) -> tuple[Any, int | None]:
    """``run()``'s result, and its scratch as :func:`scratch_of` measures it (None when it cannot
    be measured now: ``run()`` ran all the same): for an op that cannot run twice (a random draw, a
    mutation), measured on its one run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = run()
        after = torch.cuda.memory_allocated(device)
        peak = torch.cuda.max_memory_allocated(device)
        return out, max(0, peak - after)
    if device.type != "cpu" or not available():
        return run(), None
    with account() as acc:
        out = run()
    return out, max(0, acc.peak_bytes - acc.current_bytes)
