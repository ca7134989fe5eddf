"""Where ``remat.scope`` pays: around each block of a model, or around the whole model.

Eight residual MLP blocks (LayerNorm, Linear 256 -> 1024, GELU, Linear 1024 -> 256) on a batch of
64 x 128 tokens; one step (forward, a squared-mean loss, backward) measured by the CPU allocator
(``remat.memory.track(allocator=True)``): plain, with one ``remat.scope`` around the whole model and
loss, and with a scope around each block. Memory only, so one run each is the figure.
"""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat.memory import format_bytes


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(nn.functional.gelu(self.up(self.norm(h))))


def main() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(256) for _ in range(8))
    x = torch.randn(64, 128, 256)

    def plain() -> None:
        h = x
        for block in blocks:
            h = block(h)
        h.square().mean().backward()

    def whole_model() -> None:
        with remat.scope():
            h = x
            for block in blocks:
                h = block(h)
            loss = h.square().mean()
        loss.backward()

    def per_block() -> None:
        h = x
        for block in blocks:
            with remat.scope():
                h = block(h)
        h.square().mean().backward()

    peaks = {}
    for run in (plain, whole_model, per_block):
        blocks.zero_grad(set_to_none=True)
        with remat.memory.track(allocator=True) as m:
            run()
        peaks[run.__name__] = m.peak_bytes
    print("| scope placement | allocator peak | vs plain |\n|---|---|---|")
    for name, peak in peaks.items():
        print(f"| {name.replace('_', ' ')} | {format_bytes(peak)} | {peak / peaks['plain']:.2f}x |")


if __name__ == "__main__":
    main()
