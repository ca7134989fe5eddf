"""GPT-2 of ``remat.zoo`` as a chain the pipeline cuts: its embeddings, each block, and its head,
each a child that takes one tensor and returns one.

Why wrappers rather than the zoo's model itself: ``GPT2LMHeadModel`` runs its blocks inside its
own forward, where it also makes the position ids and the causal mask, and the pipeline cuts a
model at its children, each passing one tensor to the next (``remat.pipeline.chain``). The
wrappers share the zoo model's parameters, but for the head's weight, which is tied to the token
embedding in the zoo's model and is a copy of it here (stages on different ranks cannot share a
parameter: ``remat.pipeline.plan`` refuses it); a block run alone masks causally (its attention is
causal when given no mask), so the chain computes what the model computes, untied::

    tokens -> Embeddings(wte, wpe, drop) -> Block(h.0) -> ... -> Block(h.n-1) -> Head(ln_f, lm_head) -> logits
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from remat.zoo import build

__all__ = ["gpt2_chain", "token_loss"]


class Embeddings(nn.Module):
    """Token and position embeddings, then dropout."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        out = self.drop(self.wte(tokens) + self.wpe(positions))
        assert isinstance(out, torch.Tensor)
        return out


class Block(nn.Module):
    """One transformer block on the hidden states alone."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


class Head(nn.Module):
    """The final layer norm and the language-model head: the logits."""

    def __init__(self, ln_f: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(self.ln_f(hidden))
        assert isinstance(out, torch.Tensor)
        return out


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy of ``logits`` against the ``target`` tokens."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def gpt2_chain(
    batch: int, seq: int, tiny: bool = True, seed: int = 0
) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """The zoo's GPT-2 (``tiny``: 2 blocks of width 32) as a chain, one batch of ``batch``
    sequences of ``seq`` tokens and its next-token target (``token_loss``; the last position's
    target is the first token)."""
    workload = build("gpt2", batch=batch, seq=seq, tiny=tiny, seed=seed)
    model: Any = workload.model
    tokens = workload.inputs[0]
    body = model.transformer
    # the head gets a copy of the embedding it is tied to: stages own their parameters
    model.lm_head.weight = nn.Parameter(body.wte.weight.detach().clone())
    children = [Embeddings(body.wte, body.wpe, body.drop), *(Block(b) for b in body.h)]
    chain = nn.Sequential(*children, Head(body.ln_f, model.lm_head))
    return chain, tokens, tokens.roll(-1, 1)
