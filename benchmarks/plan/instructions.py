"""The overhead of per-layer checkpointing and of ``remat.plan`` at checkpointing's peak, counted in
CPU instructions: per transformer family of ``floor.py`` (at a smaller size, ``FAMILIES``), one
training step of each strategy run under
valgrind's callgrind, which counts the instructions the process executes (kernels, Python, torch's
dispatcher and autograd, remat's executor and torch's checkpoint hooks alike). Unlike a step's
time on a shared machine, the count does not move with the load (another process on the other
core changes nothing in it); what can move it is the process's own state: Python's garbage
collector and hash seeds (``PYTHONHASHSEED=0`` here).

For each family a first process (not under valgrind) builds the model from a fixed seed, measures
per-layer checkpointing's peak with the allocator, captures the step, plans at that peak (the
tape's plan, and with ``rerun_modules=True``) and saves the plans; then a process under
``valgrind --tool=callgrind`` builds the same model from the same seed, loads the plans, and for
each strategy runs one step as a warm-up (lazy initialization stays out of the count) and one
counted step, between ``torch._C._valgrind_toggle`` and ``_valgrind_toggle_and_dump_stats``.
Overhead = instructions of the strategy's step ÷ the plain step's. One intra-op thread.

    .venv/bin/python benchmarks/plan/instructions.py --out benchmarks/plan/instructions.json
    .venv/bin/python benchmarks/plan/instructions.py --table benchmarks/plan/instructions.json

Needs ``valgrind`` on the PATH; under callgrind a step runs some hundreds of times slower, and the
interpreter's start and imports take minutes: about 45 minutes per family on one core.
ResNet-50 and U-Net are left out: there the plans recompute no convolution (``flops.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import floor  # noqa: E402
from floor import Step, at_checkpointing, environment, peak, stepper  # noqa: E402

from remat.planner import Plan, plan_trace  # noqa: E402

STRATEGIES = (
    "plain",
    "checkpoint per layer",
    "remat.plan",
    "remat.plan, modules run again",
    # NOTE [bare forward] in remat.planner.module_calls: the same plans with every forward checked
    "remat.plan, every forward checked",
    "remat.plan, modules run again, every forward checked",
)
# floor.py's transformers at a size callgrind runs in minutes (a step there is hundreds of times slower):
# 4 layers of width 256, batch 2 x 128 tokens (ViT: 4 images of 64 x 64 in patches of 8)
FAMILIES: dict[str, Callable[[], Step]] = {
    "llama": lambda: floor.llama(layers=4, batch=2, seq=128),
    "vit": lambda: floor.vit(layers=4, batch=4, image=64),
    "gpt2": lambda: floor.gpt2(layers=4, batch=2, seq=128),
    "bert": lambda: floor.bert(layers=4, batch=2, seq=128),
}


def prepare(name: str, work: Path, capture_repeats: int) -> dict[str, Any]:
    """Plan the family at checkpointing's measured peak and save the plans under ``work``; the
    allocator's peak of every strategy."""
    model, step, _, ck_peak, trace, key = at_checkpointing(FAMILIES[name], capture_repeats)
    peaks = {"plain": peak(step(contextlib.nullcontext)), "checkpoint per layer": ck_peak}
    predicted = {}
    for label, again in (("remat.plan", False), ("remat.plan, modules run again", True)):
        plan = plan_trace(trace, ck_peak, block_key=key, rerun_modules=again)
        plan.save(work / f"{name}-{again}.json")
        peaks[label] = peak(step(lambda plan=plan: plan.apply(model)))  # type: ignore[misc]
        predicted[label] = {"peak": plan.predicted_peak_bytes, "overhead": plan.predicted_overhead}
    return {"family": name, "budget": ck_peak, "peaks": peaks, "predicted": predicted}


def child(name: str, work: Path) -> None:
    """Under callgrind: one warm-up and one counted step of each strategy, in ``STRATEGIES`` order
        (each counted step is a dump of its own). A plan's warm-up is its first forward, checked op by op;
    its counted step runs bare where the plan's regions allow (NOTE [bare forward])."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, loss_of, checkpointed = FAMILIES[name]()
    model.train()
    step = stepper(model, loss_of)
    plans = [Plan.load(work / f"{name}-{again}.json") for again in (False, True)]
    runs = [step(contextlib.nullcontext), step(checkpointed)]
    runs += [step(lambda plan=plan: plan.apply(model)) for plan in plans]  # type: ignore[misc]
    runs += [step(lambda plan=plan: plan.apply(model, check="every")) for plan in plans]  # type: ignore[misc]
    for run in runs:
        run()
        torch._C._valgrind_toggle()
        run()
        torch._C._valgrind_toggle_and_dump_stats()


def count(name: str, work: Path) -> dict[str, int]:
    """The instructions of each strategy's counted step, from a callgrind run of :func:`child`."""
    out = work / f"{name}.callgrind"
    command = [
        "valgrind",
        "--tool=callgrind",
        "--collect-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        __file__,
        "--child",
        name,
        "--work",
        str(work),
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    counts = []
    for part in range(1, len(STRATEGIES) + 1):
        lines = Path(f"{out}.{part}").read_text().splitlines()
        counts.append(int(next(line for line in lines if line.startswith("totals:")).split()[1]))
    return dict(zip(STRATEGIES, counts, strict=True))


def table(results: dict[str, Any]) -> str:
    """The README's table, from an ``--out`` file."""
    mib = 2**20
    lines = [
        "| family | plain step, instructions | checkpoint per layer: peak, overhead "
        "| remat.plan at that peak: peak, overhead (predicted) | ÷ checkpointing "
        "| modules run again: peak, overhead (predicted) | ÷ checkpointing "
        "| every forward checked: remat.plan, modules run again |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in results["families"]:
        n, p, pred = f["instructions"], f["peaks"], f["predicted"]
        plain, ck = n["plain"], n["checkpoint per layer"]
        ck_peak = p["checkpoint per layer"]
        cells = [f["family"], f"{plain / 1e9:.2f} G", f"{ck_peak / mib:.1f} MiB, {ck / plain:.3f}"]
        for label in ("remat.plan", "remat.plan, modules run again"):
            cells.append(f"{p[label] / mib:.1f} MiB, {n[label] / plain:.3f} ({pred[label]['overhead']:.3f})")
            cells.append(f"{n[label] / ck:.3f}")
        checked = [
            n.get(f"{label}, every forward checked")
            for label in ("remat.plan", "remat.plan, modules run again")
        ]
        cells += [f"{c / plain:.3f}" if c else "-" for c in checked]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", nargs="*", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--capture-repeats", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--table", help="print the README's table from this --out file and stop")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    if args.child:
        child(args.child, Path(args.work))
        return
    if shutil.which("valgrind") is None:
        sys.exit("instructions.py: valgrind is not on the PATH; install it (Debian: apt install valgrind)")
    torch.set_num_threads(1)
    results: dict[str, Any] = {"environment": environment(), "families": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            result = prepare(name, Path(tmp), args.capture_repeats)
            result["instructions"] = count(name, Path(tmp))
            results["families"].append(result)
            n = result["instructions"]
            print(name, {k: f"{v / n['plain']:.3f}" for k, v in n.items()}, flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
