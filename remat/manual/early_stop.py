"""Where a recomputation may stop: at the last tensor the forward saved, before or after the kernel
of the op that saved it.

NOTE [early stop] The recomputation needs the function's ops up to its last save, not the rest (the
output it returns, a residual add after the last layer), and torch's non-reentrant checkpoint stops
right at that save. But an op saves its arguments before its kernel runs, and a kernel may write
an argument it saved with no version bump: RReLU fills the noise tensor it is handed (made for it
by ``F.rrelu``, or any tensor given to ``rrelu_with_noise``, a view of one saved before included).
Stopped at that save, backward would read memory the kernel never wrote. So the recomputation
stops at the last save where its op has run (the tensor is a result of it: its node the newest)
or where each argument that op saved is in the graph (it requires grad: a write to it bumps its
version, which autograd checks; no kernel fills one unseen). Else the function runs on to its
end, the last op's kernel with it (a product with a gate cut from the graph, ``h * gate.detach()``,
as the last op: one op and what follows run again for nothing). A plan's module run again
(``remat.planner.rerun``) always stops at its last save, as its prediction says: the planner runs
no module again whose last saving op writes an argument (NOTE [module re-run]).
"""

from __future__ import annotations

import torch

__all__ = ["LastOp"]

_NEXT_NODE = getattr(torch._C._autograd, "_get_sequence_nr", None)  # torch 2.x; None where absent


class LastOp:
    """The op that saved last in a call's forward: its autograd node, and whether each tensor it
    saved so far requires grad."""

    def __init__(self) -> None:
        self.node: int | None = None
        self.in_graph = False

    def saved(self, t: torch.Tensor) -> None:
        """The forward saved ``t`` (each op's node exists before it saves)."""
        node = _NEXT_NODE() if _NEXT_NODE is not None else None  # ``aten.next_node``, one call less
        if node != self.node:
            self.node, self.in_graph = node, node is not None
        self.in_graph = self.in_graph and t.requires_grad

    def stops(self) -> bool:
        """Whether the recomputation may stop at the last save even before its op's kernel runs
        (NOTE [early stop])."""
        return self.in_graph
