"""The main demo: a small GPT-2 trained with and without recomputation, measured side by side.

Run with ``make demo`` (or ``python -m remat.demo``). Random weights and synthetic tokens on the
CPU; each strategy trains the same model from the same seed, so losses and gradients must match
the plain run exactly while the memory goes down. Then one step inside ``remat.dynamic`` at
fractions of the plain step's peak, DTR and Coop. Then a pipeline: a chain planned per stage and
run as a 1F1B step on 2 gloo processes (``remat.pipeline.demo``). Pictures end it: the peak of
every run, memory over the step of the plain and dynamic runs, and the pipeline's schedule with
each rank's memory against its budget.

Every figure is one a second run repeats: memory from the CPU allocator
(``remat.memory.track(allocator=True)``), the matrix-multiply FLOPs a step runs (what recomputation
costs, counted, where step times on a shared machine move from run to run; ``benchmarks/manual``
has measured times), and ``remat.dynamic`` deciding on the cost model's estimates
(``cost="model"``), not on op times, so it evicts the same tensors every time.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

import remat
from remat._console import console, progress
from remat.integrations import huggingface
from remat.memory import format_bytes
from remat.viz.peaks import draw_peaks
from remat.viz.steps import StepRun, draw, measure


@dataclass(frozen=True)
class Strategy:
    name: str
    apply: Callable[[nn.Module], nn.Module]


STRATEGIES = (
    Strategy("none", lambda m: m),
    Strategy("checkpoint per block", lambda m: huggingface.enable(m, form="checkpoint")),
    Strategy("scope per block", lambda m: huggingface.enable(m, form="scope")),
    Strategy(
        "checkpoint + SaveComputeIntensive",
        lambda m: huggingface.enable(m, form="checkpoint", policy=remat.SaveComputeIntensive()),
    ),
)
DYNAMIC_RATIOS = (0.7, 0.5)
DYNAMIC_POLICIES = ("dtr", "coop")
THRASH_LIMIT = 3.0


@dataclass(frozen=True)
class Result:
    name: str
    peak_bytes: int  # the CPU allocator's peak over the first step, beyond its start
    flops: int  # matrix-multiply FLOPs of the first step, recomputations included
    losses: tuple[float, ...]
    max_grad_diff: float  # of the first step's gradients from the plain run's


class FlopCount(TorchDispatchMode):
    """Counts the FLOPs of the ops torch's FLOP formulas know (matrix multiplies, convolutions,
    attention) that actually run below it: a saved output a recomputation hands back is not rerun,
    so it is not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **(kwargs or {}), out_val=out)
        return out


