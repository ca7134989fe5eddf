"""The picture of a planned pipeline step: the pipeline model's schedule (ranks x time, forwards,
backwards and the recomputation inside them) above each rank's memory over time against its
budget.

Why from the model and not from a run: the picture is what one looks at before starting the
processes, to see where a rank waits and where its peak falls; a run's measured peaks can be
drawn on it (``measured``) to compare. matplotlib is imported when a figure is drawn (a
``Figure`` object, no global pyplot state).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from remat.pipeline.plan import PipelinePlan

__all__ = ["draw"]

_MIB = 2**20
_COLOURS = {"F": "#4c78a8", "B": "#f58518", "I": "#f58518", "W": "#54a24b", "recompute": "#e45756"}


def draw(
    plan: PipelinePlan,
    path: str | os.PathLike[str] | None = None,
    measured: Sequence[int] | None = None,
    title: str | None = None,
) -> Figure:
    """Draw ``plan``'s pipeline model (saved to ``path`` if given); ``measured``: each rank's
    measured peak, drawn as a dashed line."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    line = plan.timeline()
    ranks = plan.order.n_ranks
    fig = Figure(figsize=(10, 2.2 + 1.9 * ranks), layout="constrained")
    top, *panels = fig.subplots(1 + ranks, 1, sharex=True, height_ratios=[ranks * 0.6] + [1.0] * ranks)
    for span in line.spans:
        if span.action.kind == "W" and span.end == span.start:  # nothing left to run (timeline)
            continue
        y = ranks - 1 - span.rank
        ms = (span.start * 1e3, (span.end - span.start) * 1e3)
        top.broken_barh([ms], (y - 0.4, 0.8), color=_COLOURS[span.action.kind], edgecolor="white")
        if span.recompute_s:
            top.broken_barh(
                [(span.start * 1e3, span.recompute_s * 1e3)], (y - 0.4, 0.8), color=_COLOURS["recompute"]
            )
        # with several stages on a rank, the stage is part of the label ("2F0")
        several = plan.order.n_stages > ranks
        label = str(span.action) if several else f"{span.action.kind}{span.action.microbatch}"
        top.text(ms[0] + ms[1] / 2, y, label, ha="center", va="center", fontsize=7, color="white")
    top.set_yticks(range(ranks), [f"rank {r}" for r in reversed(range(ranks))])
    top.set_title(
        title
        or f"{plan.order.name}: {plan.order.n_stages} stages x {plan.order.n_microbatches} micro-batches, "
        f"predicted step {line.makespan * 1e3:.1f} ms"
    )
    top.legend(
        handles=[
            Patch(color=c, label=k)
            for k, c in _COLOURS.items()
            if k == "recompute" or any(s.action.kind == k and s.end > s.start for s in line.spans)
        ],
        loc="upper right",
        fontsize=7,
    )
    for rank, ax in enumerate(panels):
        times = [t * 1e3 for t, _ in line.memory[rank]]
        held = [b / _MIB for _, b in line.memory[rank]]
        ax.step(times, held, where="post", label="predicted (first step)")
        ax.axhline(plan.budget_bytes / _MIB, color="black", linewidth=1, label="budget")
        if measured is not None:
            ax.axhline(
                measured[rank] / _MIB, color="grey", linestyle="--", linewidth=1, label="measured peak"
            )
        ax.set_ylabel(f"rank {rank}\nMiB")
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper right", fontsize=7)
    panels[-1].set_xlabel("ms from the step's start (pipeline model)")
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
