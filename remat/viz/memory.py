"""The picture of memory over a step: each run's CPU allocator timeline, one panel per run.

PyTorch's memory_viz shows a CUDA snapshot interactively in a browser; this draws what
``remat.memory.track(allocator=True)`` recorded as one static PNG that can go in a report. The
panels share the memory axis, y: the MiB the allocator held beyond what it held before the block
(the tracker's convention: the highest point of a curve is its ``peak_bytes``). Each has its own
time axis, x: milliseconds from the block's start, so that a fast plain step is not a sliver next to
a slow dynamic one (each title gives the duration). A budget is a horizontal line; the evictions
and recomputations of a dynamic run are markers on its curve.

Marks are ``(time_ns, kind)`` pairs, ``kind`` ``"evict"`` or ``"recompute"``, taken with
``time.time_ns()`` as ``remat.dynamic``'s ``stats.moments`` are. That is the clock of the
profiler's events (NOTE [profiler clock] in ``remat._allocator``), so a mark lands between the
allocations it happened between. matplotlib is imported when a figure is drawn, and no global
state of it (pyplot, the backend) is touched.
"""

from __future__ import annotations

import bisect
import math
import os
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from remat._errors import RematTypeError, RematValueError, message
from remat._files import path_of
from remat._tracker import MemoryTracker
from remat._units import format_bytes, parse_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["KINDS", "plot"]

_API = "memory.plot"
KINDS = ("evict", "recompute")  # what a mark may be, in legend order
_STYLE = {"evict": ("v", "tab:purple"), "recompute": ("^", "tab:green")}
_COLUMNS = 3
_MIB = 2**20
_NOTE_WIDTH = 60  # characters of a note's line, about a panel's width at its font size


