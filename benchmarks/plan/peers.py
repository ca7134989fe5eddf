"""remat.plan beside its peers, every strategy in one process, measured the same way.

Peers: the plain eager step; ``torch.utils.checkpoint`` around every block; ``torch.compile`` with
``torch._functorch.config.activation_memory_budget`` at several values (its min-cut partitioner
decides what to recompute); remat plans, one at the measured peak of each peer, so that each peer
is compared with the plan that fits in the memory the peer used, each applied twice: with eager
replay and with ``replay="compiled"`` (the regions' runs of deterministic ops recomputed by
``torch.compile``d graphs, the forward eager).

Peak: a compiled step runs C++ kernels that no dispatch mode sees, so every strategy's peak is
taken from the CPU allocator itself, for one step: ``remat.memory.track(allocator=True)``, which
sums the allocations and frees PyTorch's profiler reports. It is in the units of
``Plan.predicted_peak_bytes`` (tensors and kernels' scratch buffers), so a plan is made at the
peer's peak as measured.

Time: the process's CPU time with one intra-op thread; ``--rounds`` rounds in which each strategy
runs once, interleaved, after warm-up steps (the compiles happen there). The overhead of a
strategy is, per round, its time ÷ the time of its own recomputation-free twin in that round (the
eager plain step for eager strategies, compile at budget 1.0 for compiled ones), median over
rounds.

    .venv/bin/python benchmarks/plan/peers.py --model gpt2 --batch 8 --out benchmarks/plan/peers_gpt2_b8.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402
import torch._functorch.config as functorch_config  # noqa: E402
from torch._inductor.compile_fx import compile_fx  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from run import SIZES, blocks, per_block_checkpoint  # noqa: E402

import remat  # noqa: E402
from remat import zoo  # noqa: E402
from remat.planner import BudgetTooSmall, Plan, plan_trace, trace_step  # noqa: E402
from remat.planner.api import block_key  # noqa: E402


def allocator_peak(step: Callable[[], None]) -> int:
    """Peak bytes the CPU allocator held during ``step`` beyond what it held before."""
    with remat.memory.track(allocator=True) as tracked:
        step()
    return tracked.peak_bytes


def compiled_with_budget(model: torch.nn.Module, budget: float) -> Callable[..., Any]:
    """``torch.compile(model)`` whose partitioner runs under ``activation_memory_budget=budget``."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        with functorch_config.patch(activation_memory_budget=budget):
            return compile_fx(gm, example_inputs)

    return torch.compile(model, backend=backend)  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2", choices=sorted(SIZES))
    parser.add_argument("--batch", type=int, help="batch size (default: the model's in run.py's SIZES)")
    parser.add_argument("--compile", nargs="*", type=float, default=[1.0, 0.5, 0.2, 0.05])
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds")
    parser.add_argument("--retries", type=int, default=2, help="re-plans when a plan's peak is over")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    sizes = {**SIZES[args.model], **({"batch": args.batch} if args.batch else {})}
    wl = zoo.build(args.model, **sizes)
    model = wl.model

    def stepper(forward: Callable[..., Any], context: Callable[[], Any] | None = None) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            if context is None:
                loss = wl.loss_fn(forward(*wl.inputs))
            else:
                with context():
                    loss = wl.loss_fn(forward(*wl.inputs))
            loss.backward()

        return step

    # name -> (step, name of its recomputation-free twin)
    steps: dict[str, tuple[Callable[[], None], str]] = {
        "plain": (stepper(model), "plain"),
        "checkpoint": (stepper(model, lambda: per_block_checkpoint(blocks(args.model, model))), "plain"),
    }
    twin = "compile 1.0" if 1.0 in args.compile else "plain"
    for b in args.compile:
        steps[f"compile {b}"] = (stepper(compiled_with_budget(model, b)), twin)
    rows: dict[str, dict[str, Any]] = {}
    for name, (step, _) in steps.items():
        start = time.process_time()
        for _ in range(2 if name.startswith("compile") else 1):
            step()  # warm-up; compiles
        model.zero_grad(set_to_none=True)
        rows[name] = {"strategy": name, "peak": allocator_peak(step), "warmup_s": time.process_time() - start}
        print(json.dumps(rows[name]), flush=True)

    def loss_fn(m: torch.nn.Module, *xs: torch.Tensor) -> torch.Tensor:
        return wl.loss_fn(m(*xs))

    start = time.process_time()
    trace = trace_step(model, wl.inputs, loss_fn, repeats=2)
    capture_s = time.process_time() - start
    refused: list[dict[str, Any]] = []
    for peer in list(rows):
        if peer == "plain":
            continue
        ceiling = budget = rows[peer]["peak"]
        for attempt in range(args.retries + 1):
            start = time.process_time()
            try:
                plan: Plan = plan_trace(trace, budget, block_key=block_key(model))
                solve_s = time.process_time() - start
            except BudgetTooSmall as err:
                refused.append(
                    {"matched": peer, "budget": budget, "minimum": err.minimum_bytes, "error": str(err)}
                )
                print(err, flush=True)
                break
            name = f"plan at {peer}" + (f" (try {attempt + 1})" if attempt else "")
            steps[name] = (stepper(model, lambda p=plan: p.apply(model)), "plain")
            steps[name][0]()
            rows[name] = {
                "strategy": name,
                "matched": peer,
                "budget": budget,
                "peak": allocator_peak(steps[name][0]),
                "predicted_peak": plan.predicted_peak_bytes,
                "predicted_overhead": plan.predicted_overhead,
                "regions": len(plan.regions),
                "solve_seconds": solve_s,
            }
            print(json.dumps(rows[name]), flush=True)
            over = rows[name]["peak"] - ceiling
            if over <= 0:
                fused = f"{name}, compiled replay"
                steps[fused] = (stepper(model, lambda p=plan: p.apply(model, replay="compiled")), "plain")
                start = time.process_time()
                for _ in range(2):
                    steps[fused][0]()  # warm-up; compiles the regions' runs
                rows[fused] = {
                    **rows[name],
                    "strategy": fused,
                    "peak": allocator_peak(steps[fused][0]),
                    "warmup_s": time.process_time() - start,
                }
                print(json.dumps(rows[fused]), flush=True)
                break
            budget = plan.predicted_peak_bytes - over

    times: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(args.rounds):
        for name, (step, _) in steps.items():
            start = time.process_time()
            step()
            times[name].append(time.process_time() - start)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in times.items()), flush=True)
    for name, (_, of) in steps.items():
        rows[name]["cpu_seconds"] = statistics.median(times[name])
        rows[name]["twin"] = of
        rows[name]["overhead"] = statistics.median(t / u for t, u in zip(times[name], times[of], strict=True))
        rows[name]["overheads"] = [t / u for t, u in zip(times[name], times[of], strict=True)]
        rows[name]["seconds"] = times[name]
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "model": args.model,
                    "sizes": sizes,
                    "environment": {"torch": torch.__version__, "python": platform.python_version()},
                    "rounds": args.rounds,
                    "capture_seconds": capture_s,
                    "rows": list(rows.values()),
                    "refused": refused,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
