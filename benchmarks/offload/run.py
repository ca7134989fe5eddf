"""Three-way plans (save, recompute or offload) against recomputation alone, at equal device peak.

For each model: one step traced (measured CPU op times), and the same trace with every op's time
from the cost model's H100 roofline (``remat.trace.cost.estimate(trace, "h100")``: a GPU-like speed,
so that the link is weighed against compute as fast as a GPU's). At budgets between the smallest
peak recomputation alone reaches and the plain peak, the recompute-only plan (``remat.plan``'s
search, ``solver="auto"``) is picked first; the three-way plan is then picked with the budget set
to that plan's predicted peak, for each link rate. The candidates are found once per trace (and per
link), as ``remat.plan`` finds them (NOTE [monotone plans]). Predicted figures only (this machine
has no GPU). ``--executor none`` leaves the executor's own host time out of the predictions
(``NO_EXECUTOR_COST``): on a GPU the host runs ahead of the device, so its Python time per op does
not add to roofline op times as the CPU-calibrated figures (the default, ``calibrated``) would.

    PYTHONPATH=. .venv/bin/python benchmarks/offload/run.py --fractions 0.5 0.0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

import torch

import remat
from remat.planner import trace_step
from remat.planner.api import block_key, plan_at
from remat.planner.cost_model import NO_EXECUTOR_COST, ExecutorCost
from remat.planner.frontier import frontier
from remat.planner.offload_search import offload_frontier
from remat.trace.cost import estimate
from remat.trace.types import Op, Trace

RATES = (8, 16, 25, 32, 64)  # GB/s, each way
COSTS = {"cpu": "measured CPU", "h100": "H100 roofline"}


def gpu_like(trace: Trace) -> Trace:
    """``trace`` with every op's cost its H100 roofline estimate."""
    fast = estimate(trace, "h100")
    events = tuple(dataclasses.replace(e, cost=e.est_cost) if isinstance(e, Op) else e for e in fast.events)
    return dataclasses.replace(fast, events=events)


def run_model(
    name: str,
    sizes: dict[str, int],
    fractions: list[float],
    rates: list[int],
    out: str,
    costs: list[str],
    executor: ExecutorCost | None = None,
) -> list[dict[str, Any]]:
    wl = remat.zoo.build(name, **sizes)

    def loss_fn(model: Any, *inputs: Any) -> Any:
        return wl.loss_fn(model(*inputs))

    start = time.process_time()
    measured = trace_step(wl.model, wl.inputs, loss_fn, repeats=1)
    print(f"{name}: traced in {time.process_time() - start:.1f} s CPU: {measured}", flush=True)
    key = block_key(wl.model)
    rows = []
    traces = {"measured CPU": lambda: measured, "H100 roofline": lambda: gpu_like(measured)}
    for kind in costs:
        trace = traces[COSTS[kind]]()
        start = time.process_time()
        alone = frontier(trace, "auto", key, executor_cost=executor)
        alone_s = time.process_time() - start
        plain = alone.baseline
        low = min(c.pred.peak_bytes for c in alone.candidates)
        for rate in rates:
            link = remat.Link(d2h=f"{rate}GB/s", h2d=f"{rate}GB/s")
            start = time.process_time()
            both = offload_frontier(alone, link)
            both_s = time.process_time() - start
            for f in fractions:
                budget = int(low + f * (plain - low))
                recompute = plan_at(alone, budget)
                three = plan_at(both, recompute.predicted_peak_bytes)  # at equal device peak
                row = {
                    "model": name,
                    "sizes": sizes,
                    "costs": COSTS[kind],
                    "fraction": f,
                    "plain_peak": plain,
                    "min_recompute_peak": low,
                    "budget": budget,
                    "link_GBps": rate,
                    "recompute_peak": recompute.predicted_peak_bytes,
                    "recompute_overhead": recompute.predicted_overhead,
                    "recompute_solve_s": alone_s,
                    "three_way_peak": three.predicted_peak_bytes,
                    "three_way_overhead": three.predicted_overhead,
                    "three_way_solver": three.solver,
                    "three_way_offloaded_bytes": three.offloaded_bytes,
                    "three_way_recomputed_bytes": three.recomputed_bytes,
                    "three_way_stall_s": three.predicted_stall,
                    "three_way_solve_s": both_s,
                    "three_way_candidates": len(both.candidates),
                    "step_s": sum(op.cost for op in trace.ops),
                    "executor": "none" if executor is NO_EXECUTOR_COST else "calibrated",
                }
                print(
                    f"  {COSTS[kind]:13} f={f:.2f} {rate:2d} GB/s: recompute {row['recompute_overhead']:.4f} "
                    f"three-way {row['three_way_overhead']:.4f} ({three.solver}, "
                    f"{three.offloaded_bytes / 2**20:.1f} MiB to host, {both_s:.0f} s CPU)",
                    flush=True,
                )
                rows.append(row)
                Path(out).write_text(json.dumps(rows, indent=1))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2:batch=2,seq=256", "resnet50:batch=4,image=128"])
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.2, 0.0])
    parser.add_argument("--rates", nargs="+", type=int, default=list(RATES), help="link rates, GB/s")
    parser.add_argument("--costs", nargs="+", choices=sorted(COSTS), default=["cpu", "h100"], help="op times")
    parser.add_argument("--out", default="benchmarks/offload/results_{model}.json")
    parser.add_argument(
        "--executor", choices=["calibrated", "none"], default="calibrated", help="the executor's host time"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    executor = NO_EXECUTOR_COST if args.executor == "none" else None
    for spec in args.models:
        name, _, rest = spec.partition(":")
        sizes = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", rest)}
        out = args.out.replace("{model}", name)
        run_model(name, sizes, args.fractions, args.rates, out, args.costs, executor)


if __name__ == "__main__":
    main()
