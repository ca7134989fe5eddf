"""Workloads and a training harness for the dynamic runtime's tests: a plain run and a run inside
``remat.dynamic``, from the same seed, compared bit for bit.

The models are small, but their batches are large enough for activations to outweigh parameters,
so that a budget below the unconstrained peak leaves recomputation something to do.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from models import CNN, ConvBlock, loss_of
from torch import nn

Batch = Callable[[int], dict[str, Any]]
Region = Callable[[nn.Module, torch.optim.Optimizer], contextlib.AbstractContextManager[Any]]


class FusedBiLSTM(nn.Module):
    """A bidirectional two-layer ``nn.LSTM`` (one fused op per layer) with dropout and a tagging head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 12)
        self.lstm = nn.LSTM(12, 16, num_layers=2, bidirectional=True, batch_first=True, dropout=0.1)
        self.head = nn.Linear(32, 6)

    def forward(self, tokens: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return nn.functional.cross_entropy(self.head(out).flatten(0, 1), tags.flatten())


def _tokens(seed: int, shape: tuple[int, int], vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _gpt2() -> tuple[nn.Module, Batch]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    model = GPT2LMHeadModel(config)

    def batch(step: int) -> dict[str, Any]:
        ids = _tokens(100 + step, (4, 32), 64)
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    return model, batch


def _bert() -> tuple[nn.Module, Batch]:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=32,
    )
    model = BertForMaskedLM(config)

    def batch(step: int) -> dict[str, Any]:
        ids = _tokens(200 + step, (4, 32), 64)
        return {"input_ids": ids, "labels": ids}

    return model, batch


class InplaceBlock(ConvBlock):
    """Convolution, batch norm, in-place ReLU, dropout, residual."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu_(self.bn(self.conv(x))))


def _cnn() -> tuple[nn.Module, Batch]:
    model = CNN(c=8, depth=3)
    model.layers = nn.ModuleList(InplaceBlock(8) for _ in range(3))

    def batch(step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(step)
        return {"x": torch.randn(16, 3, 12, 12, generator=g), "y": torch.randint(0, 5, (16,), generator=g)}

    return model, batch


def conv_relu(convs: int) -> tuple[nn.Module, torch.Tensor]:
    """``convs`` 3x3 convolutions of 16 channels with ReLUs and a linear head, and a batch of eight
    16x16 images: a convolution's scratch is the size of its result."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()]
    for _ in range(convs - 1):
        layers += [nn.Conv2d(16, 16, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(16 * 16 * 16, 1)), torch.randn(8, 3, 16, 16)


def _llama() -> tuple[nn.Module, Batch]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=32,
        attention_dropout=0.1,
    )
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)

    def batch(step: int) -> dict[str, Any]:
        ids = _tokens(500 + step, (4, 32), 64)
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    return model, batch


def _bilstm() -> tuple[nn.Module, Batch]:
    model = FusedBiLSTM()

    def batch(step: int) -> dict[str, Any]:
        return {"tokens": _tokens(300 + step, (8, 16), 64), "tags": _tokens(400 + step, (8, 16), 6)}

    return model, batch


WORKLOADS = {"gpt2": _gpt2, "bert": _bert, "cnn": _cnn, "bilstm": _bilstm, "llama": _llama}


def workload(name: str) -> tuple[nn.Module, Batch]:
    torch.manual_seed(0)
    model, batch = WORKLOADS[name]()
    return model.train(), batch


@dataclass
class Result:
    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    rng_after: torch.Tensor


def train(model: nn.Module, batch: Batch, region: Region | None, steps: int = 3) -> Result:
    """SGD with momentum for ``steps`` steps; each whole step (forward, backward, optimizer) inside
    ``region(model, optimizer)``. The batch is made inside the step, as a data loader would."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    torch.manual_seed(1234)
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        with region(model, opt) if region is not None else contextlib.nullcontext():
            loss = loss_of(model(**batch(step)))
            loss.backward()
            opt.step()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        losses.append(loss.detach())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return Result(losses, grads, state, torch.rand(4))


def assert_same(a: Result, b: Result) -> None:
    """Bit-for-bit equality of losses, last gradients, parameters and buffers, and RNG stream."""
    for i, (x, y) in enumerate(zip(a.losses, b.losses, strict=True)):
        assert torch.equal(x, y), f"loss of step {i} differs: {x.item()} vs {y.item()}"
    assert a.grads.keys() == b.grads.keys() and a.grads
    for name in a.grads:
        assert torch.equal(a.grads[name], b.grads[name]), f"gradient of {name} differs"
    assert a.state.keys() == b.state.keys()
    for name in a.state:
        assert torch.equal(a.state[name], b.state[name]), f"state {name} differs"
    assert torch.equal(a.rng_after, b.rng_after), "the RNG stream after training differs"


def copies(name: str) -> tuple[nn.Module, nn.Module, Batch]:
    model, batch = workload(name)
    return model, copy.deepcopy(model), batch
