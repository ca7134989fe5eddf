"""What one checkpointed call costs beyond the plain call, on a block whose kernels take microseconds
(where a GPU's would): ``remat.checkpoint`` beside ``torch.utils.checkpoint(use_reentrant=False)``.

Eight blocks of ``Linear(64, 64)`` + ``GELU`` on a batch of 32, forward and backward, each block
one checkpointed call; the three ways interleaved round by round in one process (every other round
in reverse order), one intra-op thread, CPU time (``time.process_time``) per block call, medians
over rounds. The last column is free of the machine's load: the Python and C function calls per
block call (``sys.setprofile`` over one step).

    .venv/bin/python benchmarks/manual/per_call.py [--rounds 30] [--json out.json]
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
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import remat

BLOCKS = 8
Call = Callable[[nn.Module, torch.Tensor], torch.Tensor]
WAYS: dict[str, Call] = {
    "plain": lambda block, x: block(x),
    "torch.utils.checkpoint": lambda block, x: torch_checkpoint.checkpoint(block, x, use_reentrant=False),
    "remat.checkpoint": lambda block, x: remat.checkpoint(block, x),
}


def _step(blocks: nn.ModuleList, x: torch.Tensor, call: Call) -> None:
    h = x
    for block in blocks:
        h = call(block, h)
    h.sum().backward()


def _calls(step: Callable[[], None]) -> int:
    count = 0

    def profile(_frame: Any, event: str, _arg: Any) -> None:
        nonlocal count
        count += event in ("call", "c_call")

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return count


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5, help="steps per round and way")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(BLOCKS))
    x = torch.randn(32, 64, requires_grad=True)
    steps = {name: (lambda call=call: _step(blocks, x, call)) for name, call in WAYS.items()}
    for step in steps.values():  # warm-up
        step()
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in list(steps) if r % 2 == 0 else reversed(list(steps)):
            start = time.process_time()
            for _ in range(args.repeats):
                steps[name]()
            times[name].append((time.process_time() - start) / args.repeats / BLOCKS * 1e6)
    calls = {name: _calls(step) / BLOCKS for name, step in steps.items()}
    plain = statistics.median(times["plain"])
    rows = []
    print("| way | per block call, µs | beyond the plain call, µs | calls per block call |")
    print("|---|---:|---:|---:|")
    for name, spans in times.items():
        median = statistics.median(spans)
        rows.append({"way": name, "us": median, "beyond_us": median - plain, "calls": calls[name]})
        print(f"| {name} | {median:.0f} | {median - plain:.0f} | {calls[name]:.0f} |")
    if args.json:
        env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine()}
        with open(args.json, "w") as f:
            json.dump({"environment": env, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
