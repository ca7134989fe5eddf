"""Keeping module buffers untouched while a region is recomputed.

Re-running a region in backward re-runs its modules' forward, and a module in training mode
updates its buffers as a side effect: batch norm's running mean and variance and
``num_batches_tracked`` would move twice per step (an open PyTorch bug). While a recomputation
runs, every module that starts a forward has its buffers swapped for private copies; the copies
take the update and are dropped afterwards, and the real buffers are put back untouched (their
version counters included, so tensors autograd saved from them stay valid). A module whose
``forward`` the recomputation calls itself (``remat.checkpoint(module)`` wraps the bound method, so
no ``__call__`` and no pre-hook runs for it) is named as a root and swapped at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes


@contextlib.contextmanager
def buffers_shielded(roots: tuple[nn.Module, ...] = ()) -> Iterator[None]:
    """Within the block, buffer updates by any module's forward, and by ``roots``, go to throwaway
    copies."""
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    seen: set[int] = set()

    def swap(module: nn.Module, _args: Any) -> None:
        if id(module) in seen or not module._buffers:
            return
        seen.add(id(module))
        # The copies are not the program's ops: a selective recomputation matches the ops it runs
        # to the forward's by position, so they must not reach its dispatch mode.
        with _disable_current_modes():
            for name, buf in module._buffers.items():
                if buf is not None:
                    swapped.append((module, name, buf))
                    module._buffers[name] = buf.detach().clone()

    handle = nn.modules.module.register_module_forward_pre_hook(swap)
    try:
        for root in roots:
            swap(root, ())
        yield
    finally:
        handle.remove()
        for module, name, buf in reversed(swapped):
            module._buffers[name] = buf
