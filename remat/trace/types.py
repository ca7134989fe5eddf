"""The Trace data type: one training step as plain data (tensors, ops, releases).

The planner and the simulator reason about a step only through this type, whatever produced it
(a capture of a real PyTorch step, a capture on fake tensors, or an imported DTR log), so that what
the simulator predicts and what the runtime does are computed from the same facts.

Conventions:
- ``Trace.tensors[i].id == i``.
- A tensor either owns a storage (``nbytes`` > 0 or an empty one) or aliases another tensor's
  storage (``alias_of`` set, ``nbytes`` 0): views and extra handles share their base's memory.
- Constants (parameters, inputs, DTR ``CONSTANT``) exist before the first event and can never be
  recomputed.
- A storage is freed when every tensor sharing it has been released.
- Costs are in seconds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.StrEnum):
    """Which part of the training step issued an op."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor handle of the step."""

    id: int
    nbytes: int
    alias_of: int | None = None
    constant: bool = False
    shape: tuple[int, ...] | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class Op:
    """One op call: reads ``inputs``, creates ``outputs``, writes ``mutates`` (a subset of inputs)
    in place. ``cost`` is measured (seconds), ``est_cost`` the cost model's estimate."""

    index: int
    name: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    mutates: tuple[int, ...] = ()
    cost: float = 0.0
    est_cost: float = 0.0
    phase: Phase = Phase.UNKNOWN
    module: str = ""
    random: bool = False


@dataclass(frozen=True)
class Release:
    """The program dropped its handle to ``tensor``."""

    tensor: int


Event = Op | Release


@dataclass(frozen=True)
class Trace:
    """One step: its tensors, its events in program order, and which forward tensors autograd
    saved for backward."""

    tensors: tuple[TensorInfo, ...]
    events: tuple[Event, ...]
    saved: frozenset[int] = frozenset()
    name: str = ""
    device: str = "cpu"
    source: str = "capture"
