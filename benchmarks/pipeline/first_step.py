"""The first pipeline step against a later one: what torch's stages allocate once, when the first
step starts (NOTE [receive buffers] in ``remat.pipeline.timeline``), predicted and measured.

    PYTHONPATH=. python benchmarks/pipeline/first_step.py

Each schedule (GPipe, 1F1B, interleaved 1F1B and ZBV, two stages per rank for the last two) runs
an 8-block MLP chain (width 32, hidden 128, batch norm and dropout) on 2 gloo processes, 4
micro-batches of 64 rows, under a per-stage plan for 0.9 of the plain pipeline's need. Each rank
measures its allocator peak (``remat.memory.track(allocator=True)``) in the first step and in a
later one; the table puts them beside ``Timeline.peak_bytes`` and ``steady_peak_bytes``.
"""

from __future__ import annotations

import functools
import tempfile

import torch
from torch import nn

import remat.pipeline as pp
from remat.pipeline.chain import mlp_chain
from remat.pipeline.launch import Job, run

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zbv": 2}
RANKS, M, ROWS = 2, 4, 64


def main() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(M * ROWS, 32), torch.randn(M * ROWS, 32)
    build = functools.partial(mlp_chain, 8, 32, 128, 0.1, True)
    plans = []
    for schedule, per_rank in SCHEDULES.items():
        options = dict(
            n_stages=RANKS,
            n_microbatches=M,
            schedule=schedule,
            stages_per_rank=per_rank,
            loss_fn=nn.functional.mse_loss,
            target=y[:ROWS],
            boundaries=[4] if per_rank == 1 else [2, 4, 6],
        )
        plain = pp.plan(build(), x[:ROWS], **options, budget_per_rank="1GB")
        budget = int(0.9 * max(plain.timeline().peak_bytes))
        plans.append(pp.plan(build(), x[:ROWS], **options, budget_per_rank=budget))
    jobs = [Job(build, p.to_json(), x, y, nn.functional.mse_loss, seed=1) for p in plans]
    with tempfile.TemporaryDirectory() as folder:
        results = run(jobs, RANKS, folder)
    print("| schedule | rank | budget | first step: predicted, measured | later step: predicted, measured |")
    print("|---|---|---|---|---|")
    for schedule, plan, ranks in zip(SCHEDULES, plans, results, strict=True):
        line = plan.timeline()
        for r in ranks:
            print(
                f"| {schedule} | {r.rank} | {plan.budget_bytes:,} | {line.peak_bytes[r.rank]:,}, "
                f"{r.first_peak_bytes:,} | {line.steady_peak_bytes[r.rank]:,}, {r.peak_bytes:,} |"
            )


if __name__ == "__main__":
    main()
