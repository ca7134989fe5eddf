"""Honest memory measurement: live tensor bytes on CPU (counted) and CUDA (allocator statistics).

PyTorch keeps no allocator statistics on CPU, so ``track`` counts tensors itself: a dispatch mode sees
every ATen op run inside the block, and each new storage an op creates is counted once, from its
creation until the storage itself dies (a finalizer on the storage object, which PyTorch keeps
alive exactly as long as the memory). Views and in-place results share an existing storage and
count nothing. This is the number ``torch.cuda.max_memory_allocated`` gives on CUDA, where the
allocator's own statistics are used instead. Tensors that existed before the block (parameters,
inputs) are not counted: the figures are what the block added.

``plot`` draws trackers of the CPU allocator (``allocator=True``) as a picture of memory over time
(:mod:`remat.viz.memory`).
"""

from __future__ import annotations

import contextlib
import re
import time
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat import _allocator, aten
from remat._allocator import AllocatorSample
from remat._arguments import device_of
from remat._errors import RematRuntimeError, RematTypeError, message
from remat._reusable import reusable
from remat._tracker import MemorySample, MemoryTracker
from remat._units import format_bytes, parse_budget, parse_bytes
from remat.viz.memory import plot

__all__ = [
    "AllocatorSample",
    "MemorySample",
    "MemoryTracker",
    "format_bytes",
    "parse_budget",
    "parse_bytes",
    "plot",
    "track",
]


@contextlib.contextmanager
def _clock(tracker: MemoryTracker) -> Iterator[None]:
    tracker.start_ns = time.time_ns()
    try:
        yield
    finally:
        tracker.end_ns = time.time_ns()


