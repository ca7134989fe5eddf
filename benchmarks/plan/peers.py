"""remat.plan beside its peers, each in a process of its own, measured the same way.

Peers: the plain eager step; ``torch.utils.checkpoint`` around every block; ``torch.compile`` with
``torch._functorch.config.activation_memory_budget`` at several values (its min-cut partitioner
decides what to recompute); remat plans (made in the parent process, saved with ``Plan.save`` and
loaded in the child), one at the measured peak of each peer, so that each peer is compared with
the plan that fits in the memory the peer used.

A compiled step runs C++ kernels that no dispatch mode sees, so the peak is measured for every
strategy from the process itself: ``MALLOC_MMAP_THRESHOLD_=65536`` makes large tensors go back to
the OS when freed, the kernel's high-water mark is reset before the step
(``/proc/self/clear_refs``) and the peak is the high-water mark minus the resident size before it.
Time: the process's CPU time with ``--threads`` intra-op threads, median of ``--steps`` steps
after two warm-up steps (the compile happens there); overhead is each strategy's time ÷ the time
of its own recomputation-free twin (eager plain for eager strategies, budget 1.0 for compiled
ones).

    .venv/bin/python benchmarks/plan/peers.py --model gpt2 --steps 5 --out benchmarks/plan/peers_gpt2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, int]] = {
    "gpt2": {"batch": 2, "seq": 256},
    "bert": {"batch": 2, "seq": 256},
    "resnet50": {"batch": 4, "image": 128},
}


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one strategy in this process and return its peak and step times."""
    import torch
    from torch import nn

    import remat
    from remat import zoo

    sys.path.insert(0, str(Path(__file__).parent))
    from run import blocks, per_block_checkpoint

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    wl = zoo.build(spec["model"], **spec["sizes"])
    model: nn.Module = wl.model
    kind = spec["kind"]
    forward: Any = model
    context: Any = None
    if kind == "compile":
        import torch._functorch.config

        torch._functorch.config.activation_memory_budget = spec["budget"]
        forward = torch.compile(model)
    elif kind == "checkpoint":
        context = lambda: per_block_checkpoint(blocks(spec["model"], model))  # noqa: E731
    elif kind == "plan":
        plan = remat.Plan.load(spec["plan"])
        context = lambda: plan.apply(model)  # noqa: E731

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if context is None:
            loss = wl.loss_fn(forward(*wl.inputs))
        else:
            with context():
                loss = wl.loss_fn(forward(*wl.inputs))
        loss.backward()

    for _ in range(2):
        step()
    model.zero_grad(set_to_none=True)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    step()
    peak = _status("VmHWM") - before
    times = []
    for _ in range(spec["steps"]):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return {"peak_rss": peak, "cpu_seconds": statistics.median(times)}


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "TORCHINDUCTOR_COMPILE_THREADS": str(spec["threads"]),
    }
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--plans", nargs="*", type=float, default=[], help="extra plan budgets (ratios)")
    parser.add_argument("--compile", nargs="*", type=float, default=[1.0, 0.5, 0.2, 0.05])
    parser.add_argument("--batch", type=int, help="batch size (default: the model's in SIZES)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--retries", type=int, default=2, help="re-plans when a plan's peak is over")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every child")
    parser.add_argument("--kinds", default="plain,checkpoint,compile,plan", help="strategies to run")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    import torch

    from remat import zoo
    from remat.planner import BudgetTooSmall, plan_trace, trace_step
    from remat.planner.api import block_key

    kinds = args.kinds.split(",")
    sizes = {**SIZES[args.model], **({"batch": args.batch} if args.batch else {})}
    rows: list[dict[str, Any]] = []

    def run(spec: dict[str, Any]) -> dict[str, Any]:
        result = run_child(
            {**spec, "model": args.model, "sizes": sizes, "steps": args.steps, "threads": args.threads}
        )
        row = {**spec, **result}
        row.pop("plan", None)
        rows.append(row)
        print(json.dumps(row), flush=True)
        return row

    # 1. the peers, each in its own process
    peers = [{"kind": "plain"}, {"kind": "checkpoint"}]
    peers += [{"kind": "compile", "budget": b} for b in args.compile]
    measured = [run(spec) for spec in peers if spec["kind"] in kinds or spec["kind"] == "plain"]

    # 2. a remat plan at each peer's measured peak: resident bytes are converted to tensor bytes
    # with the plain step's ratio (allocator slack), so that the plan's resident peak matches
    torch.manual_seed(0)
    wl = zoo.build(args.model, **sizes)

    def loss_fn(m: Any, *xs: Any) -> Any:
        return wl.loss_fn(m(*xs))

    trace = trace_step(wl.model, wl.inputs, loss_fn, repeats=3)
    baseline = plan_trace(trace, 1.0).baseline_peak_bytes
    plain_rss = measured[0]["peak_rss"]
    targets: list[tuple[str, int, int | None]] = []
    for r in measured[1:]:
        if "peak_rss" in r:
            name = f"{r['kind']} {r.get('budget', '')}".strip()
            targets.append((name, int(r["peak_rss"] * baseline / plain_rss), r["peak_rss"]))
    targets += [(f"ratio {ratio}", int(ratio * baseline), None) for ratio in args.plans]
    tmp = Path(tempfile.mkdtemp())
    for k, (matched, budget, ceiling) in enumerate(targets):
        if "plan" not in kinds:
            break
        # the resident peak is not the tensor peak (allocator slack): when the plan's resident peak
        # comes out above the peer's, plan again that much lower, up to --retries times
        for attempt in range(args.retries + 1):
            start = time.perf_counter()
            try:
                plan = plan_trace(trace, budget, block_key=block_key(wl.model))
            except BudgetTooSmall as err:
                rows.append({"kind": "plan", "matched": matched, "budget": budget, "error": str(err)})
                print(err, flush=True)
                break
            path = tmp / f"plan_{k}_{attempt}.json"
            plan.save(path)
            row = run(
                {
                    "kind": "plan",
                    "matched": matched,
                    "attempt": attempt,
                    "budget": budget,
                    "plan": str(path),
                    "predicted_peak": plan.predicted_peak_bytes,
                    "predicted_overhead": plan.predicted_overhead,
                    "plan_seconds": time.perf_counter() - start,
                    "regions": len(plan.regions),
                }
            )
            over = row.get("peak_rss", 0) - (ceiling or row.get("peak_rss", 0))
            if over <= 0:
                break
            budget = plan.predicted_peak_bytes - over
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"model": args.model, "sizes": sizes, "baseline_bytes": baseline, "rows": rows},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
