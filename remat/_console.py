"""The rich consoles the command line prints to: as wide as the terminal, and never narrower than
a table needs when the output is piped (rich would otherwise cut it at 80 columns)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:
    from rich.progress import Progress

PIPED_WIDTH = 200


def console(stderr: bool = False) -> Console:
    """A console on stdout (or ``stderr``): the terminal's width, or ``PIPED_WIDTH`` columns
    where the output is not a terminal."""
    probe = Console(stderr=stderr)
    return Console(stderr=stderr, width=None if probe.is_terminal else PIPED_WIDTH)


def progress(total: int, what: str) -> Progress:
    """A progress bar on stderr for ``total`` steps of ``what``: the step k/N, the time elapsed and
    the estimate of the time left (run it with ``with``; ``advance(bar.task_ids[0])`` after each
    step)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(
        TextColumn(f"{what} [progress.description]{{task.description}}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        TextColumn("left ~"),
        TimeRemainingColumn(),
        console=console(stderr=True),
    )
    bar.add_task("", total=total)
    return bar
