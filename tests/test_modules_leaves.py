"""``remat._modules`` and ``remat._leaves``: the fast walks the plan and the manual forms run at
every forward give what ``nn.Module``'s walks and torch's pytree give."""

from __future__ import annotations

import collections

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from remat._leaves import flat, leaves
from remat._modules import TORCH_DICTS, TORCH_FIELDS, below, buffers, own_attributes, parameters


def _model() -> nn.Module:
    """Shared children, a child set to None, a tied parameter, buffers, a nested container."""
    shared = nn.Linear(4, 4)
    model = nn.Sequential(
        shared,
        nn.BatchNorm1d(4),
        nn.ModuleList([nn.Linear(4, 4), shared, nn.Sequential(nn.ReLU(), nn.LayerNorm(4))]),
    )
    model.add_module("gone", None)
    model[2][0].weight = model[0].weight  # tied
    model.register_buffer("counter", torch.zeros(1))
    return model


def test_below_parameters_and_buffers_are_the_module_walks() -> None:
    model = _model()
    assert [id(m) for m in below(model)] == [id(m) for m in model.modules()]
    assert [id(p) for p in parameters(model)] == [id(p) for p in model.parameters()]
    assert [id(b) for b in buffers(model)] == [id(b) for b in model.buffers()]
    walked = below(model)
    assert [id(p) for p in parameters(model, walked)] == [id(p) for p in model.parameters()]


def test_own_attributes_are_what_the_module_holds_besides_torch_fields() -> None:
    layer = nn.Linear(3, 3)
    layer.scale = 0.5
    layer.generator = torch.Generator()
    own = dict(own_attributes(layer))
    assert own["scale"] == 0.5 and own["generator"] is layer.generator
    assert own.keys() >= {"in_features", "out_features"}
    assert not own.keys() & TORCH_FIELDS
    assert {"_parameters", "_buffers", "_modules", "_forward_hooks"} <= TORCH_DICTS
    assert "training" in TORCH_FIELDS and "training" not in TORCH_DICTS


def test_flat_calls_give_pytree_leaves_and_containers_go_to_pytree() -> None:
    x, y = torch.randn(2), nn.Parameter(torch.randn(2))
    calls = [
        ((x, 1, None, "a", 2.0, True), {"b": y, "a": x}),
        ((), {}),
        (([x, y],), {}),
        ((x,), {"m": {"q": x}, "t": (1, 2)}),
        ((collections.OrderedDict(a=x),), {}),
    ]
    for args, kwargs in calls:
        assert [id(v) for v in leaves(args, kwargs)] == [id(v) for v in tree_leaves((args, kwargs))]
    assert flat(*calls[0]) is not None and flat(*calls[1]) == []
    assert all(flat(*call) is None for call in calls[2:])
