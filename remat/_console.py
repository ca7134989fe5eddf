"""The rich consoles the command line prints to: as wide as the terminal, and never narrower than
a table needs when the output is piped (rich would otherwise cut it at 80 columns)."""

from __future__ import annotations

from rich.console import Console

PIPED_WIDTH = 200


def console(stderr: bool = False) -> Console:
    """A console on stdout (or ``stderr``): the terminal's width, or ``PIPED_WIDTH`` columns
    where the output is not a terminal."""
    probe = Console(stderr=stderr)
    return Console(stderr=stderr, width=None if probe.is_terminal else PIPED_WIDTH)
