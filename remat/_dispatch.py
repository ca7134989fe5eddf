"""Dispatch modes on the per-op hot path, without the Dynamo guard torch puts around each call.

torch wraps every ``TorchDispatchMode`` subclass's ``__torch_dispatch__`` so that Dynamo never
compiles it (``torch._disable_dynamo``): two more Python frames and four switches of the frame
evaluator on every op, about 2 µs of CPU per op. ``unguard`` takes the wrapper off and marks the
method's code, and everything it calls, to be skipped by Dynamo instead: the frame evaluator
checks that mark in C, and only while Dynamo is compiling something. Where this torch lacks the
API (it is not public), the class keeps torch's wrapper. A mode calls it when it is made, not when
its class is defined (``Unguarded``): the mark needs Dynamo loaded (seconds), as torch's wrapper
does on its first call.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["Unguarded", "no_modes", "saved_hooks", "skip_dynamo", "unguard"]


def no_modes() -> contextlib.AbstractContextManager[object]:
    """torch's ``_disable_current_modes()`` (remat's own ops are not the program's), or nothing to
    do where no dispatch mode is on: its imports and pops cost a few µs, on every saved tensor of a
    recomputation."""
    if torch._C._len_torch_dispatch_stack() == 0 and _len_torch_dispatch_stack_pre_dispatch() == 0:
        return contextlib.nullcontext()
    return _disable_current_modes()


# the code of torch's wrapper (every function ``torch._disable_dynamo`` returns shares it): only a
# method wrapped by it is unwrapped, not one another decorator wrapped
_WRAPPER = torch._disable_dynamo(lambda: None).__code__


def unguard(cls: type[TorchDispatchMode]) -> None:
    """Take torch's wrapper off the ``__torch_dispatch__`` of ``cls`` and of the classes it derives
    from, and have Dynamo skip them (see above); nothing where done already, where this torch
    does not wrap them, or where it lacks the API (any failure keeps torch's wrapper)."""
    for klass in cls.__mro__:
        wrapped = klass.__dict__.get("__torch_dispatch__")
        raw = getattr(wrapped, "__wrapped__", None)
        if raw is None or getattr(wrapped, "__code__", None) is not _WRAPPER:
            continue
        try:
            import torch._dynamo  # noqa: F401  (the types below need it loaded)
            from torch._C._dynamo.eval_frame import set_code_exec_strategy
            from torch._dynamo.types import FrameAction, FrameExecStrategy

            set_code_exec_strategy(raw.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
        except Exception:  # a private API: a torch that moved or changed it keeps the wrapper
            return
        klass.__torch_dispatch__ = raw  # type: ignore[attr-defined]


class Unguarded(TorchDispatchMode):
    """A dispatch mode whose class is unguarded (``unguard``) when its first instance is made."""

    def __init__(self) -> None:
        unguard(type(self))
        super().__init__()


_SKIPPED: set[types.CodeType] = set()


def skip_dynamo(*functions: Callable[..., Any]) -> None:
    """Have Dynamo skip the code of ``functions`` and all it calls, as ``unguard`` does: a
    saved-tensor hook of remat's runs while a ``torch.compile``d module inside a region runs, and
    Dynamo compiled it there as a frame of its own (the tape's ``pack``, recompiled for every
    saved tensor until its recompile limit). Nothing while Dynamo is not loaded (no module was
    compiled yet: ``torch.compile`` loads it), or where this torch lacks the API."""
    if "torch._dynamo" not in sys.modules:
        return
    for function in functions:
        code = getattr(getattr(function, "__func__", function), "__code__", None)
        if code is None or code in _SKIPPED:
            continue
        try:
            from torch._C._dynamo.eval_frame import set_code_exec_strategy
            from torch._dynamo.types import FrameAction, FrameExecStrategy

            set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
        except Exception:  # a private API: a torch that moved or changed it compiles them
            return
        _SKIPPED.add(code)


def saved_hooks(
    pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]
) -> contextlib.AbstractContextManager[None]:
    """``torch.autograd.graph.saved_tensors_hooks(pack, unpack)``, the hooks skipped by Dynamo
    (``skip_dynamo``)."""
    skip_dynamo(pack, unpack)
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