def build_gpt2(layers: int, width: int, seq: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()

    config = GPT2Config(
        n_layer=layers, n_embd=width, n_head=max(1, width // 64), vocab_size=2048, n_positions=seq
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).train()


def step(model: nn.Module, tokens: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    return loss.detach()


def run(
    base: nn.Module, tokens: list[torch.Tensor], advance: Callable[[str], None] = lambda name: None
) -> list[Result]:
    """Train a copy of ``base`` per strategy on ``tokens`` (an SGD step each), the first step
    measured by the CPU allocator and the FLOP count."""
    results: list[Result] = []
    plain_grads: list[torch.Tensor] = []
    for strategy in STRATEGIES:
        advance(strategy.name)
        model = strategy.apply(copy.deepcopy(base))
        optim = torch.optim.SGD(model.parameters(), lr=1e-3)
        flops = FlopCount()
        with remat.memory.track(allocator=True) as tracker, flops:
            losses = [step(model, tokens[0], seed=0).item()]
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        plain_grads = plain_grads or grads
        for i, batch in enumerate(tokens[1:], start=1):
            optim.step()
            optim.zero_grad(set_to_none=True)
            losses.append(step(model, batch, seed=i).item())
        diff = max(float((a - b).abs().max()) for a, b in zip(plain_grads, grads, strict=True))
        results.append(Result(strategy.name, tracker.peak_bytes, flops.total, tuple(losses), diff))
    return results


def show(results: list[Result]) -> None:
    from rich.table import Table

    plain = results[0]
    table = Table(title="GPT-2 training step on CPU: recomputation vs none")
    for col in ("strategy", "peak (allocator)", "vs none", "matmul FLOPs vs none", "max |grad diff|"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    table.add_column("losses equal", justify="right")
    for r in results:
        table.add_row(
            r.name,
            format_bytes(r.peak_bytes),
            f"{r.peak_bytes / plain.peak_bytes:.2f}x",
            f"{r.flops / plain.flops:.2f}x",
            f"{r.max_grad_diff:.1e}",
            "yes" if r.losses == plain.losses else "NO",
        )
    console().print(table)


def show_dynamic(runs: list[StepRun]) -> None:
    from rich.table import Table

    table = Table(title="remat.dynamic: one GPT-2 step under a budget (CPU allocator)")
    for col in ("run", "budget", "peak (allocator)", "evictions", "recomputations", "max |grad diff|"):
        table.add_column(col, justify="left" if col == "run" else "right")
    table.add_column("outcome")
    for r in runs:
        marks = (
            ("", "") if r.moments is None else (str(sum(k == kind for _, k in r.moments)) for kind in KINDS)
        )
        table.add_row(
            r.label,
            "" if r.budget is None else format_bytes(r.budget),
            format_bytes(r.tracker.peak_bytes),
            *marks,
            "" if r.grad_diff is None else f"{r.grad_diff:.1e}",
            "stopped" if r.failure else "ok",
        )
    screen = console()
    screen.print(table)
    for r in runs:
        if r.failure:
            screen.print(f"{r.label} stopped: {r.rule}", highlight=False, soft_wrap=True)


KINDS = ("evict", "recompute")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="SGD steps per strategy")
    parser.add_argument("--out", default="out", help="folder for the pictures")
    parser.add_argument(
        "--no-pipeline", action="store_true", help="leave out the pipeline on 2 gloo processes"
    )
    args = parser.parse_args(argv)
    # one intra-op thread: with two, a matmul's sums may split and round differently from run to run
    # (seen once in many runs: 2.4e-07 on one gradient), which the bit-for-bit column would show
    torch.set_num_threads(1)
    print(
        f"GPT-2: {args.layers} layers, width {args.width}, batch {args.batch} x {args.seq} tokens, "
        f"{args.steps} SGD steps per strategy; torch {torch.__version__}, one intra-op thread"
    )
    base = build_gpt2(args.layers, args.width, args.seq)
    tokens = [
        torch.randint(0, 2048, (args.batch, args.seq), generator=torch.Generator().manual_seed(i))
        for i in range(args.steps)
    ]
    peaks_path = os.path.join(args.out, "demo-peaks.png")
    memory_path = os.path.join(args.out, "demo-memory.png")
    with progress() as bar:
        task = bar.add_task("strategies", total=len(STRATEGIES))
        done: list[str] = []

        def advance(label: str) -> None:
            bar.update(task, completed=len(done), description=label)
            done.append(label)

        results = run(base, tokens, advance)
        bar.update(task, completed=len(STRATEGIES), description="strategies")
        show(results)
        task = bar.add_task("remat.dynamic", total=1 + len(DYNAMIC_RATIOS) * len(DYNAMIC_POLICIES))
        done.clear()
        model = copy.deepcopy(base)
        batch = tokens[0]
        runs = measure(
            model,
            (batch,),
            lambda: model(input_ids=batch, labels=batch, use_cache=False).loss,
            DYNAMIC_RATIOS,
            DYNAMIC_POLICIES,
            thrash_limit=THRASH_LIMIT,
            cost="model",
            progress=lambda label: advance(f"remat.dynamic: {label}"),
        )
        bar.update(task, completed=len(runs), description="remat.dynamic")
    print(
        "Budgets are fractions of the plain step's allocator peak, beyond the parameters and inputs "
        f"(which the region also counts); a run stops past {THRASH_LIMIT:.0f}x the step's cost."
    )
    show_dynamic(runs)
    title = f"GPT-2 ({args.layers} layers, width {args.width}, batch {args.batch} x {args.seq})"
    dynamic_runs = [r for r in runs if r.budget is not None]
    draw_peaks(
        {
            **{r.name: r.peak_bytes for r in results},
            **{f"dynamic {r.label}": r.tracker.peak_bytes for r in dynamic_runs},
        },
        peaks_path,
        budgets={f"dynamic {r.label}": r.budget for r in dynamic_runs if r.budget is not None},
        notes={f"dynamic {r.label}": "stopped" for r in dynamic_runs if r.failure},
        title=f"{title}: peak memory per strategy",
    )
    draw(runs, memory_path, title=f"{title}: one step, CPU allocator")
    if not args.no_pipeline:
        from remat.pipeline.demo import demo as pipeline_demo

        # the processes' profiler notes a block allocated before its track started, harmlessly
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

        with console(stderr=True).status("remat.pipeline: a planned 1F1B step on 2 gloo processes"):
            piped = pipeline_demo(args.out)
        print(piped)
    print(f"Peak memory per strategy: {os.path.abspath(peaks_path)}")
    print(f"Memory over one step, plain and remat.dynamic: {os.path.abspath(memory_path)}")
    if not args.no_pipeline:
        print(f"Pipeline schedule and per-rank memory: {os.path.abspath(piped.picture)}")


if __name__ == "__main__":
    main()
