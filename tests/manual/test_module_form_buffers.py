"""Buffers under ``remat.checkpoint``: the module form wraps the module's bound ``forward``, which
its recomputation calls with no ``Module.__call__``, so the module's own buffers are shielded by
name (batch norm's statistics moved twice per step otherwise); and a recomputation reads buffers
as the forward found them (NOTE [buffers as the forward saw them])."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import remat


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


def _step(model: _Block, form: str, x: torch.Tensor) -> None:
    if form == "bn":
        remat.checkpoint(model.bn)
    elif form == "bn in block":
        remat.checkpoint(model.bn)
        remat.checkpoint(model)
    if form == "bn in scope":
        remat.checkpoint(model.bn)
        with remat.scope():
            y = model(x)
    else:
        y = model(x)
    y.square().sum().backward()


@pytest.mark.parametrize("form", ["bn", "bn in block", "bn in scope"])
def test_a_checkpointed_module_updates_its_buffers_once(form: str) -> None:
    torch.manual_seed(0)
    plain, x = _Block(), torch.randn(2, 4, 8, 8)
    wrapped = copy.deepcopy(plain)
    _step(plain, "plain", x)
    _step(wrapped, form, x)
    for (name, a), b in zip(plain.state_dict().items(), wrapped.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


class _Centred(nn.Module):
    """Subtracts a running mean it reads and then updates in training, an exponential moving
    average: what it computes depends on the buffer as the forward found it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (x - self.mean).tanh()  # tanh saves its output: recomputed from the buffer
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return out


@pytest.mark.parametrize("check", ["shapes", "values"])
def test_recomputation_reads_buffers_as_the_forward_found_them(check: str) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), _Centred(8), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
    wrapped = copy.deepcopy(plain)
    x = torch.randn(16, 8)
    for _ in range(2):
        plain(x).square().sum().backward()
        remat.checkpoint(wrapped, x, check=check).square().sum().backward()
    for (name, a), b in zip(plain.state_dict().items(), wrapped.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


class _Reassigned(_Centred):
    """The same running mean, updated by assigning a new tensor to the buffer's name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (x - self.mean).tanh()
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return out


def test_a_buffer_assigned_anew_is_read_as_the_forward_found_it() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), _Reassigned(8), nn.Linear(8, 8))
    wrapped = copy.deepcopy(plain)
    x = torch.randn(16, 8)
    for _ in range(2):
        plain(x).square().sum().backward()
        remat.checkpoint(wrapped, x).square().sum().backward()
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("device", ["meta", "fake"])
def test_batch_norm_under_checkpoint_on_tensors_without_data(device: str) -> None:
    """No buffer's values are read to see whether it was written: meta and fake tensors run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() if device == "fake" else torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
        x = torch.randn(16, 8)
        remat.checkpoint(model, x).sum().backward()
        assert model[0].weight.grad is not None and model[0].weight.grad.shape == (8, 8)


class _Masked(nn.Module):
    """Reads a 4 MiB buffer it never writes."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(1024, 1024))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.mask[:8, :8]).tanh()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_buffer_the_forward_only_reads_is_not_copied(training: bool) -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), _Masked()).train(training), torch.randn(16, 8)
    with remat.memory.track(allocator=True) as step:
        remat.checkpoint(model, x).sum().backward()
    assert step.peak_bytes < 2**20  # neither the forward nor the recomputation copies the mask


def test_a_compiled_block_is_compiled_once() -> None:
    """No module hook is added in the forward (``torch.compile`` guards on the global hooks)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    block = torch.compile(nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.GELU()), backend="eager")
    x = torch.randn(8, 16, requires_grad=True)
    for _ in range(3):
        remat.checkpoint(block, x).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1


def test_a_partial_of_a_layers_forward_knows_its_module() -> None:
    """``transformers``' layers checkpoint ``partial(Layer.forward, layer, **kwargs)``: the layer and
    its children are the region's modules, read as the forward found them."""
    import functools

    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), _Centred(8), nn.BatchNorm1d(8))
    wrapped = copy.deepcopy(plain)
    x = torch.randn(16, 8)
    plain(x).square().sum().backward()
    run = functools.partial(nn.Sequential.forward, wrapped)
    remat.checkpoint(run, x, check="values").square().sum().backward()
    for (name, a), b in zip(plain.state_dict().items(), wrapped.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for a, b in zip(plain.parameters(), wrapped.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_another_threads_module_keeps_its_buffer_updates_during_a_recomputation() -> None:
    """The shield of a recomputation's buffers is a process-wide module hook; a batch norm whose
    forward ran in another thread meanwhile wrote throwaway copies (``num_batches_tracked`` left 0,
    its statistics lost). Only the recomputing thread's calls are shielded now."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    other = nn.BatchNorm1d(3)
    twin = copy.deepcopy(other)
    batch = torch.randn(5, 3)
    runs: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        runs.append(len(runs))
        if len(runs) == 2:  # the run again, in backward: another thread trains its own module
            thread = threading.Thread(target=other, args=(batch,))
            thread.start()
            thread.join()
        return block(x)

    remat.checkpoint(fn, torch.randn(6, 4, requires_grad=True)).sum().backward()
    twin(batch)
    assert len(runs) == 2 and other.num_batches_tracked.item() == 1
    assert torch.equal(other.running_mean, twin.running_mean)
    assert torch.equal(other.running_var, twin.running_var)
