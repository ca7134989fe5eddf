"""remat.checkpoint and remat.scope vs torch.utils.checkpoint on GPT-2 blocks.

Every strategy checkpoints the same regions (each transformer block) through the model's own
gradient-checkpointing switch, so only the checkpoint implementation differs. Step time is the
median over interleaved repeats of the ratio to torch's step in the same round; memory is the
counted peak of live tensor bytes of one training step (remat.memory.track).

    python benchmarks/manual/run.py [--layers 6 --width 256 --seq 256 --batch 8 --repeats 15]
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch
from torch import nn

import remat
from remat.demo import build_gpt2, step
from remat.integrations import huggingface
from remat.memory import format_bytes


def torch_checkpoint(model: nn.Module) -> nn.Module:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


STRATEGIES = {
    "none": lambda m: m,
    "torch.utils.checkpoint": torch_checkpoint,
    "remat.checkpoint": lambda m: huggingface.enable(m, form="checkpoint"),
    "remat.scope": lambda m: huggingface.enable(m, form="scope"),
    "remat.checkpoint + SaveComputeIntensive": lambda m: huggingface.enable(
        m, form="checkpoint", policy=remat.SaveComputeIntensive()
    ),
    "remat.scope + SaveComputeIntensive": lambda m: huggingface.enable(
        m, form="scope", policy=remat.SaveComputeIntensive()
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    base = build_gpt2(args.layers, args.width, args.seq)
    models = {name: make(copy.deepcopy(base)) for name, make in STRATEGIES.items()}
    tokens = torch.randint(0, 2048, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    peaks = {}
    for name, model in models.items():
        with remat.memory.track(timeline=False) as m:
            step(model, tokens, seed=0)
        model.zero_grad(set_to_none=True)
        peaks[name] = m.peak_bytes

    for model in models.values():  # warm-up
        step(model, tokens, seed=0)
        model.zero_grad(set_to_none=True)
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.repeats):
        order = list(models.items())
        if r % 2:
            order.reverse()
        for name, model in order:
            start = time.perf_counter()
            step(model, tokens, seed=r)
            times[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))

    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads; GPT-2 {args.layers} layers, width {args.width}, "
        f"batch {args.batch}x{args.seq}, {args.repeats} interleaved repeats\n"
    )
    print("| strategy | median step | time vs torch.utils.checkpoint | counted peak | peak vs torch |")
    print("|---|---|---|---|---|")
    for name in models:
        print(
            f"| {name} | {statistics.median(times[name]) * 1000:.0f} ms | "
            f"{ratio(name, 'torch.utils.checkpoint'):.3f}x | {format_bytes(peaks[name])} | "
            f"{peaks[name] / peaks['torch.utils.checkpoint']:.3f}x |"
        )
    print(
        f"\nremat.scope vs remat.checkpoint (same regions): {ratio('remat.scope', 'remat.checkpoint'):.3f}x"
    )


if __name__ == "__main__":
    main()
