"""Where the step time of a plan at per-layer checkpointing's peak goes: the forward (with the loss)
and the backward timed apart, beside per-layer checkpointing's, the plain step's and the plain
forward under a dispatch mode that only calls each op (the cost any per-op interception pays).

Each family is built as ``floor.py`` builds it; CPU time with one intra-op thread, the strategies
interleaved round by round (every other round in reverse order), medians over ``--rounds``.

    .venv/bin/python benchmarks/plan/phases.py --families gpt2 bert --rounds 7
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from floor import DEFAULT, FAMILIES  # noqa: E402

import remat  # noqa: E402
from remat.planner import plan_trace, trace_step  # noqa: E402
from remat.planner.api import block_key  # noqa: E402
from remat.planner.lowering import chain_from_trace  # noqa: E402
from remat.planner.search import Step, simple  # noqa: E402


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _forward_under_a_mode(model: torch.nn.Module) -> Iterator[None]:
    """A pass-through dispatch mode around the model's forward (pushed and popped by its hooks)."""
    mode = _PassThrough()

    def enter(*_: Any) -> None:
        mode.__enter__()

    def leave(*_: Any) -> None:
        mode.__exit__(None, None, None)

    hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def phases(name: str, rounds: int) -> str:
    torch.manual_seed(0)
    model, loss_of, checkpointed = FAMILIES[name]()
    model.train()
    model.zero_grad(set_to_none=True)
    with remat.memory.track(timeline=False, allocator=True) as tracked, checkpointed():
        loss_of(model).backward()
    ck_peak = tracked.peak_bytes
    trace = trace_step(model, (), lambda m: loss_of(m), repeats=2)
    key = block_key(model)
    plan = plan_trace(trace, ck_peak, block_key=key)
    # NOTE [bare forward] in remat.planner.module_calls: plans whose regions all run as their
    # module called again (or that have none), checked once and then run bare, or checked always
    step = Step(trace, key, rerun_modules=True)
    every = next(
        c for c in simple(step, chain_from_trace(trace, key=key)) if c.notes == "every layer checkpointed"
    )
    again = dataclasses.replace(plan, regions=tuple(r for r, _ in every.regions))
    assert all(r.rerun for r in again.regions), again.regions
    # NOTE [taped call run bare] in remat.planner.taped_calls: every layer taped, its later calls
    # run from the first one's template, or recorded every call
    step = Step(trace, key)
    every = next(
        c for c in simple(step, chain_from_trace(trace, key=key)) if c.notes == "every layer checkpointed"
    )
    taped = dataclasses.replace(plan, regions=tuple(r for r, _ in every.regions))
    assert all(r.anchor and not r.rerun for r in taped.regions), taped.regions
    nothing = dataclasses.replace(plan, regions=())
    contexts: dict[str, Callable[[], Any]] = {
        "plain": contextlib.nullcontext,
        "pass-through mode on the forward": lambda: _forward_under_a_mode(model),
        "checkpoint per layer": checkpointed,
        "remat.plan at checkpointing's peak": lambda: plan.apply(model),
        "remat.plan, every layer run again, bare": lambda: again.apply(model),
        "remat.plan, every layer run again, checked": lambda: again.apply(model, check="every"),
        "remat.plan, every layer taped, from templates": lambda: taped.apply(model),
        "remat.plan, every layer taped, recorded": lambda: taped.apply(model, check="every"),
        "remat.plan with no region, bare": lambda: nothing.apply(model),
        "remat.plan with no region, checked": lambda: nothing.apply(model, check="every"),
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in contexts}

    def timed(ctx: Callable[[], Any]) -> tuple[float, float]:
        model.zero_grad(set_to_none=True)
        with ctx():
            start = time.process_time()
            loss = loss_of(model)
            middle = time.process_time()
            loss.backward()
            end = time.process_time()
        return middle - start, end - middle

    for ctx in contexts.values():  # warm-up
        timed(ctx)
    for r in range(rounds):
        for k in list(contexts) if r % 2 == 0 else reversed(list(contexts)):
            times[k].append(timed(contexts[k]))
    rows = []
    for k, spans in times.items():
        forward = statistics.median(f for f, _ in spans) * 1e3
        backward = statistics.median(b for _, b in spans) * 1e3
        rows.append(f"| {name} | {k} | {forward:.1f} | {backward:.1f} | {forward + backward:.1f} |")
    anchored = sum(bool(r.anchor or r.rerun) for r in plan.regions)
    NOTES.append(
        f"{name}: the plan at checkpointing's peak has {len(plan.regions)} regions, "
        f"{anchored} of them a module's call"
    )
    return "\n".join(rows)


NOTES: list[str] = []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", nargs="*", default=DEFAULT[:4], choices=list(FAMILIES))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| family | strategy | forward + loss, ms | backward, ms | step, ms |")
    print("|---|---|---:|---:|---:|")
    for name in args.families:
        print(phases(name, args.rounds), flush=True)
    print("\n".join(NOTES))


if __name__ == "__main__":
    main()
