"""The main demo: a small GPT-2 trained with and without recomputation, measured side by side.

Run with ``make demo`` (or ``python -m remat.demo``). Random weights and synthetic tokens on the
CPU; each strategy trains the same model from the same seed, so losses and gradients must match
the plain run exactly while the activation memory goes down. Last, one step's memory over time,
plain and under ``remat.dynamic``, is drawn from the CPU allocator's events to a PNG.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import remat
from remat.integrations import huggingface
from remat.memory import format_bytes
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


@dataclass(frozen=True)
class Result:
    name: str
    peak_bytes: int
    step_seconds: float
    losses: tuple[float, ...]
    max_grad_diff: float


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


def run(layers: int = 6, width: int = 256, seq: int = 256, batch: int = 8, steps: int = 5) -> list[Result]:
    base = build_gpt2(layers, width, seq)
    models = {s.name: s.apply(copy.deepcopy(base)) for s in STRATEGIES}
    optims = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    tokens = [
        torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(i)) for i in range(steps)
    ]

    peaks, grads = {}, {}
    for name, model in models.items():  # untimed: counted peak and first-step gradients
        with remat.memory.track(timeline=False) as m:
            step(model, tokens[0], seed=0)
        peaks[name] = m.peak_bytes
        grads[name] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {name: [] for name in models}
    losses: dict[str, list[float]] = {name: [] for name in models}
    for i in range(steps):  # interleaved, so drift of the machine hits every strategy alike
        for name, model in models.items():
            start = time.perf_counter()
            loss = step(model, tokens[i], seed=i)
            optims[name].step()
            optims[name].zero_grad(set_to_none=True)
            times[name].append(time.perf_counter() - start)
            losses[name].append(loss.item())

    plain = grads["none"]
    return [
        Result(
            name=name,
            peak_bytes=peaks[name],
            step_seconds=statistics.median(times[name]),
            losses=tuple(losses[name]),
            max_grad_diff=max((a - b).abs().max().item() for a, b in zip(plain, grads[name], strict=True)),
        )
        for name in models
    ]


def show(results: list[Result]) -> None:
    from rich.console import Console
    from rich.table import Table

    plain = results[0]
    table = Table(title="GPT-2 training step on CPU: recomputation vs none")
    for col in (
        "strategy",
        "peak activation memory",
        "vs none",
        "step time (median)",
        "overhead",
        "max |grad diff|",
        "losses equal",
    ):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in results:
        table.add_row(
            r.name,
            format_bytes(r.peak_bytes),
            f"{r.peak_bytes / plain.peak_bytes:.2f}x",
            f"{r.step_seconds * 1000:.0f} ms",
            f"{r.step_seconds / plain.step_seconds:.2f}x",
            f"{r.max_grad_diff:.1e}",
            "yes" if r.losses == plain.losses else "NO",
        )
    Console(width=130).print(table)


# -- dynamic rematerialization (remat.dynamic) ---------------------------------------------------


@dataclass(frozen=True)
class DynamicResult:
    policy: str
    ratio: float  # budget / unconstrained peak
    budget: int
    peak_bytes: int  # the runtime's count (constants included), the largest over the steps
    step_seconds: float
    evictions: int
    recomputations: int
    max_grad_diff: float
    losses_equal: bool
    failure: str = ""


DYNAMIC_RATIOS = (1.0, 0.5, 0.3)


def run_dynamic(
    layers: int = 8, width: int = 128, seq: int = 128, batch: int = 4, steps: int = 2
) -> tuple[int, list[DynamicResult]]:
    """Train the GPT-2 demo with forward and backward inside ``remat.dynamic`` at fractions of its
    unconstrained peak, with DTR and Coop, against the plain run."""
    base = build_gpt2(layers, width, seq)
    tokens = [
        torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(i)) for i in range(steps)
    ]

    def train(
        region: Callable[[nn.Module], object] | None,
    ) -> tuple[nn.Module, list[float], float, list[object]]:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        losses, times, regions = [], [], []
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            ctx = region(model) if region is not None else None
            start = time.perf_counter()
            with ctx if ctx is not None else contextlib.nullcontext():  # type: ignore[attr-defined]
                loss = step(model, tokens[i], seed=i)
            opt.step()
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
            regions.append(ctx)
        return model, losses, statistics.median(times), regions

    train(None)  # warm-up: the first steps of a process are slower
    plain, plain_losses, plain_seconds, _ = train(None)
    _, _, _, probes = train(lambda m: remat.dynamic(None, "dtr", keep=m))
    peak = max(r.stats.peak_bytes for r in probes)  # type: ignore[attr-defined]
    results = []
    for policy in ("dtr", "coop"):
        for ratio in DYNAMIC_RATIOS:
            budget = int(ratio * peak)
            try:
                model, losses, seconds, regions = train(
                    lambda m, b=budget, p=policy: remat.dynamic(b, p, keep=m, thrash_limit=10.0)  # type: ignore[misc]
                )
            except remat.RematError as error:
                results.append(DynamicResult(policy, ratio, budget, 0, 0.0, 0, 0, 0.0, False, str(error)))
                continue
            stats = [r.stats for r in regions]  # type: ignore[attr-defined]
            diff = max(
                (a.grad - b.grad).abs().max().item()  # type: ignore[operator]
                for a, b in zip(plain.parameters(), model.parameters(), strict=True)
            )
            results.append(
                DynamicResult(
                    policy,
                    ratio,
                    budget,
                    max(s.peak_bytes for s in stats),
                    seconds / plain_seconds,
                    sum(s.evictions for s in stats),
                    sum(s.recomputations for s in stats),
                    diff,
                    losses == plain_losses,
                )
            )
    return peak, results


def show_dynamic(peak: int, results: list[DynamicResult]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"remat.dynamic: GPT-2 under a byte budget (unconstrained peak {format_bytes(peak)})")
    for col in (
        "policy",
        "budget",
        "peak (counted)",
        "step time vs plain",
        "evictions",
        "recomputations",
        "max |grad diff|",
        "losses equal",
    ):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in results:
        budget = f"{r.ratio:.0%} = {format_bytes(r.budget)}"
        if r.failure:
            table.add_row(
                r.policy,
                budget,
                "stopped: " + r.failure.split("(")[0].removeprefix("remat.dynamic: "),
                "",
                "",
                "",
                "",
                "",
            )
            continue
        table.add_row(
            r.policy,
            budget,
            format_bytes(r.peak_bytes),
            f"{r.step_seconds:.2f}x",
            str(r.evictions),
            str(r.recomputations),
            f"{r.max_grad_diff:.1e}",
            "yes" if r.losses_equal else "NO",
        )
    Console(width=130).print(table)
    print(
        "Peak (counted): the region's own count of live bytes (parameters included), a prediction; the "
        "allocator's figures for the same model follow below. Step time "
        "includes the runtime's Python work per op, large next to this small model's ops; at 100% the "
        "address pool can still evict (its free memory is in pieces). See benchmarks/dynamic."
    )


# -- memory over one step (remat.memory.plot) ----------------------------------------------------

PICTURE_RATIO = 0.5


def draw_memory(
    path: str, layers: int = 8, width: int = 128, seq: int = 128, batch: int = 4
) -> list[StepRun]:
    """One training step of the dynamic demo's GPT-2, plain and inside ``remat.dynamic`` with DTR
    and Coop at ``PICTURE_RATIO`` of the plain step's allocator peak, drawn to ``path``."""
    model = build_gpt2(layers, width, seq)
    tokens = torch.randint(0, 2048, (batch, seq), generator=torch.Generator().manual_seed(0))
    runs = measure(
        model,
        (tokens,),
        lambda: model(input_ids=tokens, labels=tokens, use_cache=False).loss,
        (PICTURE_RATIO,),
        ("dtr", "coop"),
    )
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    draw(runs, path, title=f"GPT-2 ({layers} layers, width {width}): one training step, CPU allocator")
    return runs


