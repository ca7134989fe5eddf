"""``remat.pipeline.ManualStage`` and ``remat.plainly`` in one process: torchgpipe's three modes run
with remat's manual forms, as a schedule runs a stage (every micro-batch's forward, then their
backwards), checked against the same stage run plainly; the two-process run is in
``test_pipeline_manual_gloo``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from pipelines import Counted
from torch import nn

import remat
from remat.pipeline.chain import mlp_chain

M = 4
ADDMM = "aten.addmm.default"


def _step(stage: nn.Module, chain: nn.Module, seed: int = 0) -> tuple[int, dict[str, torch.Tensor]]:
    """Every micro-batch's forward, then their backwards last first (GPipe's order): the matmuls
    run, and the gradients and buffers by the chain's names."""
    torch.manual_seed(seed)
    xs = [torch.randn(16, 8) for _ in range(M)]
    with Counted(ADDMM) as counted:
        outs = [stage(x) for x in xs]
        for out in reversed(outs):
            out.square().mean().backward()
    state = {f"grad.{n}": p.grad for n, p in chain.named_parameters()}
    state.update({f"buffer.{n}": b for n, b in chain.named_buffers()})
    return counted.count, state


def _chain() -> nn.Sequential:
    torch.manual_seed(1)
    return mlp_chain(3, 8, 16, 0.2, True)


class _OwnCheckpoints(nn.Module):
    """A stage whose forward checkpoints its blocks itself."""

    def __init__(self, chain: nn.Sequential) -> None:
        super().__init__()
        self.chain = chain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.chain:
            x = remat.checkpoint(block, x)
        return x


def _stages() -> dict[str, Callable[[nn.Sequential, str], nn.Module]]:
    return {
        "form=checkpoint": lambda c, mode: remat.pipeline.ManualStage(c, M, mode, form="checkpoint"),
        "form=scope": lambda c, mode: remat.pipeline.ManualStage(c, M, mode, form="scope"),
        "the stage's own checkpoints": lambda c, mode: remat.pipeline.ManualStage(
            _OwnCheckpoints(c), M, mode
        ),
    }


@pytest.mark.parametrize("kind", list(_stages()))
def test_each_mode_recomputes_its_micro_batches_and_changes_no_bit(kind: str) -> None:
    """``always`` runs the blocks' matmuls again for every micro-batch, ``except_last`` for all but
    the last, ``never`` for none; gradients, batch norm's statistics and dropout's draws are the
    plain stage's, bit for bit, in every mode."""
    plain_chain = _chain()
    plain, expected = _step(plain_chain, plain_chain)
    counts = {}
    for mode in ("always", "except_last", "never"):
        chain = _chain()
        stage = _stages()[kind](chain, mode)
        counts[mode], state = _step(stage, chain)
        assert stage.forwards == M
        for name, value in expected.items():
            assert torch.equal(state[name], value), (mode, name)
    again = (counts["always"] - plain) // M
    assert again > 0 and counts["always"] == plain + M * again
    assert counts["except_last"] == plain + (M - 1) * again
    assert counts["never"] == plain


def test_except_last_counts_micro_batches_across_steps_and_not_forwards_without_grad() -> None:
    plain_chain = _chain()
    plain, _ = _step(plain_chain, plain_chain)
    always_chain = _chain()
    again = (
        _step(remat.pipeline.ManualStage(always_chain, M, "always", form="checkpoint"), always_chain)[0]
        - plain
    ) // M
    chain = _chain()
    stage = remat.pipeline.ManualStage(chain, M, "except_last", form="checkpoint")
    for seed in range(2):
        with torch.no_grad():  # a validation pass before each step: no micro-batch of a step
            stage(torch.randn(16, 8))
        count, _ = _step(stage, chain, seed)
        assert again > 0 and count == plain + (M - 1) * again
    assert stage.forwards == 2 * M


def test_plainly_switches_every_manual_form_off_and_nests() -> None:
    """Inside ``remat.plainly()`` nothing is recomputed or moved, whatever form the code uses."""
    chain = _chain()
    x = torch.randn(16, 8)

    def forms() -> dict[str, Callable[[], Any]]:
        def offloaded() -> torch.Tensor:
            with remat.offload() as offloader:
                y = chain(x)
            moved.append(offloader.stats().bytes_out)
            return y

        def scoped() -> torch.Tensor:
            with remat.scope():
                return chain(x)

        return {
            "checkpoint": lambda: remat.checkpoint(chain, x),
            "checkpoint_sequential": lambda: remat.checkpoint_sequential(chain, 3, x),
            "scope": scoped,
            "offload": offloaded,
        }

    moved: list[int] = []
    with Counted(ADDMM) as counted:
        chain(x).sum().backward()
    plain = counted.count
    for name, run in forms().items():
        for switched in (False, True):
            with Counted(ADDMM) as counted:
                if switched:
                    with remat.plainly(), remat.plainly():
                        y = run()
                    assert not remat.manual.plainly.plain()
                else:
                    y = run()
                y.sum().backward()
            if name != "offload":
                assert (counted.count == plain) == switched, name
    assert moved[0] > 0 and moved[1] == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"module": "chain"}, r"remat\.pipeline\.ManualStage: the stage is an nn\.Module \(got str\)"),
        ({"n_microbatches": 0}, r"n_microbatches is a whole number of at least 1 \(got 0\)"),
        ({"n_microbatches": True}, r"n_microbatches is a whole number of at least 1 \(got True\)"),
        (
            {"checkpoint": "sometimes"},
            r"checkpoint is one of torchgpipe's modes \(got 'sometimes'\); pass one",
        ),
        ({"form": "plan"}, r"form names a manual form, or None \(got 'plan'\)"),
    ],
)
def test_bad_arguments_get_a_clear_error(kwargs: dict[str, Any], match: str) -> None:
    given: dict[str, Any] = {"module": _chain(), "n_microbatches": M, **kwargs}
    with pytest.raises((TypeError, ValueError), match=match):
        remat.pipeline.ManualStage(**given)
