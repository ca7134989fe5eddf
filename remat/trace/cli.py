"""``remat trace``: capture a zoo model's training step to a file, and summarize trace files.

    remat trace --model bert-large --batch 16 --seq 512 --fake --out bert-large.jsonl
    remat trace info bert-large.jsonl
    remat trace models

Capturing is the command itself (its options sit on ``trace``); ``info`` and ``models`` are
subcommands, so both forms read naturally and ``--model`` lists the zoo's names in ``--help``.
"""

from __future__ import annotations

import argparse
from typing import Any

from remat._arguments import positive
from remat._errors import RematValueError, message
from remat._units import format_bytes

OPTIMIZERS = ("none", "sgd", "adam")


def register(subparsers: Any) -> None:
    from remat import zoo
    from remat.trace.cost import PROFILES

    parser = subparsers.add_parser(
        "trace",
        help="capture a training step as a trace file, or summarize one",
        description="Capture one training step of a zoo model (remat trace --model NAME --out FILE), "
        "or summarize a trace file (remat trace info FILE).",
    )
    parser.add_argument("--model", choices=zoo.names(), help="zoo model to capture")
    parser.add_argument("--batch", type=int, help="samples per batch (default: the model's paper size)")
    parser.add_argument("--seq", type=int, help="tokens per sample, for text and sequence models")
    parser.add_argument("--image", type=int, help="image side in pixels, for vision models")
    parser.add_argument(
        "--fake", action="store_true", help="trace on fake tensors: any size, no memory, no timing"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="shrink the model (2 layers, small width) for quick tries"
    )
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="none", help="optimizer step to include")
    parser.add_argument("--repeats", type=positive, default=3, help="timed runs per op (median); default 3")
    parser.add_argument("--profile", choices=sorted(PROFILES), help="device profile of the cost estimates")
    parser.add_argument("--out", help="trace file to write (.jsonl, or .jsonl.gz to compress)")
    parser.set_defaults(func=_capture)
    commands = parser.add_subparsers(dest="trace_command", metavar="{info,models}")
    info = commands.add_parser("info", help="summarize a trace file (ours or a DTR log)")
    info.add_argument("file", help="trace file")
    info.add_argument("--top", type=positive, default=10, help="largest tensors to list (default 10)")
    info.set_defaults(func=_info)
    models = commands.add_parser("models", help="list the zoo's models")
    models.set_defaults(func=_models)


def _capture(args: argparse.Namespace) -> int:
    import torch

    from remat import zoo
    from remat._console import progress
    from remat.trace.capture import capture
    from remat.trace.codec import save

    if args.model is None or args.out is None:
        raise RematValueError(
            message(
                "trace",
                "capturing needs --model and --out",
                f"got --model {args.model}, --out {args.out}",
                "run e.g. remat trace --model gpt2 --tiny --out gpt2.jsonl, or remat trace info FILE",
            )
        )
    what = f"{args.model}{' (tiny)' if args.tiny else ''}{' on fake tensors' if args.fake else ''}"
    with progress() as bar:  # the number of ops is known only at the end: k/? ops captured
        task = bar.add_task(f"building {what}", total=None)
        model, inputs, loss_fn = zoo.build(
            args.model, batch=args.batch, seq=args.seq, image=args.image, fake=args.fake, tiny=args.tiny
        )
        optimizer: torch.optim.Optimizer | None = None
        if args.optimizer == "sgd":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        elif args.optimizer == "adam":
            optimizer = torch.optim.Adam(model.parameters())
        bar.update(task, description=f"capturing {what}: ops")
        trace = capture(
            model,
            inputs,
            loss_fn,
            optimizer=optimizer,
            name=args.model,
            repeats=args.repeats,
            device=args.profile,
            progress=lambda n: bar.update(task, completed=n),
        )
        bar.update(task, description=f"writing {args.out}", completed=len(trace.ops))
        save(trace, args.out)
        bar.update(task, description=f"captured {what}: ops", total=len(trace.ops))
    _summary(trace, top=5)
    return 0


