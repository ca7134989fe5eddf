"""``Plan.explain()``: the plan as a per-module table a user can read before running it.

Why per block and not per tensor: a step saves thousands of tensors, and the question a user asks
is which blocks are recomputed and what that buys; the per-tensor decisions stay in
``Plan.tensors``. rich is imported here only, when a table is asked for.
"""

from __future__ import annotations

import io
import sys
from typing import Any

from remat._units import format_bytes
from remat.planner.plan import Plan
from remat.planner.problem import Action, stage_key

__all__ = ["render"]


def render(plan: Plan, file: Any = None) -> str:
    """Print the table to ``file`` (default stdout) and return it as text."""
    from rich.console import Console
    from rich.table import Table

    rows: dict[str, list[int]] = {}  # block -> [saved tensors, kept bytes, recomputed bytes]
    for t in plan.tensors:
        row = rows.setdefault(stage_key(t.module), [0, 0, 0])
        row[0] += 1
        row[1 if t.action is Action.SAVE else 2] += t.nbytes
    regions: dict[str, str] = {}
    for region in plan.regions:
        for key in dict.fromkeys(stage_key(m) for m in plan.modules[region.first : region.last + 1]):
            regions.setdefault(key, region.name)
    order = list(dict.fromkeys(stage_key(m) for m in plan.modules))
    table = Table(title=str(plan), title_justify="left")
    for column in ("module", "saved tensors", "kept", "recomputed", "region"):
        table.add_column(column, justify="left" if column in ("module", "region") else "right")
    for key in order:
        if key not in rows:
            continue
        n, kept, again = rows[key]
        table.add_row(key, str(n), format_bytes(kept), format_bytes(again), regions.get(key, "-"))
    table.add_row(
        "total",
        str(len(plan.tensors)),
        format_bytes(plan.saved_bytes),
        format_bytes(plan.recomputed_bytes),
        f"{len(plan.regions)} regions",
        style="bold",
    )
    buffer = io.StringIO()
    Console(file=buffer, width=120, force_terminal=False).print(table)
    console = Console(file=file or sys.stdout)
    console.print(table)
    if plan.notes:
        console.print(f"solver notes: {plan.notes}")
    console.print(f"peak reached at {plan.peak_at}")
    return buffer.getvalue()
