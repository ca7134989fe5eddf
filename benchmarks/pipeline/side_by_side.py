"""One pipeline stage's step, timed alone and with a second process running the same beside it:
what the ranks of a pipeline pay for sharing the host, apart from any schedule.

    PYTHONPATH=. python benchmarks/pipeline/side_by_side.py

The stage is half of run.py's narrow chain (4 blocks, width 64, hidden 256) on 128 rows, one
intra-op thread per process, as each rank runs it; each process times 60 forward-and-backward
steps (``time.process_time``) and reports the median of the last 50. Alone and side by side
alternate, twice each.
"""

from __future__ import annotations

import statistics
import time
from multiprocessing.queues import Queue

import torch
import torch.multiprocessing as mp

from remat.pipeline.chain import mlp_chain


def steps(rank: int, out: Queue[tuple[int, float]]) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stage = mlp_chain(4, 64, 256)
    x = torch.randn(128, 64, requires_grad=True)
    seconds = []
    for _ in range(60):
        clock = time.process_time()
        stage(x).sum().backward()
        seconds.append(time.process_time() - clock)
    out.put((rank, statistics.median(seconds[10:])))


def main() -> None:
    context = mp.get_context("spawn")
    for n in (1, 2, 1, 2):
        out: Queue[tuple[int, float]] = context.Queue()
        processes = [context.Process(target=steps, args=(r, out)) for r in range(n)]
        for p in processes:
            p.start()
        for p in processes:
            p.join()
        times = sorted(out.get()[1] * 1e3 for _ in range(n))
        print(f"{'alone' if n == 1 else 'side by side'}: " + ", ".join(f"{t:.2f} ms" for t in times))


if __name__ == "__main__":
    main()