def plot(
    runs: Mapping[str, MemoryTracker],
    path: str | os.PathLike[str] | None = None,
    *,
    budget: int | str | Mapping[str, int | str] | None = None,
    marks: Mapping[str, Sequence[tuple[int, str]]] | None = None,
    notes: Mapping[str, str] | None = None,
    title: str | None = None,
) -> Figure:
    """Draw ``runs`` (label -> tracker of ``remat.memory.track(allocator=True)``), one panel each
    in the order given; write a PNG to ``path`` when one is given, and return the figure.

    ``budget``: bytes (an int or a size such as ``"2GB"``) drawn on every panel, or a mapping
    label -> bytes for the panels that have one; in the tracker's convention (beyond what was held
    before the block). ``marks``: label -> ``(time.time_ns(), "evict" | "recompute")`` pairs, such
    as ``region.stats.moments`` of ``remat.dynamic``. ``notes``: label -> a line written on the
    panel (why a run stopped). A tracker without an allocator timeline (CUDA, ``allocator=False``)
    gets a panel saying so, with its peak.
    """
    trackers, budgets, moments, lines = _check(runs, budget, marks, notes)
    from matplotlib.figure import Figure

    columns = min(len(trackers), _COLUMNS)
    rows = math.ceil(len(trackers) / columns)
    fig = Figure(figsize=(5.2 * columns, 3.8 * rows), layout="constrained")
    axes = fig.subplots(rows, columns, sharey=True, squeeze=False)
    for i, (label, tracker) in enumerate(trackers.items()):
        ax = axes[i // columns][i % columns]
        _panel(ax, label, tracker, budgets.get(label), moments.get(label, ()), lines.get(label, ""))
        if i % columns == 0:
            ax.set_ylabel("MiB held beyond the block's start")
        if i + columns >= len(trackers):  # nothing below it
            ax.set_xlabel("ms from the block's start")
        ax.set_xlim(left=0)
    for i in range(len(trackers), rows * columns):
        axes[i // columns][i % columns].set_visible(False)
    axes[0][0].set_ylim(bottom=0)
    if title:
        fig.suptitle(title, parse_math=False)  # a "$" in a label is a dollar, not math
    if path is not None:
        if path_of(path, _API).is_dir():  # matplotlib would write "<folder>.png" beside it
            rule, todo = "path names the picture's file, not a folder", "pass e.g. memory.png"
            raise RematValueError(message(_API, rule, f"{path} is a folder", todo))
        try:
            # a name without an extension is written as named, a PNG (matplotlib would add ".png")
            fig.savefig(path, dpi=120, format=None if Path(path).suffix else "png")
        except (ValueError, OSError) as err:  # a format matplotlib has no writer for, a missing folder
            rule, todo = "the picture could not be written", "pass a .png path in a folder that exists"
            raise RematValueError(message(_API, rule, f"{path}: {err}"[:300], todo)) from None
    return fig


def _panel(
    ax: Axes,
    label: str,
    tracker: MemoryTracker,
    budget: int | None,
    marks: Sequence[tuple[int, str]],
    note: str,
) -> None:
    samples, start = tracker.allocator_timeline, tracker.start_ns
    heading = f"{label}: peak {format_bytes(tracker.peak_bytes)}"
    if samples is None:
        cuda = tracker.device.type == "cuda"
        how = "measured on CUDA: peak from torch.cuda statistics" if cuda else "measured with allocator=False"
        ax.text(
            0.5,
            0.5,
            f"no allocator timeline:\n{how}",
            transform=ax.transAxes,
            ha="center",
            va="center",
            gid="no-timeline",
        )
    else:
        last = samples[-1] if samples else None
        end = max(tracker.end_ns, last.time_ns if last else start)
        times = [start, *(s.time_ns for s in samples), end]
        held = [0, *(s.bytes for s in samples), last.bytes if last else 0]
        xs = [(t - start) / 1e6 for t in times]
        ys = [b / _MIB for b in held]
        heading += f", {xs[-1]:.0f} ms"
        ax.step(xs, ys, where="post", color="tab:blue", linewidth=1.0, gid="held")
        ax.fill_between(xs, ys, step="post", color="tab:blue", alpha=0.2, linewidth=0)
        for kind in KINDS:
            when = [t for t, k in marks if k == kind]
            if not when:
                continue
            at = [held[max(0, bisect.bisect_right(times, t) - 1)] / _MIB for t in when]
            marker, colour = _STYLE[kind]
            ax.plot(
                [(t - start) / 1e6 for t in when],
                at,
                linestyle="none",
                marker=marker,
                markersize=4,
                color=colour,
                alpha=0.7,
                label=f"{kind} ({len(when)})",
                gid=kind,
            )
    if budget is not None:
        ax.axhline(
            budget / _MIB,
            color="tab:red",
            linestyle="--",
            linewidth=1.2,
            label=f"budget {format_bytes(budget)}",
            gid="budget",
        )
    if note:
        # wrapped to the panel's width: matplotlib's own wrap goes to the figure's edge
        text = textwrap.fill(note, _NOTE_WIDTH)
        ax.text(
            0.02, 0.97, text, transform=ax.transAxes, va="top", fontsize="small", gid="note", parse_math=False
        )
    ax.set_title(heading, fontsize="medium", parse_math=False)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="best")


def _check(
    runs: object, budget: object, marks: object, notes: object
) -> tuple[dict[str, MemoryTracker], dict[str, int], dict[str, list[tuple[int, str]]], dict[str, str]]:
    if not isinstance(runs, Mapping):
        raise RematTypeError(
            message(
                _API,
                "runs map labels to trackers",
                f"got {type(runs).__name__}",
                "pass {label: tracker, ...}",
            )
        )
    if not runs:
        raise RematValueError(
            message(_API, "needs at least one run", "got none", "pass {label: tracker, ...}")
        )
    for label, tracker in runs.items():
        if not isinstance(tracker, MemoryTracker):
            raise RematTypeError(
                message(
                    _API,
                    "each run is a MemoryTracker",
                    f"got {type(tracker).__name__} for {label!r}",
                    "pass the tracker of remat.memory.track(allocator=True)",
                )
            )
    trackers = {str(label): tracker for label, tracker in runs.items()}
    if budget is None or isinstance(budget, Mapping):
        budgets = {label: parse_bytes(b, _API) for label, b in _per_run("budget", budget, trackers).items()}
    else:
        budgets = dict.fromkeys(trackers, parse_bytes(budget, _API))
    given_marks = _per_run("marks", marks, trackers)
    for label, m in given_marks.items():
        if not isinstance(m, (list, tuple)):
            rule = "a run's marks are a list of (time_ns, kind) pairs"
            given = f"got {type(m).__name__} for {label!r}"
            raise RematTypeError(
                message(_API, rule, given, "pass e.g. region.stats.moments of remat.dynamic")
            )
    moments = {label: list(m) for label, m in given_marks.items()}
    for label, pairs in moments.items():
        for pair in pairs:
            if not (isinstance(pair, Sequence) and len(pair) == 2 and pair[1] in KINDS):
                raise RematValueError(
                    message(
                        _API,
                        "a mark is a (time_ns, kind) pair, kind 'evict' or 'recompute'",
                        f"got {pair!r} for {label!r}",
                        "pass e.g. region.stats.moments of remat.dynamic",
                    )
                )
    lines = {label: str(n) for label, n in _per_run("notes", notes, trackers).items()}
    return trackers, budgets, moments, lines


def _per_run(what: str, given: object, trackers: Mapping[str, Any]) -> dict[str, Any]:
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise RematTypeError(
            message(
                _API,
                f"{what} is a mapping from run labels",
                f"got {type(given).__name__}",
                f"pass {what}={{label: ...}}",
            )
        )
    unknown = [label for label in given if label not in trackers]
    if unknown:
        raise RematValueError(
            message(
                _API,
                f"{what} names a run that is not plotted",
                f"got {unknown[0]!r}",
                f"use one of {', '.join(map(repr, trackers))}",
            )
        )
    return dict(given)
