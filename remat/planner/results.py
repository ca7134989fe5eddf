"""An op's first result as the plan's executor checks it against the traced step
(``_Runner._checked`` in ``remat.planner.execute``): ``float32[8, 64]``, its dtype and shape.

Why apart: the executor names a result on each forward op, the capture's side names the traced
one (``first_result``), and a module run again checks its ops with the same names
(``remat.planner.rerun.CallCheck``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from remat import aten
from remat.trace.types import Op, Trace

__all__ = ["expected", "first_result", "made"]


_PARSED: dict[int, tuple[Sequence[str], list[tuple[torch.dtype, tuple[int, ...]] | None]]] = {}


def expected(shapes: Sequence[str]) -> list[tuple[torch.dtype, tuple[int, ...]] | None]:
    """Each ``float32[8, 64]`` of ``shapes`` as its dtype and shape (None: not one), once per plan."""
    entry = _PARSED.get(id(shapes))
    if entry is None or entry[0] is not shapes:
        parsed: list[tuple[torch.dtype, tuple[int, ...]] | None] = []
        for text in shapes:
            name, _, dims = text.partition("[")
            dtype = getattr(torch, name, None)
            parts = [d.strip() for d in dims[:-1].split(",") if d.strip()]
            whole = dims.endswith("]") and all(map(str.isdigit, parts))
            if not isinstance(dtype, torch.dtype) or not whole:
                parsed.append(None)
                continue
            sizes = tuple(map(int, parts))
            parsed.append((dtype, sizes) if aten.describe(dtype, sizes) == text else None)
        if len(_PARSED) > 64:  # plans come and go
            _PARSED.clear()
        entry = _PARSED[id(shapes)] = (shapes, parsed)
    return entry[1]


def _first(out: Any, written: Sequence[bool]) -> torch.Tensor | None:
    """An op's first result tensor that is not a written argument handed back (the trace's first
    output of the op: ``remat.trace.recorder``)."""
    results = [out] if len(written) == 1 else list(out or ())
    for is_write, result in zip(written, results, strict=False):
        if not is_write:
            for t in tree_leaves(result):
                if isinstance(t, torch.Tensor):
                    return t
    return None


def made(out: Any, info: aten.OpFacts) -> str | None:
    """An op's first result's dtype and shape as ``_Runner._checked`` names them."""
    got = _first(out, info.written_returns)
    return None if got is None else aten.describe(got.dtype, got.shape)


def first_result(trace: Trace, op: Op) -> str:
    """``op``'s first result as ``_Runner._checked`` names it (``float32[8, 64]``), from the trace;
    empty where the trace does not know it."""
    t = trace.tensors[op.outputs[0]] if op.outputs else None
    return f"{t.dtype}{list(t.shape)}" if t is not None and t.shape is not None and t.dtype else ""
