"""remat.plan against per-layer ``torch.utils.checkpoint`` on each model family: the lowest peak each
reaches, and the overhead of each at checkpointing's peak (issue 16).

Families: Llama (rotary embeddings, RMSNorm, SwiGLU, grouped-query attention), ViT, GPT-2 (tied
embeddings), BERT, each built from its ``transformers`` config with random weights, and ResNet-50
and U-Net from ``remat.zoo``. Per-layer checkpointing is transformers' switch
(``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``) on the
transformers, and ``torch.utils.checkpoint`` around every bottleneck / double convolution on the
others (``run.per_block_checkpoint``). Strategies: the plain step, per-layer checkpointing,
``remat.plan`` at its smallest feasible budget (the figure ``BudgetTooSmall`` names) and at
checkpointing's measured peak. Peaks: the CPU allocator's count for one step
(``remat.memory.track(allocator=True)``). Time: the process's CPU time with one intra-op thread,
``--rounds`` rounds in which each strategy runs once, interleaved (every other round in reverse
order); overhead per round ÷ the plain step of the same round, median.

    .venv/bin/python benchmarks/plan/floor.py --rounds 5 --out benchmarks/plan/floor.json
    .venv/bin/python benchmarks/plan/floor.py --table benchmarks/plan/floor.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from run import blocks, per_block_checkpoint  # noqa: E402

import remat  # noqa: E402
from remat import zoo  # noqa: E402
from remat.planner import BudgetTooSmall, Plan, plan_trace, trace_step  # noqa: E402
from remat.planner.api import block_key, plan_at  # noqa: E402
from remat.planner.cost_model import ExecutorCost  # noqa: E402
from remat.planner.frontier import frontier  # noqa: E402
from remat.planner.predict import Prediction  # noqa: E402
from remat.planner.room import filled  # noqa: E402
from remat.planner.search import simple  # noqa: E402

Step = tuple[nn.Module, Callable[[nn.Module], torch.Tensor], Callable[[], Any]]


def _hf(model: Any, batch: dict[str, Any]) -> Step:
    def switch() -> Iterator[None]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            yield
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                model.gradient_checkpointing_disable()

    return model, lambda m: m(**batch).loss, contextlib.contextmanager(switch)


def llama(layers: int = 8, batch: int = 4, seq: int = 256) -> Step:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=256,
        intermediate_size=688,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=2000,
        max_position_embeddings=256,
    )
    ids = torch.randint(0, 2000, (batch, seq))
    return _hf(LlamaForCausalLM(config), {"input_ids": ids, "labels": ids, "use_cache": False})


def vit(layers: int = 8, batch: int = 4, image: int = 128) -> Step:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        num_hidden_layers=layers,
        hidden_size=256,
        intermediate_size=1024,
        num_attention_heads=8,
        image_size=image,
        patch_size=8,
        num_labels=10,
    )
    inputs = {"pixel_values": torch.randn(batch, 3, image, image), "labels": torch.randint(0, 10, (batch,))}
    return _hf(ViTForImageClassification(config), inputs)


def gpt2(layers: int = 8, batch: int = 4, seq: int = 256) -> Step:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=256, n_head=8, vocab_size=2000, n_positions=256)
    ids = torch.randint(0, 2000, (batch, seq))
    return _hf(GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids, "use_cache": False})


def bert(layers: int = 8, batch: int = 4, seq: int = 256) -> Step:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=layers,
        hidden_size=256,
        intermediate_size=1024,
        num_attention_heads=8,
        vocab_size=2000,
        max_position_embeddings=256,
    )
    ids = torch.randint(0, 2000, (batch, seq))
    return _hf(BertForMaskedLM(config), {"input_ids": ids, "labels": ids})


def _zoo(name: str, **size: int) -> Step:
    wl = zoo.build(name, **size)
    model = wl.model
    return model, lambda m: wl.loss_fn(m(*wl.inputs)), lambda: per_block_checkpoint(blocks(name, model))


FAMILIES: dict[str, Callable[[], Step]] = {
    "llama": llama,
    "vit": vit,
    "gpt2": gpt2,
    "bert": bert,
    "resnet50": lambda: _zoo("resnet50", batch=4, image=128),
    "unet": lambda: _zoo("unet", batch=2, image=128),
    # section 3's planning time: GPT-2 small, 12 layers, batch 2 x 256 (not in the default families)
    "gpt2-small": lambda: _zoo("gpt2", batch=2, seq=256),
}
DEFAULT = ["llama", "vit", "gpt2", "bert", "resnet50", "unet"]
RERUN = "remat.plan at checkpointing's peak, modules run again"  # rerun_modules=True


def stepper(
    model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor]
) -> Callable[..., Callable[[], None]]:
    """``run(ctx)``: one training step of ``model`` (no optimizer) inside the context ``ctx()`` makes."""

    def run(ctx: Callable[[], Any]) -> Callable[[], None]:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            with ctx():
                loss_of(model).backward()

        return step

    return run


class AtCheckpointing(NamedTuple):
    """A family built from the fixed seed, in train mode: ``run(ctx)`` makes its training step (as
    ``stepper``), ``checkpointed`` per-layer checkpointing's context, ``peak`` the allocator's peak
    of a step under it, ``trace`` the captured step and ``key`` the model's blocks."""

    model: nn.Module
    run: Callable[..., Callable[[], None]]
    checkpointed: Callable[[], Any]
    peak: int
    trace: Any
    key: Callable[[str], str]


