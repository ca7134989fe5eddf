"""The host pool: byte buffers in host memory that offloaded tensors are copied into, reused by size.

Offload only pays if the host copy is memory the device's allocator does not count. On CUDA the
buffers are pinned host memory (page-locked, so copies to and from the GPU run asynchronously on
a side stream). On a machine without a GPU the "device" is torch's CPU allocator, so the buffers
are allocated by numpy and wrapped with ``torch.from_numpy``: torch's allocator never sees them,
and ``remat.memory.track(allocator=True)`` shows the device-side peak lower by the bytes moved
while the pool reports its own bytes (``held_bytes``, ``peak_bytes``).

A buffer whose tensor came back is reused for the next request of the same size: pinning memory is
slow, and a training step offloads the same sizes each time. On CUDA a buffer is reused only after
the copy that read it has finished (its event). ``budget`` caps the bytes the pool holds: cached free
buffers are released first, and a request that still does not fit raises (NOTE [host budget]).
Without a budget, the cached bytes never pass the most bytes ever in use at once: steps of other
shapes (sequence lengths) each leave buffers of sizes no later step asks for, and a cache without
a cap grew with every one.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import numpy as np
import torch

from remat._errors import RematRuntimeError, message
from remat._units import format_bytes

__all__ = ["HostPool"]


class HostPool:
    """Host buffers of ``uint8``, handed out by ``take`` and returned by ``give``.

    ``budget``: the most bytes the pool may hold (in use and cached), or None for no limit.
    """

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget
        self.used_bytes = 0
        self.cached_bytes = 0
        self.peak_bytes = 0
        self.peak_used = 0  # the most bytes in use at once: the cap of the cached ones
        self._free: dict[tuple[int, bool], list[tuple[torch.Tensor, torch.cuda.Event | None]]] = defaultdict(
            list
        )
        self._lock = threading.Lock()
        # who a refusal names, and what it suggests (a plan's executor sets its own)
        self.api = "offload"
        self.todo = "raise host_budget=, offload fewer tensors (min_bytes=, a policy), or pass "
        self.todo += "host_budget=None"

    @property
    def held_bytes(self) -> int:
        """Bytes of host memory the pool holds now: buffers in use and cached ones."""
        return self.used_bytes + self.cached_bytes

    def take(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        """A host buffer of exactly ``nbytes`` bytes (contents undefined); ``pinned`` for copies with
        a CUDA device, else memory torch's CPU allocator does not see."""
        with self._lock:
            free = self._free.get((nbytes, pinned))
            if free:
                buffer, done = free.pop()
                self.cached_bytes -= nbytes
                if done is not None:
                    done.synchronize()  # the copy that last read the buffer must have finished
            else:
                self._make_room(nbytes)
                buffer = _allocate(nbytes, pinned)
            self.used_bytes += nbytes
            self.peak_used = max(self.peak_used, self.used_bytes)
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            return buffer

    def give(self, buffer: torch.Tensor, pinned: bool, done: torch.cuda.Event | None = None) -> None:
        """Return a buffer ``take`` gave; ``done`` is the event after the last copy that reads it."""
        nbytes = buffer.numel()
        with self._lock:
            self.used_bytes -= nbytes
            self.cached_bytes += nbytes
            self._free[(nbytes, pinned)].append((buffer, done))
            if self.cached_bytes > self.peak_used:  # the other sizes go, this one stays
                self._free = defaultdict(list, {(nbytes, pinned): self._free[(nbytes, pinned)]})
                self.cached_bytes = sum(b.numel() for b, _ in self._free[(nbytes, pinned)])

    def release(self) -> None:
        """Drop every cached buffer (those in use stay theirs)."""
        with self._lock:
            self._free.clear()
            self.cached_bytes = 0

    def _make_room(self, nbytes: int) -> None:
        # NOTE [host budget]: a request over the budget is an error, not a silent fallback to keeping
        # the tensor on the device: the device budget the offload was planned for would break
        # without a word. Cached buffers go first.
        if self.budget is None or self.held_bytes + nbytes <= self.budget:
            return
        self._free.clear()
        self.cached_bytes = 0
        if self.used_bytes + nbytes > self.budget:
            raise RematRuntimeError(
                message(
                    self.api,
                    "the host budget is too small for the tensors offloaded",
                    f"{format_bytes(self.used_bytes)} held + {format_bytes(nbytes)} asked > "
                    f"host_budget {format_bytes(self.budget)}",
                    self.todo,
                )
            )


def _allocate(nbytes: int, pinned: bool) -> torch.Tensor:
    if pinned:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))
