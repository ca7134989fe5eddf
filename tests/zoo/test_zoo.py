"""remat.zoo: every model builds, its captured step's liveness peaks at the measured peak, fake tensors give
the same trace as real ones, and bad names or sizes are refused clearly."""

from __future__ import annotations

import gc

import pytest
import torch

import remat
from remat import zoo
from remat.trace import Trace, capture

ALL = ["bert", "bert-large", "bilstm", "densenet121", "gpt2", "resnet50", "unet", "vit"]


def test_the_registry_lists_every_model() -> None:
    assert zoo.names() == tuple(ALL)
    assert str(zoo.get("resnet50")).startswith("resnet50: ResNet-50")


@pytest.mark.parametrize("name", ALL)
def test_liveness_peak_equals_measured_peak(name: str) -> None:
    # NOTE: a model's first step differs from later ones (lazy caches in transformers, batch-norm
    # counters), so both runs follow a warm-up step and start without gradients.
    model, inputs, loss_fn = zoo.build(name, tiny=True)

    def step() -> None:
        loss_fn(model(*inputs)).backward()

    step()
    model.zero_grad(set_to_none=True)
    gc.collect()
    with remat.memory.track(timeline=False, allocator=True) as m:
        step()
    model.zero_grad(set_to_none=True)
    trace = capture(step, repeats=1)
    assert m.peak_bytes > 0
    # exact on CPU: kernels' scratch buffers and the 0-dim tensors Python numbers become before
    # dispatch (NOTE [wrapped numbers] in ``remat.aten.schema``) are in the trace
    assert trace.activation_peak_bytes == m.peak_bytes


@pytest.mark.parametrize("name", ALL)
def test_fake_tensors_trace_the_same_step(name: str) -> None:
    real = capture(*zoo.build(name, tiny=True), repeats=1, scratch=False)  # fake kernels allocate nothing
    fake = capture(*zoo.build(name, tiny=True, fake=True))
    assert fake.source == "capture-fake" and fake.total_cost == 0.0

    def made(trace: Trace) -> list[tuple[str, list[int]]]:
        return [(op.name, [trace.tensors[t].nbytes for t in op.outputs]) for op in trace.ops]

    assert made(fake) == made(real)
    assert (fake.peak_bytes, fake.activation_peak_bytes) == (real.peak_bytes, real.activation_peak_bytes)


def test_sizes_and_defaults() -> None:
    model, (tokens,), _ = zoo.build("gpt2", tiny=True, batch=3, seq=7)
    assert tokens.shape == (3, 7) and model.training
    _, (images,), _ = zoo.build("unet", tiny=True, image=48)
    assert images.shape == (2, 3, 48, 48)
    _, (fake_images,), _ = zoo.build("resnet50", fake=True)  # paper size, no memory
    assert fake_images.shape == (64, 3, 224, 224)


def test_builds_are_deterministic_and_leave_the_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a, _, _ = zoo.build("resnet50", tiny=True, seed=3)
    b, _, _ = zoo.build("resnet50", tiny=True, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"name": "resnet"},
            remat.RematValueError,
            r"unknown model name \(got 'resnet'\); pass one of bert, bert-large",
        ),
        (
            {"name": "resnet50", "seq": 128},
            remat.RematValueError,
            r"'resnet50' takes image, not seq \(got seq=128\)",
        ),
        ({"name": "bert", "image": 224}, remat.RematValueError, r"'bert' takes seq, not image"),
        (
            {"name": "unet", "image": 100},
            remat.RematValueError,
            r"multiple of 16 \(got image=100\); pass e\.g\. image=96",
        ),
        ({"name": "bert-large", "seq": 1024}, remat.RematValueError, r"at most 512 tokens per sample"),
        ({"name": "vit", "batch": 0}, remat.RematValueError, r"batch must be positive \(got batch=0\)"),
        ({"name": "gpt2", "seq": -3}, remat.RematValueError, r"seq must be positive"),
        ({"name": "gpt2", "batch": 2.5}, remat.RematTypeError, r"batch must be an int \(got 2\.5\)"),
    ],
)
def test_bad_names_and_sizes(kwargs: dict[str, object], error: type[Exception], pattern: str) -> None:
    name = kwargs.pop("name")
    with pytest.raises(error, match=r"^remat\.zoo\.build: .*" + pattern):
        zoo.build(name, tiny=True, **kwargs)  # type: ignore[arg-type]
