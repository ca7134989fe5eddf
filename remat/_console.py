"""The rich consoles the command line prints to: as wide as the terminal, and never narrower than
a table needs when the output is piped (rich would otherwise cut it at 80 columns); and the one
progress display every long-running command and the demo show."""

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


def progress(transient: bool = False) -> Progress:
    """A progress display on stderr: what runs now, a bar, ``k/N`` steps done, the time elapsed and
    an estimate of the time left (``k/?`` and a pulsing bar for a task added with ``total=None``).

    ``with progress() as bar: task = bar.add_task("simulating", total=n); ...; bar.advance(task)``.
    ``transient=True`` clears it when the block ends, for a command whose output follows at once.
    """
    from rich.progress import (  # not at import: ``import remat`` stays light
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        console=console(stderr=True),
        transient=transient,
    )
