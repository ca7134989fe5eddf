"""Which phase of the step and which module issued each captured op.

The recorder (``remat.trace.recorder``) asks ``Attribution.where()`` at every op. Forward ops get
the innermost module whose forward is running; backward ops get the module of the forward op that
made the autograd node now running, stored on the node itself; ops outside any module or node get
their phase at the end (``phases``).

NOTE [phases] An op is BACKWARD while the autograd engine runs a node, OPTIMIZER inside
``Optimizer.step``, FORWARD inside a module's forward. Other ops are FORWARD before the first
backward op, BACKWARD up to the last one (gradient accumulation between nodes) and OPTIMIZER
after it (gradient clipping, zero_grad).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from remat.trace.types import Phase

__all__ = ["Attribution", "hooked", "phases"]

# Key under which a forward op's module path is stored on its autograd node, so that the backward
# ops the node runs are attributed to the same module.
_MODULE_KEY = "remat.trace.module"


class Attribution:
    """The module stack and optimizer depth of a running step, kept by global hooks."""

    def __init__(self, on_call: Callable[[nn.Module, Any, Any, Any], None] | None = None) -> None:
        self.on_call = on_call  # a forward hook (with keyword arguments) for every named module
        self.watched: list[torch.utils.hooks.RemovableHandle] = []
        self.modules: list[str] = []
        self.names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.in_optimizer = 0
        self.calls: dict[str, int] = {}  # forward calls per named module below a root
        self.roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def where(self) -> tuple[Phase | None, str]:
        """The phase and module of the op running now; phase None: decided by ``phases``."""
        if self.in_optimizer:
            return Phase.OPTIMIZER, self.modules[-1] if self.modules else ""
        node = torch._C._current_autograd_node()
        if node is not None:
            return Phase.BACKWARD, str(_metadata(node).get(_MODULE_KEY, ""))
        if self.modules:
            return Phase.FORWARD, self.modules[-1]
        return None, ""

    def tag_nodes(self, made_by: Iterable[tuple[torch.Tensor, str]]) -> None:
        """Tag each tensor's autograd node with ``made_by``'s module (that of the op that made it)."""
        # An op's outputs get their grad_fn only after the op returns, so each op tags the nodes of
        # its inputs with the module of the op that made them.
        for t, module in made_by:
            node = t.grad_fn
            if node is not None:
                _metadata(node).setdefault(_MODULE_KEY, module)

    def name_modules(self, root: nn.Module) -> None:
        """Name ``root``'s modules by their qualified path (``root`` itself by its class)."""
        self.roots.add(root)
        for qualified, m in root.named_modules():
            if m not in self.names and self.on_call is not None:
                # per module: a global hook with keyword arguments outlives its removal in torch
                # 2.13 (its entry in ``_global_forward_hooks_with_kwargs`` stays), and Dynamo then
                # compiles no module call
                self.watched.append(m.register_forward_hook(self.on_call, with_kwargs=True))
            self.names.setdefault(m, qualified or type(root).__name__)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Follow module forwards and optimizer steps while the context is open."""
        handles = [
            nn.modules.module.register_module_forward_pre_hook(self._module_pre),
            nn.modules.module.register_module_forward_hook(self._module_post, always_call=True),
            register_optimizer_step_pre_hook(self._optimizer_pre),
            register_optimizer_step_post_hook(self._optimizer_post),
        ]
        try:
            yield
        finally:
            for h in [*handles, *self.watched]:
                h.remove()
            self.watched.clear()

    def _module_pre(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(module)
        if name is not None and module not in self.roots:  # by a path its root resolves
            self.calls[name] = self.calls.get(name, 0) + 1
            # a submodule called from outside its parent's call makes the parent's ops one more
            # run of its own (``block(x)`` then ``block.inner(h)``): counted as a call of the parent
            parts = name.split(".")
            for k in range(1, len(parts)):
                parent = ".".join(parts[:k])
                if parent not in self.modules and parent in self.calls:
                    self.calls[parent] += 1
        if name is None:
            if self.modules:
                name = f"{self.modules[-1]}.{type(module).__name__}"
            else:
                self.name_modules(module)
                name = self.names[module]
        self.modules.append(name)

    def _module_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.modules:
            self.modules.pop()

    def _optimizer_pre(self, *args: Any) -> None:
        self.in_optimizer += 1

    def _optimizer_post(self, *args: Any) -> None:
        self.in_optimizer -= 1


def phases(found: Sequence[Phase | None]) -> list[Phase]:
    """Each op's phase, in op order, from what ``where`` found: see NOTE [phases]."""
    backward = [i for i, p in enumerate(found) if p is Phase.BACKWARD]
    first, last = (backward[0], backward[-1]) if backward else (len(found), len(found))
    resolved: list[Phase] = []
    for i, p in enumerate(found):
        if p is None:
            p = Phase.FORWARD if i < first else Phase.BACKWARD if i < last else Phase.OPTIMIZER
        resolved.append(p)
    return resolved


def _metadata(node: Any) -> dict[str, Any]:
    # Node.metadata is a dict property at run time, typed as a method in torch's stubs.
    return cast(dict[str, Any], node.metadata)


def hooked(module: nn.Module, ours: Any) -> bool:
    """Whether the program hooks ``module``'s calls (besides ``ours``, the capture's own): a
    pre-hook's ops or a backward hook's wrapping are part of its call in the trace but not of its
    ``forward``, which a module run again calls alone (NOTE [module re-run] in
    ``remat.planner.rerun_regions``), so such a call is not noted for it."""
    module_hooks = nn.modules.module
    others = [h for h in module._forward_hooks.values() if h != ours]
    return bool(
        module._forward_pre_hooks
        or others
        or module._backward_hooks
        or module._backward_pre_hooks
        or module_hooks._global_backward_hooks
        or module_hooks._global_backward_pre_hooks
        or len(module_hooks._global_forward_pre_hooks) > 1  # the capture's own is one
        or len(module_hooks._global_forward_hooks) > 1
    )
