"""The pipeline model's makespan against the measured one, with the per-action cost calibrated:
2 gloo processes (one intra-op thread each), GPipe and 1F1B, M micro-batches, on the narrow and
wide MLP chains of run.py and the zoo's tiny GPT-2 chain, nothing recomputed.

    PYTHONPATH=. python benchmarks/pipeline/makespan.py --out benchmarks/pipeline

Per model, ``remat.pipeline.plan`` plans the step (op times traced on one thread, as it always
does) once per schedule and M, and each stage's forward and backward CPU time on one micro-batch
is measured here once (run.py's ``stage_times``: --rounds interleaved rounds, medians). One spawn
of 2 processes (``remat.pipeline.launch.run_calibrated``) first measures the per-action cost
(``remat.pipeline.calibrate``'s measurement, messages of the narrow chain's activation), then runs
every job: --steps timed steps after a warm-up, each ``schedule.step`` between a barrier before
and a barrier after. The predictions walk the stage CPU times (and, for comparison, the plan's
traced op times) with the calibrated per-action cost. Reported per run: the predicted makespan
with op times only and with the per-action cost, the measured wall time of a step (median over
steps, of the ranks' medians; and the fastest step) and their ratio, and per rank the model's
busy time against the measured CPU time of a step (``time.process_time``, median). The figures
are taken on whatever the machine runs beside them: the load (``os.getloadavg``) is written down
before the planning, before the spawn and after it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from run import stage_times, timed  # this folder's run.py: stage CPU times in interleaved rounds
from torch import nn

import remat.pipeline as pp
from remat.pipeline.chain import mlp_chain
from remat.pipeline.launch import Job, run_calibrated
from remat.pipeline.zoo_chain import gpt2_chain, token_loss

SCHEDULES = ("gpipe", "1f1b")
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


def gpt2_model(seq: int) -> nn.Module:
    """The zoo's tiny GPT-2 as a chain (the same weights in every process)."""
    return gpt2_chain(1, seq)[0]


def models(rows: int, seq: int) -> dict[str, tuple[Callable[[], nn.Module], Batch, Loss]]:
    """Per model: its builder, the maker of ``n`` micro-batches (input and target), the loss."""

    def mlp_batch(width: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(n)
        return torch.randn(n * rows, width, generator=g), torch.randn(n * rows, width, generator=g)

    def gpt2_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, 128, (n * 8, seq), generator=torch.Generator().manual_seed(n))
        return tokens, tokens.roll(-1, 1)

    return {
        "narrow chain": (
            functools.partial(mlp_chain, 8, 64, 256),
            functools.partial(mlp_batch, 64),
            nn.functional.mse_loss,
        ),
        "wide chain": (
            functools.partial(mlp_chain, 8, 256, 1024),
            functools.partial(mlp_batch, 256),
            nn.functional.mse_loss,
        ),
        "tiny GPT-2": (functools.partial(gpt2_model, seq), gpt2_batch, token_loss),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rows", type=int, default=128, help="rows per micro-batch (MLP chains)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (GPT-2: 8 per micro-batch)")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the stage times")
    parser.add_argument("--out", default="benchmarks/pipeline")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = [os.getloadavg()]
    runs: list[dict[str, Any]] = []
    jobs: list[Job] = []
    plans: list[tuple[pp.PipelinePlan, pp.PipelinePlan]] = []
    for name, (build, batch, loss) in models(args.rows, args.seq).items():
        torch.manual_seed(0)
        model = build()
        n = len(list(model.children()))
        times: list[tuple[float, float]] = []
        for schedule in SCHEDULES:
            for m in args.microbatches:
                x, y = batch(m)
                one = x.shape[0] // m
                plan = pp.plan(
                    model,
                    x[:one],
                    n_stages=2,
                    n_microbatches=m,
                    schedule=schedule,
                    budget_per_rank="100GB",
                    loss_fn=loss,
                    target=y[:one],
                    boundaries=[n // 2],
                    checkpoint="never",
                )
                # the stages' CPU times, measured once per model: the same stages in every run
                times = (
                    times
                    or stage_times({"none": plan}, x[:one], y[:one], loss, args.rounds, ("none",))["none"]
                )
                plans.append((plan, timed(plan, times, times)))
                jobs.append(Job(build, plan.to_json(), x, y, loss, 1, None, args.steps))
                runs.append({"model": name, "schedule": schedule, "microbatches": m})
    load.append(os.getloadavg())
    # the per-action cost measured in the same processes, before the jobs, with messages of the
    # narrow chain's activation
    with tempfile.TemporaryDirectory(prefix="remat-makespan-") as folder:
        results, per_action = run_calibrated(jobs, 2, folder, (args.rows, 64))
    load.append(os.getloadavg())
    print(per_action)
    for row, (traced, plan), ranks in zip(runs, plans, results, strict=True):
        traced, plan = (replace(p, action_cost=per_action) for p in (traced, plan))
        bare = replace(plan, action_cost=pp.ActionCost()).timeline()
        line = plan.timeline()
        wall = statistics.median(r.wall_seconds for r in ranks)
        fastest = min(r.fastest_wall_seconds for r in ranks)
        row.update(
            predicted_traced_ms=traced.timeline().makespan * 1e3,
            predicted_ops_only_ms=bare.makespan * 1e3,
            predicted_ms=line.makespan * 1e3,
            measured_ms=wall * 1e3,
            fastest_ms=fastest * 1e3,
            ratio=wall / line.makespan,
            ratio_fastest=fastest / line.makespan,
            ratio_ops_only=wall / bare.makespan,
            busy_ms=[line.busy(r) * 1e3 for r in range(2)],
            busy_ops_only_ms=[bare.busy(r) * 1e3 for r in range(2)],
            cpu_ms=[r.cpu_seconds * 1e3 for r in ranks],
            stage_ms=[[sp.forward_s * 1e3, sp.backward_s * 1e3] for sp in plan.stage_plans],
        )
        print(json.dumps(row))
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, 2 processes, 1 thread each",
        "load_before_after": load,
        "action_cost": asdict(per_action),
        "args": vars(args),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "results-makespan.json").write_text(
        json.dumps({"env": env, "runs": runs}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
