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
import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from remat._units import format_bytes

if TYPE_CHECKING:
    from remat.trace.replay import Replay


# Bytes per element of the dtypes a TensorInfo names (``str(torch.float32)`` without "torch.").
_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}


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

    @property
    def view_bytes(self) -> int:
        """Bytes the handle itself spans (shape × dtype size); its storage's ``nbytes`` when the
        shape or dtype is unknown. What an op reading this handle moves, for the cost model."""
        size = _ITEMSIZE.get(self.dtype or "")
        if self.shape is None or size is None:
            return self.nbytes
        return math.prod(self.shape) * size

    def __str__(self) -> str:
        kind = "constant" if self.constant else "tensor"
        size = f"alias of {self.alias_of}" if self.alias_of is not None else format_bytes(self.nbytes)
        shape = f" {self.dtype}{list(self.shape)}" if self.shape is not None else ""
        return f"{kind} {self.id}{shape} ({size})"


@dataclass(frozen=True)
class Op:
    """One op call: reads ``inputs``, creates ``outputs``, writes ``mutates`` (a subset of inputs)
    in place. ``index`` is the op's position among the trace's ops (0, 1, 2, ...; releases are not
    counted), so ``trace.ops[op.index] is op``. ``cost`` is measured (seconds), ``est_cost`` the
    cost model's estimate. ``scratch`` is the bytes the op's kernel allocates for itself and frees
    before it returns (a convolution's unfolded input, a reordered weight), held beside its
    inputs and outputs while it runs: no tensor of the trace, but part of the memory peak.
    ``state`` is the bytes the op's recomputation needs kept from its first run to the end of the
    step, beside its inputs (a random op's generator state, in a dynamic region): held like a
    constant from the op on."""

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
    scratch: int = 0
    state: int = 0

    @property
    def packet(self) -> str:
        """The op without namespace and overload: ``"mm"`` for ``"aten.mm.default"`` and for a DTR
        log's ``"mm"``; what the cost model keys on."""
        parts = self.name.split(".")
        return parts[1] if len(parts) >= 2 and parts[0] == "aten" else self.name

    def __str__(self) -> str:
        where = f", {self.module}" if self.module else ""
        mut = f" mutates {list(self.mutates)}" if self.mutates else ""
        io = f"{list(self.inputs)} -> {list(self.outputs)}"
        return f"op {self.index} {self.name} ({self.phase.value}{where}): {io}{mut}"


@dataclass(frozen=True)
class Release:
    """The program dropped its handle to ``tensor``."""

    tensor: int


Event = Op | Release


@dataclass(frozen=True)
class Trace:
    """One step: its tensors, its events in program order, and which forward tensors autograd
    saved for backward. ``saved_at`` says when, where known: one ``(tensor, position)`` per save,
    ``position`` being the number of ops that had run (the save came after op ``position - 1`` and
    before op ``position``: autograd saves an op's inputs before it runs and its outputs after),
    sorted."""

    tensors: tuple[TensorInfo, ...]
    events: tuple[Event, ...]
    saved: frozenset[int] = frozenset()
    name: str = ""
    device: str = "cpu"
    source: str = "capture"
    saved_at: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "saved_at", tuple(sorted(self.saved_at)))

    @functools.cached_property
    def ops(self) -> tuple[Op, ...]:
        """The op events alone, in program order (``ops[i].index == i``)."""
        return tuple(e for e in self.events if isinstance(e, Op))

    @functools.cached_property
    def replay(self) -> Replay:
        """Replay with no budget (see ``remat.trace.replay``); cached."""
        from remat.trace.replay import replay

        return replay(self)

    @property
    def peak_bytes(self) -> int:
        """Peak live bytes of the unconstrained replay, constants included (the DTR convention:
        budget ratios are relative to this)."""
        return self.replay.peak_bytes

    @property
    def activation_peak_bytes(self) -> int:
        """Peak live bytes of the storages the step itself made and of its ops' scratch, constants
        excluded: what ``remat.memory.track(allocator=True)`` measures around the same step."""
        return self.replay.activation_peak_bytes

    @property
    def constant_bytes(self) -> int:
        """Bytes of the constants' storages (parameters, inputs, pre-existing optimizer state)."""
        return self.replay.constant_bytes

    @property
    def total_cost(self) -> float:
        """Sum of the measured op costs, seconds (0.0 for a trace taken on fake tensors)."""
        return math.fsum(op.cost for op in self.ops)

    @property
    def total_est_cost(self) -> float:
        """Sum of the cost model's estimates, seconds."""
        return math.fsum(op.est_cost for op in self.ops)

    def root(self, tensor: int) -> int:
        """The tensor that owns ``tensor``'s storage (itself unless it is an alias)."""
        info = self.tensors[tensor]
        while info.alias_of is not None:
            info = self.tensors[info.alias_of]
        return info.id

    def saved_reads(self) -> dict[int, tuple[int, ...]]:
        """For each tensor autograd saved, the indices of the backward ops that read it (directly
        or through an alias of its storage)."""
        by_root: dict[int, list[int]] = {}
        for t in self.saved:
            by_root.setdefault(self.root(t), []).append(t)
        reads: dict[int, list[int]] = {t: [] for t in self.saved}
        for op in self.ops:
            if op.phase is not Phase.BACKWARD:
                continue
            for r in {self.root(t) for t in op.inputs} & by_root.keys():
                for t in by_root[r]:
                    reads[t].append(op.index)
        return {t: tuple(ops) for t, ops in reads.items()}

    def __str__(self) -> str:
        ops = self.ops
        phases = ", ".join(
            f"{sum(op.phase is p for op in ops)} {p.value}" for p in Phase if any(op.phase is p for op in ops)
        )
        return (
            f"Trace({self.name or 'unnamed'}, {self.source} on {self.device}: {len(ops)} ops ({phases}), "
            f"{len(self.tensors)} tensors, peak {format_bytes(self.peak_bytes)} of which constants "
            f"{format_bytes(self.constant_bytes)})"
        )