def at_checkpointing(build: Callable[[], Step], capture_repeats: int) -> AtCheckpointing:
    """Build a family, measure per-layer checkpointing's peak and capture the step to plan at it."""
    torch.manual_seed(0)
    model, loss_of, checkpointed = build()
    model.train()
    run = stepper(model, loss_of)
    ck_peak = peak(run(checkpointed))
    trace = trace_step(model, (), lambda m: loss_of(m), repeats=capture_repeats)
    return AtCheckpointing(model, run, checkpointed, ck_peak, trace, block_key(model))


def environment() -> dict[str, str]:
    """The versions a result was measured with."""
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
    }


def peak(step: Callable[[], None]) -> int:
    """The allocator's peak over ``step()``."""
    with remat.memory.track(timeline=False, allocator=True) as tracked:
        step()
    return tracked.peak_bytes


def bench(name: str, rounds: int, capture_repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, loss_of, checkpointed = FAMILIES[name]()
    model.train()
    run = stepper(model, loss_of)

    steps: dict[str, Callable[[], None]] = {
        "plain": run(contextlib.nullcontext),
        "checkpoint per layer": run(checkpointed),
    }
    ck_peak = peak(steps["checkpoint per layer"])
    start = time.perf_counter()
    trace = trace_step(model, (), lambda m: loss_of(m), repeats=capture_repeats)
    capture_s = time.perf_counter() - start
    key = block_key(model)
    try:
        plan_trace(trace, 1, block_key=key)
    except BudgetTooSmall as error:
        floor = error.minimum_bytes
    plans: dict[str, Plan | str] = {}
    for label, budget, again in (
        ("remat.plan at its floor", floor, False),
        ("remat.plan at checkpointing's peak", ck_peak, False),
        (RERUN, ck_peak, True),
    ):
        try:
            plans[label] = plan = plan_trace(trace, budget, block_key=key, rerun_modules=again)
            steps[label] = run(lambda plan=plan: plan.apply(model))  # type: ignore[misc]
        except BudgetTooSmall as error:
            plans[label] = f"refused: {error}"
    rows: dict[str, dict[str, Any]] = {k: {"peak": peak(s), "ratios": []} for k, s in steps.items()}
    for s in steps.values():  # warm-up
        s()
    for index in range(rounds):
        times = {}
        # every other round runs the strategies in reverse order, so that a drift of the machine's
        # speed within a round favours none of them over a pair of rounds
        for k in list(steps) if index % 2 == 0 else reversed(list(steps)):
            begin = time.process_time()
            steps[k]()
            times[k] = time.process_time() - begin
        for k in steps:
            rows[k]["ratios"].append(times[k] / times["plain"])
        rows["plain"].setdefault("seconds", []).append(times["plain"])
    for k, row in rows.items():
        row["overhead"] = statistics.median(row["ratios"])
        plan = plans.get(k)
        if isinstance(plan, Plan):
            row.update(
                predicted_peak=plan.predicted_peak_bytes,
                predicted_overhead=plan.predicted_overhead,
                regions=[str(r) for r in plan.regions],
                notes=plan.notes,
            )
    for k, plan in plans.items():
        if isinstance(plan, str):
            rows[k] = {"refused": plan}
    return {"family": name, "floor": floor, "checkpoint_peak": ck_peak, "capture_s": capture_s, "rows": rows}


def predicted_only(name: str, capture_repeats: int) -> str:
    """A row of the predicted figures (no timed rounds): per-layer checkpointing as remat's own plan
    (``simple``'s "every layer checkpointed"), the same plan filled up to its peak
    (``remat.planner.room``), and the plan ``auto`` picks at checkpointing's measured peak."""
    torch.manual_seed(0)
    model, loss_of, checkpointed = FAMILIES[name]()
    model.train()
    checkpointed_peak = peak(stepper(model, loss_of)(checkpointed))
    trace = trace_step(model, (), lambda m: loss_of(m), repeats=capture_repeats)
    key = block_key(model)
    found = frontier(trace, "auto", key)
    every = next(c for c in simple(found.step, found.chain) if c.notes == "every layer checkpointed")
    full = filled(found.step, every)
    picked = plan_at(found, checkpointed_peak)
    base = every.pred.base_cost

    def figures(p: Prediction) -> str:
        return f"{p.overhead:.3f} ({p.recompute_cost / base:.3f} + {p.executor_cost / base:.3f})"

    mib = 2**20
    return (
        f"| {name} | {checkpointed_peak / mib:.1f} MiB | {every.pred.peak_bytes / mib:.1f} MiB, "
        f"{figures(every.pred)} | {figures(full.pred) if full else '-'} "
        f"| {picked.predicted_peak_bytes / mib:.1f} MiB, {picked.predicted_overhead:.3f} |"
    )


def fill_gain(name: str, fractions: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 0.75)) -> str:
    """A row: the plan's predicted overhead at budgets ``min + f · (plain − min)`` without filling
    and with it (``remat.planner.room``), and the CPU seconds ``frontier`` takes each way; one
    trace, no executor figures, so that the two differ by filling alone."""
    torch.manual_seed(0)
    model, loss_of, _ = FAMILIES[name]()
    model.train()
    trace = trace_step(model, (), lambda m: loss_of(m), repeats=1)
    key = block_key(model)
    found, seconds = {}, {}
    for fill in (False, True):
        with contextlib.ExitStack() as stack:
            if not fill:
                stack.enter_context(_no_filling())
            start = time.process_time()
            found[fill] = frontier(trace, "auto", key, executor_cost=ExecutorCost())
            seconds[fill] = time.process_time() - start
    low = min(c.pred.peak_bytes for c in found[True].candidates)
    base = found[True].baseline
    cells = []
    for f in fractions:
        a, b = (plan_at(found[x], int(low + f * (base - low))).predicted_overhead for x in (False, True))
        cells.append(f"{a:.3f}" if round(a, 3) == round(b, 3) else f"{a:.3f} → {b:.3f}")
    return f"| {name} | {' | '.join(cells)} | {seconds[False]:.1f} s → {seconds[True]:.1f} s |"


