"""What each of the two ranks of ``test_data_parallel.py`` runs: every remat form inside DDP and FSDP2,
compared with one process that runs the same global batch.

Each rank takes half of the global batch. The reference runs in one process on every rank: one copy
of the model per half, with the RNG seeded as that rank seeds it (the same dropout masks) and the
batch-norm buffers that rank would hold (DDP broadcasts rank 0's at each forward; FSDP2 keeps each
rank's own). Each half's loss is halved before backward, so the reference's gradient is g0/2 + g1/2,
which is what the data-parallel average computes: halving is exact in floating point and a sum of
two terms does not depend on their order, so the comparison is for equality, not closeness.

Results (one line of text per check, ``"ok"`` or what differed) go to ``rank<r>.json``; the test
asserts on them in the parent process.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import remat
from remat.integrations import huggingface
from remat.integrations.distributed import broadcast_plan, hide_fsdp_hooks
from remat.planner.api import block_key, plan_trace, trace_step
from remat.planner.regions import Region
from remat.trace.types import Op

WORLD = 2
STEPS = 2
LR = 0.1

Inputs = dict[str, Any]


@dataclass(frozen=True)
class Case:
    """A model, its global batch per step and the blocks a form wraps."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], Inputs]
    blocks: Callable[[nn.Module], list[nn.Module]]


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=3, n_embd=32, n_head=4, vocab_size=96, n_positions=32)  # dropout 0.1
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).train()


