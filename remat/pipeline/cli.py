"""``remat pipeline``: plan a pipeline step of the built-in chain, explain it per rank and draw it.

    remat pipeline --model mlp --stages 4 --microbatches 8 --schedule 1f1b --budget 3MB --plot p.png

The model is ``remat.pipeline.chain.mlp_chain`` (``--blocks``, ``--width``, ``--hidden``,
``--batch`` rows per micro-batch); the plan (``remat.pipeline.plan``) is printed as its per-rank
table, saved with ``--save``, and its pipeline model drawn with ``--plot``. Nothing is started:
running it takes processes (``PipelinePlan.stages``, ``remat.pipeline.launch``).
"""

from __future__ import annotations

import argparse
from typing import Any

from remat._errors import RematError
from remat._units import parse_bytes

MODELS = ("mlp",)


def register(subparsers: Any) -> None:
    from remat.pipeline.schedule import SCHEDULES

    parser = subparsers.add_parser(
        "pipeline",
        help="plan recomputation per stage and micro-batch of a pipeline, explain and draw it",
        description="Cut the built-in chain into stages, plan each within a per-rank budget, explain it.",
    )
    parser.add_argument("--model", default="mlp", choices=MODELS, help="the built-in chain of MLP blocks")
    parser.add_argument("--blocks", type=_positive, default=8, help="blocks in the chain (default 8)")
    parser.add_argument("--width", type=_positive, default=64, help="block width (default 64)")
    parser.add_argument("--hidden", type=_positive, default=256, help="hidden width (default 256)")
    parser.add_argument("--batch", type=_positive, default=256, help="rows per micro-batch (default 256)")
    parser.add_argument("--stages", type=_positive, required=True, help="ranks (processes)")
    parser.add_argument(
        "--stages-per-rank",
        type=_positive,
        default=1,
        help="stages on each rank (interleaved-1f1b; default 1)",
    )
    parser.add_argument("--microbatches", type=_positive, required=True, help="micro-batches per step")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="schedule (default 1f1b)")
    parser.add_argument("--budget", required=True, type=_budget, help="bytes per rank ('3MB')")
    parser.add_argument("--balance", default="memory", choices=("memory", "time"), help="how to cut")
    parser.add_argument("--save", metavar="PLAN.json", help="write the plan (PipelinePlan.load reads it)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the schedule and per-rank memory")
    parser.set_defaults(func=run)


def _budget(text: str) -> int:
    try:
        return parse_bytes(text, "pipeline")
    except RematError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


def run(args: argparse.Namespace) -> int:
    import torch
    from torch import nn

    from remat.pipeline.api import plan
    from remat.pipeline.chain import mlp_chain
    from remat.pipeline.picture import draw

    torch.manual_seed(0)
    model = mlp_chain(args.blocks, args.width, args.hidden)
    x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
    planned = plan(
        model,
        x,
        n_stages=args.stages,
        n_microbatches=args.microbatches,
        schedule=args.schedule,
        stages_per_rank=args.stages_per_rank,
        budget_per_rank=args.budget,
        loss_fn=nn.functional.mse_loss,
        target=y,
        balance_by=args.balance,
    )
    planned.explain()
    if args.save:
        planned.save(args.save)
    if args.plot:
        draw(planned, args.plot)
        print(f"wrote {args.plot}")
    return 0