@contextlib.contextmanager
def _no_filling() -> Iterator[None]:
    import remat.planner.frontier as module

    filled_all = module.filled_all
    module.filled_all = lambda step, candidates: []
    try:
        yield
    finally:
        module.filled_all = filled_all


def _paired(row: dict[str, Any], other: dict[str, Any]) -> str:
    """``row``'s step time ÷ ``other``'s in the same round: median and range over the rounds."""
    if "ratios" not in row:
        return "-"
    each = [a / b for a, b in zip(row["ratios"], other["ratios"], strict=True)]
    return f"{statistics.median(each):.3f} ({min(each):.3f}-{max(each):.3f})"


def _again(row: dict[str, Any] | None, ck: dict[str, Any]) -> str:
    if row is None or "peak" not in row:
        return "-" if row is None else "refused"
    return (
        f"{row['peak'] / 2**20:.1f} MiB, {row['predicted_overhead']:.3f}, {row['overhead']:.3f}, "
        f"{_paired(row, ck)}"
    )


def table(results: dict[str, Any]) -> str:
    """The README's table, from a ``--out`` file."""
    mib = 2**20
    lines = [
        "| family | plain | checkpoint per layer: peak, overhead | plan's floor: predicted, measured, "
        "overhead | plan at checkpointing's peak: measured, predicted overhead, overhead "
        "| plan ÷ checkpointing at its peak, per round: median (range) "
        "| modules run again: measured, predicted overhead, overhead, ÷ checkpointing |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in results["families"]:
        rows = f["rows"]
        ck, low, at = (
            rows["checkpoint per layer"],
            rows["remat.plan at its floor"],
            rows["remat.plan at checkpointing's peak"],
        )
        lines.append(
            f"| {f['family']} | {rows['plain']['peak'] / mib:.1f} MiB "
            f"| {ck['peak'] / mib:.1f} MiB, {ck['overhead']:.3f} "
            f"| {low['predicted_peak'] / mib:.1f} MiB, {low['peak'] / mib:.1f} MiB, {low['overhead']:.3f} "
            f"| {at['peak'] / mib:.1f} MiB, {at['predicted_overhead']:.3f}, {at['overhead']:.3f} "
            f"| {_paired(at, ck)} | {_again(rows.get(RERUN), ck)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", nargs="*", default=DEFAULT, choices=list(FAMILIES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--capture-repeats", type=int, default=2)
    parser.add_argument("--out")
    parser.add_argument("--table", help="print the README's table from this --out file and stop")
    parser.add_argument("--predicted", action="store_true", help="the predicted figures only, as a table")
    parser.add_argument(
        "--fill-gain",
        action="store_true",
        help="predicted overheads and planning time without and with filling",
    )
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return
    torch.set_num_threads(1)
    if args.fill_gain:
        print("| family | f = 0 | 0.1 | 0.25 | 0.5 | 0.75 | planning, CPU |")
        print("|---|---|---|---|---|---|---|")
        for name in args.families:
            print(fill_gain(name), flush=True)
        return
    if args.predicted:
        print(
            "| family | checkpoint per layer, measured peak | as remat's plan: predicted peak, overhead "
            "(replay + executor) | filled up to its peak: overhead (replay + executor) "
            "| picked at checkpointing's peak: predicted peak, overhead |"
        )
        print("|---|---|---|---|---|")
        for name in args.families:
            print(predicted_only(name, args.capture_repeats), flush=True)
        return
    results: dict[str, Any] = {"environment": environment(), "families": []}
    for name in args.families:
        result = bench(name, args.rounds, args.capture_repeats)
        results["families"].append(result)
        mib = 2**20
        ck = result["checkpoint_peak"]
        print(f"{name}: floor {result['floor'] / mib:.1f} MiB, checkpoint {ck / mib:.1f} MiB")
        for k, row in result["rows"].items():
            if "refused" in row:
                print(f"  {k}: {row['refused']}")
            else:
                print(f"  {k}: peak {row['peak'] / mib:.1f} MiB, overhead {row['overhead']:.3f}")
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
