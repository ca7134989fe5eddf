"""``remat._flops.counted_flops``: the profiler's count of matrix-product work, each op once also
where a dispatch mode re-dispatches it (the profiler then shows the op twice, nested)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat._flops import counted_flops


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def test_a_matrix_product_counts_once_under_a_dispatch_mode_too() -> None:
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    expected = 2 * 8 * 16 * 4
    assert counted_flops(lambda: a @ b) == expected

    def moded() -> None:
        with _PassThrough():
            a @ b

    assert counted_flops(moded) == expected
    assert counted_flops(lambda: (a @ b, a @ b)) == 2 * expected
