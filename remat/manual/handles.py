"""What a region gives autograd for each saved tensor (the tensor kept, or a handle to recompute it),
and which of its handles autograd still holds.

NOTE [dead handles] Autograd lets go of a saved tensor's packed object with its node, and a node
dies as soon as no tensor leads to it any more: ``gate = sigmoid(g(x)); gate.detach_()`` frees
the sigmoid's node and the handle of the output it saved; so does a branch computed and dropped
inside the region, or an output the caller throws away. A handle that never comes back to be
unpacked must not make the region recompute its value and hold it to the end of the backward
(``torch.utils.checkpoint`` keeps nothing for such a handle either). So a region watches its
handles through weak references: one dead before the region finishes counts for nothing in the
slice it replays, and a backward's replay caches a value for as many of its handles as autograd
holds when the backward first unpacks one of the region's.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

import torch

from remat import aten

__all__ = ["Handle", "Kept", "Versions", "Watch"]


class Kept(NamedTuple):
    """A saved tensor the region keeps (detached where its own node saves it: NOTE [kept
    detached] in ``remat.manual.scope``), and its version when autograd saved it."""

    tensor: torch.Tensor
    version: int


@dataclass(frozen=True, slots=True, weakref_slot=True)
class Handle:
    """A saved tensor the region recomputes: its value id, the in-place writer of its storage group
    when it was saved (NOTE [aliasing] in ``remat.manual.tape``) and what it looked like."""

    vid: int
    group: int
    writer: int | None
    declared: int | None
    shape: torch.Size
    dtype: torch.dtype
    place: aten.Geometry  # where it sits in its storage
    after: int = -1  # the node the tape records next: the op saving it, if it saves an input


class Watch:
    """The handles a region gave autograd, watched for their death (NOTE [dead handles])."""

    def __init__(self) -> None:
        self._watched: list[tuple[weakref.ref[Handle], int, int]] = []

    def add(self, handle: Handle) -> None:
        self._watched.append((weakref.ref(handle), handle.vid, handle.after))

    def dead(self) -> Counter[tuple[int, int]]:
        """How many handles of each (value id, ``Handle.after``) autograd has let go of; the watch
        forgets them."""
        gone = Counter((vid, after) for ref, vid, after in self._watched if ref() is None)
        if gone:
            self._watched = [w for w in self._watched if w[0]() is not None]
        return gone

    def pruned(
        self, handles: dict[int, int], packed: dict[tuple[int, int], int], results: set[tuple[int, int]]
    ) -> dict[int, int]:
        """A region's count of handles per value id (``handles``) without those autograd let go of
        while the region ran; ``packed`` (per value id and ``Handle.after``) and ``results`` (saved
        as a result) lose them in place."""
        for (vid, after), n in self.dead().items():
            handles[vid] -= n
            packed[vid, after] -= n
            if not packed[vid, after]:
                del packed[vid, after]
                results.discard((vid, after))
        return {vid: n for vid, n in handles.items() if n > 0}

    def alive(self, own: dict[tuple[int, int], int]) -> Counter[int]:
        """How many handles autograd holds per value id they unpack to (``own``: NOTE [saved
        before its own write] in ``remat.manual.scope``)."""
        return Counter(own.get((vid, after), vid) for ref, vid, after in self._watched if ref() is not None)


class Versions:
    """NOTE [written after the region] Autograd refuses, in backward, a saved tensor written in
    place since it was saved. A region hands autograd a handle instead and replays the value, so
    the forward's tensor (or a view of it) written after the region would go unseen, and backward
    would read the value the forward made where plain autograd raises. So the region watches the
    tensor behind each handle (weakly: it may die; its base too, which shares its version counter)
    and its version as the region ends; a handle unpacked after the tensor moved on is refused.
    Writes inside the region are the tape's to judge (``TapedRegion._written_since``)."""

    def __init__(self) -> None:
        # value id -> the tensor and its base, and their version as the region ended (-1: not yet)
        self._watched: dict[int, tuple[tuple[weakref.ref[torch.Tensor], ...], int]] = {}

    def saw(self, vid: int, t: torch.Tensor) -> None:
        """``t`` is the tensor with value id ``vid`` that autograd saved."""
        if vid not in self._watched and not t.is_inference():
            refs = (weakref.ref(t),) if t._base is None else (weakref.ref(t), weakref.ref(t._base))
            self._watched[vid] = (refs, -1)

    def ended(self) -> None:
        """The region ended: the versions its tensors have now are the ones backward may read."""
        watched = {}
        for vid, (refs, _) in self._watched.items():
            t = _alive(refs)
            if t is not None:
                watched[vid] = (refs, t._version)
        self._watched = watched

    def written(self, vid: int) -> int | None:
        """The version of ``vid``'s tensor where it moved on since the region ended, else None."""
        refs, version = self._watched.get(vid, ((), -1))
        t = _alive(refs)
        return t._version if t is not None and version >= 0 and t._version != version else None


def _alive(refs: tuple[weakref.ref[torch.Tensor], ...]) -> torch.Tensor | None:
    return next((t for ref in refs if (t := ref()) is not None), None)
