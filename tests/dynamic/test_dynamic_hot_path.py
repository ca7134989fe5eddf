"""The shortcuts the dynamic runtime's per-op path takes give what the general code gives: argument
flattening against pytree, the scan of the flat leaves against plain ``isinstance`` tests, the
scratch signature from flat leaves, numpy columns synced on read, and the cost update of a record;
and a region's state is freed when it ends, not left in reference cycles."""

from __future__ import annotations

import dataclasses
import gc
import random
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import remat
from remat.aten import facts, scratch
from remat.core.graph import Column, with_cost
from remat.dynamic.recipe import Scan, flatten, scan, unflatten
from remat.trace.types import Op, Phase

aten = torch.ops.aten
x, y = torch.randn(2, 3), torch.randn(2, 3)
CALLS = [
    (aten.add.Tensor, (x, y), {"alpha": 2}),
    (aten.cat.default, ([x, y], 0), {}),
    (aten.cat.default, ((x, y),), {"dim": 1}),
    (aten.index.Tensor, (x, [None, torch.tensor([0, 2])]), {}),
    (aten.view.default, (x, [3, 2]), {}),
    (aten.sum.dim_IntList, (x, [0, 1], True), {"dtype": torch.float64}),
    (aten.full.default, ([2, 3], 1.5), {"dtype": torch.float32, "device": torch.device("cpu")}),
    (aten.native_dropout.default, (x, 0.5, True), {}),
]
SCANNED = [  # with generators, devices, layouts and memory formats among the leaves
    *CALLS,
    (aten.normal.Tensor_float, (x, 1.0), {"generator": torch.Generator().manual_seed(0)}),
    (aten.to.dtype_layout, (x,), {"dtype": torch.float64, "layout": torch.strided, "device": "meta"}),
    (aten.empty.memory_format, ([2], None, None, torch.device("cpu"), False, torch.contiguous_format), {}),
]


def _same(a: object, b: object) -> bool:
    """The same objects, in containers of the same type."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b, strict=True))
    return a is b


@pytest.mark.parametrize("call", CALLS, ids=lambda c: str(c[0]))
def test_flatten_matches_pytree_and_round_trips(call: tuple) -> None:
    func, args, kwargs = call
    flat, spec = flatten(args, kwargs)
    assert _same(flat, tree_leaves((args, kwargs)))
    rebuilt_args, rebuilt_kwargs = unflatten(flat, spec)
    assert _same(rebuilt_args, list(args))
    assert list(rebuilt_kwargs) == list(kwargs) and _same(
        list(rebuilt_kwargs.values()), list(kwargs.values())
    )
    torch.manual_seed(0)
    expected = func(*args, **kwargs)
    torch.manual_seed(0)
    torch.testing.assert_close(func(*rebuilt_args, **rebuilt_kwargs), expected, equal_nan=True)


@pytest.mark.parametrize("call", SCANNED, ids=lambda c: str(c[0]))
def test_scan_skips_plain_leaves_as_isinstance_would(call: tuple) -> None:
    """:func:`scan` passes over leaves of plain types without asking ``isinstance``; the result is
    the one the three ``isinstance`` tests give on every leaf."""
    _, args, kwargs = call
    flat, _ = flatten(args, kwargs)

    def managed(t: torch.Tensor) -> bool:  # the region's tensors, told apart by rank here
        return t.dim() == 2

    expected = Scan(
        [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor) and managed(v)],
        [(i, v) for i, v in enumerate(flat) if isinstance(v, torch.Generator)],
        [v for v in flat if isinstance(v, torch.device)],
        # the region's tensors and the generators leave the leaves; other tensors (sparse,
        # another device's) stay, for the recipe to pass them as they are
        [
            None if isinstance(v, torch.Generator) or (isinstance(v, torch.Tensor) and managed(v)) else v
            for v in flat
        ],
        any(isinstance(v, torch.Tensor) for v in flat),
    )
    assert _same(list(scan(flat, managed)), list(expected))


@pytest.mark.parametrize("call", CALLS, ids=lambda c: str(c[0]))
def test_signature_from_flat_leaves_is_the_signature(call: tuple) -> None:
    func, args, kwargs = call
    flat, _ = flatten(args, kwargs)
    pointwise = facts(func).pointwise  # as the engine passes it
    assert scratch.signature_of(str(func), flat, pointwise) == scratch.signature(func, args, kwargs)


@pytest.mark.parametrize("dtype", [float, bool])
def test_column_array_follows_its_values(dtype: type) -> None:
    rng = random.Random(0)
    column = Column(dtype)
    for step in range(3000):
        if not column.values or rng.random() < 0.3:
            column.append(dtype(rng.random() < 0.5) if dtype is bool else rng.random())
        else:
            i = rng.randrange(len(column.values))
            column.set(i, dtype(rng.random() < 0.5) if dtype is bool else rng.random())
        if step % 97 == 0 or step == 2999:
            n = len(column.values)
            array = column.array
            assert len(array) >= n and not array[n:].any()
            np.testing.assert_array_equal(array[:n], np.array(column.values, dtype=array.dtype))


def test_with_cost_is_replace() -> None:
    op = Op(3, "aten.mm.default", (1, 2), (4,), (2,), 0.5, 0.25, Phase.BACKWARD, "fc", True, 64, 128)
    changed = with_cost(op, 0.75)
    assert changed == dataclasses.replace(op, cost=0.75)
    assert op.cost == 0.5 and changed.cost == 0.75
    with pytest.raises(dataclasses.FrozenInstanceError):
        changed.cost = 1.0  # type: ignore[misc]


def test_a_region_leaves_no_reference_cycles() -> None:
    """The runtime's state (a few lists per storage) goes when the region ends: nothing of it waits
    for the cycle collector, whose passes would land in whatever code runs next."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    region = remat.dynamic(budget=None, keep=model)

    state: list[weakref.ref[Any]] = []

    def step() -> None:
        with region:
            model(x).sum().backward()
            engine = region._engine
            assert engine is not None
            state[:] = [weakref.ref(engine), weakref.ref(engine.backend), weakref.ref(engine.backend.runtime)]

    step()  # first use: caches of torch and remat fill
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        model.zero_grad(set_to_none=True)
        step()
        assert [ref() for ref in state] == [None, None, None]
    finally:
        if collecting:
            gc.enable()
