"""The parameters' gradients are wanted at the region's end (``remat.dynamic.wanted``): a tight
budget evicts other storages instead, and handing the gradients back recomputes nothing, where the
same step without those marks (its own trace, replayed by the core) recomputes them at the end."""

from __future__ import annotations

import math

import pytest
import torch
from budgeted import budgeted_step
from torch import nn

import remat
from remat.core.driver import make_pool
from remat.core.runtime import Runtime
from remat.dynamic import DynamicStats
from remat.sim.backend import SimBackend, drive

RATIO = 0.4


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    """Twelve 64-wide layers on a batch of 512: activations outweigh the parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(12)], nn.Linear(64, 1))
    return model, torch.randn(512, 64)


def _hand_over(stats: DynamicStats, wants: tuple[tuple[int, int], ...]) -> int:
    """Recomputations of the hand-over when the core runs the region's trace with ``wants``."""
    backend = SimBackend(stats.trace.total_cost, len(stats.trace.ops), math.inf)
    pool = make_pool(stats.capacity, stats.layout, stats.fit)
    runtime = Runtime(pool, stats.policy_object, backend, compact=True)
    runtime.expect(wants)
    drive(runtime, stats.trace, backend, finish=False)
    before = runtime.telemetry.recomputations
    runtime.finish()
    return runtime.telemetry.recomputations - before


@pytest.mark.parametrize("kept", [True, False], ids=["keep=model", "keep=()"])
@pytest.mark.parametrize("policy", ["dtr", "dte"])
def test_gradients_are_handed_over_without_recomputation(policy: str, kept: bool) -> None:
    """Also without ``keep``: the gradient of every leaf the step reads is wanted (the hand-over
    rebuilt them, and a ratio budget the step met with ``keep`` was refused at the end)."""
    model, x = _mlp()
    run = budgeted_step(model, x, policy, RATIO, thrash_limit=20.0, keep=model if kept else ())
    stats, plain = run.stats, run.plain
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain, strict=True))
    assert run.allocator_peak + stats.outside_bytes <= run.budget
    assert len(stats.wants) == len(plain) and stats.evictions > 0
    assert stats.exit_recomputations == 0
    assert _hand_over(stats, stats.wants) == 0  # the simulator agrees
    assert _hand_over(stats, ()) > 0  # without the marks, the gradients were evicted and rebuilt
    assert stats.compare().same_evictions


def test_every_leaf_in_keep_is_wanted_also_leaves_that_view_one_storage() -> None:
    """Leaves that are views of one storage that needs no gradient (weights carved out of a flat
    buffer): the region counts the storage once, and only its first leaf's gradient was wanted."""
    torch.manual_seed(0)
    store = torch.randn(3 * 64 * 64)
    ws = [store[i * 4096 : (i + 1) * 4096].view(64, 64).requires_grad_() for i in range(3)]
    x = torch.randn(256, 64)
    region = remat.dynamic(None, "dtr", keep=tuple(ws))
    with region:
        h = x
        for w in ws:
            h = (h @ w).tanh()
        h.sum().backward()
    assert len(region.stats.wants) == len(ws)
