"""``PipelinePlan.explain()``: the per-rank table a user reads before starting the processes.

Why per rank: what a rank must fit is its own budget, and what it pays is its own recomputation;
the table puts the pipeline model's peak next to the budget, the micro-batches the rank holds at
once, what its plan recomputes and the time the model predicts. rich is imported here only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from remat._console import PIPED_WIDTH
from remat._units import format_bytes
from remat.pipeline.schedule import Schedule
from remat.pipeline.stage_plan import StagePlan
from remat.pipeline.timeline import Timeline
from remat.policy import Decision

__all__ = ["render"]


def render(
    title: str,
    order: Schedule,
    budget_bytes: int,
    stage_plans: Sequence[StagePlan],
    line: Timeline,
    file: Any = None,
) -> None:
    """Print a pipeline plan's per-rank table (its ``str()`` as ``title``, and its parts) to
    ``file`` (default stdout)."""
    from rich.console import Console
    from rich.table import Table

    m = order.n_microbatches
    table = Table(title=title, title_justify="left")
    columns = ("rank", "stage", "first step's peak", "later steps'", "budget", "held", "recomputed")
    for column in (*columns, "plain micro-batches", "busy"):
        table.add_column(
            column, justify="left" if column in ("recomputed", "plain micro-batches") else "right"
        )
    for sp in stage_plans:
        if sp.plan is None:
            recomputed = "nothing"
        else:
            n = sum(t.action is Decision.RECOMPUTE for t in sp.plan.tensors)
            recomputed = (
                f"{n} tensors ({format_bytes(sp.plan.recomputed_bytes)}) in {len(sp.plan.regions)} regions"
            )
        plain = [i for i in range(m) if not sp.recomputes(i, m)]
        table.add_row(
            str(sp.rank),
            str(sp.stage),
            format_bytes(line.peak_bytes[sp.rank]),
            format_bytes(line.steady_peak_bytes[sp.rank]),
            format_bytes(budget_bytes),
            str(sp.in_flight),
            recomputed,
            "all" if len(plain) == m else ", ".join(map(str, plain)) or "none",
            f"{line.busy(sp.rank) * 1e3:.1f} ms",
        )
    console = Console(file=file or sys.stdout)
    if not console.is_terminal:  # a file or a pipe: as wide as the table needs (``remat._console``)
        console = Console(file=file or sys.stdout, width=PIPED_WIDTH)
    console.print(table)
    console.print(f"predicted step: {line.makespan * 1e3:.1f} ms ({order.name})")
