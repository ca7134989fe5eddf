"""Per-stage plans against torchgpipe's uniform checkpointing modes and against no recomputation, on
a 1F1B (or interleaved 1F1B) pipeline of P CPU processes over gloo (torch.distributed.pipelining).

    PYTHONPATH=. python benchmarks/pipeline/run.py --ranks 4 --microbatches 8 --out benchmarks/pipeline
    PYTHONPATH=. python benchmarks/pipeline/run.py --model gpt2 --seq 64 --rows 8 --row-step 2 \
        --out benchmarks/pipeline

The model is the built-in MLP chain (--blocks, --width, --hidden; --rows rows per micro-batch) or
the zoo's tiny GPT-2 cut at its embeddings, blocks and head (remat.pipeline.zoo_chain; --rows
sequences of --seq tokens per micro-batch).
Four modes share the cut (an even split of the children, as one cuts a model by hand) and the batch:
  none         no recomputation
  always       every block of every stage under torch.utils.checkpoint (use_reentrant=False) in
               every micro-batch: torchgpipe's 'always', and torch.distributed.pipelining with
               uniform torch.utils.checkpoint
  except_last  the same in all micro-batches but the last (torchgpipe's 'except_last')
  planned      remat.pipeline.plan with the per-rank budget set to the always mode's largest
               predicted rank need (equal per-rank peak)
Predicted: each rank's memory from remat.pipeline.plan (checkpoint="never" | "always" |
"except_last" | "planned"), and the step from the pipeline model walked with stage times measured
here, in this process: the CPU time of each stage's forward and backward on one micro-batch, as
each mode runs it (plain, per-block torch.utils.checkpoint, or under its plan), in interleaved
rounds, medians; a mode's recomputation is its backward's time less the plain backward's.
Measured, per rank: the CPU time of a step (median of --steps, time.process_time in each process)
and the allocator's peak in one more step (remat.memory.track(allocator=True)); and the step's
wall time from a barrier before it to a barrier after it (the makespan; meaningful only where every
process has a core of its own).
The largest micro-batch each of none and planned fits in the same budget is found by the plan's
prediction (rows in steps of --row-step) and run once more to measure each rank's peak.
With --rerun-modules the plans may run a block again as its module (remat.pipeline.plan's
rerun_modules: no tape, as torch.utils.checkpoint runs it). The predictions of always and
except_last always count their blocks run that way, as torch.utils.checkpoint runs them: each call
keeps the generators' state it started with (5,056 bytes on CPU) as long as its micro-batch is held.
Writes results<suffix>.json and planned<suffix>.png, the suffix naming the schedule if not 1f1b,
the model if not the 64x256 MLP chain (-256x1024, -gpt2), and -rerun with --rerun-modules.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat.pipeline as pp
from remat import RematValueError
from remat.pipeline.chain import mlp_chain
from remat.pipeline.launch import Job, run
from remat.pipeline.picture import draw
from remat.pipeline.zoo_chain import gpt2_chain, token_loss

MODES = ("none", "always", "except_last", "planned")
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def gpt2_model(seq: int) -> nn.Module:
    """The zoo's tiny GPT-2 as a chain (the same weights in every process)."""
    return gpt2_chain(1, seq)[0]


