"""remat.plan against its own predictions and against plain per-block checkpointing, on CPU.

For each model: trace one step, plan it at several budgets (``solver="auto"``), then run the plain
step, each plan and ``torch.utils.checkpoint`` around every block, measuring the peak of the step's
memory with ``remat.memory.track(allocator=True)`` (the CPU allocator's own count: tensors and
kernels' scratch buffers) and the step time interleaved (median of ``--repeats``
rounds, each strategy timed once per round, the ratio to the plain step taken per round; the
time is the process's CPU time, since the machine is shared). Writes
``results.json``; README.md holds the table.

At each budget the step is planned twice: with the executor's own per-op cost (NOTE [executor
cost] in ``remat.planner.cost_model``; figures calibrated once in the process, the default of
``remat.plan``) and without it (``NO_EXECUTOR_COST``: the kernels' times alone, the model before
the executor's cost was counted). Every plan run gets both predictions of its overhead, so each
can be held against the measured one; a budget where the two models pick different plans runs both.

    .venv/bin/python benchmarks/plan/run.py --models bert gpt2 resnet50 --repeats 2 --capture-repeats 2 \
        --fractions 0.5 0.1 --out benchmarks/plan/results.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import remat
from remat import zoo
from remat.planner import BudgetTooSmall, Plan, plan_trace, trace_step
from remat.planner.api import block_key
from remat.planner.cost_model import NO_EXECUTOR_COST, ExecutorCost
from remat.planner.executor_cost import measured
from remat.planner.search import Step, predicted
from remat.trace.types import Trace

SIZES: dict[str, dict[str, int]] = {
    "gpt2": {"batch": 2, "seq": 256},
    "bert": {"batch": 2, "seq": 256},
    "resnet50": {"batch": 4, "image": 128},
    "unet": {"batch": 2, "image": 128},
    # remat.zoo's tiny configurations (2 layers, width 32): steps of many small ops, where the
    # executor's own per-op cost is most of what a plan adds
    "gpt2-tiny": {"batch": 8, "seq": 64},
    "bert-tiny": {"batch": 8, "seq": 64},
}


def blocks(name: str, model: nn.Module) -> list[nn.Module]:
    """The blocks per-block checkpointing wraps."""
    if name.startswith("gpt2"):
        return list(model.transformer.h)  # type: ignore[union-attr, arg-type]
    if name.startswith("bert"):
        return list(model.bert.encoder.layer)  # type: ignore[union-attr, arg-type]
    return [m for m in model.modules() if type(m).__name__ in ("Bottleneck", "DoubleConv")]


@contextlib.contextmanager
def per_block_checkpoint(mods: list[nn.Module]) -> Any:
    """torch.utils.checkpoint (non-reentrant) around each block's forward."""
    saved = []
    for m in mods:
        forward = m.forward
        saved.append((m, forward))

        def wrapped(*args: Any, _f: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            return checkpoint(_f, *args, use_reentrant=False, **kwargs)

        m.forward = wrapped  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m, forward in saved:
            m.forward = forward  # type: ignore[method-assign]


def predicted_overhead(trace: Trace, model: nn.Module, plan: Plan, figures: ExecutorCost) -> float:
    """``plan``'s predicted overhead with the executor's per-op ``figures``."""
    step = Step(trace, block_key(model), figures)
    regions = []
    for r in plan.regions:
        made = step.region(
            r.name,
            [step.forward[p].index for p in range(r.first, r.last + 1)],
            [step.forward[p].index for p in r.save],
        )
        assert made is not None
        regions.append(made)
    return predicted(step, regions).overhead


def bench(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Plan, run and measure one model; its entry of results.json."""
    wl = zoo.build(name.removesuffix("-tiny"), tiny=name.endswith("-tiny"), **SIZES[name])
    model, inputs = wl.model, wl.inputs

    def loss_fn(m: nn.Module, *xs: torch.Tensor) -> torch.Tensor:
        return wl.loss_fn(m(*xs))

    start = time.perf_counter()
    trace = trace_step(model, inputs, loss_fn, repeats=args.capture_repeats)
    capture_s = time.perf_counter() - start
    strategies: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
        "plain": contextlib.nullcontext,
        "checkpoint per block": lambda m=model, n=name: per_block_checkpoint(blocks(n, m)),
    }

    def step(ctx: Callable[[], Any], track: bool) -> int:
        model.zero_grad(set_to_none=True)
        with remat.memory.track(allocator=True) if track else contextlib.nullcontext() as t:
            with ctx():
                loss = loss_fn(model, *inputs)
            loss.backward()
        return t.peak_bytes if track else 0

    peaks = {k: step(ctx, True) for k, ctx in strategies.items()}
    plain_peak = plan_trace(trace, 1.0).baseline_peak_bytes
    lowest = plain_peak
    try:
        plan_trace(trace, 1, block_key=block_key(model))
    except BudgetTooSmall as err:
        lowest = err.minimum_bytes
    # at the plain peak the plan recomputes nothing: what it costs is the executor's check alone
    budgets = [plain_peak] + [int(lowest + f * (plain_peak - lowest)) for f in args.fractions]
    budgets.append(peaks["checkpoint per block"])  # the plan at per-block checkpointing's peak
    plans = {}
    figures = measured(trace.device)
    for budget in budgets:
        start = time.perf_counter()
        try:
            p = plan_trace(trace, budget, block_key=block_key(model))
        except BudgetTooSmall as err:  # checkpointing's measured peak can be below the plans' floor
            print(name, f"budget {budget} refused: {err}")
            continue
        plan_s = time.perf_counter() - start
        kernels_only = plan_trace(trace, budget, block_key=block_key(model), executor_cost=NO_EXECUTOR_COST)
        key = f"remat.plan {budget / plain_peak:.2f}"
        picks = [(key, p)]
        if kernels_only.regions != p.regions:
            picks.append((f"{key}, kernels-only model", kernels_only))
        for k, chosen in picks:
            plans[k] = (chosen, plan_s)
            strategies[k] = lambda p=chosen, m=model: p.apply(m)
            peaks[k] = step(strategies[k], True)
    # CPU time of the process (all its threads), not wall time: the machine is shared, and what
    # recomputation costs is compute
    times: dict[str, list[float]] = {k: [] for k in strategies}
    for _ in range(args.repeats):
        for k, ctx in strategies.items():
            start = time.process_time()
            step(ctx, False)
            times[k].append(time.process_time() - start)
    ratios = {
        k: statistics.median(t / p for t, p in zip(v, times["plain"], strict=True)) for k, v in times.items()
    }
    rows = []
    for k in strategies:
        row: dict[str, Any] = {
            "strategy": k,
            "measured_peak": peaks[k],
            "peak_ratio": peaks[k] / peaks["plain"],
            "measured_overhead": ratios[k],
            "plain_cpu_seconds": statistics.median(times["plain"]),
        }
        if k in plans:
            p, plan_s = plans[k]
            with_executor = predicted_overhead(trace, model, p, figures)
            kernels = predicted_overhead(trace, model, p, NO_EXECUTOR_COST)
            row.update(
                budget=p.budget_bytes,
                predicted_peak=p.predicted_peak_bytes,
                predicted_overhead=with_executor,
                predicted_kernels_only=kernels,
                peak_error=peaks[k] / p.predicted_peak_bytes - 1,
                overhead_error=ratios[k] / with_executor - 1,
                kernels_only_error=ratios[k] / kernels - 1,
                solver=p.solver,
                notes=p.notes,
                plan_seconds=plan_s,
                regions=len(p.regions),
            )
        rows.append(row)
        print(name, json.dumps(row))
    return {
        "sizes": SIZES[name],
        "capture_seconds": capture_s,
        "smallest_plan_peak": lowest,
        "baseline_predicted": trace.activation_peak_bytes,
        "executor_cost": dataclasses.asdict(figures),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["gpt2", "bert", "resnet50"])
    parser.add_argument(
        "--fractions",
        nargs="+",
        type=float,
        default=[0.75, 0.5, 0.1],
        help="budgets as min + f * (plain - min) of the range a plan can reach",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timing rounds")
    parser.add_argument("--capture-repeats", type=int, default=3, help="timed runs per op in the capture")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is compute)")
    parser.add_argument("--out", default="benchmarks/plan/results.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    results: dict[str, Any] = {
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
        },
        "models": {},
    }
    for name in args.models:
        results["models"][name] = bench(name, args)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
