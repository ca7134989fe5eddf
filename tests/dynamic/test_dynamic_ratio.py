"""``remat.dynamic(0.6)``: a ratio budget, as ``remat.plan`` takes, of the plain step's peak, given
(``peak=``) or measured by the region's first block; later blocks hold it in the allocator's count
and train exactly like the plain model."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from dynamic_models import assert_same, copies, train
from torch import nn

import remat
from remat.dynamic.region import Dynamic

RATIO = 0.9  # of the first step's peak, which has no optimizer state yet


def _steps(regions: list[Dynamic], peaks: list[tuple[int, int, int]]):  # type: ignore[no-untyped-def]
    """One region for every step, registering the model and its optimizer (``keep``: the budget
    counts them from the first op on)."""

    @contextlib.contextmanager
    def step(model: nn.Module, opt: torch.optim.Optimizer) -> Iterator[None]:
        if not regions:  # the first block measures the step (and its ops' scratch: the profiler is free)
            regions.append(remat.dynamic(RATIO, "dtr", keep=(model, opt), cost="model", reserve=0))
            with regions[0]:
                yield
            peaks.append((regions[0].stats.budget, -1, -1))
            return
        region = regions[0]
        with remat.memory.track(allocator=True) as measured, region:
            yield
        peaks.append((region.stats.budget, measured.peak_bytes, region.stats.outside_bytes))

    return step


def test_a_ratio_budget_is_measured_by_the_first_block_then_held() -> None:
    plain, model, batch = copies("gpt2")
    expected = train(plain, batch, None, steps=4)
    regions: list[Dynamic] = []
    peaks: list[tuple[int, int, int]] = []
    assert_same(expected, train(model, batch, _steps(regions, peaks), steps=4))
    region = regions[0]
    first, *later = peaks
    assert first[0] > 2**60  # the first block ran with no budget, and measured the step
    assert later and region.ratio == RATIO
    for budget, allocated, outside in later:
        assert budget == region.budget < first[0]
        assert allocated + outside <= budget
    assert region.stats.evictions > 0


def test_a_ratio_budget_with_the_peak_given_is_that_many_bytes() -> None:
    region = remat.dynamic(RATIO, "dtr", peak="10MB", reserve=0)
    assert region.budget == int(RATIO * 10**7) and region.ratio == RATIO


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"budget": 1.5}, r"remat\.dynamic: a ratio budget must lie in \(0, 1\] \(got 1\.5\)"),
        ({"budget": "2GB", "peak": "4GB"}, r"remat\.dynamic: peak is for a ratio budget"),
        ({"budget": 0.5, "backend": "arena"}, r"the arena backend needs a budget in bytes .*with no peak"),
    ],
)
def test_ratio_budgets_refuse_what_they_cannot_mean(kwargs: dict[str, object], pattern: str) -> None:
    with pytest.raises(remat.RematValueError, match=pattern):
        remat.dynamic(**kwargs)  # type: ignore[arg-type]
