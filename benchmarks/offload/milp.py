"""The three-way MILP against the greedy rule on one problem: solve CPU time, status and predicted time.

A tiny GPT-2 (``remat.zoo.build("gpt2", tiny=True)``) traced once, its op times replaced by the
H100 roofline (as ``run.py`` does), offered to both solvers at budgets a share of the plain peak,
over a few link rates, with the host's per-move charge 0 and 10 µs. Predicted figures under NOTE
[offload model]; solve times are CPU time (``time.process_time``).

    PYTHONPATH=. .venv/bin/python benchmarks/offload/milp.py --time-limit 20
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from run import gpu_like

import remat
from remat.planner import trace_step
from remat.planner.api import block_key
from remat.planner.offload_lowering import offload_problem
from remat.planner.offload_model import OffloadSchedule, evaluate
from remat.planner.solvers import get


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["8GB/s", "25GB/s"])
    parser.add_argument("--shares", nargs="+", type=float, default=[0.9, 0.7, 0.5])
    parser.add_argument("--per-move", nargs="+", type=float, default=[0.0, 10e-6], help="seconds")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds of HiGHS per solve")
    args = parser.parse_args()
    torch.set_num_threads(1)
    wl = remat.zoo.build("gpt2", tiny=True)
    trace = gpu_like(trace_step(wl.model, wl.inputs, lambda m, *i: wl.loss_fn(m(*i)), repeats=1))
    head = ["link", "per move", "budget (÷ plain peak)", "greedy ÷ plain", "MILP ÷ plain", "MILP moves"]
    print("| " + " | ".join([*head, "MILP CPU s", "HiGHS"]) + " |")
    print("|---" * (len(head) + 2) + "|")
    for rate in args.rates:
        for per_move in args.per_move:
            problem = offload_problem(trace, remat.Link(rate, rate), key=block_key(wl.model))
            problem = dataclasses.replace(problem, per_move=per_move)
            top, base = evaluate(problem, OffloadSchedule()).peak_bytes, problem.base_cost
            for share in args.shares:
                budget = int(share * top)
                try:
                    fast = f"{get('offload_greedy').solve(problem, budget).total_cost / base:.4f}"
                except remat.RematValueError:
                    fast = "none"
                start = time.process_time()
                try:
                    exact = get("offload_milp").solve(problem, budget, time_limit=args.time_limit)
                    figures = f"{exact.total_cost / base:.4f} | {len(exact.offload.moves)}"
                    verdict = exact.notes.removeprefix("HiGHS ")
                except remat.RematValueError:
                    figures, verdict = "none | -", "no plan in the time limit"
                spent = time.process_time() - start
                cells = [rate, f"{per_move * 1e6:g} µs", f"{share:g}", fast, figures, f"{spent:.1f}", verdict]
                print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