def _gpt2_batch(step: int) -> Inputs:
    ids = torch.randint(0, 96, (2 * WORLD, 32), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


class _CNN(nn.Module):
    """Convolutions with batch norm and dropout, the loss inside (``forward(x, y)``)."""

    def __init__(self, c: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.Dropout(0.2))
            for _ in range(depth)
        )
        self.head = nn.Linear(c, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for layer in self.layers:
            h = h + layer(h)
        return nn.functional.cross_entropy(self.head(h.mean((2, 3))), y)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return _CNN().train()


def _cnn_batch(step: int) -> Inputs:
    g = torch.Generator().manual_seed(step)
    return {
        "x": torch.randn(2 * WORLD, 3, 16, 16, generator=g),
        "y": torch.randint(0, 5, (2 * WORLD,), generator=g),
    }


CASES = {
    "gpt2": Case("gpt2", _gpt2, _gpt2_batch, lambda m: list(m.transformer.h)),
    "cnn": Case("cnn", _cnn, _cnn_batch, lambda m: list(m.layers)),
}


def half(inputs: Inputs, rank: int) -> Inputs:
    n = next(v for v in inputs.values() if isinstance(v, torch.Tensor)).shape[0] // WORLD
    return {k: v[rank * n : (rank + 1) * n] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def seed(step: int, rank: int) -> None:
    torch.manual_seed(1000 + 10 * step + rank)


def loss_of(model: nn.Module, inputs: Inputs) -> torch.Tensor:
    out = model(**inputs)
    return out if isinstance(out, torch.Tensor) else out.loss


@dataclass
class Step:
    """One step's figures: the mean loss over the global batch, the averaged gradients, and the
    buffers of this rank after it."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


def reference(case: Case, rank: int, broadcast_buffers: bool) -> list[Step]:
    copies = [case.build() for _ in range(WORLD)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=LR) for m in copies]
    steps = []
    for step in range(STEPS):
        if broadcast_buffers:
            for b, b0 in zip(copies[1].buffers(), copies[0].buffers(), strict=True):
                b.copy_(b0)
        losses = []
        for r, model in enumerate(copies):
            model.zero_grad(set_to_none=True)
            seed(step, r)
            loss = loss_of(model, half(case.batch(step), r))
            (loss / WORLD).backward()
            losses.append(loss.detach())
        grads = {
            name: sum((dict(m.named_parameters())[name].grad for m in copies), torch.tensor(0.0))
            for name, _ in copies[0].named_parameters()
        }
        steps.append(
            Step(
                (losses[0] + losses[1]) / WORLD,
                {k: g.clone() for k, g in grads.items()},
                {k: b.clone() for k, b in copies[rank].named_buffers()},
            )
        )
        for m, opt in zip(copies, optimizers, strict=True):
            for name, p in m.named_parameters():
                p.grad = grads[name].clone()
            opt.step()
    return steps


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 shards are DTensors


def compare(got: Step, want: Step) -> str:
    if not torch.equal(got.loss, want.loss):
        return f"loss {got.loss.item()} != {want.loss.item()}"
    for kind, a, b in (("grad", got.grads, want.grads), ("buffer", got.buffers, want.buffers)):
        if a.keys() != b.keys():
            return f"{kind} names differ: {sorted(a.keys() ^ b.keys())[:3]}"
        for name in a:
            if not torch.equal(a[name], b[name]):
                return f"{kind} {name} differs by {(a[name] - b[name]).abs().max().item():.3g}"
    return "ok"


def train(
    case: Case, wrapper: nn.Module, inner: nn.Module, rank: int, run: Callable[[Inputs], torch.Tensor]
) -> tuple[list[Step], list[int]]:
    """``STEPS`` steps of SGD on this rank's half; returns the steps and each step's allocator peak."""
    opt = torch.optim.SGD(wrapper.parameters(), lr=LR)
    steps, peaks = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        inputs = half(case.batch(step), rank)
        seed(step, rank)
        with remat.memory.track(allocator=True) as m:
            loss = run(inputs)
            loss.backward()
        peaks.append(m.peak_bytes)
        total = loss.detach().clone()
        dist.all_reduce(total)
        steps.append(
            Step(
                total / WORLD,
                {name: _full(p.grad).clone() for name, p in inner.named_parameters() if p.grad is not None},
                {name: b.clone() for name, b in inner.named_buffers()},
            )
        )
        opt.step()
    return steps, peaks


def _scoped(block: nn.Module) -> None:
    forward = block.forward

    def scoped_forward(*args: Any, **kwargs: Any) -> Any:
        with remat.scope():
            return forward(*args, **kwargs)

    block.forward = scoped_forward  # type: ignore[method-assign]


@functools.cache
def _plan(case: Case) -> remat.Plan:
    """Rank 0 plans on a plain copy with its half batch; every rank gets that plan (once per model:
    every rank asks in the same order). The plan is made on the cost model's op costs, not on
    measured times, so that it is the same however busy the machine is."""
    plan = None
    if dist.get_rank() == 0:
        model = case.build()
        trace = trace_step(model, half(case.batch(0), 0), repeats=1)
        events = tuple(
            dataclasses.replace(e, cost=e.est_cost) if isinstance(e, Op) else e for e in trace.events
        )
        # within one block each region: FSDP2 shards per block (NOTE [regions across units])
        plan = plan_trace(
            dataclasses.replace(trace, events=events), 0.7, block_key=block_key(model), within_blocks=True
        )
    return broadcast_plan(plan)


def apply_form(case: Case, model: nn.Module, form: str) -> Callable[[nn.Module, Inputs], torch.Tensor]:
    """Wrap the blocks of ``model`` for ``form``; returns how to run the parallel wrapper."""
    if form == "checkpoint":
        for block in case.blocks(model):
            remat.checkpoint(block)
    elif form == "scope":
        for block in case.blocks(model):
            _scoped(block)
    elif form in ("hf-checkpoint", "hf-scope"):
        huggingface.enable(model, form="checkpoint" if form == "hf-checkpoint" else "scope")
    elif form == "whole-scope":

        def in_scope(wrapper: nn.Module, inputs: Inputs) -> torch.Tensor:
            with remat.scope():
                return loss_of(wrapper, inputs)

        return in_scope
    elif form in ("plan", "merged-plan"):
        plan = _plan(case)
        if form == "merged-plan":  # one region from the first planned op to the last, across blocks
            first, last = plan.regions[0].first, plan.regions[-1].last
            plan = dataclasses.replace(plan, regions=(Region("merged", first, last),))

        def planned(wrapper: nn.Module, inputs: Inputs) -> torch.Tensor:
            with plan.apply(model):
                return loss_of(wrapper, inputs)

        return planned
    return loss_of


def ddp(case: Case, form: str, rank: int, **options: Any) -> tuple[list[Step], list[int]]:
    from torch.nn.parallel import DistributedDataParallel

    model = case.build()
    run = apply_form(case, model, form)
    wrapper = DistributedDataParallel(model, **options)
    return train(case, wrapper, model, rank, lambda inputs: run(wrapper, inputs))


def fsdp(case: Case, form: str, rank: int, reshard: bool, hidden: bool) -> tuple[list[Step], list[int]]:
    from torch.distributed.fsdp import fully_shard

    model = case.build()
    run = apply_form(case, model, form)
    for block in case.blocks(model):
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    if hidden:
        hide_fsdp_hooks(model)
    return train(case, model, model, rank, lambda inputs: run(model, inputs))


# (parallelism, model, form) of every check; "fsdp" reshards after forward, "fsdp-keep" does not
CHECKS = [
    *[("ddp", "gpt2", f) for f in ("plain", "checkpoint", "scope", "whole-scope", "plan")],
    *[("fsdp", "gpt2", f) for f in ("plain", "checkpoint", "scope", "hf-checkpoint", "plan", "whole-scope")],
    ("fsdp-visible", "gpt2", "plan"),
    ("fsdp-visible", "gpt2", "whole-scope"),
    ("fsdp-keep", "gpt2", "whole-scope"),
    *[("ddp", "cnn", f) for f in ("plain", "checkpoint", "scope", "plan", "whole-scope")],
    *[("fsdp", "cnn", f) for f in ("plain", "checkpoint", "scope", "plan", "merged-plan")],
    # DDP as most code runs it: no static graph (its hooks find the ready buckets step by step)
    *[("ddp-dynamic", "gpt2", f) for f in ("checkpoint", "scope", "plan")],
]


def run_check(parallelism: str, case: Case, form: str, rank: int) -> tuple[list[Step], list[int]]:
    if parallelism.startswith("ddp"):
        return ddp(case, form, rank, static_graph=parallelism == "ddp", find_unused_parameters=False)
    return fsdp(case, form, rank, reshard=parallelism != "fsdp-keep", hidden=parallelism != "fsdp-visible")


def worker(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank, world_size=WORLD
    )
    results: dict[str, Any] = {}
    references: dict[tuple[str, bool], list[Step]] = {}
    try:
        for parallelism, model, form in CHECKS:
            case = CASES[model]
            key = (model, parallelism.startswith("ddp"))  # DDP broadcasts rank 0's buffers at each forward
            if key not in references:
                references[key] = reference(case, rank, key[1])
            try:
                steps, peaks = run_check(parallelism, case, form, rank)
                verdict = next(
                    (
                        f"step {i}: {c}"
                        for i, c in enumerate(map(compare, steps, references[key]))
                        if c != "ok"
                    ),
                    "ok",
                )
            except Exception as error:  # recorded for the parent, which asserts on it
                verdict, peaks = f"{type(error).__name__}: {error}", []
                dist.barrier()
            results[f"{parallelism}-{model}-{form}"] = {"verdict": verdict, "peaks": peaks}
    finally:
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(results, f, indent=1)
        dist.destroy_process_group()


if __name__ == "__main__":  # the figures of docs/distributed.md
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(worker, args=(folder,), nprocs=WORLD)
        for r in range(WORLD):
            with open(os.path.join(folder, f"rank{r}.json")) as f:
                for name, result in json.load(f).items():
                    print(f"rank {r}  {name:28} {result['peaks']}  {result['verdict'][:100]}")
