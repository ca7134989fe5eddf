"""A short CUDA run of every form of remat on one GPT-2 model: step time and the allocator's peak.

Each strategy trains the same model (random weights, from a ``transformers`` config) for a few
steps on one CUDA device; the peak is ``torch.cuda.max_memory_allocated`` over a step beyond what
the model and optimizer held before it, the time the median step with the device synchronized.
Gradients of the first step are compared with the plain model's, so a form that computes
differently on CUDA fails here rather than in a user's run.

    python benchmarks/cuda/run.py [--layers 6 --width 512 --seq 512 --batch 8 --steps 5 --device cuda]

Run by ``make check-cuda``, after the CUDA-marked tests.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.demo import build_gpt2, step
from remat.integrations import huggingface
from remat.memory import format_bytes

Region = Callable[[nn.Module, torch.Tensor], AbstractContextManager[object]]


def _plain(model: nn.Module, tokens: torch.Tensor) -> AbstractContextManager[object]:
    return nullcontext()


def _loss(m: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return m(input_ids=tokens, labels=tokens, use_cache=False).loss


Prepare = Callable[[nn.Module, torch.Tensor], tuple[nn.Module, Region]]


def _planned(ratio: float) -> Prepare:
    def prepare(model: nn.Module, tokens: torch.Tensor) -> tuple[nn.Module, Region]:
        plan = remat.plan(model, (tokens,), ratio, loss_fn=_loss)
        return model, lambda m, t: plan.apply(m)

    return prepare


class PassThrough(TorchDispatchMode):
    """Calls every op and counts them: the floor any dispatch mode pays per op."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _unlimited(model: nn.Module, tokens: torch.Tensor) -> tuple[nn.Module, Region]:
    return model, lambda m, t: remat.dynamic(None, keep=(m,), device=t.device)


def _dynamic(ratio: float, policy: str) -> Prepare:
    def prepare(model: nn.Module, tokens: torch.Tensor) -> tuple[nn.Module, Region]:
        with peak_of(tokens.device) as peak:  # the plain step's peak above what the model holds
            step(model, tokens, seed=0)
        model.zero_grad(set_to_none=True)
        budget = held(model) + int(ratio * peak[0])
        return model, lambda m, t: remat.dynamic(budget, policy, keep=(m,), device=t.device)

    return prepare


def held(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (what the region reads from outside it)."""
    return sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers()))


@contextmanager
def peak_of(device: torch.device) -> Iterator[list[int]]:
    """The allocator's peak over the block beyond what was allocated before it, appended to the
    list yielded: ``torch.cuda.max_memory_allocated`` on CUDA, the profiler's allocation events
    on CPU (``remat.memory.track(allocator=True)``)."""
    found: list[int] = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        yield found
        torch.cuda.synchronize()
        found.append(torch.cuda.max_memory_allocated() - before)
    else:
        with remat.memory.track(allocator=True) as m:
            yield found
        found.append(m.peak_bytes)


STRATEGIES: dict[str, Prepare] = {
    "plain": lambda m, t: (m, _plain),
    "remat.checkpoint per block": lambda m, t: (huggingface.enable(m, form="checkpoint"), _plain),
    "remat.scope per block": lambda m, t: (huggingface.enable(m, form="scope"), _plain),
    "remat.plan at 0.7": _planned(0.7),
    "pass-through dispatch mode": lambda m, t: (m, lambda m, t: PassThrough()),
    "remat.dynamic, no budget": _unlimited,
    **{
        f"remat.dynamic {policy} at {ratio}": _dynamic(ratio, policy)
        for ratio in (0.8, 0.5)
        for policy in ("dtr", "dte", "coop")
    },
    "save_on_cpu (pinned)": lambda m, t: (
        m,
        lambda m, t: torch.autograd.graph.save_on_cpu(pin_memory=t.is_cuda),
    ),
    "remat.offload, everything": lambda m, t: (m, lambda m, t: remat.offload()),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cpu runs the same code, for a quick check of it")
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/cuda: needs a CUDA device (torch.cuda.is_available() is False)")
    base = build_gpt2(args.layers, args.width, args.seq).to(device)
    tokens = [
        torch.randint(0, 2048, (args.batch, args.seq), generator=torch.Generator().manual_seed(i)).to(device)
        for i in range(args.steps)
    ]
    title = f"GPT-2 {args.layers}x{args.width}, batch {args.batch}x{args.seq}"
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    table = Table(title=f"{title}, {where}")
    columns = (
        "strategy",
        "peak above model",
        "÷ plain",
        "step ms",
        "÷ plain",
        "µs/op over plain",
        "max |grad diff|",
    )
    for column in columns:
        table.add_column(column)
    counter = PassThrough()
    with counter:
        step(copy.deepcopy(base), tokens[0], seed=0)
    rows: list[dict[str, object]] = []
    plain_peak = plain_time = 0.0
    plain_grads: list[torch.Tensor] = []
    for name, prepare in STRATEGIES.items():
        model, region = prepare(copy.deepcopy(base), tokens[0])
        peaks, times, grads = [], [], []
        try:
            for i, batch in enumerate(tokens):
                model.zero_grad(set_to_none=True)
                with peak_of(device) as peak:
                    start = time.perf_counter()
                    with region(model, batch):
                        step(model, batch, seed=i)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                peaks.append(peak[0])
                if i == 0:
                    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        except remat.RematError as error:  # a budget the policy cannot hold: the row says so
            rule = str(error).split(" (")[0]
            table.add_row(name, "stops", "", "", "", "", rule)
            rows.append({"strategy": name, "stops": str(error)})
            continue
        peak, seconds = max(peaks[1:] or peaks), statistics.median(times[1:] or times)
        if name == "plain":
            plain_peak, plain_time, plain_grads = peak, seconds, grads
        diff = max((a - b).abs().max().item() for a, b in zip(plain_grads, grads, strict=True))
        table.add_row(
            name,
            format_bytes(int(peak)),
            f"{peak / plain_peak:.2f}",
            f"{seconds * 1e3:.1f}",
            f"{seconds / plain_time:.2f}",
            f"{(seconds - plain_time) / counter.ops * 1e6:.1f}",
            f"{diff:.1e}",
        )
        rows.append(
            {"strategy": name, "peak": peak, "step_s": seconds, "ops": counter.ops, "max_grad_diff": diff}
        )
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    Console(width=140).print(table)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {device}; peaks from the allocator")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "device": where, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
