"""The arena backend holds its budget in the allocator's count, two steps in a row, or says how much
more reserve it needs (NOTE [beside the arena] in ``remat.dynamic.arena``): an MLP whose backward
products are 1 MiB each, and a small CNN, at several ratios of their unbudgeted peak."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from dynamic_models import conv_relu
from torch import nn

import remat
from remat import RematValueError

BESIDE = r"remat\.dynamic: the arena backend holds kernels' scratch, results copied in and the hand-over's"
HAND_OVER = BESIDE + r".*\(the hand-over of what the program keeps needs .*; raise the reserve by \d+ bytes"
TOO_SMALL = r"remat\.dynamic: the budget cannot hold what op \d+ \(.*\) needs at once"


def mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers = [nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(256, 1)), torch.randn(1024, 32)


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {"mlp": mlp, "cnn": lambda: conv_relu(3)}

# (model, ratio, reserve) -> the error the first budgeted step raises; every other case holds. The
# CNN's convolutions hold scratch the size of their result beside the arena, which the pool counts
# as well: no ratio here leaves room for both, and which rule stops it first depends on the
# kernels' scratch (and so on the thread count).
ANY = BESIDE + "|" + TOO_SMALL + r"|remat\.dynamic: op \d+ \(.*\) found no contiguous room"
FAILS = {
    ("mlp", 0.6, 0.1): HAND_OVER,
    ("mlp", 0.75, 0.1): HAND_OVER,
    ("mlp", 0.6, 0.25): TOO_SMALL,
    **{("cnn", ratio, reserve): ANY for ratio in (0.6, 0.75, 0.9) for reserve in (0.1, 0.25)},
}


def step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


@functools.cache
def reference(name: str) -> tuple[list[torch.Tensor], int]:
    """The plain step's gradients, and the pool's peak of the second unbudgeted region step."""
    model, x = MODELS[name]()
    step(model, x)
    plain = [p.grad.clone() for p in model.parameters()]
    free = remat.dynamic(None, "dtr", keep=model, cost="model")
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with free:
            step(model, x)
    return plain, free.stats.peak_bytes


@pytest.mark.parametrize("reserve", [0.1, 0.25])
@pytest.mark.parametrize("ratio", [0.6, 0.75, 0.9])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_arena_holds_the_budget_in_the_allocators_count_or_says_what_it_needs(
    name: str, ratio: float, reserve: float
) -> None:
    plain, peak = reference(name)
    model, x = MODELS[name]()
    budget = int(ratio * peak)
    region = remat.dynamic(
        budget, "dtr", backend="arena", keep=model, cost="model", reserve=reserve, thrash_limit=50.0
    )
    failure = FAILS.get((name, ratio, reserve))
    if failure is not None:
        with pytest.raises(RematValueError, match=failure), region:
            step(model, x)
        assert all(p.grad is None for p in model.parameters())  # the step was undone
        return
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with remat.memory.track(allocator=True) as measured, region:
            step(model, x)
        assert measured.peak_bytes + region.stats.outside_bytes <= budget
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain, strict=True))


def test_a_product_run_beside_the_arena_is_refused_before_it_runs() -> None:
    """An op with no ``out=`` kernel taking its arguments runs first and is copied in: its result,
    sized ahead by its meta kernel, must fit beside the arena."""
    x = torch.randn(256, 256)
    with (
        pytest.raises(
            RematValueError,
            match=BESIDE + r".*\(aten\.ones_like\.default needs 256\.00 KiB beside the arena, "
            r"the reserve leaves 1\.\d\d KiB\); raise the reserve by \d+ bytes or more",
        ),
        remat.dynamic(2_000_000, "dtr", backend="arena", keep=x, reserve=1024),
    ):
        torch.ones_like(x)


def test_tensors_read_mid_step_that_take_the_reserve_are_named() -> None:
    model, x = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(x).square().mean().backward()
    optimizer.step()  # gradients and momentum exist before the region
    free = remat.dynamic(None, "dtr", keep=(model, optimizer), cost="model")
    with free:
        model(x).square().mean().backward()
        optimizer.step()
    weights = [p.detach().clone() for p in model.parameters()]
    region = remat.dynamic(
        int(0.5 * free.stats.peak_bytes), "dtr", backend="arena", keep=(model, optimizer), cost="model",
        reserve=0.02,
    )  # fmt: skip
    with (
        pytest.raises(
            RematValueError,
            match=BESIDE + r".*, where tensors first read mid-step already hold .*, "
            r".* more than the reserve\); raise the reserve by \d+ bytes or more, "
            r"name the tensors read mid-step in keep",
        ),
        region,
    ):
        model(x).square().mean().backward()
        optimizer.step()
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))  # undone


def test_an_out_form_without_its_own_kernel_holds_its_results_beside_the_arena() -> None:
    """Convolution's backward has only a composite ``out=`` form: placed through it, it makes its
    results beside the arena and copies them in, which must fit there (it passed the budget
    silently before)."""
    _, peak = reference("cnn")  # the kernels' scratch learned first, as a second step would have
    model, x = conv_relu(3)
    region = remat.dynamic(
        int(1.5 * peak), "dtr", backend="arena", keep=model, cost="model", reserve=0.25, thrash_limit=50.0
    )
    beside = BESIDE + r".*\(aten\.convolution_backward\.default needs "
    with pytest.raises(RematValueError, match=beside), region:
        step(model, x)
    assert all(p.grad is None for p in model.parameters())  # the step was undone


def _data_dependent_step(weights: list[torch.Tensor], x: torch.Tensor) -> None:
    h = x
    for w in weights:
        h = torch.tanh(h @ w)
        where = (h > 0).nonzero()  # its size depends on the data: no meta kernel sizes it
        h = h + h[where[:, 0], where[:, 1]].sum() * 1e-3
    h.square().mean().backward()


@pytest.mark.parametrize("policy", ["dtr", "dte"])
def test_an_op_whose_size_depends_on_the_data_is_recomputed_beside_the_arena(policy: str) -> None:
    """``nonzero`` recomputed: its ``out=`` form cannot be placed ahead (its meta kernel refuses),
    so it runs beside the arena and its result is copied in (torch's NotImplementedError before)."""
    torch.manual_seed(0)
    weights = [torch.randn(32, 32, requires_grad=True) for _ in range(3)]
    x = torch.randn(256, 32)
    _data_dependent_step(weights, x)
    plain = [w.grad.clone() for w in weights]
    free = remat.dynamic(None, keep=weights, cost="model")
    for _ in range(2):
        for w in weights:
            w.grad = None
        with free:
            _data_dependent_step(weights, x)
    budget = int(0.7 * free.stats.peak_bytes)
    region = remat.dynamic(
        budget, policy, backend="arena", keep=weights, cost="model", reserve=0.3, thrash_limit=50.0
    )
    for w in weights:
        w.grad = None
    with remat.memory.track(allocator=True) as measured, region:
        _data_dependent_step(weights, x)
    assert region.stats.recomputations > 0
    assert measured.peak_bytes + region.stats.outside_bytes <= budget
    assert all(torch.equal(w.grad, g) for w, g in zip(weights, plain, strict=True))


def test_an_integer_index_recomputed_is_placed_in_the_arena() -> None:
    """``x[idx]`` carries torch's dynamic-output-shape tag, though its meta kernel sizes it from the
    index: its recomputation is placed in the arena, not run beside it (which needed 512 KiB the
    reserve did not have)."""
    torch.manual_seed(0)
    weights = [torch.randn(64, 64, requires_grad=True)] + [
        torch.randn(128, 64, requires_grad=True) for _ in range(3)
    ]
    x, v, idx = torch.randn(1024, 64), torch.randn(128, 1), torch.randint(0, 1024, (2048,))
    keep = [*weights, x, v, idx]

    def gathered() -> None:
        h = x
        for w in weights:
            h = torch.tanh(h @ w)[idx].reshape(1024, 128)
        (h @ v).square().mean().backward()

    free = remat.dynamic(None, "dtr", keep=keep, cost="model")
    for _ in range(2):
        for w in weights:
            w.grad = None
        with free:
            gathered()
    plain = [w.grad.clone() for w in weights]
    region = remat.dynamic(
        int(0.8 * free.stats.peak_bytes),
        "dtr",
        backend="arena",
        keep=keep,
        cost="model",
        reserve=0.1,
        thrash_limit=50.0,
    )
    for w in weights:
        w.grad = None
    with region:
        gathered()
    assert region.stats.recomputations > 0
    assert all(torch.equal(w.grad, g) for w, g in zip(weights, plain, strict=True))
