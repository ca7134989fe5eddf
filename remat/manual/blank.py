"""Blank writes: a replayed batch norm writes its running statistics into new tensors, so that a
region keeps no copy of them from its forward to its replay.

NOTE [blank writes] Batch norm in training writes its running statistics without its schema
saying so (NOTE [hidden writes] in ``remat.aten.schema``), and its results do not depend on their
old values. A tape keeps a snapshot of each tensor from outside the region that an op writes, for
its replay to write into a clone of (NOTE [aliasing] in ``remat.manual.tape``). For such a hidden
write the replay needs only somewhere to write, where no other op of the region reads the
statistics (before the write or after it), the replay returns nothing the write makes, and it is
not replayed for its writes: when the region ends the write becomes *blank*, the slice lets the
snapshot go, and the replay writes into a new tensor of the same geometry. ``remat.planner.predict``
counts the snapshot to the region's end for such a write.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Collection

import torch

from remat import aten
from remat.manual.tape import Node, Slice, Step, Tape, _keys, written_from

__all__ = ["blank_writes"]


def blank_writes(tape: Tape, cut: Slice, also: Collection[int]) -> Slice:
    """``cut`` (sliced from ``tape`` after running the nodes ``also``) with its hidden writes that
    need no snapshot made blank."""
    if not any(w.clone for step in cut.steps for w in step.node.writes):
        return cut
    readers = _Readers(tape)
    steps: list[Step] = []
    let_go: set[int] = set()
    for step, i in zip(cut.steps, cut.at, strict=True):
        node, olds = (step.node, []) if i in also else _blanked(tape, readers, step.node, i, cut.targets)
        steps.append(Step(node, (*step.free, *olds)))
        let_go.update(olds)
    if not let_go:
        return cut
    kept = {vid: held for vid, held in cut.kept.items() if vid not in let_go}
    return dataclasses.replace(cut, steps=tuple(steps), kept=kept)


class _Readers:
    """Which nodes of a tape read each value, each value's tensor, and the values the tape keeps
    on each storage: indexed once per slice, so that each write asks in constant time (a scan of
    the tape per write made a region of many batch norms quadratic)."""

    def __init__(self, tape: Tape) -> None:
        self.nodes: dict[int, set[int]] = {}
        for j, node in enumerate(tape.nodes):
            for vid in node.reads:
                self.nodes.setdefault(vid, set()).add(j)
        self.tensor: dict[int, weakref.ref[torch.Tensor]] = {}
        for ref, vid in tape._ids.values():
            self.tensor.setdefault(vid, ref)
        self.kept: dict[int, list[int]] = {}
        for vid, (t, _) in tape.kept.items():
            if (storage := aten.storage_of(t)) is not None:  # none: sparse and nested tensors
                self.kept.setdefault(storage.data_ptr(), []).append(vid)

    def elsewhere(self, old: int, new: int, i: int) -> bool:
        """Whether a node other than the ``i``-th reads the value before (``old``) or after
        (``new``) the write, or another tensor from outside the region on the same storage (a
        view of the statistics taken before the region)."""
        values = {old, new}
        ref = self.tensor.get(new)
        written = ref() if ref is not None else None
        storage = aten.storage_of(written) if written is not None else None
        if storage is not None:
            values.update(self.kept.get(storage.data_ptr(), ()))
        return any(self.nodes.get(v, set()) - {i} for v in values)


def _blanked(
    tape: Tape, readers: _Readers, node: Node, i: int, wanted: frozenset[int]
) -> tuple[Node, list[int]]:
    """``node`` with its blank writes, and the value ids whose snapshots they let go."""
    if not any(w.clone for w in node.writes):
        return node, []
    hidden = _keys(aten.facts(node.func), node.args)
    writes, olds = [], []
    for w in node.writes:
        old = written_from(node, w)
        if w.clone and w.key in hidden and w.vid not in wanted and not readers.elsewhere(old, w.vid, i):
            snapshot = tape.kept[old][0]
            # geometry only: an op here would reach a dispatch mode still open (the plan's runner)
            blank = (tuple(snapshot.shape), tuple(snapshot.stride()), snapshot.dtype, snapshot.device)
            w = w._replace(clone=False, blank=blank)
            olds.append(old)
        writes.append(w)
    return node._replace(writes=tuple(writes)), olds
