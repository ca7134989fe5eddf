"""When each forward and backward of a 2-rank pipeline starts, under torch's ``ScheduleGPipe`` and
``Schedule1F1B``: where the wall time of a GPipe step goes beyond its actions.

    PYTHONPATH=. python benchmarks/pipeline/gpipe_timeline.py

run.py's narrow chain (8 blocks of 64 -> 256 -> 64) cut in two halves, 8 micro-batches of 128
rows, nothing recomputed, 2 gloo processes with one intra-op thread each. Per schedule and rank:
the step's wall time (each ``schedule.step`` between a barrier before and one after; median and
fastest of 10 steps after 2 warm-ups), its CPU time (``time.process_time``, median), and for the
last step the time (ms from the step's start) at which each micro-batch's forward starts (``F``)
and its output's gradient arrives (``B``: the stage's backward starts). Plain torch: no remat code
runs in the processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from remat.pipeline.chain import mlp_chain  # noqa: E402

ROWS, WIDTH, STEPS, WARM = 128, 64, 12, 2


def worker(rank: int, schedule: str, m: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    chain = mlp_chain(8, WIDTH, 256)
    body = chain[:4] if rank == 0 else chain[4:]
    meta = torch.empty(ROWS, WIDTH, device="meta")
    stage = PipelineStage(
        body,
        rank,
        2,
        torch.device("cpu"),
        input_args=meta.clone().requires_grad_(rank > 0),
        output_args=meta.clone().requires_grad_(True),
    )
    log: list[tuple[str, float]] = []
    start = [0.0]

    def at(kind: str, i: int) -> None:
        log.append((f"{kind}{i}", time.perf_counter() - start[0]))

    count = [0]

    def forward(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        at("F", count[0] % m)

    def forwarded(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        i = count[0] % m
        count[0] += 1
        out.register_hook(lambda grad: at("B", i))  # type: ignore[func-returns-value]

    body.register_forward_pre_hook(forward)
    body.register_forward_hook(forwarded)
    kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    runner = kind(stage, m, loss_fn=nn.functional.mse_loss)
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(m * ROWS, WIDTH, generator=g), torch.randn(m * ROWS, WIDTH, generator=g)
    steps = []
    for _ in range(STEPS):
        log.clear()
        dist.barrier()
        start[0], cpu = time.perf_counter(), time.process_time()
        if rank == 0:
            runner.step(x)
        else:
            runner.step(target=target, losses=[])
        steps.append((time.perf_counter() - start[0], time.process_time() - cpu))
        dist.barrier()
    Path(f"{out}.{rank}.json").write_text(json.dumps({"steps": steps[WARM:], "log": log}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--port", type=int, default=29611)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in ("gpipe", "1f1b"):
            out = f"{tmp}/{schedule}"
            mp.spawn(worker, args=(schedule, args.microbatches, args.port, out), nprocs=2)
            for rank in range(2):
                d = json.loads(Path(f"{out}.{rank}.json").read_text())
                walls = [w * 1e3 for w, _ in d["steps"]]
                cpu = statistics.median(c * 1e3 for _, c in d["steps"])
                wall = statistics.median(walls)
                fastest = min(walls)
                print(f"{schedule} rank {rank}: wall {wall:.1f} ms (fastest {fastest:.1f}), CPU {cpu:.1f} ms")
                print("   ", " ".join(f"{name}@{t * 1e3:.1f}" for name, t in d["log"]))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
