"""Kernels' scratch learned inside ``remat.memory.track(allocator=True)`` (NOTE [held back] in
``remat._allocator``): the step that meets an op signature first, while the profiler runs for the
track, counts its scratch as nothing and says so; the track's end learns it, the same figure a
step outside the profiler learns; the next step counts it and holds the budget."""

from __future__ import annotations

import math
import re
import threading
import time
import warnings

import pytest
import torch
from dynamic_models import conv_relu
from torch import nn

import remat
from remat import _allocator
from remat.aten import scratch

UNMEASURED = (
    r"remat\.dynamic: \d+ ops? of this step ran with their kernels' scratch unknown.*learns it when it ends"
)


def step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()


@pytest.fixture
def forgotten(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[object, ...], int]:
    """The process's learned scratch, emptied for the test (and put back after it)."""
    known: dict[tuple[object, ...], int] = {}
    monkeypatch.setattr(scratch, "_KNOWN", known)
    monkeypatch.setattr(scratch, "_RESULTS", {})
    return known


def test_a_window_of_a_running_account_gets_the_scratch_of_its_allocations() -> None:
    got: list[int] = []
    with _allocator.account():
        assert _allocator.ours() and not _allocator.available()
        before = torch.empty(4096)  # not in the window: counts for the account, not for the window
        start = time.time_ns()
        temporary = torch.empty(1000)  # 4000 bytes, freed inside the window
        kept = torch.empty(500)  # 2000 bytes, held after it
        del temporary
        _allocator.later(start, time.time_ns(), got.append)
        assert got == []  # only when the account ends
        del before
    assert got == [4000]
    assert not _allocator.ours() and kept.numel() == 500


def test_another_threads_account_is_neither_ours_nor_free() -> None:
    """The profiler records the allocations of the thread that started it: another thread may
    neither ask ``later`` nor start a session of its own (two sessions crash the process)."""
    seen: list[bool] = []
    with _allocator.account():
        thread = threading.Thread(target=lambda: seen.extend((_allocator.ours(), _allocator.available())))
        thread.start()
        thread.join()
    assert seen == [False, False]
    assert _allocator.available()


def test_scratch_learned_inside_a_track_equals_scratch_learned_outside(
    forgotten: dict[tuple[object, ...], int],
) -> None:
    model, x = conv_relu(2)
    with remat.dynamic(None, "dtr", keep=model):
        step(model, x)
    outside = dict(forgotten)
    assert any("convolution" in key[0] and n > 0 for key, n in outside.items())
    forgotten.clear()
    region = remat.dynamic(None, "dtr", keep=model)
    with pytest.warns(UserWarning, match=UNMEASURED), remat.memory.track(allocator=True), region:
        step(model, x)
    assert forgotten == outside


def test_the_step_after_the_track_learned_the_scratch_holds_the_budget(
    forgotten: dict[tuple[object, ...], int],
) -> None:
    model, x = conv_relu(2)
    step(model, x)
    plain = [p.grad.clone() for p in model.parameters()]
    free = remat.dynamic(None, "dtr", keep=model, cost="model")
    with pytest.warns(UserWarning, match=UNMEASURED), remat.memory.track(allocator=True), free:
        step(model, x)
    assert free.stats.unmeasured_scratch > 0
    with remat.memory.track(allocator=True), free:
        step(model, x)
    assert free.stats.unmeasured_scratch == 0
    # between the least budget the step needs and the budget that needs no eviction
    least = remat.dynamic(1, "dtr", reserve=0.1).least_budget(free.stats.needed_bytes)
    budget = (least + math.ceil(free.stats.peak_bytes / 0.9)) // 2
    region = remat.dynamic(budget, "dtr", keep=model, cost="model", reserve=0.1, thrash_limit=50.0)
    for _ in range(2):
        with remat.memory.track(allocator=True) as measured, region:
            step(model, x)
        assert region.stats.unmeasured_scratch == 0
        assert region.stats.evictions > 0
        assert measured.peak_bytes + region.stats.outside_bytes <= region.budget
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain, strict=True))


def test_an_optimizers_new_numbers_each_step_are_one_signature(
    forgotten: dict[tuple[object, ...], int],
) -> None:
    """AdamW passes a new step size to its pointwise ops every step: each step's keys were new, the
    tables grew without bound, and every tracked step warned that its scratch was unknown (NOTE
    [signature numbers] in ``remat.aten.scratch``)."""
    model, x = conv_relu(2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    region = remat.dynamic(None, "dtr", keep=(model, optimizer))
    sizes = []
    for k in range(4):
        with warnings.catch_warnings(record=True) as caught, remat.memory.track(allocator=True), region:
            warnings.simplefilter("always")
            step(model, x)
            optimizer.step()
        unknown = [w for w in caught if re.search(UNMEASURED, str(w.message))]
        assert bool(unknown) == (k == 0)
        sizes.append(len(forgotten))
    assert sizes[1] == sizes[2] == sizes[3]


def test_a_storage_argument_is_keyed_by_its_size_not_its_contents() -> None:
    storage = torch.arange(1000.0).untyped_storage()
    key = scratch.signature_of("aten.set_.source_Storage", [torch.empty(0), storage])
    assert key[-1] == ("storage", storage.device, 4000)
    assert scratch.signature_of("aten.add.Tensor", [torch.ones(2), 0.5], True)[-1] == "float"
    assert scratch.signature_of("aten.arange.default", [7.5])[-1] == "7.5"  # sizes the result
