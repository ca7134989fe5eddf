"""Every Python example of the README runs as written, on small stand-ins for the names it leaves
to the reader (``block``, ``x``, ``model`` ...), and the CLI lines it shows parse.

The examples are read from the README itself, so an example edited there is tested as edited.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat import cli

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return h if mask is None else h * mask


class Loss(nn.Module):
    """A model whose call returns its loss, which also answers to ``.loss`` (both README styles)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        loss = (self.net(x) - (x if y is None else y)).square().mean()
        loss.loss = loss  # type: ignore[attr-defined]
        return loss


def _namespace(tmp_path: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Loss()
    x = torch.randn(16, 8, requires_grad=True)
    with remat.memory.track(allocator=True) as plain:
        model(x).backward()
    region = remat.dynamic(None, "dtr", keep=(model,))
    with remat.memory.track(allocator=True) as dyn, region:
        model(x).backward()
    return {
        "remat": remat,
        "block": Block(),
        "x": x,
        "y": torch.randn(16, 8),
        "mask": torch.ones(16, 8),
        "h": torch.randn(4, 8, requires_grad=True),
        "mlp": nn.Linear(8, 8),
        "norm": nn.LayerNorm(8),
        "model": model,
        "compiled": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "plain": plain,
        "dyn": dyn,
        "region": region,
    }


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_example_runs(index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # examples write files (plans, pictures) where they run
    exec(compile(_blocks("python")[index], f"README.md python example {index}", "exec"), _namespace(tmp_path))


def test_cli_lines_parse() -> None:
    """Each ``remat ...`` line of the README names a command and options the CLI takes."""
    lines = [
        line.split("#", 1)[0].strip()
        for block in _blocks("bash")
        for line in block.splitlines()
        if line.strip().startswith("remat ")
    ]
    lines += re.findall(r"`(remat (?:plan|memory|sim|trace) [^`]*)`", README.read_text())
    assert lines
    parser = cli.build_parser()
    for line in lines:
        parser.parse_args(shlex.split(line)[1:])
