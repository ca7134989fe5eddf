"""``remat pipeline``: the per-rank table and the picture, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from remat.cli import main
from remat.pipeline.zoo_chain import gpt2_chain
from remat.zoo import build


def test_plans_explains_and_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.png"
    args = ["--stages", "2", "--microbatches", "2", "--blocks", "2", "--width", "16", "--hidden", "32"]
    assert main(["pipeline", *args, "--batch", "16", "--budget", "1MB", "--plot", str(out)]) == 0
    text = capsys.readouterr().out
    assert "PipelinePlan(1f1b, 2 stages x 2 micro-batches" in text and "held" in text
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_a_budget_too_small_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--stages", "2", "--microbatches", "2", "--blocks", "2", "--width", "16", "--hidden", "32"]
    assert main(["pipeline", *args, "--batch", "16", "--budget", "100"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("remat.pipeline.plan: --budget below") and "\n" not in err
    assert err.endswith("raise --budget, or use more stages or smaller micro-batches")  # not budget_per_rank


def test_the_plans_advice_names_the_commands_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """It advised "raise n_microbatches or use schedule='gpipe'", the Python API's arguments."""
    args = ["--stages", "2", "--microbatches", "1", "--blocks", "2", "--width", "16", "--hidden", "32"]
    assert main(["pipeline", *args, "--batch", "16", "--budget", "1MB"]) == 2
    assert capsys.readouterr().err.strip() == (
        "remat.pipeline.plan: 1f1b needs at least as many micro-batches as stages (1 < 2); raise "
        "--microbatches or use --schedule gpipe"
    )


def test_plans_an_interleaved_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--stages", "2", "--microbatches", "2", "--blocks", "4", "--width", "16", "--hidden", "32"]
    extra = ["--schedule", "interleaved-1f1b", "--stages-per-rank", "2"]
    assert main(["pipeline", *args, *extra, "--batch", "16", "--budget", "1MB"]) == 0
    assert "PipelinePlan(interleaved-1f1b, 4 stages x 2 micro-batches" in capsys.readouterr().out


def test_the_gpt2_chain_computes_what_the_zoo_model_computes() -> None:
    chain, tokens, target = gpt2_chain(2, 8)
    model = build("gpt2", batch=2, seq=8, tiny=True).model
    chain.eval()
    model.eval()
    assert len(chain) == 4 and tokens.shape == target.shape == (2, 8)
    assert torch.equal(chain(tokens), model(tokens).logits)
    assert torch.equal(target[:, :-1], tokens[:, 1:])


def test_plans_gpt2_blocks_and_torchgpipes_modes(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["pipeline", "--model", "gpt2", "--stages", "2", "--microbatches", "2", "--batch", "2"]
    assert main([*args, "--seq", "8", "--budget", "1GB", "--checkpoint", "always"]) == 0
    text = capsys.readouterr().out
    assert "PipelinePlan(1f1b, 2 stages x 2 micro-batches" in text and "nothing" not in text
    assert main([*args, "--seq", "8", "--budget", "1GB"]) == 0
    assert "nothing" in capsys.readouterr().out  # a budget this large needs no recomputation


@pytest.mark.parametrize(
    ("model", "flag", "value"), [("gpt2", "--blocks", "3"), ("gpt2", "--width", "7"), ("mlp", "--seq", "16")]
)
def test_a_size_of_the_other_model_is_refused(
    model: str, flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """They were ignored: the plan was of another size than asked, with exit code 0."""
    args = ["--model", model, flag, value, "--stages", "2", "--microbatches", "2", "--budget", "1MB"]
    assert main(["pipeline", *args]) == 2
    assert capsys.readouterr().err.startswith(f"remat.pipeline: {flag} does not apply to --model {model}")


def test_gpt2_blocks_run_again_as_modules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--rerun-modules``: under checkpoint="always" each GPT-2 block is one call of one module,
    and its region runs again as that call (``torch.utils.checkpoint``'s way), not from the tape."""
    saved = tmp_path / "plan.json"
    args = [
        "pipeline",
        "--model",
        "gpt2",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--batch",
        "2",
        "--seq",
        "8",
    ]
    extra = ["--budget", "1GB", "--checkpoint", "always", "--save", str(saved)]
    for again in (False, True):
        assert main([*args, *extra, *(["--rerun-modules"] if again else [])]) == 0
        regions = [
            r
            for sp in json.loads(saved.read_text())["stage_plans"]
            if sp["plan"]
            for r in sp["plan"]["regions"]
        ]
        assert regions and all(bool(r.get("rerun")) is again for r in regions), regions
    capsys.readouterr()
