"""The parts of a Trace: the tensors of a step (TensorInfo) and its events (Op, Release).

Plain frozen data with no knowledge of memory over time: ``remat.trace.liveness`` walks them,
``remat.trace.types`` holds them together as a ``Trace`` (and re-exports them).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from remat._units import format_bytes

__all__ = ["Event", "Op", "Phase", "Release", "TensorInfo"]

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
