"""``remat.dynamic(..., swap=remat.Link(...))``: victims whose copy to host hides behind compute go
to host memory (outside the allocator's count) and come back instead of being recomputed; training
is exactly the plain model's, and the budget holds in the allocator's count."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from dynamic_models import assert_same, copies, train
from torch import nn

import remat
from remat.dynamic.region import Dynamic


def _steps(link: remat.Link, ratio: float, regions: list[Dynamic], peaks: list[tuple[int, int]]):  # type: ignore[no-untyped-def]
    @contextlib.contextmanager
    def step(model: nn.Module, opt: torch.optim.Optimizer) -> Iterator[None]:
        if not regions:  # the first block measures the plain step
            regions.append(remat.dynamic(ratio, "dtr", keep=(model, opt), cost="model", reserve=0, swap=link))
            with regions[0]:
                yield
            return
        region = regions[0]
        with remat.memory.track(allocator=True) as measured, region:
            yield
        peaks.append((region.stats.budget, measured.peak_bytes + region.stats.outside_bytes))

    return step


def _run(link: remat.Link, ratio: float, name: str = "gpt2") -> tuple[Dynamic, list[tuple[int, int]]]:
    plain, model, batch = copies(name)
    expected = train(plain, batch, None, steps=3)
    regions: list[Dynamic] = []
    peaks: list[tuple[int, int]] = []
    assert_same(expected, train(model, batch, _steps(link, ratio, regions, peaks), steps=3))
    assert peaks
    for budget, allocated in peaks:
        assert allocated <= budget
    return regions[0], peaks


@pytest.mark.parametrize("name", ["gpt2", "bert", "cnn"])
def test_a_fast_link_swaps_victims_and_training_stays_exact(name: str) -> None:
    """On GPT-2, BERT and the CNN with batch norm (and in-place ReLU): gradients, buffers and the
    RNG stream equal to the plain run's, and the allocator's peak within the budget."""
    region, _ = _run(remat.Link(d2h="1000TB/s", h2d="1000TB/s", latency=0), 0.6, name)
    counts = region.stats.swap
    assert counts is not None and counts.swaps > 0 and counts.reloads > 0
    assert counts.h2d_bytes > 0 and counts.host_peak > 0
    assert region.stats.evictions > 0


def test_a_link_too_slow_to_hide_swaps_nothing() -> None:
    region, _ = _run(remat.Link(d2h="1KB/s", h2d="1KB/s", latency="1s"), 0.9)
    counts = region.stats.swap
    assert counts is not None and counts.swaps == 0 and counts.reloads == 0
    assert region.stats.evictions > 0


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"swap": "25GB/s"}, remat.RematTypeError, r"remat\.dynamic: swap must be a remat\.Link"),
        (
            {"swap": remat.Link(), "backend": "arena", "budget": "1MB"},
            remat.RematValueError,
            r"remat\.dynamic: the arena backend places tensors in its arena",
        ),
    ],
)
def test_swap_refuses_what_it_cannot_do(kwargs: dict[str, object], error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        remat.dynamic(**{"budget": 0.5, **kwargs})  # type: ignore[arg-type]