class _StorageCounter(TorchDispatchMode):
    """Counts each new storage on ``device`` once, until it dies."""

    def __init__(self, tracker: MemoryTracker, timeline: bool, cuda_base: int) -> None:
        super().__init__()
        self.tracker = tracker
        self.keep_timeline = timeline
        self.live: dict[int, int] = {}
        self.on_cuda = tracker.device.type == "cuda"
        self.base = cuda_base

    def _release(self, key: int) -> None:
        self.tracker.current_bytes -= self.live.pop(key, 0)

    @staticmethod
    def _sizes(facts: aten.OpFacts, args: Any, kwargs: Any) -> list[tuple[torch.Tensor, int, int]]:
        """The tensors the op writes, with their storages' bytes and keys before it runs."""
        found = []
        for t in aten.written_tensors(facts.writes, args, kwargs or {}):
            storage = aten.storage_of(t)
            if storage is not None and not t.is_meta:
                found.append((t, storage.nbytes(), storage.data_ptr()))
        return found

    def _count(self, out: torch.Tensor) -> None:
        if out.device != self.tracker.device or out.is_meta or out._is_zerotensor():  # no memory
            return
        storage = aten.storage_of(out)  # None: sparse and nested tensors, not counted
        if storage is None:
            return
        nbytes = storage.nbytes()
        key = storage.data_ptr()
        if nbytes == 0 or key in self.live:
            return
        self.live[key] = nbytes
        self.tracker.current_bytes += nbytes
        weakref.finalize(storage, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        facts = aten.facts(func)
        sized = self._sizes(facts, args, kwargs) if facts.writes and not self.on_cuda else ()
        out = func(*args, **(kwargs or {}))
        for t, nbytes, key in sized:  # a storage the op grew in place (``resize_``, ``out=``)
            storage = aten.storage_of(t)
            if storage is not None and storage.nbytes() > nbytes:
                self.tracker.current_bytes -= self.live.pop(key, 0)
                self._count(t)
        tracker = self.tracker
        tracker.ops += 1
        if self.on_cuda:
            tracker.current_bytes = torch.cuda.memory_allocated(tracker.device) - self.base
            tracker.peak_bytes = torch.cuda.max_memory_allocated(tracker.device) - self.base
        else:
            fresh = facts.fresh_returns
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for i, o in enumerate(outs):
                if isinstance(o, torch.Tensor) and (i >= len(fresh) or fresh[i]):
                    self._count(o)
            tracker.peak_bytes = max(tracker.peak_bytes, tracker.current_bytes)
        if self.keep_timeline:
            tracker.timeline.append(MemorySample(tracker.ops, str(func), tracker.current_bytes))
        return out


# remat.manual.fused's warning for a run whose compilation failed because a dispatch mode was on
_UNDER_MODE = re.compile(
    r"^remat: a run of .* not compiled \(compilation failed: .*torch dispatch mode", re.S
)


@contextlib.contextmanager
def _compiled_replay_note() -> Iterator[None]:
    """While tensors are counted (a dispatch mode, under which Dynamo compiles nothing), a
    ``replay="compiled"`` region's runs fail to compile and replay op by op, each with a screen of
    Dynamo's reasons: those become one warning that says why and what to do; every other warning
    passes through as it was."""
    with warnings.catch_warnings(record=True) as caught:  # the caller's filters still apply
        yield
    failed = 0
    for w in caught:
        if _UNDER_MODE.match(str(w.message)):
            failed += 1
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if failed:
        warnings.warn(
            f"remat.memory.track: {failed} compiled replay run(s) replayed op by op, here and from now on "
            "(counting tensors on CPU runs a dispatch mode, and torch.compile runs nothing under one); "
            "measure a replay='compiled' step with remat.memory.track(allocator=True)",
            RuntimeWarning,
            stacklevel=6,  # the caller's with-statement, past two context managers' exits and the entry's
        )


@reusable
def track(
    device: torch.device | str = "cpu", timeline: bool | None = None, allocator: bool = False
) -> Iterator[MemoryTracker]:
    """Measure the tensor memory a block of code adds on ``device``.

    ``with remat.memory.track() as m: loss = model(x).sum(); loss.backward()`` then ``m.peak_bytes``
    is the highest number of live tensor bytes during the block, ``m.current_bytes`` those still
    live, and ``m.timeline`` one sample per op (``timeline=False`` skips it for long runs).

    ``allocator=True`` counts on CPU what the allocator itself hands out (``remat._allocator``,
    through PyTorch's profiler): also the buffers kernels allocate and free while they run and
    whatever code no dispatch mode sees allocates (a ``torch.compile``d graph). Then
    ``peak_bytes``, ``current_bytes`` and ``m.allocator_timeline`` (the bytes held after each
    allocation and free, with its time) are set when the block ends. On CUDA the allocator's
    statistics are always used, and no allocator timeline is kept (``remat.memory.plot`` says so).

    The timeline and ``m.ops`` come from a dispatch mode, and Dynamo runs no compiled code under
    one (a ``torch.compile``d function runs eagerly inside it). So the mode runs only where it
    must: to count tensors on CPU without ``allocator``, or when ``timeline=True`` is asked for.
    By default (``timeline=None``) a timeline is kept only where the mode runs anyway, so that
    ``allocator=True`` on CPU, and CUDA, measure a compiled step as compiled. Where the mode runs,
    the runs of a ``replay="compiled"`` region cannot compile; one warning says so, and that
    ``allocator=True`` is the way to measure them.
    """
    for name, flag in (("allocator", allocator), ("timeline", timeline)):
        if not isinstance(flag, bool) and (flag is not None or name == "allocator"):
            raise RematTypeError(
                message("memory.track", f"{name} must be True or False", repr(flag), f"pass {name}=True")
            )
    dev = device_of(device, "memory.track")
    if dev.type == "cpu":  # tensors say ``cpu`` whatever index was given
        dev = torch.device("cpu")
    if allocator and dev.type == "cpu" and not _allocator.available():
        ours = _allocator.ours()  # an account of remat's own: a track, or a dynamic region's
        raise RematRuntimeError(
            message(
                "memory.track",
                "allocator=True on CPU needs PyTorch's profiler, which is already running",
                "another remat.memory.track(allocator=True) is measuring"
                if ours
                else "a torch.profiler session is active",
                "measure outside that session, or pass allocator=False",
            )
        )
    tracker = MemoryTracker(device=dev)
    base = 0
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    counting = dev.type == "cpu" and not allocator
    keep_timeline = counting if timeline is None else timeline
    mode: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    note: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if counting or keep_timeline:
        mode = _StorageCounter(tracker, keep_timeline, base)
        note = _compiled_replay_note()
    if allocator and dev.type == "cpu":
        try:  # the figures also where the block raised, as the counted ones are
            with note, _allocator.account(timeline=True) as account, mode, _clock(tracker):
                yield tracker
        finally:
            tracker.peak_bytes, tracker.current_bytes = account.peak_bytes, account.current_bytes
            tracker.allocator_timeline = tuple(account.timeline or ())
        return
    try:
        with note, mode, _clock(tracker):
            yield tracker
    finally:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            tracker.peak_bytes = torch.cuda.max_memory_allocated(dev) - base
            tracker.current_bytes = torch.cuda.memory_allocated(dev) - base
