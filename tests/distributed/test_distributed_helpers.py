"""``remat.integrations.distributed`` in one process: its errors, a plan broadcast in a group of one,
and that hiding FSDP2's hooks leaves a model without them as it was."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import remat
from remat.integrations.distributed import broadcast_plan, hide_fsdp_hooks


def test_hide_fsdp_hooks_takes_a_module() -> None:
    with pytest.raises(
        remat.RematTypeError, match=r"hide_fsdp_hooks: model must be an nn.Module \(got int\)"
    ):
        hide_fsdp_hooks(3)  # type: ignore[arg-type]


def test_hide_fsdp_hooks_leaves_other_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    seen: list[int] = []
    model.register_forward_pre_hook(lambda m, args: seen.append(1))
    hooks = dict(model._forward_pre_hooks)
    assert hide_fsdp_hooks(model) is model
    assert dict(model._forward_pre_hooks) == hooks
    model(torch.randn(2, 4))
    assert seen == [1]


def test_broadcast_plan_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(remat.RematValueError, match="broadcast_plan: torch.distributed must be initialized"):
        broadcast_plan(None)


def test_broadcast_plan_in_a_group_of_one(tmp_path: object) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    plan = remat.plan(model, (torch.randn(64, 32),), 1.0, loss_fn=lambda m, x: m(x).sum(), repeats=1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(
            remat.RematTypeError, match=r"the source rank must pass a Plan \(rank 0 got NoneType\)"
        ):
            broadcast_plan(None)
        assert broadcast_plan(plan).to_json() == plan.to_json()
    finally:
        dist.destroy_process_group()


def test_scope_around_a_buffer_copy_then_batch_norm() -> None:
    torch.manual_seed(0)
    bn, x = nn.BatchNorm1d(8), torch.randn(4, 8, requires_grad=True)
    plain = copy.deepcopy(bn)
    (plain(x * 2) ** 2).sum().backward()
    want = x.grad
    x.grad = None
    with remat.scope():
        with torch.no_grad():
            bn.running_mean.copy_(torch.zeros(8))  # what DDP does with rank 0's buffers
        y = bn(x * 2)
    (y**2).sum().backward()
    assert torch.equal(x.grad, want)
