"""The dynamic runtime's own cost per ATen op, beside a pass-through dispatch mode's.

One training step (forward and backward) of each workload runs three ways, interleaved round by
round in one process: plain, inside a ``TorchDispatchMode`` that only calls each op (the floor any
dispatch mode pays), and inside ``remat.dynamic(budget=None)`` (no eviction: the runtime's
bookkeeping alone). The cost per op is (step CPU time - plain step CPU time) / ATen ops per step,
the median over rounds. One intra-op thread, so that the process's CPU time is the ops' and the
runtime's, not idle workers spinning. Beside the times, a figure free of the machine's load: the
Python and C function calls the runtime makes per ATen op beyond the pass-through mode's (counted
with ``sys.setprofile`` over one step of each).

    .venv/bin/python benchmarks/dynamic/per_op.py [--rounds 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat


class PassThrough(TorchDispatchMode):
    """Calls every op and counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def mlp() -> Callable[[], None]:
    """16 layers of 64-wide Linear + GELU, batch 32."""
    generator = torch.Generator().manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(16):
        layers += [nn.Linear(64, 64), nn.GELU()]
    model = nn.Sequential(*layers)
    x = torch.randn(32, 64, generator=generator)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    return step


def gpt2() -> Callable[[], None]:
    """``remat.zoo.build("gpt2", tiny=True)``: its own tiny batch and sequence."""
    workload = remat.zoo.build("gpt2", tiny=True)
    model, inputs, loss = workload

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss(model(*inputs)).backward()

    return step


WORKLOADS = {"mlp": mlp, "gpt2": gpt2}


def calls(run: Callable[[], None]) -> int:
    """Python and C function calls made by one ``run()``."""
    count = 0

    def counter(frame: Any, event: str, arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(counter)
    try:
        run()
    finally:
        sys.setprofile(None)
    return count


def measure(name: str, rounds: int) -> dict[str, Any]:
    step = WORKLOADS[name]()
    region = remat.dynamic(budget=None)
    counter = PassThrough()

    def plain() -> None:
        step()

    def passing() -> None:
        with counter:
            step()

    def managed() -> None:
        with region:
            step()

    ways = {"plain": plain, "pass-through": passing, "dynamic": managed}
    for run in ways.values():  # warm-up: the runtime learns scratch bytes and meta results
        run()
        run()
    counter.ops = 0
    passing()
    ops = counter.ops
    extra_calls = (calls(managed) - calls(passing)) / ops
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(rounds):
        for way, run in ways.items():
            start = time.thread_time()
            run()
            times[way].append(time.thread_time() - start)
    plain_rounds = times["plain"]
    per_op = {
        way: statistics.median((t - p) / ops * 1e6 for t, p in zip(times[way], plain_rounds, strict=True))
        for way in ("pass-through", "dynamic")
    }
    return {
        "workload": name,
        "ops": ops,
        "plain_ms": statistics.median(plain_rounds) * 1e3,
        "pass_us_per_op": per_op["pass-through"],
        "dynamic_us_per_op": per_op["dynamic"],
        "calls_per_op": extra_calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", default="mlp,gpt2")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(name, args.rounds) for name in args.workloads.split(",")]
    print(
        "| workload | ATen ops per step | plain step | pass-through, per op | remat.dynamic(None), per op "
        "| / pass-through | calls per op beyond pass-through |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['workload']} | {r['ops']} | {r['plain_ms']:.2f} ms | {r['pass_us_per_op']:.1f} µs "
            f"| {r['dynamic_us_per_op']:.1f} µs | {r['dynamic_us_per_op'] / r['pass_us_per_op']:.1f} "
            f"| {r['calls_per_op']:.1f} |"
        )
    if args.json:
        env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
