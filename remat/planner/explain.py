"""``Plan.explain()``: the plan as a per-module table a user can read before running it.

Why per block and not per tensor: a step saves thousands of tensors, and the question a user asks
is which blocks are recomputed and what that buys; the per-tensor decisions stay in
``Plan.tensors``. rich is imported here only, when a table is asked for.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from remat._console import PIPED_WIDTH
from remat._units import format_bytes
from remat.planner.lowering import stage_key
from remat.planner.regions import Region, TensorDecision
from remat.policy import Decision

__all__ = ["render"]


def render(
    title: str,
    tensors: Sequence[TensorDecision],
    regions: Sequence[Region],
    modules: Sequence[str],
    notes: str,
    peak_at: str,
    file: Any = None,
    offload: str = "",
) -> None:
    """Print the table of a plan (its ``str()`` as ``title``, and its parts) to ``file`` (default
    stdout); ``offload`` is the plan's offload summary, and then each offloaded tensor is listed."""
    from rich.console import Console
    from rich.table import Table

    rows: dict[str, list[int]] = {}  # block -> [saved tensors, kept, recomputed, offloaded bytes]
    column = {Decision.SAVE: 1, Decision.RECOMPUTE: 2, Decision.OFFLOAD: 3}
    for t in tensors:
        row = rows.setdefault(stage_key(t.module), [0, 0, 0, 0])
        row[0] += 1
        row[column[t.action]] += t.nbytes
    region_of: dict[str, str] = {}
    for region in regions:
        for key in dict.fromkeys(stage_key(m) for m in modules[region.first : region.last + 1]):
            region_of.setdefault(key, region.name)
    order = list(dict.fromkeys(stage_key(m) for m in modules))
    table = Table(title=title, title_justify="left")
    names = (
        ("module", "saved tensors", "kept", "recomputed") + (("offloaded",) if offload else ()) + ("region",)
    )
    for name in names:
        table.add_column(name, justify="left" if name in ("module", "region") else "right")
    for key in order:
        if key not in rows:
            continue
        n, *amounts = rows[key]
        shown = [format_bytes(b) for b in amounts[: len(names) - 3]]
        table.add_row(key, str(n), *shown, region_of.get(key, "-"))
    table.add_row(
        "total",
        str(len(tensors)),
        *(format_bytes(sum(row[k] for row in rows.values())) for k in range(1, len(names) - 2)),
        f"{len(regions)} regions",
        style="bold",
    )
    console = Console(file=file or sys.stdout)
    if not console.is_terminal:  # a file or a pipe: as wide as the table needs (``remat._console``)
        console = Console(file=file or sys.stdout, width=PIPED_WIDTH)
    console.print(table)
    if notes:
        console.print(f"solver notes: {notes}")
    console.print(f"peak reached at {peak_at}")
    if offload:
        console.print(offload)
        for t in tensors:
            if t.action is Decision.OFFLOAD:
                console.print(f"  {t}")
