"""Per-stage plans against uniform per-block checkpointing and against no recomputation, on a
1F1B (or interleaved 1F1B) pipeline of P CPU processes over gloo (torch.distributed.pipelining).

    PYTHONPATH=. python benchmarks/pipeline/run.py --ranks 4 --microbatches 8 --out benchmarks/pipeline
    PYTHONPATH=. python benchmarks/pipeline/run.py --schedule interleaved-1f1b --stages-per-rank 2 \
        --blocks 16 --ranks 4 --microbatches 8 --out benchmarks/pipeline

Three modes share the cut (an even split of the blocks, as one cuts a model by hand) and the batch:
  none     no recomputation
  uniform  every block of every stage under torch.utils.checkpoint (use_reentrant=False)
  planned  remat.pipeline.plan with the per-rank budget set to the uniform mode's largest
           predicted rank peak (equal per-rank peak), raised by 5% steps where no plan reaches it,
           up to the none mode's (where nothing needs recomputing)
For each: the pipeline model's predicted step (op costs measured by the trace capture), and per
rank the measured CPU time of a step (median of --steps, time.process_time in each process) and
the allocator's peak (remat.memory.track(allocator=True)). Writes results.json and planned.png
(1f1b) or results-<schedule>.json and planned-<schedule>.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat.pipeline as pp
from remat import RematValueError
from remat.pipeline.api import measure
from remat.pipeline.chain import mlp_chain
from remat.pipeline.launch import Job, run
from remat.pipeline.picture import draw


class Checkpointed(nn.Module):
    """One block under ``torch.utils.checkpoint``."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = checkpoint(self.block, x, use_reentrant=False)
        assert isinstance(out, torch.Tensor)
        return out


def checkpoint_blocks(stage: nn.Module) -> nn.Module:
    """The stage with each of its blocks checkpointed."""
    return nn.Sequential(*(Checkpointed(block) for block in stage.children()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rows", type=int, default=128, help="rows per micro-batch")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedule", default="1f1b", choices=pp.SCHEDULES)
    parser.add_argument("--stages-per-rank", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/pipeline")
    args = parser.parse_args()
    torch.set_num_threads(1)
    build = functools.partial(mlp_chain, args.blocks, 64, 256)
    torch.manual_seed(0)
    model = build()
    m, rows = args.microbatches, args.rows
    x, y = torch.randn(m * rows, 64), torch.randn(m * rows, 64)
    loss = nn.functional.mse_loss

    def planned_for(budget: int | str, cut: list[int] | None) -> pp.PipelinePlan:
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
        )

    n_stages = args.ranks * args.stages_per_rank
    cut = [args.blocks * s // n_stages for s in range(1, n_stages)]
    none = planned_for("100GB", cut)
    # the uniform mode, as the pipeline model sees it: each stage traced with its blocks checkpointed
    stage_plans, h = [], x[:rows]
    for s, module in enumerate(none.stage_modules()):
        base, _, h = measure(none.order, s, checkpoint_blocks(module), h, y[:rows], loss)
        stage_plans.append(base)
    uniform = dataclasses.replace(none, stage_plans=tuple(stage_plans))
    # the uniform mode's largest rank peak; raised by 5% steps where the planner cannot reach it
    budget, ceiling = max(uniform.timeline().peak_bytes), max(none.timeline().peak_bytes)
    while True:
        try:
            planned = planned_for(min(budget, ceiling), cut)
            break
        except RematValueError as error:
            print(str(error)[:160])
            budget = int(budget * 1.05)
    budget = planned.budget_bytes
    planned.explain()
    modes = {"none": (none, None), "uniform": (uniform, checkpoint_blocks), "planned": (planned, None)}
    jobs = [Job(build, p.to_json(), x, y, loss, seed=1, wrap=w, steps=args.steps) for p, w in modes.values()]
    results = run(jobs, args.ranks, tempfile.mkdtemp(prefix="remat-pipeline-"))
    rows_out = []
    for (name, (p, _)), ranks in zip(modes.items(), results, strict=True):
        line = p.timeline()
        rows_out.append(
            {
                "mode": name,
                "predicted_step_ms": line.makespan * 1e3,
                "predicted_busy_ms": [line.busy(r) * 1e3 for r in range(args.ranks)],
                "measured_cpu_ms": [r.cpu_seconds * 1e3 for r in ranks],
                "predicted_peak_bytes": list(line.peak_bytes),
                "measured_peak_bytes": [r.peak_bytes for r in ranks],
            }
        )
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, shared 2-core CPU, 1 thread per process",
        "budget_bytes": budget,
        "cut": none.boundaries,
        "args": vars(args),
    }
    suffix = "" if args.schedule == "1f1b" else f"-{args.schedule}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"results{suffix}.json").write_text(
        json.dumps({"env": env, "modes": rows_out}, indent=1) + "\n"
    )
    draw(planned, Path(args.out) / f"planned{suffix}.png", measured=[r.peak_bytes for r in results[2]])
    for row in rows_out:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
