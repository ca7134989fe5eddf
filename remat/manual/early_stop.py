"""Where a checkpoint's recomputation may stop: at the last tensor the forward saved, before or
after the kernel of the op that saved it.

NOTE [early stop] The recomputation needs the function's ops up to its last save, not the rest (the
output it returns, a residual add after the last layer), and torch's non-reentrant checkpoint stops
right at that save. But an op saves its arguments before its kernel runs, and a kernel may write
an argument it saved with no version bump: RReLU fills the noise tensor made for it. Stopped at
that save, backward would read memory the kernel never wrote. So the recomputation stops at the
last save where its op has run (the tensor is a result of it: its node the newest) or where each
argument that op saved is one no kernel fills unseen: in the graph (it requires grad: a write to it
bumps its version, which autograd checks) or, where the forward held every tensor it saved to its
end (``remat.checkpoint``), the memory of a tensor saved before in the function. Else the function
runs on to its end, the last op's kernel with it.
"""

from __future__ import annotations

import torch

from remat import aten

__all__ = ["LastOp"]


class LastOp:
    """The op that saved last in a call's forward: its autograd node, the index of the first
    tensor it saved, and whether each it saved so far requires grad."""

    def __init__(self) -> None:
        self.node: int | None = None
        self.start = 0
        self.in_graph = False

    def saved(self, t: torch.Tensor, index: int) -> None:
        """The forward saved ``t``, its ``index``-th tensor (each op's node exists before it saves)."""
        node = aten.next_node()
        if node != self.node:
            self.node, self.start, self.in_graph = node, index, node is not None
        self.in_graph = self.in_graph and t.requires_grad

    def stops(self, saved: list[torch.Tensor] | None = None) -> bool:
        """Whether the recomputation may stop at the last save even before its op's kernel runs
        (NOTE [early stop]); ``saved``: every tensor the forward saved, in order, all still held
        (else a tensor made since could sit where one of them was), or None where not at hand."""
        if self.in_graph:
            return True
        if self.node is None or not saved:
            return False
        seen = {_memory(t) for t in saved[: self.start]} - {None}
        return all(t.requires_grad or _memory(t) in seen for t in saved[self.start :])


def _memory(t: torch.Tensor) -> int | None:
    storage = aten.storage_of(t)
    return None if storage is None else storage.data_ptr()
