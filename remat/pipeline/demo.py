"""The pipeline section of ``make demo``: a planned 1F1B step on 2 CPU processes over gloo, its
schedule picture, and each rank's measured peak in the first step (the one that also makes the
receive buffers: NOTE [receive buffers] in ``remat.pipeline.timeline``) against its budget and the
prediction.

Why a budget below the plain pipeline's need: so that the plan has something to do. Rank 0 holds
two micro-batches under 1F1B and rank 1 one, so the same budget makes rank 0 recompute and leaves
rank 1 alone; the picture shows where.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from remat._units import format_bytes
from remat.pipeline.api import plan
from remat.pipeline.chain import mlp_chain
from remat.pipeline.launch import Job, run
from remat.pipeline.picture import draw
from remat.pipeline.plan import PipelinePlan

__all__ = ["DemoResult", "demo"]

_RANKS, _MICROBATCHES, _ROWS, _WIDTH = 2, 4, 256, 32
_BUILD = functools.partial(mlp_chain, 4, _WIDTH, 128, 0.1, True)


@dataclass(frozen=True)
class DemoResult:
    """What the demo drew and measured: the ``picture`` path, the per-rank ``budget_bytes``, and
    per rank the ``predicted`` and ``measured`` peaks of the first step (bytes)."""

    picture: Path
    budget_bytes: int
    predicted: tuple[int, ...]
    measured: tuple[int, ...]

    def __str__(self) -> str:
        rows = [
            f"rank {r}: measured peak {format_bytes(m)} (predicted {format_bytes(p)}) of budget "
            f"{format_bytes(self.budget_bytes)}"
            for r, (p, m) in enumerate(zip(self.predicted, self.measured, strict=True))
        ]
        return "\n".join([f"pipeline, 1f1b on {len(rows)} gloo processes: {self.picture}", *rows])


def demo(out_dir: str | os.PathLike[str]) -> DemoResult:
    """Plan, run and draw the demo's pipeline step; the picture goes to ``out_dir/pipeline.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = _BUILD()
    x, y = torch.randn(_MICROBATCHES * _ROWS, _WIDTH), torch.randn(_MICROBATCHES * _ROWS, _WIDTH)

    def planned_for(budget: int | str) -> PipelinePlan:
        return plan(
            model,
            x[:_ROWS],
            n_stages=_RANKS,
            n_microbatches=_MICROBATCHES,
            budget_per_rank=budget,
            loss_fn=nn.functional.mse_loss,
            target=y[:_ROWS],
            boundaries=[2],
        )

    budget = int(0.85 * max(planned_for("1GB").timeline().peak_bytes))
    planned = planned_for(budget)
    (results,) = run(
        [Job(_BUILD, planned.to_json(), x, y, nn.functional.mse_loss, seed=1)], _RANKS, out / "gloo"
    )
    measured = tuple(r.first_peak_bytes for r in results)  # the step that makes the receive buffers
    picture = out / "pipeline.png"
    draw(planned, picture, measured=measured)
    return DemoResult(picture, budget, planned.timeline().peak_bytes, measured)
