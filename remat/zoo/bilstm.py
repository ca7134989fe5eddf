"""A bidirectional LSTM tagger: embedding, two bidirectional LSTM layers, a per-token classifier.

Recurrent models keep one activation per time step and layer, so their memory grows with the
sequence length like a very deep chain. The layers are unrolled over time with ``nn.LSTMCell``
rather than run as one fused ``nn.LSTM`` op: a rematerialization planner can then choose per
time step (the DTR artifact's LSTM log is unrolled the same way), and fake-tensor traces are exact
(the fused oneDNN op's meta kernel reports an empty workspace, so fake runs would undercount it).
"""

from __future__ import annotations

import torch
from torch import nn

from remat.zoo.registry import Workload, ZooModel, register


class BiLSTMLayer(nn.Module):
    def __init__(self, c_in: int, hidden: int) -> None:
        super().__init__()
        self.forward_cell = nn.LSTMCell(c_in, hidden)
        self.backward_cell = nn.LSTMCell(c_in, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        steps = x.unbind(1)
        return torch.cat(
            [self._run(self.forward_cell, steps), self._run(self.backward_cell, steps[::-1]).flip(1)], 2
        )

    @staticmethod
    def _run(cell: nn.LSTMCell, steps: tuple[torch.Tensor, ...]) -> torch.Tensor:
        state: tuple[torch.Tensor, torch.Tensor] | None = None
        outputs = []
        for x in steps:
            state = cell(x, state)
            outputs.append(state[0])
        return torch.stack(outputs, 1)


class BiLSTMTagger(nn.Module):
    def __init__(
        self, vocab: int = 10000, embed: int = 256, hidden: int = 512, layers: int = 2, tags: int = 32
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.layers = nn.Sequential(
            *(BiLSTMLayer(embed if i == 0 else 2 * hidden, hidden) for i in range(layers))
        )
        self.head = nn.Linear(2 * hidden, tags)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.embed(tokens)))


def _make(batch: int, seq: int, tiny: bool) -> Workload:
    model = BiLSTMTagger(vocab=128, embed=16, hidden=16, tags=8) if tiny else BiLSTMTagger()
    tokens = torch.randint(0, model.embed.num_embeddings, (batch, seq))
    tags = torch.randint(0, model.head.out_features, (batch, seq))
    return Workload(
        model, (tokens,), lambda logits: nn.functional.cross_entropy(logits.flatten(0, 1), tags.flatten())
    )


register(ZooModel("bilstm", "bidirectional 2-layer LSTM tagger, unrolled over time", "seq", 128, 128, _make))
