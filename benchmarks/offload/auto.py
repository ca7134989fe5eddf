"""CPU seconds of ``remat.plan(..., solver="auto", link=...)`` on tiny zoo models.

Each model built tiny (``remat.zoo.build(name, tiny=True)``) and planned once at a share of its
plain peak over an 8 GB/s link, timed with ``time.process_time``; the solver of the plan picked.

    PYTHONPATH=. .venv/bin/python benchmarks/offload/auto.py --models gpt2 bilstm bert
"""

from __future__ import annotations

import argparse
import time

import torch

import remat
from remat.planner import ExecutorCost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "bilstm", "bert"])
    parser.add_argument("--share", type=float, default=0.9)
    parser.add_argument("--rate", default="8GB/s")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    print("| model | plan CPU s | plan picked |")
    print("|---|---|---|")
    for name in args.models:
        wl = remat.zoo.build(name, tiny=True)
        start = time.process_time()
        plan = remat.plan(
            wl.model,
            wl.inputs,
            args.share,
            loss_fn=lambda m, *i, wl=wl: wl.loss_fn(m(*i)),
            link=remat.Link(args.rate, args.rate),
            executor_cost=ExecutorCost(),
            repeats=1,
        )
        spent = time.process_time() - start
        print(f"| {name} | {spent:.1f} | {str(plan).splitlines()[0][:80]} |", flush=True)


if __name__ == "__main__":
    main()
