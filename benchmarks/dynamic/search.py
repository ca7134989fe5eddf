"""Victim search time against the number of evictable storages, on the core the runtime drives.

A :class:`remat.core.Runtime` over an address pool is filled, through its own ``call``, with a
chain of ``n`` resident, evictable storages (random sizes of 1-16 units, random costs, a few pinned
constants between them), the pool full. Then, for each policy:

- **one search**: the CPU time of one ``policy.choose`` for a request of 32 units (about four average
  storages), on that state (the median of ``--repeats`` calls; a search changes nothing);
- **per allocation**: the CPU time of the searches of one allocation that must
  evict, made by ``Runtime.call`` of an op whose output needs the 32 units (a greedy policy is asked
  once per victim, Coop once per allocation); the median over ``--allocations`` allocations in a
  row, on the same state.

    .venv/bin/python benchmarks/dynamic/search.py [--sizes 1000,10000,100000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from typing import Any

import torch

from remat.core import AddressPool, End, Runtime
from remat.core.graph import Record
from remat.core.policies import get
from remat.core.policies.base import EvictionPolicy
from remat.core.residency import Residency
from remat.trace.types import Op, TensorInfo

UNIT = 4096  # bytes of one size unit
REQUEST = 32  # units an evicting allocation asks for


class Timed:
    """``policy`` with the CPU time of its searches added up (host time would count the other
    processes of a shared machine)."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.name, self.needs, self.inplace = policy.name, policy.needs, policy.inplace
        self.seconds = 0.0

    def end(self, op: Op) -> End:
        return self.policy.end(op)

    def choose(self, runtime: Residency, nbytes: int) -> list[int]:
        start = time.thread_time()
        victims = self.policy.choose(runtime, nbytes)
        self.seconds += time.thread_time() - start
        return victims


class Accounts:
    """A backend that runs nothing: the core's decisions alone, as in the simulator."""

    def materialize(self, record: Record, recompute: bool) -> float:
        return record.op.cost

    def free(self, storage: int) -> None:
        """Nothing to give back."""


def fill(policy: Timed, n: int, seed: int) -> tuple[Runtime, int]:
    """A runtime whose pool holds ``n`` evictable storages and every 50th a constant, and is full;
    returns it and the next free handle."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 16) * UNIT for _ in range(n)]
    constants = [rng.randint(1, 16) * UNIT for _ in range(n // 50 + 1)]
    runtime = Runtime(AddressPool(sum(sizes) + sum(constants)), policy, Accounts())
    handle = 0
    runtime.constant(handle, constants[0])
    previous = handle
    handle += 1
    for i, nbytes in enumerate(sizes):
        if i % 50 == 49:
            runtime.constant(handle, constants[i // 50 + 1])
            handle += 1
        name = "aten.mm.default" if i % 2 else "aten.relu.default"
        op = Op(i, name, (previous,), (handle,), cost=rng.uniform(1e-4, 1e-2))
        runtime.call(op, [TensorInfo(handle, nbytes)])
        previous = handle
        handle += 1
    return runtime, handle


def measure(name: str, n: int, repeats: int, allocations: int, seed: int) -> dict[str, Any]:
    policy = Timed(get(name))
    runtime, handle = fill(policy, n, seed)
    evictable = int(runtime.evictable.array[: len(runtime.graph)].sum())
    searches = []
    for _ in range(repeats):
        before = policy.seconds
        policy.choose(runtime, REQUEST * UNIT)
        searches.append(policy.seconds - before)
    per_allocation, victims = [], []
    telemetry = runtime.telemetry
    for k in range(allocations):
        before, evictions = policy.seconds, telemetry.evictions
        op = Op(n + k, "aten.relu.default", (handle - 1,), (handle,), cost=1e-3)
        runtime.call(op, [TensorInfo(handle, REQUEST * UNIT)])
        per_allocation.append(policy.seconds - before)
        victims.append(telemetry.evictions - evictions)
        handle += 1
    return {
        "policy": name,
        "n": n,
        "evictable": evictable,
        "search_ms": statistics.median(searches) * 1e3,
        "allocation_ms": statistics.median(per_allocation) * 1e3,
        "victims": statistics.median(victims),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--policies", default="dtr,dte,coop")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--allocations", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    print("| evictable storages | policy | one search | per allocation | victims per allocation |")
    print("|---:|---|---:|---:|---:|")
    for n in (int(x) for x in args.sizes.split(",")):
        for name in args.policies.split(","):
            row = measure(name, n, args.repeats, args.allocations, args.seed)
            rows.append(row)
            print(
                f"| {row['evictable']:,} | {name} | {row['search_ms']:.3f} ms "
                f"| {row['allocation_ms']:.3f} ms | {row['victims']:g} |",
                flush=True,
            )
    if args.json:
        env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
