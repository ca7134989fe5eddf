"""Small models for equivalence tests, and a harness that trains a plain and a wrapped copy.

Each builder returns ``(model, batch_fn, blocks)``: ``batch_fn(step)`` makes the inputs of one
step (deterministic), ``blocks(model)`` lists the sub-modules a test wraps for recomputation.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)) for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


class ResidualMLP(nn.Module):
    """``x + Linear(GELU(Linear(x)))``, twice as wide inside."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x)


class ConvBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.drop = nn.Dropout2d(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.relu(self.bn(self.conv(x))))


class CNN(nn.Module):
    def __init__(self, c: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.layers = nn.ModuleList(ConvBlock(c) for _ in range(depth))
        self.head = nn.Linear(c, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.cross_entropy(self.head(h.mean((2, 3))), y)


def _gpt2() -> tuple[nn.Module, Callable[[int], dict[str, Any]], Callable[[nn.Module], list[nn.Module]]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=96,
        n_positions=32,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    model = GPT2LMHeadModel(config)

    def batch(step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, 96, (2, 16), generator=g)
        return {"input_ids": ids, "labels": ids, "use_cache": False}

    return model, batch, lambda m: list(m.transformer.h)


def _bert() -> tuple[nn.Module, Callable[[int], dict[str, Any]], Callable[[nn.Module], list[nn.Module]]]:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=96,
        max_position_embeddings=32,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    model = BertForMaskedLM(config)

    def batch(step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(200 + step)
        ids = torch.randint(0, 96, (2, 12), generator=g)
        return {"input_ids": ids, "labels": ids}

    return model, batch, lambda m: list(m.bert.encoder.layer)


def _mlp() -> tuple[nn.Module, Callable[[int], dict[str, Any]], Callable[[nn.Module], list[nn.Module]]]:
    model = MLP()

    def batch(step: int) -> dict[str, Any]:
        return {"x": torch.randn(8, 32, generator=torch.Generator().manual_seed(step))}

    return model, batch, lambda m: list(m.layers)


def _cnn() -> tuple[nn.Module, Callable[[int], dict[str, Any]], Callable[[nn.Module], list[nn.Module]]]:
    model = CNN()

    def batch(step: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(step)
        return {"x": torch.randn(4, 3, 8, 8, generator=g), "y": torch.randint(0, 5, (4,), generator=g)}

    return model, batch, lambda m: list(m.layers)


BUILDERS = {"mlp": _mlp, "cnn": _cnn, "gpt2": _gpt2, "bert": _bert}


def build(
    name: str, seed: int = 0
) -> tuple[nn.Module, Callable[[int], dict[str, Any]], Callable[[nn.Module], list[nn.Module]]]:
    torch.manual_seed(seed)
    model, batch, blocks = BUILDERS[name]()
    model.train()
    return model, batch, blocks


def loss_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


@dataclass
class Run:
    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    rng_after: torch.Tensor


def train(
    model: nn.Module,
    batch: Callable[[int], dict[str, Any]],
    steps: int = 3,
    autocast: torch.dtype | None = None,
    region: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> Run:
    """Train with SGD for ``steps`` steps from seed 1234; keep losses, last grads, final state."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1234)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        ctx = torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with ctx, region() if region is not None else contextlib.nullcontext():
            loss = loss_of(model(**batch(step)))
        loss.backward()
        losses.append(loss.detach().float())
        if step < steps - 1:
            opt.step()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return Run(losses, grads, state, torch.rand(4))


def assert_same(a: Run, b: Run) -> None:
    """Exact equality: same kernels in the same order must give the same bits."""
    assert len(a.losses) == len(b.losses)
    for i, (x, y) in enumerate(zip(a.losses, b.losses, strict=True)):
        assert torch.equal(x, y), f"loss of step {i} differs: {x.item()} vs {y.item()}"
    assert a.grads.keys() == b.grads.keys()
    assert len(a.grads) > 0
    for name in a.grads:
        assert torch.equal(a.grads[name], b.grads[name]), f"gradient of {name} differs"
    assert a.state.keys() == b.state.keys()
    for name in a.state:
        assert torch.equal(a.state[name], b.state[name]), f"state {name} differs"
    assert torch.equal(a.rng_after, b.rng_after), "the RNG stream after training differs"


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


@contextlib.contextmanager
def no_region() -> Iterator[None]:
    yield


def assert_close(a: Run, b: Run, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """Equality up to floating-point rounding (fused kernels sum in another order); the first
    loss (before any update) and the RNG stream exactly."""
    assert len(a.losses) == len(b.losses)
    assert torch.equal(a.losses[0], b.losses[0]), "the forward of the first step differs"
    for x, y in zip(a.losses, b.losses, strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)
    assert a.grads.keys() == b.grads.keys()
    assert len(a.grads) > 0
    for name in a.grads:
        torch.testing.assert_close(
            a.grads[name], b.grads[name], rtol=rtol, atol=atol, msg=f"gradient of {name}"
        )
    assert a.state.keys() == b.state.keys()
    for name in a.state:
        torch.testing.assert_close(a.state[name], b.state[name], rtol=rtol, atol=atol, msg=f"state {name}")
    assert torch.equal(a.rng_after, b.rng_after), "the RNG stream after training differs"


def chain_example(rows: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The pipeline tests' model, input and target: 4 MLP blocks with batch norm, ``rows`` rows."""
    from remat.pipeline.chain import mlp_chain

    torch.manual_seed(0)
    return mlp_chain(4, 32, 128, batch_norm=True), torch.randn(rows, 32), torch.randn(rows, 32)
