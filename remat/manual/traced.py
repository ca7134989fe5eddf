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

Dynamo may also run a frame eagerly while the frames it calls still run compiled code: the code
after a graph break once it has passed ``torch._dynamo.config.recompile_limit`` (``run`` breaks the
graph, and every checkpointed call of every model shares its code, so a model whose blocks are
called with differing arguments reaches the limit), or a function it skips. Its frame callback is
then set: to compile the frames below, or (False) to run the code compiled for them before, where
their guards pass. ``is_compiling`` reads off there, but the checkpointed function could run
compiled in forward, saving the compiled graph's tensors, and run again otherwise in backward: an
error where their shapes differ, wrong gradients where they agree. Where the callback is set
(``compiled_frames``) the call is remat's eager one with Dynamo off for every frame below it
(``torch.compiler.disable``), and the run again in backward, met where the callback is set (a
``backward`` called inside a compiled function), runs with Dynamo off too (``eagerly``).

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
    if not torch.compiler.is_compiling():  # a frame Dynamo runs eagerly: NOTE [under torch.compile]
        return _outside_the_graph(eager)
    if policy is None or isinstance(policy, RecomputeAll):
        return torch.utils.checkpoint.checkpoint(
            fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng, **kwargs
        )
    return _outside_the_graph(eager)


@torch.compiler.disable
def _outside_the_graph(eager: Callable[[], Any]) -> Any:
    return eager()


def compiled_frames() -> bool:
    """Whether the frames called from here may run compiled code: Dynamo's frame callback is set, to
    compile them, or (False) to run the code it compiled for them before (NOTE [under
    torch.compile])."""
    return _callback() is not None


_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


def eagerly(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` with no frame below it compiled, where Dynamo would compile them."""
    return torch.compiler.disable(fn)(*args, **kwargs) if compiled_frames() else fn(*args, **kwargs)


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
