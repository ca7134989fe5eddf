"""``remat.checkpoint`` met by ``torch.compile``: what Dynamo traces in place of the checkpointed call.

NOTE [under torch.compile] remat's recomputation rests on saved-tensor hooks and runs the function
again eagerly in backward; in a graph Dynamo traces, the compiled forward saves other tensors than
that eager run makes again, and matching them by position handed autograd the wrong ones (silently
wrong gradients). A call met while compiling becomes instead what torch compiles itself:
``torch.utils.checkpoint`` (its higher-order op: the partitioner recomputes the region, saves its
random ops' results, and updates buffers once) when nothing is to be kept, else the remat call run
eagerly outside the graph (a graph break), exact but not compiled. ``run`` asks this before it
asks ``transformed``: while Dynamo traces, the functorch interpreter stack reads as not empty, and
the call ran as a plain one, keeping everything it saved.

Under ``torch.func``'s transforms (``vmap``, ``grad``, ``jvp``) and forward-mode AD, which carry
their own derivatives, the call runs as it is (``transformed``), as under ``no_grad``: remat's
anchor of the inputs is an ``autograd.Function`` those transforms refuse (torch's error, deep inside).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._functorch.pyfunctorch
import torch.autograd.forward_ad as fw_ad
import torch.utils.checkpoint

from remat.policy import Policy, RecomputeAll


def under_compile(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    policy: Policy | None,
    preserve_rng: bool,
    eager: Callable[[], Any],
) -> Any:
    """The call ``fn(*args, **kwargs)`` checkpointed while Dynamo traces it; ``eager()`` runs remat's
    own form of it."""
    if policy is None or isinstance(policy, RecomputeAll):
        return torch.utils.checkpoint.checkpoint(
            fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng, **kwargs
        )
    return _outside_the_graph(eager)


@torch.compiler.disable
def _outside_the_graph(eager: Callable[[], Any]) -> Any:
    return eager()


def transformed() -> bool:
    """Whether a ``torch.func`` transform or forward-mode AD is running (see the module doc)."""
    return torch._C._functorch.peek_interpreter_stack() is not None or fw_ad._current_level >= 0


@contextlib.contextmanager
def outside_transforms() -> Iterator[None]:
    """Within the block, no ``torch.func`` transform and no vmap applies: for a run again of what the
    forward ran outside any, met by a backward that runs under one (``torch.autograd.grad(...,
    is_grads_batched=True)`` runs it under torch's older vmap mode, which refuses random ops). The
    saved tensors such a run makes are what autograd saved in forward, unbatched, as the backward
    reads them."""
    levels = torch._C._vmapmode_increment_nesting() - 1  # the older vmap's nesting, read
    torch._C._vmapmode_decrement_nesting()
    for _ in range(levels):
        torch._C._vmapmode_decrement_nesting()
    try:
        if torch._C._functorch.peek_interpreter_stack() is None:
            yield
        else:
            with torch._functorch.pyfunctorch.temporarily_clear_interpreter_stack():
                yield
    finally:
        for _ in range(levels):
            torch._C._vmapmode_increment_nesting()
