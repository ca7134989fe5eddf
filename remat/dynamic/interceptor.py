"""The dispatch mode of a dynamic region: hands every ATen op that reads data to the region's engine
(``remat.dynamic.engine``) and lets the others, which only make views, pass straight through.

NOTE [inference mode] A composite op (``reshape``, ``contiguous``, ``to``) is taken apart by autograd
before it reaches a dispatch mode, except under ``torch.inference_mode``, which leaves autograd out:
there it arrives whole, and ``reshape`` of an expanded view, which copies, would pass for a view and
read an evicted input. The interceptor runs its parts instead, each through the region. Not where the
op has a kernel of its own (``silu_backward`` on CPU, called whole by autograd's formulas in any mode):
that kernel is what runs plainly, and the parts may round otherwise.
"""

from __future__ import annotations

from typing import Any

from torch._C import DispatchKey

from remat import aten
from remat._dispatch import Unguarded
from remat.aten import OpFacts
from remat.dynamic.engine import Engine

__all__ = ["Interceptor"]

_OPS: dict[int, tuple[Any, OpFacts, bool, bool]] = {}
"""``id(overload)`` -> the overload, its facts, whether it reads no data or is no op of the program
(then it passes straight through), whether it is composite (NOTE [inference mode]). By ``id``: an
overload's ``__hash__`` is Python code."""


_KERNELS = (DispatchKey.CPU, DispatchKey.CUDA, DispatchKey.CompositeExplicitAutograd)  # these run first


def _known(func: Any) -> tuple[Any, OpFacts, bool, bool]:
    schema = aten.facts(func)
    has = func.has_kernel_for_dispatch_key
    composite = (
        not schema.skipped and has(DispatchKey.CompositeImplicitAutograd) and not any(map(has, _KERNELS))
    )
    _OPS[id(func)] = known = (func, schema, schema.skipped or (schema.view_only and not composite), composite)
    return known


class Interceptor(Unguarded):
    """Hands every ATen op of the region to its engine, whose storages an offloader must not copy."""

    owns_storages = True  # (``remat.host.offloader``)

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        known = _OPS.get(id(func)) or _known(func)
        if known[2]:  # reads no data: straight through
            return func(*args, **(kwargs or {}))
        if known[3]:  # NOTE [inference mode]: its parts come back here one by one
            with self:
                return func.decompose(*args, **(kwargs or {}))
        return self.engine.run(func, known[1], args, kwargs or {})
