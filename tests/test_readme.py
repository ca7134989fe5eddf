"""Every Python example of the README runs as written, on small stand-ins for the names it leaves
to the reader (``block``, ``x``, ``model`` ...), the CLI lines it shows parse, and every command it
gives a time for runs at the size it shows and writes the files it names (marked slow: about a
minute in all); ``make demo``'s module runs at a small size and writes its pictures.

The examples are read from the README itself, so an example edited there is tested as edited.
"""

from __future__ import annotations

import glob
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat import cli, demo

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
WRITES = ("--out", "--plot", "--json", "--save")  # options that name a file the command writes


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
        "chain": nn.Sequential(*(Block() for _ in range(4))),
        "x_micro": torch.randn(4, 8),
        "y_micro": torch.randn(4, 8),
        "loss_fn": nn.functional.mse_loss,
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


def _timed_commands() -> list[str]:
    """The ``remat ...`` commands the README states a time for, in the order they appear: a line
    of a bash block with ``# about ...``, or an inline command followed by ``(about ...``."""
    text = README.read_text()
    found = [(m.start(), m.group(1).strip()) for m in re.finditer(r"^(remat [^#\n]*)#\s*about ", text, re.M)]
    found += [(m.start(), m.group(1)) for m in re.finditer(r"`(remat [^`]*)`\s*\(about\s", text)]
    return [line for _, line in sorted(found)]


def test_every_timed_command_is_found() -> None:
    lines = _timed_commands()
    assert {shlex.split(line)[1] for line in lines} >= {"trace", "sim", "memory", "plan"}, lines


@pytest.mark.slow
def test_readme_commands_run_and_write_their_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each timed command, in README order (a trace is written before it is read), exits 0 and
    writes what its options name, from a folder where ``data/`` is the repository's."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").symlink_to(ROOT / "data")
    for line in _timed_commands():
        words = [w for word in shlex.split(line)[1:] for w in (sorted(glob.glob(word)) or [word])]
        assert cli.main(words) == 0, (line, capsys.readouterr().err)
        for option, value in zip(words, words[1:], strict=False):
            if option in WRITES:
                assert (tmp_path / value).stat().st_size > 0, (line, value)


@pytest.mark.slow
def test_demo_writes_its_pictures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--layers", "1", "--width", "64", "--seq", "16", "--batch", "2", "--out", str(tmp_path)]
    demo.main([*args, "--no-pipeline"])  # the pipeline section: tests/pipeline/test_pipeline_gloo.py
    out = capsys.readouterr().out
    for name in ("demo-peaks.png", "demo-memory.png"):
        assert (tmp_path / name).stat().st_size > 0 and name in out
    assert "NO" not in out.split()  # every strategy's losses equal the plain run's
