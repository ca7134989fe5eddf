"""Write a Trace event by event: the importer of DTR logs and the synthetic programs both do."""

from __future__ import annotations

from remat.trace.types import Event, Op, Phase, Release, TensorInfo, Trace


class TraceBuilder:
    """``tensor`` adds a tensor (a view owns no bytes), ``op`` and ``release`` add events, ``trace``
    returns the Trace. Op indices count ops only."""

    def __init__(self) -> None:
        self.tensors: list[TensorInfo] = []
        self.events: list[Event] = []
        self.ops = 0

    def tensor(self, nbytes: int, alias_of: int | None = None, constant: bool = False) -> int:
        tensor = len(self.tensors)
        self.tensors.append(TensorInfo(tensor, 0 if alias_of is not None else nbytes, alias_of, constant))
        return tensor

    def op(
        self,
        name: str,
        inputs: tuple[int, ...],
        outputs: tuple[int, ...],
        cost: float,
        mutates: tuple[int, ...] = (),
        phase: Phase = Phase.FORWARD,
    ) -> None:
        self.events.append(Op(self.ops, name, inputs, outputs, mutates, cost=cost, phase=phase))
        self.ops += 1

    def release(self, tensor: int) -> None:
        self.events.append(Release(tensor))

    def trace(self, name: str, device: str = "cpu", source: str = "synthetic") -> Trace:
        return Trace(tuple(self.tensors), tuple(self.events), name=name, device=device, source=source)
