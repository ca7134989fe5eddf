"""The ``remat`` command line: a thin front over the library, one subcommand module each."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from remat._errors import RematError

# Each module here defines ``register(subparsers)``; its subcommands set ``func`` on their parser.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "remat.trace.cli",
    "remat.sim.cli",
    "remat.planner.cli",
    "remat.viz.cli",
    "remat.pipeline.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remat", description="Rematerialization for PyTorch training.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. remat's own errors (bad input, a budget no plan meets, ...) print as one
    line on stderr with exit code 2, as argparse's do; ``--debug`` shows their traceback too."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except (RematError, OSError) as error:
        if args.debug:
            raise
        detail = str(error) if isinstance(error, RematError) else f"remat {args.command}: {error}"
        print(detail.splitlines()[0] if detail else type(error).__name__, file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
