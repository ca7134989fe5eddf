"""``remat memory``: one training step of a zoo model, plain and under ``remat.dynamic``, as a picture.

    remat memory --model gpt2 --out memory.png
    remat memory --model resnet50 --budget 0.7 0.5 --policy dtr coop --out memory.png

The step (forward and backward) runs once plain and once per policy and budget ratio, each measured
by the CPU allocator (``remat.memory.track(allocator=True)``); the figure has one panel per run
(``remat.memory.plot``) and a table sums them up. A ratio is a fraction of the plain step's
allocator peak (``remat.viz.steps``). The model is the zoo's tiny variant unless ``--full``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from remat._errors import message

if TYPE_CHECKING:
    from remat.viz.steps import StepRun

_API = "memory.cli"


def register(subparsers: Any) -> None:
    from remat.core.policies import names as policies
    from remat.zoo import names as models

    parser = subparsers.add_parser(
        "memory",
        help="draw one training step's memory over time, plain and under remat.dynamic budgets",
        description="Measure a zoo model's training step with the CPU allocator, plain and under "
        "remat.dynamic at budget ratios, and draw memory over time as a PNG.",
    )
    parser.add_argument("--model", required=True, choices=models(), help="zoo model")
    parser.add_argument(
        "--full", action="store_true", help="the paper-size model (default: its tiny variant)"
    )
    parser.add_argument("--batch", type=int, help="batch size (default: the zoo's, 2 for the tiny variant)")
    parser.add_argument("--seq", type=int, help="tokens per sample (text models)")
    parser.add_argument("--image", type=int, help="image side (vision models)")
    parser.add_argument(
        "--budget",
        type=ratio,
        nargs="+",
        default=[0.7],
        metavar="RATIO",
        help="fractions of the plain step's allocator peak, in (0, 1] (default 0.7)",
    )
    parser.add_argument(
        "--policy",
        nargs="+",
        default=["dtr"],
        choices=policies(),
        metavar="POLICY",
        help=f"eviction policies, from: {', '.join(policies())} (default dtr)",
    )
    parser.add_argument(
        "--thrash-limit",
        type=_thrash_limit,
        default=3.0,
        help="stop a run past this overhead, finite and above 1 (default 3)",
    )
    parser.add_argument("--out", required=True, metavar="FILE.png", help="where to write the picture")
    parser.set_defaults(func=run)


def _thrash_limit(text: str) -> float:
    """The limit ``remat.dynamic`` takes, read before the plain step runs."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 1.0 < value < math.inf:
        raise argparse.ArgumentTypeError(
            message("memory", "--thrash-limit is an overhead: a finite number above 1", repr(text), "pass 3")
        )
    return value


def run(args: argparse.Namespace) -> int:
    from remat import zoo
    from remat._console import progress
    from remat.viz.steps import draw, measure

    what = f"{args.model}{'' if args.full else ' (tiny)'}"
    started: list[str] = []

    def step(label: str) -> None:
        bar.update(task, completed=len(started), description=f"{what}: {label} step")
        started.append(label)

    with progress() as bar:
        task = bar.add_task(f"building {what}", total=1 + len(args.policy) * len(args.budget))
        model, inputs, loss_fn = zoo.build(
            args.model, batch=args.batch, seq=args.seq, image=args.image, tiny=not args.full
        )
        runs = measure(
            model,
            inputs,
            lambda: loss_fn(model(*inputs)),
            args.budget,
            args.policy,
            thrash_limit=args.thrash_limit,
            progress=step,
        )
        bar.update(task, completed=len(started), description=f"drawing {args.out}")
        draw(runs, args.out, title=f"{what}: one training step, CPU allocator")
    _summary(runs, args.out)
    return 0


def _summary(runs: Sequence[StepRun], out: str) -> None:
    from rich.table import Table

    from remat._console import console
    from remat.memory import format_bytes
    from remat.viz.memory import KINDS

    table = Table(title="one training step, measured by the CPU allocator")
    table.add_column("run", no_wrap=True, min_width=max(len(r.label) for r in runs))
    for column in ("budget", "peak", "time", "evict", "recompute", "max |grad diff|"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("outcome", no_wrap=True)
    for r in runs:
        t = r.tracker
        table.add_row(
            r.label,
            "" if r.budget is None else format_bytes(r.budget),
            format_bytes(t.peak_bytes),
            f"{(t.end_ns - t.start_ns) / 1e6:.0f} ms",
            *(
                ("", "")
                if r.moments is None
                else (str(sum(kind == wanted for _, kind in r.moments)) for wanted in KINDS)
            ),
            "" if r.grad_diff is None else f"{r.grad_diff:.1e}",
            "stopped" if r.failure else "ok",
        )
    screen = console()
    screen.print(table)
    kept = next(
        (r.region_budget - r.budget for r in runs if r.region_budget is not None and r.budget is not None),
        None,
    )
    if kept is not None:
        screen.print(
            f"budget: what the step may hold beyond the {format_bytes(kept)} of parameters, buffers and "
            "inputs, which remat.dynamic also counts (its budget is the sum)",
            highlight=False,
            soft_wrap=True,
        )
    for r in runs:
        if r.failure:
            screen.print(f"{r.label} stopped: {r.failure}", highlight=False, soft_wrap=True)
    screen.print(f"picture: {out}", highlight=False, soft_wrap=True)


def ratio(text: str) -> float:
    """A budget ratio from the command line: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            message(_API, "a budget is a ratio of the plain peak in (0, 1]", f"got {text!r}", "pass e.g. 0.5")
        )
    return value
