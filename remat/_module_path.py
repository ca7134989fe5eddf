"""The path of the module that issued the op running now, read off the Python stack.

NOTE [module paths] A policy may choose by module (``OpContext.module``): the manual forms and the
offload region ask ``ModulePaths.now()`` when they build an op's context. The answer is the path of
the innermost module whose call is running, below the region's root, the root itself by its class
name. The root is the module the region runs (``remat.checkpoint(block)``: ``"attn.c_proj"`` and
``"GPT2Block"``; ``checkpoint_sequential``: the sequence, ``"3.mlp"``); else the module whose call
the region starts in (a ``remat.scope`` in a model's forward: ``"block.attn"``, and ``"Model"``
for the forward's own ops); else, at the top level of a program, the outermost module called in
the region (``with remat.scope(): model(x)``). An op issued outside any module call gets ``""``.

Why the stack and not module hooks: global forward hooks would have every module call of the
process take torch's slow path while a region runs, and make ``torch.compile`` guard on them;
walking a few frames costs nothing until a policy asks. A module's call is the frame of
``nn.Module.__call__`` (its ``_wrapped_call_impl``; a compiled module's call too), whose first local
is the module. The frames above the region (a model's call around a ``remat.scope``) are told apart
by the innermost such frame running when the region starts: the walk stops there. A module called
through its ``forward`` directly has no such frame and counts as the module that called it.
"""

from __future__ import annotations

import sys
from types import FrameType

from torch import nn

__all__ = ["ModulePaths"]

_CALL = nn.Module._wrapped_call_impl.__code__


class ModulePaths:
    """Module paths of the ops of one region; make it where the region starts, in its thread."""

    def __init__(self, root: object = None) -> None:
        owner = getattr(root, "__self__", None)  # a module's bound method: the module
        self.root = root if isinstance(root, nn.Module) else owner if isinstance(owner, nn.Module) else None
        self.names: dict[int, str] = {}  # id of a module -> its path, filled as roots are met
        self.held: list[nn.Module] = []  # the named modules, so that their ids stay theirs
        around = _innermost_call(sys._getframe(1))  # the module call the region starts in, if any
        self.outside = id(around)
        if self.root is None and around is not None:
            enclosing = around.f_locals.get("self")
            self.root = enclosing if isinstance(enclosing, nn.Module) else None

    def now(self) -> str:
        """The path of the module whose call issued the op running now (NOTE [module paths])."""
        if self.root is not None and not self.names:
            self._name(self.root)
        names, outside = self.names, self.outside
        unnamed: list[nn.Module] = []  # calls met below the innermost named module, innermost first
        f: FrameType | None = sys._getframe(1)
        while f is not None:
            if f.f_code is _CALL:
                if id(f) == outside:
                    break
                module = f.f_locals.get("self")
                if isinstance(module, nn.Module):
                    known = names.get(id(module))
                    if known is not None:
                        return _joined(known, unnamed)
                    unnamed.append(module)
            f = f.f_back
        if not unnamed:  # the root's own ops where the region is its forward (``remat.checkpoint(m)``)
            return "" if self.root is None else names[id(self.root)]
        self._name(unnamed[-1])  # no module of the region named yet: the outermost is a root
        k = next(k for k, m in enumerate(unnamed) if id(m) in names)
        return _joined(names[id(unnamed[k])], unnamed[:k])

    def _name(self, root: nn.Module) -> None:
        for path, module in root.named_modules():
            if id(module) not in self.names:
                self.names[id(module)] = path or type(root).__name__
                self.held.append(module)


def _joined(known: str, inner: list[nn.Module]) -> str:
    """``known``, then the modules made or attached during the region below it, by class."""
    return ".".join([known, *(type(m).__name__ for m in reversed(inner))]) if inner else known


def _innermost_call(f: FrameType | None) -> FrameType | None:
    while f is not None and f.f_code is not _CALL:
        f = f.f_back
    return f
