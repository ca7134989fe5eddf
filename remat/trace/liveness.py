"""The liveness of a Trace with no budget: the live bytes after every op, and their peak.

This is the reference every budgeted simulation is measured against (a budget ratio is a fraction
of this peak) and the check that a capture is faithful: for a real CPU step, the activation peak
computed here equals what ``remat.memory.track(allocator=True)`` measured around the same step.

NOTE [liveness semantics] Constants are allocated before the first event. An op allocates each
output that owns a storage; an alias output adds a handle to its storage and allocates nothing.
A Release drops one handle; a storage is freed when its last handle is released. Live bytes are
sampled after each op, as ``remat.memory.track`` samples them, so a storage an op makes and the
next release frees still counts at that op; the op's scratch (``Op.scratch``: what its kernel
held while it ran) is added to its sample, and its state (``Op.state``) counts as a constant from
that op on. Two figures come out of one pass: with constants
(``peak_bytes``, the DTR convention) and without (``activation_peak_bytes``, what the step added,
which is what ``remat.memory.track(allocator=True)`` reports, and without scratch what
``remat.memory.track()`` reports).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from remat._units import format_bytes
from remat.trace.events import Event, Op, TensorInfo

__all__ = ["Liveness", "activation_peak_bytes", "live_bytes", "liveness", "peak_bytes"]


class Steps(Protocol):
    """What liveness reads of a ``remat.trace.Trace`` (which imports this module, so it is named
    here by its shape): its tensors and its events."""

    @property
    def tensors(self) -> Sequence[TensorInfo]: ...

    @property
    def events(self) -> Sequence[Event]: ...


@dataclass(frozen=True)
class Liveness:
    """Figures of a trace's liveness with no budget. ``peak_op`` is the op at which the activation peak
    was first reached (-1 for a trace without ops); ``end_bytes`` is live at the end, constants
    included."""

    peak_bytes: int
    activation_peak_bytes: int
    constant_bytes: int
    end_bytes: int
    peak_op: int

    def __str__(self) -> str:
        return (
            f"Liveness(peak {format_bytes(self.peak_bytes)}, "
            f"activations {format_bytes(self.activation_peak_bytes)} at op {self.peak_op}, "
            f"constants {format_bytes(self.constant_bytes)}, "
            f"end {format_bytes(self.end_bytes)})"
        )


def live_bytes(trace: Steps) -> list[tuple[int, int]]:
    """``(with constants, without constants)`` live bytes after each op, in op order."""
    return _walk(trace)[0]


def liveness(trace: Steps) -> Liveness:
    """The live bytes of ``trace`` with no budget; see NOTE [liveness semantics]. ``Trace.liveness``
    caches it."""
    samples, constants, end = _walk(trace)
    peak_op, peak, act_peak = -1, constants, 0
    for i, (total, made) in enumerate(samples):
        peak = max(peak, total)
        if made > act_peak:
            peak_op, act_peak = i, made
    return Liveness(peak, act_peak, constants, end, peak_op)


def peak_bytes(trace: Steps) -> int:
    """Peak live bytes with no budget, constants included."""
    return liveness(trace).peak_bytes


def activation_peak_bytes(trace: Steps) -> int:
    """Peak live bytes of the storages the step made, constants excluded."""
    return liveness(trace).activation_peak_bytes


def _walk(trace: Steps) -> tuple[list[tuple[int, int]], int, int]:
    """The per-op samples, the constants' bytes at the start, and the live bytes at the end."""
    # alias_of always names an earlier tensor (the validator checks it), so one pass resolves chains.
    roots = list(range(len(trace.tensors)))
    for t in trace.tensors:
        if t.alias_of is not None:
            roots[t.id] = roots[t.alias_of]
    handles = [0] * len(trace.tensors)
    constant = 0
    for t in trace.tensors:
        if t.constant:
            r = roots[t.id]
            if handles[r] == 0:
                constant += trace.tensors[r].nbytes
            handles[r] += 1
    at_start = constant
    made = 0  # live bytes of the storages the step made
    samples: list[tuple[int, int]] = []
    for event in trace.events:
        if isinstance(event, Op):
            constant += event.state
            for out in event.outputs:
                r = roots[out]
                if handles[r] == 0:
                    made += trace.tensors[r].nbytes
                handles[r] += 1
            samples.append((constant + made + event.scratch, made + event.scratch))
        else:
            r = roots[event.tensor]
            handles[r] -= 1
            if handles[r] == 0:
                if trace.tensors[r].constant:
                    constant -= trace.tensors[r].nbytes
                else:
                    made -= trace.tensors[r].nbytes
    return samples, at_start, constant + made
