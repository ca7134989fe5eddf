"""``Plan.explain()``: the plan as a per-module table a user can read before running it.

Why per block and not per tensor: a step saves thousands of tensors, and the question a user asks
is which blocks are recomputed and what that buys; the per-tensor decisions stay in
``Plan.tensors``. Each block's row says why, in the figures the planner weighed: the time its
saved tensors' ops take to run again against the bytes they hold ("kept: matmul outputs, 2.10 ms
to recompute for 1.50 MiB"). rich is imported here only, when a table is asked for.
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

# the words a reader knows for the ATen ops that make most of what a step saves
_KINDS = (
    (frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}), "matmul"),
    (frozenset({"convolution", "cudnn_convolution", "mkldnn_convolution"}), "convolution"),
    (
        frozenset(
            {
                "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention",
                "_scaled_dot_product_flash_attention_for_cpu",
                "_scaled_dot_product_attention_math",
            }
        ),
        "attention",
    ),
)


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"


def _what(tensors: Sequence[TensorDecision]) -> str:
    """The kinds of op that made ``tensors``, the most bytes first: ``matmul and gelu outputs``."""
    kinds: dict[str, int] = {}
    for t in tensors:
        base = t.op_name.split(".")[1] if t.op_name.startswith("aten.") else t.op_name
        kind = next((word for names, word in _KINDS if base in names), base)
        kinds[kind] = kinds.get(kind, 0) + t.nbytes
    top = sorted(kinds, key=lambda k: -kinds[k])
    more = f" and {len(top) - 2} other kinds" if len(top) > 2 else ""
    return f"{' and '.join(top[:2])} output{'s' if len(tensors) > 1 else ''}{more}"


def _reason(tensors: Sequence[TensorDecision], region: str | None) -> str:
    """Why a block's saved tensors are kept or recomputed, in the figures that decide it: the time
    their ops take to run again against the bytes they hold from forward to backward."""
    parts = []
    for action, verb in (
        (Decision.RECOMPUTE, "recomputed"),
        (Decision.SAVE, "kept"),
        (Decision.OFFLOAD, "offloaded"),
    ):
        mine = [t for t in tensors if t.action is action]
        if not mine:
            continue
        seconds, nbytes = sum(t.seconds for t in mine), sum(t.nbytes for t in mine)
        figures = f"{_milliseconds(seconds)} to recompute for {format_bytes(nbytes)}"
        where = ""
        if action is Decision.SAVE:
            where = " (outside every recomputed region)" if region is None else f" (kept inside {region})"
        parts.append(f"{verb}: {_what(mine)}, {figures}{where}")
    return "; ".join(parts)


def _executor_share(overhead: float, executor: float) -> str:
    """How much of the predicted overhead is the executor's own time besides the kernels."""
    added = overhead - 1.0
    share = f", {executor / added:.0%} of what the plan adds" if added > 0 else ""
    return (
        f"executor (per-op check, tapes, replays, offload bookkeeping): +{executor:.3f} of the "
        f"predicted overhead {overhead:.3f}{share}"
    )


def render(
    title: str,
    tensors: Sequence[TensorDecision],
    regions: Sequence[Region],
    modules: Sequence[str],
    notes: str,
    peak_at: str,
    file: Any = None,
    offload: str = "",
    overheads: tuple[float, float] = (1.0, 0.0),
) -> None:
    """Print the table of a plan (its ``str()`` as ``title``, and its parts) to ``file`` (default
    stdout); ``offload`` is the plan's offload summary, and then each offloaded tensor is listed;
    ``overheads`` are the plan's predicted overhead and the executor's part of it."""
    from rich.console import Console
    from rich.table import Table

    blocks: dict[str, list[TensorDecision]] = {}
    for t in tensors:
        blocks.setdefault(stage_key(t.module), []).append(t)
    region_of: dict[str, str] = {}
    for region in regions:
        for key in dict.fromkeys(stage_key(m) for m in modules[region.first : region.last + 1]):
            region_of.setdefault(key, f"{region.name} (run again)" if region.rerun else region.name)
    order = list(dict.fromkeys(stage_key(m) for m in modules))
    table = Table(title=title, title_justify="left")
    amounts = ("kept", "recomputed") + (("offloaded",) if offload else ())
    for column in ("module", "saved tensors", *amounts, "replay time", "region", "why"):
        table.add_column(
            column, justify="right" if column == "saved tensors" or column in amounts else "left"
        )

    def row(mine: Sequence[TensorDecision]) -> tuple[str, ...]:
        kept = sum(t.nbytes for t in mine if t.action is Decision.SAVE)
        again = [t for t in mine if t.action is Decision.RECOMPUTE]
        moved = (
            (format_bytes(sum(t.nbytes for t in mine if t.action is Decision.OFFLOAD)),) if offload else ()
        )
        replay = _milliseconds(sum(t.seconds for t in again)) if again else "-"
        return (
            str(len(mine)),
            format_bytes(kept),
            format_bytes(sum(t.nbytes for t in again)),
            *moved,
            replay,
        )

    for key in order:
        if key in blocks:
            name = region_of.get(key)
            table.add_row(key, *row(blocks[key]), name or "-", _reason(blocks[key], name))
    table.add_row("total", *row(tensors), f"{len(regions)} regions", "", style="bold")
    console = Console(file=file or sys.stdout)
    if not console.is_terminal:  # a file or a pipe: as wide as the table needs (``remat._console``)
        console = Console(file=file or sys.stdout, width=PIPED_WIDTH)
    console.print(table)
    console.print(
        "kept, recomputed: bytes of the tensors autograd saves for backward, held from forward to "
        "backward or made again in backward; replay time: what running their ops again costs "
        "(times measured when the step was traced)"
    )
    console.print(_executor_share(*overheads))
    if notes:
        console.print(f"solver notes: {notes}")
    console.print(f"peak reached at {peak_at}")
    if offload:
        console.print(offload)
        for t in tensors:
            if t.action is Decision.OFFLOAD:
                console.print(f"  {t}")
