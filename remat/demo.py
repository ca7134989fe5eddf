"""The main demo: a small GPT-2 trained with and without recomputation, measured side by side.

Run with ``make demo`` (or ``python -m remat.demo``). Random weights and synthetic tokens on the
CPU; each strategy trains the same model from the same seed, so losses and gradients must match
the plain run exactly while the activation memory goes down.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import remat
from remat.integrations import huggingface
from remat.memory import format_bytes


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    print(
        f"GPT-2: {args.layers} layers, width {args.width}, batch {args.batch} x {args.seq} tokens, "
        f"{args.steps} SGD steps per strategy; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    show(run(args.layers, args.width, args.seq, args.batch, args.steps))


if __name__ == "__main__":
    main()
