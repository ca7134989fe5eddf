"""Three-way plans (save, recompute or offload) against recomputation alone, at equal device peak.

For each model: one step traced (measured CPU op times), and the same trace with every op's time
from the cost model's H100 roofline (``remat.trace.cost.estimate(trace, "h100")``: a GPU-like speed,
so that the link is weighed against compute as fast as a GPU's). At budgets between the smallest
peak recomputation alone reaches and the plain peak, the recompute-only plan (``remat.plan``'s
search, ``solver="auto"``) is made first; the three-way plan is then made with the budget set to
that plan's predicted peak, for each link rate. Predicted figures only (this machine has no GPU).

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
from remat.planner import BudgetTooSmall, plan_trace, trace_step
from remat.planner.api import block_key
from remat.trace.cost import estimate
from remat.trace.types import Op, Trace

RATES = (8, 16, 25, 32, 64)  # GB/s, each way


def gpu_like(trace: Trace) -> Trace:
    """``trace`` with every op's cost its H100 roofline estimate."""
    fast = estimate(trace, "h100")
    events = tuple(dataclasses.replace(e, cost=e.est_cost) if isinstance(e, Op) else e for e in fast.events)
    return dataclasses.replace(fast, events=events)


def minimum(trace: Trace, key: Any) -> int:
    try:
        plan_trace(trace, 1, block_key=key)
    except BudgetTooSmall as err:
        return err.minimum_bytes
    raise AssertionError("a budget of 1 byte was met")


def run_model(
    name: str, sizes: dict[str, int], fractions: list[float], rates: list[int], out: str
) -> list[dict[str, Any]]:
    wl = remat.zoo.build(name, **sizes)

    def loss_fn(model: Any, *inputs: Any) -> Any:
        return wl.loss_fn(model(*inputs))

    start = time.process_time()
    measured = trace_step(wl.model, wl.inputs, loss_fn, repeats=1)
    print(f"{name}: traced in {time.process_time() - start:.1f} s CPU: {measured}", flush=True)
    key = block_key(wl.model)
    rows = []
    for costs, trace in (("measured CPU", measured), ("H100 roofline", gpu_like(measured))):
        plain = plan_trace(trace, 1.0, block_key=key).baseline_peak_bytes
        low = minimum(trace, key)
        for f in fractions:
            budget = int(low + f * (plain - low))
            start = time.process_time()
            alone = plan_trace(trace, budget, block_key=key)
            alone_s = time.process_time() - start
            for rate in rates:
                link = remat.Link(d2h=f"{rate}GB/s", h2d=f"{rate}GB/s")
                start = time.process_time()
                at = alone.predicted_peak_bytes
                try:
                    both = plan_trace(trace, at, block_key=key, link=link)
                except BudgetTooSmall:
                    # the search at the recompute-only plan's own peak does not find that plan
                    # again (it was found at a larger budget): plan at the same budget instead
                    at = budget
                    both = plan_trace(trace, at, block_key=key, link=link)
                row = {
                    "model": name,
                    "sizes": sizes,
                    "costs": costs,
                    "fraction": f,
                    "plain_peak": plain,
                    "min_recompute_peak": low,
                    "budget": budget,
                    "link_GBps": rate,
                    "recompute_peak": alone.predicted_peak_bytes,
                    "three_way_budget": at,
                    "recompute_overhead": alone.predicted_overhead,
                    "recompute_solve_s": alone_s,
                    "three_way_peak": both.predicted_peak_bytes,
                    "three_way_overhead": both.predicted_overhead,
                    "three_way_solver": both.solver,
                    "three_way_offloaded_bytes": both.offloaded_bytes,
                    "three_way_recomputed_bytes": both.recomputed_bytes,
                    "three_way_stall_s": both.predicted_stall,
                    "three_way_solve_s": time.process_time() - start,
                    "step_s": sum(op.cost for op in trace.ops),
                }
                print(
                    f"  {costs:13} f={f:.2f} {rate:2d} GB/s: recompute {row['recompute_overhead']:.4f} "
                    f"three-way {row['three_way_overhead']:.4f} ({both.solver}, "
                    f"{both.offloaded_bytes / 2**20:.1f} MiB to host)",
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
    parser.add_argument("--out", default="benchmarks/offload/results_{model}.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for spec in args.models:
        name, _, rest = spec.partition(":")
        sizes = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", rest)}
        run_model(name, sizes, args.fractions, args.rates, args.out.replace("{model}", name))


if __name__ == "__main__":
    main()
