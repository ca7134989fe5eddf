"""The picture of peak memory per strategy: one horizontal bar per run, from the allocator's peaks.

Where ``remat.viz.memory`` shows how memory moves during a step, this shows how far each way of
running the same step brings its peak down, next to the plain run: the picture ``make demo`` ends
with. Bars are MiB held beyond the step's start (the convention of ``remat.memory.track``), each
labelled with its size and its ratio to the first bar; a budget, where a run had one, is a tick on
its bar. matplotlib is imported when a figure is drawn, and no global state of it is touched.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from remat._units import format_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["draw_peaks"]

_MIB = 2**20


def draw_peaks(
    peaks: Mapping[str, int],
    path: str | os.PathLike[str] | None = None,
    *,
    budgets: Mapping[str, int] | None = None,
    notes: Mapping[str, str] | None = None,
    title: str | None = None,
) -> Figure:
    """Draw ``peaks`` (label -> bytes, the first being the reference run) as bars, top to bottom in
    the order given; ``budgets``: label -> bytes, a tick on that bar; ``notes``: label -> a word
    after its figure ("stopped"). Writes a PNG to ``path`` when one is given; returns the figure."""
    from matplotlib.figure import Figure

    labels = list(peaks)
    reference = peaks[labels[0]] if labels else 0
    fig = Figure(figsize=(8.0, 0.5 * len(labels) + 1.4), layout="constrained")
    ax = fig.subplots()
    rows = range(len(labels))[::-1]  # the first label on top
    values = [peaks[label] / _MIB for label in labels]
    ax.barh(list(rows), values, color=["tab:gray"] + ["tab:blue"] * (len(labels) - 1))
    for row, label, value in zip(rows, labels, values, strict=True):
        ratio = f" ({peaks[label] / reference:.2f}x)" if reference else ""
        note = f", {notes[label]}" if notes and label in notes else ""
        tick = budgets[label] / _MIB if budgets and label in budgets else None
        if tick is not None:
            ax.plot([tick] * 2, [row - 0.4, row + 0.4], color="tab:red", linewidth=2)
        end = value if tick is None else max(value, tick)
        ax.text(end, row, f" {format_bytes(peaks[label])}{ratio}{note}", va="center", fontsize=8)
    if budgets:
        ax.plot([], [], color="tab:red", linewidth=2, label="budget")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_yticks(list(rows), labels)
    ax.set_xlabel("peak MiB beyond the step's start (CPU allocator)")
    ticks = [b / _MIB for b in (budgets or {}).values()]
    ax.set_xlim(0, max([*values, *ticks], default=1.0) * 1.45)
    if title:
        ax.set_title(title, fontsize=10)
    if path is not None:
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig
