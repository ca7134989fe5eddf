"""Keeping module buffers untouched while a region is recomputed, and recomputing it from the
buffers' values of its forward.

Re-running a region in backward re-runs its modules' forward, and a module in training mode
updates its buffers as a side effect: batch norm's running mean and variance and
``num_batches_tracked`` would move twice per step (an open PyTorch bug). While a recomputation
runs, every module that starts a forward has its buffers swapped for private copies; the copies
take the update and are dropped afterwards, and the real buffers are put back untouched (their
version counters included, so tensors autograd saved from them stay valid). A module whose
``forward`` the recomputation calls itself (``remat.checkpoint(module)`` wraps the bound method, so
no ``__call__`` and no pre-hook runs for it) is named as a root and swapped at once.

NOTE [buffers as the forward saw them] By the time of the recomputation the forward has already
updated its buffers, so a private copy of the buffer as it is now is not what the forward read: a
module whose output depends on a buffer it updates (an exponential moving average used in
training) would compute otherwise, and the values check (``check="values"``) would see batch
norm's running statistics differ from those autograd saved. So in the forward each training-mode
module's buffers are copied before it runs, the copy kept only where the module then wrote the
buffer (its version moved, or its values: batch norm's kernel writes the running statistics it is
passed without moving their version), and the recomputation's private copies start from those.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["Buffers"]


class Buffers:
    """The buffers of one region: those its forward wrote, as they were before (``noting``), and
    the shield of its recomputation (``shielded``). ``roots``: modules whose forward the region
    calls without ``__call__``."""

    def __init__(self, roots: tuple[nn.Module, ...] = ()) -> None:
        self.roots = roots
        self.before: dict[tuple[int, str], torch.Tensor] = {}  # (id(module), name) -> value before
        self._pending: dict[int, list[tuple[str, torch.Tensor, int, torch.Tensor]]] = {}

    @contextlib.contextmanager
    def noting(self) -> Iterator[None]:
        """Around the region's forward (NOTE [buffers as the forward saw them])."""
        pre = nn.modules.module.register_module_forward_pre_hook(lambda m, _args: self._note(m))
        post = nn.modules.module.register_module_forward_hook(lambda m, _args, _out: self._keep(m))
        try:
            for root in self.roots:
                self._note(root)
            yield
            for root in self.roots:
                self._keep(root)
        finally:
            pre.remove()
            post.remove()
            self._pending.clear()

    def _note(self, module: nn.Module) -> None:
        if not module.training or not module._buffers or id(module) in self._pending:
            return
        with _disable_current_modes():  # our copies are not the program's ops
            self._pending[id(module)] = [
                (name, buf, buf._version, buf.detach().clone())
                for name, buf in module._buffers.items()
                if buf is not None and (id(module), name) not in self.before
            ]

    def _keep(self, module: nn.Module) -> None:
        with _disable_current_modes():  # a kernel may write a buffer it was passed unannounced
            for name, buf, version, copy in self._pending.pop(id(module), ()):
                if buf._version != version or not torch.equal(buf, copy):
                    self.before[(id(module), name)] = copy

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """Within the block, buffer updates by any module's forward, and by the roots, go to
        throwaway copies, which start from the values the region's forward read."""
        swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
        seen: set[int] = set()

        def swap(module: nn.Module, _args: Any) -> None:
            if id(module) in seen or not module._buffers:
                return
            seen.add(id(module))
            # The copies are not the program's ops: a selective recomputation matches the ops it
            # runs to the forward's by position, so they must not reach its dispatch mode.
            with _disable_current_modes():
                for name, buf in module._buffers.items():
                    if buf is not None:
                        swapped.append((module, name, buf))
                        module._buffers[name] = self.before.get((id(module), name), buf).detach().clone()

        handle = nn.modules.module.register_module_forward_pre_hook(swap)
        try:
            for root in self.roots:
                swap(root, ())
            yield
        finally:
            handle.remove()
            for module, name, buf in reversed(swapped):
                module._buffers[name] = buf
