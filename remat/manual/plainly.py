"""``plainly()``: a block of code in which remat's manual forms run as plain PyTorch.

Why a switch rather than an argument: a model's checkpoints sit deep inside its modules (its own
``remat.checkpoint`` calls, the Hugging Face switch, ``checkpoint_sequential``), where the caller
who knows that this call needs no recomputation cannot reach them. A pipeline stage is the case in
point: the last micro-batch's backward comes right after its forward, so recomputing it saves no
memory (torchgpipe's ``checkpoint="except_last"``; ``remat.pipeline.ManualStage``). Inside the block
``remat.checkpoint``, ``remat.checkpoint_sequential``, ``remat.scope`` and ``remat.offload`` run their
code as if they were not there, as they already do with grad disabled: everything autograd saves is
kept, on the device. The switch is per thread and nests; recomputations in backward, which run
after the block, are not affected.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from remat._reusable import reusable

__all__ = ["plain", "plainly"]

_STATE = threading.local()


@reusable
def plainly() -> Iterator[None]:
    """Run the block with remat's manual forms switched off (see the module doc)."""
    depth = getattr(_STATE, "depth", 0)
    _STATE.depth = depth + 1
    try:
        yield
    finally:
        _STATE.depth = depth


def plain() -> bool:
    """Whether this thread is inside ``plainly()``."""
    return getattr(_STATE, "depth", 0) > 0
