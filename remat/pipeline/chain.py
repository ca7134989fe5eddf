"""A small built-in chain of MLP blocks to pipeline: the model the command line, the demo, the
tests and the benchmark cut into stages when no chain of one's own is given.

Why a model here rather than from ``remat.zoo``: the zoo's models are not chains of children that
run in order (a transformer's embeddings, blocks and head pass more than one tensor), and the
pipeline cuts a model at its children. Each block is ``Linear -> [BatchNorm1d] -> ReLU ->
[Dropout] -> Linear``, so that the batch-norm statistics and the dropout draws a recomputation
must reproduce exactly are there to test.
"""

from __future__ import annotations

from torch import nn

__all__ = ["mlp_chain"]


def mlp_chain(
    n_blocks: int = 8, width: int = 64, hidden: int = 256, dropout: float = 0.0, batch_norm: bool = False
) -> nn.Sequential:
    """``n_blocks`` blocks of ``width -> hidden -> width``, with batch norm and dropout if asked."""
    blocks = []
    for _ in range(n_blocks):
        layers: list[nn.Module] = [nn.Linear(width, hidden)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(hidden))
        layers.append(nn.ReLU())
        if dropout:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(hidden, width))
        blocks.append(nn.Sequential(*layers))
    return nn.Sequential(*blocks)
