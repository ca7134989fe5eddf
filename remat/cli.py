"""The ``remat`` command line: a thin front over the library, one subcommand module each."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Each module here defines ``register(subparsers)``; its subcommands set ``func`` on their parser.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "remat.trace.cli",
    "remat.sim.cli",
    "remat.planner.cli",
    "remat.viz.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="remat", description="Rematerialization for PyTorch training.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
