"""Overhead of remat.dynamic on CPU: budget ratio against step time, DTR, DTE and Coop side by side.

For each workload: the plain step, the step in a region with no budget (the runtime's own cost),
and the step in regions at fractions of the unconstrained peak, all in one process, interleaved;
each CPU time is divided by the plain step's in the same round, and the median of those ratios
over ``--repeats`` rounds is reported (it cancels most drift of a shared machine). The peak is the
pool's peak at no budget (constants included, as in the simulator). Each constrained step's own
trace is replayed by the simulator, whose predicted overhead is set against the measured one.
After the timed rounds each configuration runs once more inside
``remat.memory.track(allocator=True)``: the allocator's peak (plus the bytes of the tensors from
before the region that the budget also counts) is reported beside the pool's own peak, and every
gradient of that step is compared, bit for bit, with a plain step's on the same batch and seed.
Policies cost ops by the cost model (``--cost model``, the default: the same decisions every run) or
by their measured times.

    .venv/bin/python benchmarks/dynamic/run.py [--quick] [--cost model|measured] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

import remat
from remat.demo import build_gpt2
from remat.zoo.resnet import ResNet


@dataclass(frozen=True)
class Row:
    workload: str
    policy: str
    ratio: float  # budget / unconstrained peak (NaN: no budget)
    budget: int
    step_ratio: float  # median over rounds of step time / plain step time in the same round
    vs_unlimited: float  # the same against the step in a region with no budget
    predicted: float  # simulator: 1 + recomputed cost / first-run cost, on this step's trace
    measured: float  # runtime: 1 + recomputation time / first-run time (kernels only)
    evictions: int
    recomputations: int
    fragmentation: float
    outcome: str
    exit_recomputations: int = 0  # restoring what the program keeps at the region's end
    pool_peak: int = 0  # the pool's own count
    allocator_peak: int = 0  # the allocator's count around the region, plus the bytes from before it
    exact: bool = False  # every gradient of the allocator's pass equal, bit for bit, to the plain step's


def gpt2(quick: bool) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    model = build_gpt2(layers=2 if quick else 4, width=256, seq=128)
    tokens = torch.randint(0, 2048, (8, 128), generator=torch.Generator().manual_seed(0))

    def loss() -> torch.Tensor:
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss

    return model, loss


def resnet50(quick: bool, batch: int | None = None) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """ResNet-50's depth (3, 4, 6, 3 bottlenecks, batch norm) at width 8, 10 classes, 64x64 images,
    ``batch`` of them (16; 8 when ``quick``)."""
    model = ResNet((3, 4, 6, 3), 8, 10)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(batch or (8 if quick else 16), 3, 64, 64, generator=generator)
    labels = torch.randint(0, 10, (len(images),), generator=generator)

    def loss() -> torch.Tensor:
        return nn.functional.cross_entropy(model(images), labels)

    return model, loss


WORKLOADS = {"gpt2": gpt2, "resnet50": resnet50}


def step(model: nn.Module, loss: Callable[[], torch.Tensor], region: Any) -> float:
    """CPU seconds of one step in ``region``."""
    model.zero_grad(set_to_none=True)
    start = time.process_time()
    with region:
        loss().backward()
    return time.process_time() - start


def gradients(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def allocator_peak(model: nn.Module, loss: Callable[[], torch.Tensor], region: Any) -> int:
    """The allocator's peak of one more step in ``region``, plus the bytes from before it."""
    model.zero_grad(set_to_none=True)
    with remat.memory.track(allocator=True) as measured, region:
        loss().backward()
    return measured.peak_bytes + region.stats.outside_bytes


