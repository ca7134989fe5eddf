"""Where a layer's recomputation stops: a Llama built from a ``transformers`` config (4 layers,
hidden 256, grouped-query attention, random weights, batch 8 x 128 tokens), every layer
checkpointed by ``torch.utils.checkpoint(use_reentrant=False)`` (transformers' own switch) and by
``remat.checkpoint`` (``remat.integrations.huggingface.enable``). A Llama layer's last op that
saves anything is its MLP's ``down_proj``, which saves its input and weight before its kernel
runs (NOTE [early stop] in ``remat.manual.early_stop``).

Printed: the matrix products each backward runs (recomputations included: free of the machine's
load), the allocator's peak of a step, and the CPU time per step (``time.process_time``, one
intra-op thread, the two interleaved round by round, medians).

    .venv/bin/python benchmarks/manual/last_op.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat.integrations import huggingface

_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


class _Matmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in _MATMULS
        return func(*args, **(kwargs or {}))


def _model(form: str) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    if form == "torch.utils.checkpoint":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        huggingface.enable(model, form="checkpoint")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(0, 1000, (8, 128), generator=torch.Generator().manual_seed(1))
    models = {form: _model(form) for form in ("torch.utils.checkpoint", "remat.checkpoint")}

    def step(model: torch.nn.Module, mode: TorchDispatchMode | None = None) -> None:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        if mode is None:
            loss.backward()
        else:
            with mode:
                loss.backward()
        model.zero_grad(set_to_none=True)

    seconds: dict[str, list[float]] = {form: [] for form in models}
    for form, model in models.items():
        step(model)
        matmuls = _Matmuls()
        step(model, matmuls)
        with remat.memory.track(allocator=True) as tracked:
            step(model)
        print(f"{form}: {matmuls.count} matrix products in backward, allocator peak {tracked.peak_bytes} B")
    for _ in range(args.rounds):
        for form, model in models.items():
            start = time.process_time()
            step(model)
            seconds[form].append(time.process_time() - start)
    for form, times in seconds.items():
        print(f"{form}: {statistics.median(times) * 1e3:.1f} ms CPU per step (median of {args.rounds})")
    ratios = [
        r / t for r, t in zip(seconds["remat.checkpoint"], seconds["torch.utils.checkpoint"], strict=True)
    ]
    ratio = statistics.median(ratios)
    print(f"remat.checkpoint / torch.utils.checkpoint: {ratio:.3f} (median of per-round ratios)")


if __name__ == "__main__":
    main()
