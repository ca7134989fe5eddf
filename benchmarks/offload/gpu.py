"""Offload on a GPU: measured step time and peak of three-way plans, against their prediction and
against ``torch.autograd.graph.save_on_cpu`` and offloading everything.

For each model (``remat.zoo``, random weights, on one CUDA device): the link is measured
(``remat.Link.measure()``), one step is traced with op times measured on the device, and at a
budget ``min + f * (plain - min)`` (``min`` the smallest peak recomputation alone reaches) the
recompute-only plan is picked, then the three-way plan over the measured link at that plan's
predicted peak (equal device peak), as ``benchmarks/offload/run.py`` picks them. Each strategy
then trains a copy of the model for ``--steps`` steps:

  plain         no remat
  recompute     the recompute-only plan (``plan.apply``)
  three-way     the plan that may offload too (pinned host buffers, a side stream, prefetch)
  save_on_cpu   ``torch.autograd.graph.save_on_cpu(pin_memory=True)``: every saved tensor to host
  offload all   ``remat.offload()``: every saved tensor made in the step to host, with prefetch
                (what torchtune's ``OffloadActivations`` does)

Step time is the median wall time of the steps after the first, the device synchronized; the peak
is ``torch.cuda.max_memory_allocated`` over a step beyond what was allocated before it; gradients
and buffers of the first step (run with ``torch.use_deterministic_algorithms``, so that two plain
runs agree: embedding's backward sums with atomics otherwise) are compared bitwise with the plain
model's. Predicted step time is
the plan's ``predicted_overhead`` times the traced step's summed op times (each op timed alone,
the device synchronized around it).

    python benchmarks/offload/gpu.py [--models gpt2:batch=8,seq=512 resnet50:batch=32,image=224]
        [--fractions 0.5 0.0] [--steps 6] [--json out.json]
    python benchmarks/offload/gpu.py --device cpu --models gpt2:batch=1,seq=32 --steps 2  # check
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import remat
from remat.memory import format_bytes
from remat.planner import trace_step
from remat.planner.api import block_key, plan_at
from remat.planner.frontier import frontier
from remat.planner.offload_search import offload_frontier

Region = Callable[[nn.Module], AbstractContextManager[Any]]


@contextmanager
def peak_of(device: torch.device) -> Iterator[list[int]]:
    """The allocator's peak over the block beyond what was allocated before it, appended to the
    list yielded (``torch.cuda.max_memory_allocated``; on CPU the profiler's allocation events)."""
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


def train(
    base: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    loss_fn: Callable[[Any], torch.Tensor],
    region: Region,
    steps: int,
    device: torch.device,
) -> dict[str, Any]:
    """``steps`` forward and backward passes of a copy of ``base`` under ``region``: the median
    wall time after the first, the largest peak, and the first step's gradients and buffers."""
    model = copy.deepcopy(base)
    times, peaks = [], []
    first: dict[str, torch.Tensor] = {}
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(i)
        # the first step, compared bit for bit, on deterministic kernels; the others timed as users run
        torch.use_deterministic_algorithms(i == 0)
        with peak_of(device) as peak:
            start = time.perf_counter()
            with region(model):
                loss = loss_fn(model(*inputs))
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peaks.append(peak[0])
        if i == 0:
            first = {
                f"grad {n}": p.grad.detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
            first.update({f"buffer {n}": b.detach().clone() for n, b in model.named_buffers()})
        del loss
    torch.use_deterministic_algorithms(False)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # the first two steps warm the allocators (device and pinned host) up
    return {"step_s": statistics.median(times[2:] or times), "peak": max(peaks[1:] or peaks), "first": first}


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> int:
    """How many of the gradients and buffers are not bitwise equal."""
    if a.keys() != b.keys():
        return len(a.keys() ^ b.keys())
    return sum(not torch.equal(a[k], b[k]) for k in a)


def run_model(spec: str, fractions: list[float], steps: int, device: torch.device) -> list[dict[str, Any]]:
    name, _, rest = spec.partition(":")
    sizes = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", rest)}
    wl = remat.zoo.build(name, device=device, **sizes)
    link = remat.Link.measure(device) if device.type == "cuda" else remat.Link(d2h="25GB/s", h2d="25GB/s")
    print(f"{spec}: link {link}", flush=True)

    def loss_of(model: Any, *inputs: Any) -> Any:
        return wl.loss_fn(model(*inputs))

    clock = time.perf_counter()
    trace = trace_step(wl.model, wl.inputs, loss_of, repeats=3)
    alone = frontier(trace, "auto", block_key(wl.model))
    both = offload_frontier(alone, link)
    print(f"  traced and planned in {time.perf_counter() - clock:.0f} s: {trace}", flush=True)
    traced_s = sum(op.cost for op in trace.ops)
    low = min(c.pred.peak_bytes for c in alone.candidates)
    plain_run = train(wl.model, wl.inputs, wl.loss_fn, lambda m: nullcontext(), steps, device)
    rows: list[dict[str, Any]] = []

    def row(fraction: float | None, strategy: str, result: dict[str, Any], plan: Any = None) -> None:
        entry = {
            "model": spec,
            "fraction": fraction,
            "strategy": strategy,
            "link": str(link),
            "step_ms": 1e3 * result["step_s"],
            "overhead": result["step_s"] / plain_run["step_s"],
            "peak": result["peak"],
            "peak_ratio": result["peak"] / plain_run["peak"],
            "differ": differ(plain_run["first"], result["first"]),
            "of": len(plain_run["first"]),
        }
        if plan is not None:
            entry.update(
                predicted_peak=plan.predicted_peak_bytes,
                predicted_overhead=plan.predicted_overhead,
                predicted_step_ms=1e3 * plan.predicted_overhead * traced_s,
                offloaded=plan.offloaded_bytes,
                stall_ms=1e3 * plan.predicted_stall,
            )
        rows.append(entry)

    row(None, "plain", plain_run)
    rows[-1].update(predicted_peak=alone.baseline, predicted_overhead=1.0, predicted_step_ms=1e3 * traced_s)
    for strategy, region in (
        ("save_on_cpu", lambda m: torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")),
        ("offload all", lambda m: remat.offload()),
    ):
        row(None, strategy, train(wl.model, wl.inputs, wl.loss_fn, region, steps, device))
    for f in fractions:
        recompute = plan_at(alone, int(low + f * (alone.baseline - low)))
        three = plan_at(both, recompute.predicted_peak_bytes)
        for strategy, plan in (("recompute", recompute), ("three-way", three)):
            result = train(wl.model, wl.inputs, wl.loss_fn, lambda m, p=plan: p.apply(m), steps, device)
            row(f, strategy, result, plan)
    return rows


def show(rows: list[dict[str, Any]], title: str) -> None:
    table = Table(title=title)
    columns = ("model", "f", "strategy", "peak", "÷ plain", "pred. peak", "step ms", "pred. ms", "÷ plain")
    for column in (*columns, "pred. ÷ plain", "to host", "bitwise"):
        table.add_column(column)
    for r in rows:
        pred = r.get("predicted_step_ms")
        table.add_row(
            r["model"],
            "" if r["fraction"] is None else f"{r['fraction']:.1f}",
            r["strategy"],
            format_bytes(r["peak"]),
            f"{r['peak_ratio']:.2f}",
            format_bytes(r["predicted_peak"]) if "predicted_peak" in r else "",
            f"{r['step_ms']:.1f}",
            "" if pred is None else f"{pred:.1f}",
            f"{r['overhead']:.3f}",
            f"{r['predicted_overhead']:.3f}" if "predicted_overhead" in r else "",
            format_bytes(r["offloaded"]) if "offloaded" in r else "",
            "yes" if r["differ"] == 0 else f"{r['differ']} of {r['of']} differ",
        )
    Console(width=200).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["gpt2:batch=8,seq=512", "resnet50:batch=32,image=224"]
    )
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda", help="cpu runs the same code, for a quick check of it")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    device = torch.device(args.device)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, first steps
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks/offload/gpu.py: needs a CUDA device (torch.cuda.is_available() is False)")
    rows: list[dict[str, Any]] = []
    for spec in args.models:
        rows += run_model(spec, args.fractions, args.steps, device)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(rows, out, indent=1)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    show(rows, f"Offload on {where}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