def run(
    name: str, ratios: list[float], policies: list[str], repeats: int, quick: bool, cost: str, reserve: float
) -> list[Row]:
    model, loss = WORKLOADS[name](quick)
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # dropout draws the same masks in the allocator's pass below
    loss().backward()
    reference = gradients(model)  # batch norm's statistics move each step; its gradients do not
    free = remat.dynamic(None, "dtr", keep=model)
    step(model, loss, free)  # warm up: first dispatch imports, allocator; the ops' scratch is learned
    step(model, loss, free)  # the peak with the scratch counted
    peak = free.stats.peak_bytes
    configs: list[tuple[str, float]] = [(p, r) for p in policies for r in ratios]
    times: dict[Any, list[float]] = {"plain": [], "free": [], **{c: [] for c in configs}}
    stats: dict[Any, Any] = {}
    failed: dict[Any, str] = {}
    for _ in range(repeats):  # interleaved: drift of the machine hits every configuration alike
        times["plain"].append(step(model, loss, _Nothing()))
        times["free"].append(step(model, loss, free))
        for policy, ratio in configs:
            if (policy, ratio) in failed:
                continue
            region = remat.dynamic(int(ratio * peak), policy, keep=model, cost=cost, reserve=reserve)
            try:
                times[(policy, ratio)].append(step(model, loss, region))
                stats[(policy, ratio)] = region.stats
            except remat.RematError as error:
                failed[(policy, ratio)] = _rule(str(error))

    allocated: dict[Any, int] = {}
    exact: dict[Any, bool] = {}
    for policy, ratio in configs:
        if (policy, ratio) not in failed:
            region = remat.dynamic(int(ratio * peak), policy, keep=model, cost=cost, reserve=reserve)
            try:
                torch.manual_seed(0)
                allocated[(policy, ratio)] = allocator_peak(model, loss, region)
                grads = gradients(model)
                exact[(policy, ratio)] = len(grads) == len(reference) and all(
                    torch.equal(g, r) for g, r in zip(grads, reference, strict=True)
                )
            except remat.RematError as error:  # measured costs: another draw, other decisions
                failed[(policy, ratio)] = f"{_rule(str(error))} (in the allocator's pass)"

    def ratio_to(key: Any, base: str) -> float:
        """Median over rounds of this round's time over the base's time in the same round."""
        return statistics.median(t / b for t, b in zip(times[key], times[base], strict=True))

    rows = [Row(name, "none", float("nan"), 0, ratio_to("free", "plain"), 1.0, 1.0, 1.0, 0, 0, 0.0, "ok")]
    for policy, ratio in configs:
        if (policy, ratio) in failed:
            rows.append(
                Row(
                    name,
                    policy,
                    ratio,
                    int(ratio * peak),
                    *[float("nan")] * 4,
                    0,
                    0,
                    0.0,
                    failed[(policy, ratio)],
                )
            )
            continue
        s = stats[(policy, ratio)]
        comparison = s.compare()
        rows.append(
            Row(
                name,
                policy,
                ratio,
                s.budget,
                ratio_to((policy, ratio), "plain"),
                ratio_to((policy, ratio), "free"),
                comparison.predicted_overhead,
                s.overhead,
                s.evictions,
                s.recomputations,
                s.fragmentation,
                "ok",
                s.exit_recomputations,
                s.peak_bytes,
                allocated[(policy, ratio)],
                exact[(policy, ratio)],
            )
        )
    return rows


def _rule(error: str) -> str:
    """The rule an error states, without its figures and advice."""
    rule = error.split("; ")[0].split(" (budget")[0]
    return re.sub(r" \(aten\.[\w.]+\)", "", rule).removeprefix("remat.dynamic: ")


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def table(rows: list[Row]) -> str:
    lines = [
        "| workload | policy | budget ratio | budget | pool peak | allocator peak | step time / plain "
        "| / no budget | predicted | measured | evictions | recomputations | at the end | fragmentation "
        "| gradients |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 2.0**20
    for r in rows:
        if r.outcome != "ok":
            lines.append(
                f"| {r.workload} | {r.policy} | {r.ratio:.2f} | {r.budget / mib:.1f} MiB | {r.outcome} "
                "| | | | | | | | | | |"
            )
            continue
        ratio = "none" if r.ratio != r.ratio else f"{r.ratio:.2f}"
        budget = f"{r.budget / mib:.1f} MiB" if r.budget else "none"
        pool = f"{r.pool_peak / mib:.1f} MiB" if r.pool_peak else ""
        real = f"{r.allocator_peak / mib:.1f} MiB ({r.allocator_peak / r.budget:.2f})" if r.budget else ""
        lines.append(
            f"| {r.workload} | {r.policy} | {ratio} | {budget} | {pool} | {real} | {r.step_ratio:.2f} | "
            f"{r.vs_unlimited:.2f} | {r.predicted:.3f} | {r.measured:.3f} | {r.evictions} | "
            f"{r.recomputations} | {r.exit_recomputations} | {r.fragmentation:.1%} | "
            f"{'exact' if r.exact else ('-' if r.ratio != r.ratio else 'DIFFER')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer ratios")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--reserve", type=float, default=0.1, help="of the budget, for what the pool cannot count"
    )
    parser.add_argument(
        "--cost", default="model", choices=["model", "measured"], help="what an op costs for the policies"
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ratios = [0.8, 0.5] if args.quick else [0.9, 0.7, 0.5, 0.4]
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, {args.repeats} repeats, cost={args.cost}, reserve={args.reserve}"
    )
    rows = []
    for name in WORKLOADS:
        rows += run(name, ratios, ["dtr", "dte", "coop"], args.repeats, args.quick, args.cost, args.reserve)
        print(table([r for r in rows if r.workload == name]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
