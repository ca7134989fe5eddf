"""The work recomputation adds, measured where time cannot tell: per model family of ``floor.py``,
the matrix products' floating-point operations one step runs beyond the plain step's, as torch's
profiler counts them (``remat._flops.counted_flops``), under per-layer checkpointing and under
``remat.plan`` at the peak checkpointing measured (the tape's plan, and with ``rerun_modules``).

Unlike a step's time, these counts do not move with the machine's load: what they do not show is
the host's own cost per op (remat's executor, torch's checkpoint hooks), nor the elementwise ops
the profiler does not count.

    .venv/bin/python benchmarks/plan/flops.py
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from floor import DEFAULT, FAMILIES, at_checkpointing, peak  # noqa: E402

from remat._flops import counted_flops  # noqa: E402
from remat.planner import plan_trace  # noqa: E402


def row(name: str, capture_repeats: int) -> str:
    """The family's table row: peak and added GFLOP of each strategy."""
    model, step, checkpointed, ck_peak, trace, key = at_checkpointing(FAMILIES[name], capture_repeats)
    plans = [plan_trace(trace, ck_peak, block_key=key, rerun_modules=again) for again in (False, True)]
    plain = counted_flops(step(contextlib.nullcontext))
    cells = [f"{ck_peak / 2**20:.1f} MiB, {(counted_flops(step(checkpointed)) - plain) / 1e9:.2f}"]
    for plan in plans:
        run = step(lambda plan=plan: plan.apply(model))  # type: ignore[misc]
        added = counted_flops(run) - plain
        cells.append(f"{peak(run) / 2**20:.1f} MiB, {added / 1e9:.2f}")
    return f"| {name} | {plain / 1e9:.2f} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", nargs="*", default=DEFAULT, choices=list(FAMILIES))
    parser.add_argument("--capture-repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        "| family | plain step, GFLOP | checkpoint per layer: peak, GFLOP added "
        "| remat.plan at its peak: peak, GFLOP added | with rerun_modules: peak, GFLOP added |"
    )
    print("|---|---|---|---|---|")
    for name in args.families:
        print(row(name, args.capture_repeats), flush=True)


if __name__ == "__main__":
    main()
