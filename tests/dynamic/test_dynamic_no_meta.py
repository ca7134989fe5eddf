"""An op whose meta kernel refuses its arguments (``_grouped_mm`` in float32 on CPU: its meta
kernel asks for bfloat16) runs before the pool places its results the first time; the sizes it
made then stand in for its meta results, so that later calls are placed first and the budget holds
in the allocator's count (NOTE [room first] in ``remat.dynamic.engine``)."""

from __future__ import annotations

import pytest
import torch
from budgeted import budgeted_step
from torch import nn

from remat.dynamic import accounting


class _Experts(nn.Module):
    """Two grouped matmuls over four experts, as a mixture-of-experts layer runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 32, 64) * 0.1)
        self.w2 = nn.Parameter(torch.randn(4, 64, 32) * 0.1)
        self.register_buffer("offs", torch.tensor([100, 500, 700, 1024], dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch._grouped_mm(x, self.w1, offs=self.offs).tanh().tanh()
        return torch._grouped_mm(h, self.w2, offs=self.offs)


def _refused() -> bool:
    meta = [torch.empty(8, 32, device="meta"), torch.empty(4, 32, 64, device="meta")]
    try:
        torch._grouped_mm(*meta, offs=torch.empty(4, dtype=torch.int32, device="meta"))
    except (RuntimeError, NotImplementedError):
        return True
    return False


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm") or not _refused(), reason="meta kernel accepts it")
@pytest.mark.parametrize("policy", ["dtr", "coop"])
def test_an_op_its_meta_kernel_refuses_is_placed_once_seen(policy: str) -> None:
    torch.manual_seed(0)
    model, x = _Experts(), torch.randn(1024, 32)
    run = budgeted_step(model, x, policy, 0.8)
    assert run.stats.evictions > 0
    assert run.allocator_peak + run.stats.outside_bytes <= run.budget
    for p, g in zip((p for p in model.parameters() if p.grad is not None), run.plain, strict=True):
        assert torch.equal(p.grad, g)
    assert any("_grouped_mm" in str(key[0]) and metas for key, metas in accounting._METAS.items())