def show_memory(runs: list[StepRun], path: str) -> None:
    for r in runs:
        budget = "" if r.budget is None else f", budget {format_bytes(r.budget)}"
        outcome = f", stopped: {r.rule}" if r.failure else ""
        print(f"  {r.label}: allocator peak {format_bytes(r.tracker.peak_bytes)}{budget}{outcome}")
    print(f"Memory over one step: {os.path.abspath(path)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--picture", default="out/demo-memory.png", help="where to draw memory over a step")
    args = parser.parse_args(argv)
    print(
        f"GPT-2: {args.layers} layers, width {args.width}, batch {args.batch} x {args.seq} tokens, "
        f"{args.steps} SGD steps per strategy; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    show(run(args.layers, args.width, args.seq, args.batch, args.steps))
    print(
        "\nremat.dynamic: GPT-2 with 8 layers, width 128, batch 4 x 128 tokens, 2 SGD steps, forward and "
        "backward inside the region; budgets are fractions of the same step's peak with no budget "
        "(parameters included); gradients compared with the plain run's"
    )
    show_dynamic(*run_dynamic())
    print(
        f"\nOne step of the same GPT-2 measured by the CPU allocator (remat.memory.track(allocator=True)), "
        f"plain and inside remat.dynamic at {PICTURE_RATIO:.0%} of the plain step's peak (beyond the "
        "parameters and inputs, which the region also counts):"
    )
    path = args.picture
    show_memory(draw_memory(path), path)


if __name__ == "__main__":
    main()
