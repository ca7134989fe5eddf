"""``remat pipeline``: plan a pipeline step of a chain, explain it per rank and draw it.

    remat pipeline --model mlp --stages 4 --microbatches 8 --schedule 1f1b --budget 3MB --plot p.png
    remat pipeline --model gpt2 --stages 4 --microbatches 8 --batch 8 --seq 64 --budget 5MB
    remat pipeline --stages 2 --microbatches 4 --schedule zbv --budget 4MB

The model is the built-in chain ``remat.pipeline.chain.mlp_chain`` (``--blocks``, ``--width``,
``--hidden``, ``--batch`` rows per micro-batch) or the zoo's tiny GPT-2 cut at its embeddings,
blocks and head (``remat.pipeline.zoo_chain``; ``--batch`` sequences of ``--seq`` tokens per
micro-batch); ``--checkpoint`` picks torchgpipe's uniform modes instead of the plan, and
``--schedule`` one of ``remat.pipeline.SCHEDULES`` (``interleaved-1f1b`` with ``--stages-per-rank``,
``zbv`` with two stages per rank in a V). Stage costs are measured on one intra-op thread, as
each rank runs (``remat.pipeline.measure``). The plan
(``remat.pipeline.plan``) is printed as its per-rank table, saved with ``--save``, and its
pipeline model drawn with ``--plot``. Nothing is started: running it takes processes
(``PipelinePlan.stages``, ``remat.pipeline.launch``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from remat._arguments import advice_in_flags, positive
from remat._errors import RematError, RematValueError, message
from remat._units import parse_bytes

MODELS = ("mlp", "gpt2")


def register(subparsers: Any) -> None:
    from remat.pipeline.api import CHECKPOINT_MODES
    from remat.pipeline.schedule import SCHEDULES
    from remat.pipeline.split import BALANCES

    parser = subparsers.add_parser(
        "pipeline",
        help="plan recomputation per stage and micro-batch of a pipeline, explain and draw it",
        description="Cut the built-in chain into stages, plan each within a per-rank budget, explain it.",
    )
    parser.add_argument(
        "--model",
        default="mlp",
        choices=MODELS,
        help="the built-in chain of MLP blocks, or the zoo's tiny GPT-2",
    )
    parser.add_argument("--blocks", type=positive, help="mlp: blocks in the chain (default 8)")
    parser.add_argument("--width", type=positive, help="mlp: block width (default 64)")
    parser.add_argument("--hidden", type=positive, help="mlp: hidden width (default 256)")
    parser.add_argument(
        "--batch",
        type=positive,
        default=256,
        help="rows (mlp) or sequences (gpt2) per micro-batch (default 256)",
    )
    parser.add_argument("--seq", type=positive, help="gpt2: tokens per sequence (default 64)")
    parser.add_argument("--stages", type=positive, required=True, help="ranks (processes)")
    parser.add_argument(
        "--stages-per-rank",
        type=positive,
        default=1,
        help="stages on each rank (interleaved-1f1b; default 1; zbv always runs two, in a V)",
    )
    parser.add_argument("--microbatches", type=positive, required=True, help="micro-batches per step")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="schedule (default 1f1b)")
    parser.add_argument("--budget", required=True, type=_budget, help="bytes per rank ('3MB')")
    parser.add_argument("--balance", default="auto", choices=BALANCES, help="how to cut")
    parser.add_argument(
        "--checkpoint",
        default="planned",
        choices=CHECKPOINT_MODES,
        help="planned per stage (default), or torchgpipe's uniform modes: every block checkpointed",
    )
    parser.add_argument(
        "--rerun-modules",
        action="store_true",
        help="run a region that is one block's call again as that block (remat.plan's rerun_modules)",
    )
    parser.add_argument("--save", metavar="PLAN.json", help="write the plan (PipelinePlan.load reads it)")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the schedule and per-rank memory")
    parser.set_defaults(func=run)


def _budget(text: str) -> int:
    try:
        return parse_bytes(text, "pipeline")
    except RematError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def run(args: argparse.Namespace) -> int:
    import torch
    from torch import nn

    from remat.pipeline.api import plan
    from remat.pipeline.chain import mlp_chain
    from remat.pipeline.picture import draw
    from remat.pipeline.zoo_chain import gpt2_chain, token_loss

    other = ("blocks", "width", "hidden") if args.model == "gpt2" else ("seq",)
    if stray := [f"--{k}" for k in other if getattr(args, k) is not None]:
        rule = f"{', '.join(stray)} {'does' if len(stray) == 1 else 'do'} not apply to --model {args.model}"
        raise RematValueError(message("pipeline", rule, f"got {' '.join(stray)}", "leave it out"))
    torch.manual_seed(0)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    if args.model == "gpt2":
        model, x, y = gpt2_chain(args.batch, args.seq or 64)
        loss_fn = token_loss
    else:
        width = args.width or 64
        model = mlp_chain(args.blocks or 8, width, args.hidden or 256)
        x, y = torch.randn(args.batch, width), torch.randn(args.batch, width)
        loss_fn = nn.functional.mse_loss
    with advice_in_flags(_ADVICE):
        planned = plan(
            model,
            x,
            n_stages=args.stages,
            n_microbatches=args.microbatches,
            schedule=args.schedule,
            stages_per_rank=args.stages_per_rank,
            budget_per_rank=args.budget,
            loss_fn=loss_fn,
            target=y,
            balance_by=args.balance,
            checkpoint=args.checkpoint,
            rerun_modules=args.rerun_modules,
        )
    planned.explain()
    if args.save:
        planned.save(args.save)
    if args.plot:
        draw(planned, args.plot)
        print(f"wrote {args.plot}")
    return 0


# the planner's advice in this command's flags (``raise n_microbatches`` -> ``raise --microbatches``)
_ADVICE = (
    (r"schedule='([\w-]+)'", r"--schedule \1"),
    (r"\bn_microbatches\b", "--microbatches"),
    (r"\bbudget_per_rank\b", "--budget"),
    (r"\bstages_per_rank\b", "--stages-per-rank"),
    (r"\bn_stages\b", "--stages"),
    (r"balance_by='(\w+)'", r"--balance \1"),
    (r"\bbalance_by\b", "--balance"),
    (r"cut elsewhere \(boundaries=\), ", ""),  # no flag fixes the cut
)