# the capture's options and their defaults: ``info`` and ``models`` take none of them
_CAPTURE: dict[str, object] = {"model": None, "batch": None, "seq": None, "image": None}
_CAPTURE |= {"fake": False, "tiny": False, "optimizer": "none", "repeats": 3, "profile": None, "out": None}


def _capture_options_unused(args: argparse.Namespace) -> None:
    given = [f"--{name}" for name, default in _CAPTURE.items() if getattr(args, name) != default]
    if given:
        raise RematValueError(
            message(
                "trace",
                f"the capture's options do not apply to `remat trace {args.trace_command}`",
                f"got {', '.join(given)}",
                f"run remat trace {args.trace_command} without them "
                "(or capture with remat trace --model NAME --out FILE)",
            )
        )


def _info(args: argparse.Namespace) -> int:
    from remat.trace.codec import load

    _capture_options_unused(args)

    trace = load(args.file)  # a RematError prints as one line (remat.cli.main)
    _summary(trace, top=args.top)
    return 0


def _models(args: argparse.Namespace) -> int:
    from rich.table import Table

    from remat import zoo
    from remat._console import console

    _capture_options_unused(args)
    table = Table("name", "model", "input", "default batch", "default size")
    for name in zoo.names():
        spec = zoo.get(name)
        table.add_row(name, spec.summary, spec.input, str(spec.batch), str(spec.size))
    console().print(table)
    return 0


def _summary(trace: Any, top: int) -> None:
    from rich.table import Table

    from remat._console import console
    from remat.trace.types import Phase

    ops = trace.ops
    made_by = {t: op for op in ops for t in op.outputs}
    live = trace.liveness
    facts = Table.grid(padding=(0, 2))
    facts.add_row("trace", f"{trace.name or '-'} ({trace.source}, {trace.device})")
    phases = ", ".join(
        f"{sum(op.phase is p for op in ops):,} {p.value}" for p in Phase if any(op.phase is p for op in ops)
    )
    facts.add_row("ops", f"{len(ops):,} ({phases})")
    constants = sum(t.constant for t in trace.tensors)
    aliases = sum(t.alias_of is not None for t in trace.tensors)
    kinds = f"{constants:,} constants, {aliases:,} aliases, {len(trace.saved):,} saved for backward"
    facts.add_row("tensors", f"{len(trace.tensors):,} ({kinds})")
    facts.add_row("constants", format_bytes(live.constant_bytes))
    peak_at = f" at op {live.peak_op} ({ops[live.peak_op].name})" if live.peak_op >= 0 else ""
    facts.add_row("unconstrained peak", f"{format_bytes(live.peak_bytes)} with constants")
    facts.add_row("activation peak", f"{format_bytes(live.activation_peak_bytes)}{peak_at}")
    if trace.unseen_bytes:  # NOTE [unseen bytes] in ``remat.trace.types``
        facts.add_row("unseen bytes", f"{format_bytes(trace.unseen_bytes)} the allocator held beyond it")
    for label, seconds in (("measured cost", trace.total_cost), ("estimated cost", trace.total_est_cost)):
        facts.add_row(label, f"{seconds * 1e3:,.3f} ms" if seconds else "- (none in the trace)")
    screen = console()
    screen.print(facts)
    if top > 0:
        table = Table("tensor", "bytes", "shape", "dtype", "made by", title=f"{top} largest tensors")
        largest = sorted((t for t in trace.tensors if t.alias_of is None), key=lambda t: -t.nbytes)[:top]
        for t in largest:
            op = made_by.get(t.id)
            origin = "constant" if t.constant else f"op {op.index} {op.name} {op.module}" if op else "-"
            shape = "x".join(map(str, t.shape)) if t.shape is not None else "-"
            saved = " (saved)" if t.id in trace.saved else ""
            table.add_row(str(t.id), format_bytes(t.nbytes), shape, t.dtype or "-", origin + saved)
        screen.print(table)