class Checkpointed(nn.Module):
    """A stage whose blocks each run under ``torch.utils.checkpoint``; with ``plain_every`` set,
    every ``plain_every``-th forward (the last micro-batch of a step) runs without it."""

    def __init__(self, stage: nn.Module, plain_every: int = 0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(stage.children())
        self.plain_every = plain_every
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        plain = self.plain_every and self.forwards % self.plain_every == 0
        for block in self.blocks:
            out = block(x) if plain else checkpoint(block, x, use_reentrant=False)
            assert isinstance(out, torch.Tensor)
            x = out
        return x


def checkpoint_blocks(stage: nn.Module) -> nn.Module:
    """``always``: every block checkpointed in every micro-batch."""
    return Checkpointed(stage)


def checkpoint_blocks_except_last(n_microbatches: int, stage: nn.Module) -> nn.Module:
    """``except_last``: every block checkpointed, the last micro-batch of each step plain."""
    return Checkpointed(stage, n_microbatches)


def _step_times(
    module: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Loss,
    last: bool,
    context: AbstractContextManager[Any],
) -> tuple[float, float]:
    """CPU seconds of one forward (under ``context``) and one backward of ``module`` on ``x``."""
    start = time.process_time()
    with context:
        out = module(x)
        loss = loss_fn(out, y) if last else out
    mid = time.process_time()
    loss.backward(None if last else torch.ones_like(out))
    return mid - start, time.process_time() - mid


def stage_times(
    plans: dict[str, pp.PipelinePlan],
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Loss,
    rounds: int,
    modes: tuple[str, ...] = ("none", "always", "planned"),
) -> dict[str, list[tuple[float, float]]]:
    """Per mode of ``modes`` and stage, the median forward and backward CPU seconds of one
    micro-batch (``x`` enters the first stage, ``y`` is the target) as the mode runs it: plain,
    every block under ``torch.utils.checkpoint`` (``always``; ``except_last`` runs the same), or
    under the planned stage's plan; every (mode, stage) once per round."""
    modules = plans["none"].stage_modules()
    n = len(modules)
    inputs = [x]
    with torch.no_grad():
        for module in modules[:-1]:
            inputs.append(module(inputs[-1]))

    def runner(mode: str, s: int) -> Callable[[], tuple[float, float]]:
        body = checkpoint_blocks(modules[s]) if mode == "always" else modules[s]
        plan = plans["planned"].stage_plans[s].plan if mode == "planned" else None

        def once() -> tuple[float, float]:
            context = nullcontext() if plan is None else plan.apply(modules[s])
            feed = inputs[s].detach().requires_grad_(s > 0 and inputs[s].is_floating_point())
            return _step_times(body, feed, y, loss_fn, s == n - 1, context)

        return once

    runners = {(mode, s): runner(mode, s) for mode in modes for s in range(n)}
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {key: [] for key in runners}
    for _ in range(rounds):
        for key, once in runners.items():
            samples[key].append(once())
    for module in modules:
        module.zero_grad(set_to_none=True)
    medians = {
        mode: [
            (
                statistics.median(f for f, _ in samples[mode, s]),
                statistics.median(b for _, b in samples[mode, s]),
            )
            for s in range(n)
        ]
        for mode in modes
    }
    return {**medians, "except_last": medians["always"]} if "always" in medians else medians


def timed(
    plan: pp.PipelinePlan, times: list[tuple[float, float]], plain: list[tuple[float, float]]
) -> pp.PipelinePlan:
    """``plan`` with each stage's costs replaced by the measured ``times`` of its mode: the forward
    as the mode runs it (its hooks, or the plan's executor, included), the backward as without
    recomputation (``plain``), the recomputation as what the mode's backward takes more."""
    stages = []
    for sp, (f, b), (f0, b0) in zip(plan.stage_plans, times, plain, strict=True):
        recompute = max(b - b0, 0.0) if sp.plan is not None else 0.0
        stages.append(
            replace(sp, forward_s=f if sp.plan is not None else f0, backward_s=b0, recompute_s=recompute)
        )
    return replace(plan, stage_plans=tuple(stages))


def largest(fits: Callable[[int], pp.PipelinePlan | None], step: int) -> tuple[int, pp.PipelinePlan | None]:
    """The most rows (a multiple of ``step``) for which ``fits`` gives a plan, and that plan
    (``fits`` is taken as monotone: what fits a batch fits every smaller one)."""
    lo, best, hi = 0, None, step
    while (found := fits(hi)) is not None:
        lo, best, hi = hi, found, 2 * hi
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        if (found := fits(mid)) is not None:
            lo, best = mid, found
        else:
            hi = mid
    return lo, best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=128, help="rows per micro-batch")
    parser.add_argument("--row-step", type=int, default=16, help="rows step of the largest micro-batch")
    parser.add_argument("--model", default="mlp", choices=("mlp", "gpt2"))
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (gpt2; rows are sequences)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the stage times")
    parser.add_argument("--schedule", default="1f1b", choices=pp.SCHEDULES)
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/pipeline")
    parser.add_argument(
        "--rerun-modules",
        action="store_true",
        help="plans may run a block again as its module (remat.pipeline.plan's rerun_modules)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    gpt2 = args.model == "gpt2"
    build = (
        functools.partial(gpt2_model, args.seq)
        if gpt2
        else functools.partial(mlp_chain, args.blocks, args.width, args.hidden)
    )
    loss: Loss = token_loss if gpt2 else nn.functional.mse_loss
    torch.manual_seed(0)
    model = build()
    m = args.microbatches
    n_stages = args.ranks * args.stages_per_rank
    children = len(list(model.children()))
    cut = [children * s // n_stages for s in range(1, n_stages)]

    def batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(rows)
        if gpt2:
            vocab = model[-1].lm_head.out_features
            tokens = torch.randint(0, vocab, (m * rows, args.seq), generator=g)
            return tokens, tokens.roll(-1, 1)
        return torch.randn(m * rows, args.width, generator=g), torch.randn(m * rows, args.width, generator=g)

    def plan_for(mode: str, rows: int, budget: int | str, costs: str = "measured") -> pp.PipelinePlan:
        x, y = batch(rows)
        return pp.plan(
            model,
            x[:rows],
            n_stages=args.ranks,
            n_microbatches=m,
            schedule=args.schedule,
            stages_per_rank=args.stages_per_rank,
            budget_per_rank=budget,
            loss_fn=loss,
            target=y[:rows],
            boundaries=cut,
            checkpoint=mode,
            op_costs=costs,
            rerun_modules=args.rerun_modules or mode in ("always", "except_last"),
        )

    rows = args.rows
    plans = {mode: plan_for("never" if mode == "none" else mode, rows, "100GB") for mode in MODES[:3]}
    budget = max(plans["always"].timeline().peak_bytes)  # equal per-rank peak: always's largest need
    plans["planned"] = plan_for("planned", rows, budget)
    plans["planned"].explain()
    x, y = batch(rows)
    times = stage_times(plans, x[:rows], y[:rows], loss, args.rounds)
    predicted = {mode: timed(plans[mode], times[mode], times["none"]) for mode in MODES}

    def fits(mode: str) -> Callable[[int], pp.PipelinePlan | None]:
        def at(r: int) -> pp.PipelinePlan | None:
            try:
                return plan_for(mode, r, budget, "model")
            except RematValueError:
                return None

        return at

    big = {
        mode: largest(fits(name), args.row_step) for mode, name in (("none", "never"), ("planned", "planned"))
    }
    print({mode: r for mode, (r, _) in big.items()})
    wraps = {
        "none": None,
        "always": checkpoint_blocks,
        "except_last": functools.partial(checkpoint_blocks_except_last, m),
        "planned": None,
    }
    jobs = [
        Job(
            build,
            (plans[mode] if mode == "planned" else plans["none"]).to_json(),
            x,
            y,
            loss,
            1,
            wraps[mode],
            args.steps,
        )
        for mode in MODES
    ]
    for _, (r, p) in big.items():
        assert p is not None
        jobs.append(Job(build, p.to_json(), *batch(r), loss, 1, None, 1))
    results = run(jobs, args.ranks, tempfile.mkdtemp(prefix="remat-pipeline-"))
    rows_out = []
    for mode, ranks in zip(MODES, results, strict=False):
        line = predicted[mode].timeline()
        rows_out.append(
            {
                "mode": mode,
                "stage_ms": [
                    [1e3 * sp.forward_s, 1e3 * sp.backward_s, 1e3 * sp.recompute_s]
                    for sp in predicted[mode].stage_plans
                ],
                "plans": [None if sp.plan is None else sp.plan.notes for sp in plans[mode].stage_plans],
                "except_last": [sp.except_last for sp in plans[mode].stage_plans],
                "predicted_step_ms": line.makespan * 1e3,
                "predicted_busy_ms": [line.busy(r) * 1e3 for r in range(args.ranks)],
                "measured_cpu_ms": [r.cpu_seconds * 1e3 for r in ranks],
                "measured_wall_ms": statistics.median(r.wall_seconds for r in ranks) * 1e3,
                # the first step, which makes the receive buffers, and a later one
                "predicted_peak_bytes": list(line.peak_bytes),
                "measured_peak_bytes": [r.first_peak_bytes for r in ranks],
                "predicted_later_peak_bytes": list(line.steady_peak_bytes),
                "measured_later_peak_bytes": [r.peak_bytes for r in ranks],
            }
        )
    largest_out = [
        {
            "mode": mode,
            "rows": r,
            "predicted_peak_bytes": list(p.timeline().peak_bytes) if p else None,
            "measured_peak_bytes": [q.first_peak_bytes for q in ranks],
            "plans": [None if sp.plan is None else sp.plan.notes for sp in p.stage_plans] if p else None,
        }
        for (mode, (r, p)), ranks in zip(big.items(), results[len(MODES) :], strict=True)
    ]
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, 1 thread per process",
        "budget_bytes": budget,
        "cut": plans["none"].boundaries,
        "args": vars(args),
    }
    suffix = (
        ("" if args.schedule == "1f1b" else f"-{args.schedule}")
        + (
            "-gpt2"
            if gpt2
            else ""
            if (args.width, args.hidden) == (64, 256)
            else f"-{args.width}x{args.hidden}"
        )
        + ("-rerun" if args.rerun_modules else "")
    )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"results{suffix}.json").write_text(
        json.dumps({"env": env, "modes": rows_out, "largest": largest_out}, indent=1) + "\n"
    )
    draw(
        predicted["planned"],
        Path(args.out) / f"planned{suffix}.png",
        measured=[r.first_peak_bytes for r in results[3]],
    )
    for row in [*rows_out, *largest_out]:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
