"""Opt-in value checks: did the recomputation produce what the forward pass produced?

Comparing metadata (shape, dtype) is free and always done. Comparing values needs the forward
values, which recomputation exists to not keep; so in forward we keep a cheap fingerprint of each
saved tensor (its sum and absolute sum in float64: two scalars) and the op and module that made
it, and compare the recomputed tensor's fingerprint in backward. A mismatch names the op and the
module, which is what a user needs to find the non-deterministic or stateful code.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from remat._errors import RecomputationError, message
from remat.aten import GRAD_MODE_PACKETS

Check = Literal["none", "shapes", "values"]
"""How a recomputation is checked against the forward: not at all, shapes and dtypes (free), or
values too (a fingerprint per saved tensor; a mismatch names the op and the module)."""


@dataclass(frozen=True)
class TensorMeta:
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(t.shape, t.dtype, t.device)

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')} on {self.device}"


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Three float64 scalars that change when the values change or move (kept on the tensor's
    device): their sum, their absolute sum, and a sum weighted by position (a permutation, a mask
    redrawn with as many ones, leaves the first two as they were)."""
    with torch.no_grad():
        d = t.detach()
        if d.is_complex():
            d = torch.view_as_real(d)
        d = d.to(torch.float64).flatten()
        weights = torch.arange(1, d.numel() + 1, dtype=torch.float64, device=d.device).remainder_(9973)
        return torch.stack((d.sum(), d.abs().sum(), torch.dot(d, weights)))


def same_fingerprint(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, rtol=1e-6, atol=1e-9, equal_nan=True))


def compare_values(
    prints: list[torch.Tensor | None], origins: list[str], store: dict[int, torch.Tensor]
) -> None:
    """Raise where a recomputed saved tensor (``store``: index -> tensor) has other values than the
    forward left in it (``prints``, None where its values may differ between runs)."""
    for i, t in sorted(store.items()):
        forward = prints[i]
        if forward is not None and not same_fingerprint(forward, fingerprint(t)):
            raise RecomputationError(
                message(
                    "checkpoint",
                    "a recomputed tensor has other values than the forward's",
                    f"saved tensor #{i} made by {origins[i]}",
                    "the code is not deterministic or reads state that changed since the forward; "
                    "fix it or exclude it from the checkpointed region",
                )
            )


class Provenance(TorchDispatchMode):
    """Remembers, for each tensor made inside it, the ATen op and the module path that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.origin: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.modules: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        where = self.modules[-1] if self.modules else "<top>"
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.origin[o] = (str(func), where)
        return out

    def checkable(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s :func:`fingerprint`, or None where its values differ between runs: the workspace
        of a recurrent kernel (``remat.aten.GRAD_MODE_PACKETS``), memory it need not write."""
        op = self.origin.get(t, ("",))[0]
        return None if op.rsplit(".", 1)[0] in GRAD_MODE_PACKETS else fingerprint(t)

    def describe(self, t: torch.Tensor) -> str:
        op, module = self.origin.get(t, ("an input of the region", "<outside>"))
        return f"op {op} in module {module}"

    @contextlib.contextmanager
    def tracking(self, root: object) -> Iterator[None]:
        """Record origins; name modules by their path under ``root`` when it is a module."""
        names: dict[int, str] = {}
        if isinstance(root, nn.Module):
            names = {id(m): (n or type(root).__name__) for n, m in root.named_modules()}

        owner = threading.get_ident()  # the hooks are the process's; the calls, this thread's

        def enter(module: nn.Module, _args: Any) -> None:
            if threading.get_ident() == owner:
                self.modules.append(names.get(id(module), type(module).__name__))

        def leave(module: nn.Module, _args: Any, _out: Any) -> None:
            if self.modules and threading.get_ident() == owner:
                self.modules.pop()

        pre = nn.modules.module.register_module_forward_pre_hook(enter)
        post = nn.modules.module.register_module_forward_hook(leave)
        try:
            with self:
                yield
        finally:
            pre.remove()
            post.remove()
