"""The ``remat`` command line: a thin front over the library, one subcommand module each."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from remat._errors import RematError, RematValueError, message

# Each module here defines ``register(subparsers)``; its subcommands set ``func`` on their parser.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "remat.trace.cli",
    "remat.sim.cli",
    "remat.planner.cli",
    "remat.viz.cli",
    "remat.pipeline.cli",
)


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (a bad flag or value) as remat's: one line on stderr, exit code 2,
    no usage block (``--help`` shows it)."""

    given: Sequence[str] = ()  # the command line being parsed, for the errors (``main`` sets it)

    def error(self, message: str) -> NoReturn:
        words = self.prog.split()  # "remat trace info" -> remat.trace.info, see remat trace info --help
        at = message.find("remat.")  # a value an argparse type of remat's refused, in its words
        where, flags = ".".join(words), f"see {' '.join(words)} --help"
        given = "" if "(got" in message else f" (got: {' '.join(['remat', *self.given])})"
        text = message[at:] if at >= 0 else f"{where}: {message}{given}; {flags}"
        self.exit(2, text.splitlines()[0] + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="remat", description="Rematerialization for PyTorch training.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. remat's own errors (bad input, a budget no plan meets, ...) print as one
    line on stderr with exit code 2, as argparse's do; ``--debug`` shows their traceback too."""
    parser = build_parser()
    _Parser.given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        _outputs(parser, args)
        result = args.func(args)
    except (RematError, OSError, MemoryError, RuntimeError) as error:
        if args.debug or (isinstance(error, RuntimeError) and not _out_of_memory(error)):
            raise
        detail = str(error) if isinstance(error, RematError) else f"remat {args.command}: {error}"
        if isinstance(error, MemoryError | RuntimeError):  # sizes this machine cannot hold
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            detail = message(
                args.command, "the sizes asked for need more memory than there is", first, "use smaller sizes"
            )
        print(detail.splitlines()[0] if detail else type(error).__name__, file=sys.stderr)
        return 2
    return int(result or 0)


def _out_of_memory(error: RuntimeError) -> bool:
    """Whether torch failed to allocate (its CPU allocator's error, or CUDA's ``OutOfMemoryError``)."""
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error)


_OUTPUTS = ("--out", "--json", "--save", "--plot")


def _outputs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The files a command writes, checked before it works: each in a folder that exists, and each
    picture (a ``FILE.png`` metavar) in a format matplotlib writes."""
    chosen = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for action in chosen[args.command]._actions:
        path = getattr(args, action.dest, None)
        if not isinstance(path, str) or not set(action.option_strings) & set(_OUTPUTS):
            continue
        flag = action.option_strings[0]
        if Path(path).is_dir():
            rule = f"{flag} names a file, not a folder"
            raise RematValueError(
                message(args.command, rule, f"{path} is a folder", "pass a file path in it")
            )
        if not Path(path).resolve().parent.is_dir():
            rule = f"{flag} names a file in a folder that exists"
            raise RematValueError(
                message(args.command, rule, path, "make the folder first, or pass another path")
            )
        existed = Path(path).exists()
        try:  # opened to append, which changes no file already there; one made here goes again
            with open(path, "a"):
                pass
        except OSError as error:
            rule = f"{flag} names a file this process may write"
            given = f"{path}: {error.strerror}"
            todo = "pass a path in a folder you can write"
            raise RematValueError(message(args.command, rule, given, todo)) from None
        if not existed:
            Path(path).unlink()
        if str(action.metavar or "").upper().endswith(".PNG"):
            from matplotlib.figure import Figure

            kinds = Figure().canvas.get_supported_filetypes()
            if Path(path).suffix.lstrip(".").lower() not in kinds:
                rule = f"{flag} is a picture, in a format matplotlib writes"
                raise RematValueError(
                    message(
                        args.command, rule, path, f"end the name in .png (or .{', .'.join(sorted(kinds))})"
                    )
                )


if __name__ == "__main__":
    sys.exit(main())
