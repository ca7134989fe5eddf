"""``remat trace``: capture a zoo model to a file, summarize files, list the zoo, refuse bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from remat.cli import main
from remat.trace import load


def test_capture_then_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "resnet.jsonl.gz"
    args = ["trace", "--model", "resnet50", "--tiny", "--batch", "2", "--image", "32", "--repeats", "1"]
    assert main([*args, "--optimizer", "sgd", "--out", str(out)]) == 0
    trace = load(out)
    assert trace.name == "resnet50" and any(op.phase.value == "optimizer" for op in trace.ops)
    capsys.readouterr()
    assert main(["trace", "info", str(out), "--top", "3"]) == 0
    shown = capsys.readouterr().out
    assert "activation peak" in shown and "3 largest tensors" in shown and "resnet50" in shown


def test_fake_capture_uses_the_chosen_profile(tmp_path: Path) -> None:
    out = tmp_path / "bert.jsonl"
    assert main(["trace", "--model", "bert", "--tiny", "--fake", "--profile", "h100", "--out", str(out)]) == 0
    trace = load(out)
    assert trace.source == "capture-fake" and trace.total_cost == 0 and trace.total_est_cost > 0


def test_models_lists_the_zoo(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "models"]) == 0
    shown = capsys.readouterr().out
    assert "bert-large" in shown and "densenet121" in shown


def test_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "remat.trace: capturing needs --model and --out" in capsys.readouterr().err
    assert main(["trace", "info", str(tmp_path / "missing.jsonl")]) == 2
    assert "remat.trace.load: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trace", "--model", "alexnet", "--out", "x"])
    assert "invalid choice: 'alexnet'" in capsys.readouterr().err


def test_info_and_models_refuse_the_capture_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace", "--model", "gpt2", "--tiny", "info", str(tmp_path / "t.jsonl")]) == 2
    err = capsys.readouterr().err
    assert (
        "remat.trace: the capture's options do not apply to `remat trace info` (got --model, --tiny)" in err
    )
    assert main(["trace", "--repeats", "5", "models"]) == 2
    assert "(got --repeats)" in capsys.readouterr().err
