"""The cut searched with the stages' plans (``balance_by="step"``) against the balanced cuts.

    PYTHONPATH=. python benchmarks/pipeline/cut_search.py --out benchmarks/pipeline/results-cut-search.json

For each chain and per-rank budget (a fraction of what the even cut needs with nothing recomputed),
``remat.pipeline.plan`` on 4 ranks, 1F1B, 8 micro-batches, with the cut balanced by memory (the
default), by time, and searched (``balance_by="step"``): the cut, the predicted step (the pipeline
model on the cost model's op times, ``op_costs="model"``, so that every run plans the same) and
the largest predicted rank peak, or the refusal; and the planning's CPU time. Nothing runs on
processes here: the plans' execution is the gloo tests' and ``run.py``'s.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers
from torch import nn

import remat.pipeline as pp
from remat import RematValueError
from remat.pipeline.chain import mlp_chain
from remat.pipeline.zoo_chain import Block, Embeddings, Head, token_loss

RANKS, MICROBATCHES = 4, 8
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mlp(width: int, hidden: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, Loss]:
    torch.manual_seed(0)
    return (
        mlp_chain(8, width, hidden),
        torch.randn(128, width),
        torch.randn(128, width),
        nn.functional.mse_loss,
    )


def gpt2() -> tuple[nn.Module, torch.Tensor, torch.Tensor, Loss]:
    """GPT-2 from a ``transformers`` config (6 layers of width 64, a 4096-token vocabulary: the head's
    logits are the largest tensors) cut at its embeddings, blocks and head; 4 sequences of 64 tokens
    per micro-batch."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=6, n_embd=64, n_head=4, vocab_size=4096, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).train()
    body = model.transformer
    model.lm_head.weight = nn.Parameter(body.wte.weight.detach().clone())  # stages own their parameters
    chain = nn.Sequential(
        Embeddings(body.wte, body.wpe, body.drop), *(Block(b) for b in body.h), Head(body.ln_f, model.lm_head)
    )
    tokens = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(0))
    return chain, tokens, tokens.roll(-1, 1), token_loss


CHAINS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor, Loss]]] = {
    "mlp 64x256": lambda: mlp(64, 256),
    "mlp 256x1024": lambda: mlp(256, 1024),
    "gpt2 6 layers": gpt2,
}


def row(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: Loss, budget: int, by: str
) -> dict[str, Any]:
    start = time.process_time()
    try:
        plan = pp.plan(
            model,
            x,
            n_stages=RANKS,
            n_microbatches=MICROBATCHES,
            budget_per_rank=budget,
            loss_fn=loss,
            target=y,
            balance_by=by,
            op_costs="model",
        )
    except RematValueError as error:
        return {"balance_by": by, "refused": str(error)[:160], "seconds": time.process_time() - start}
    line = plan.timeline()
    return {
        "balance_by": by,
        "cut": list(plan.boundaries[1:-1]),
        "step_ms": 1e3 * line.makespan,
        "peak_bytes": max(line.peak_bytes),
        "recomputing_ranks": [s for s, sp in enumerate(plan.stage_plans) if sp.plan is not None],
        "seconds": time.process_time() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.8, 0.65, 0.5])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for name, build in CHAINS.items():
        model, x, y, loss = build()
        n = len(list(model.children()))
        even = [n * s // RANKS for s in range(1, RANKS)]
        plain = pp.plan(
            model,
            x,
            n_stages=RANKS,
            n_microbatches=MICROBATCHES,
            budget_per_rank="100GB",
            loss_fn=loss,
            target=y,
            boundaries=even,
            checkpoint="never",
            op_costs="model",
        )
        need = max(plain.timeline().peak_bytes)
        for fraction in args.fractions:
            budget = int(fraction * need)
            for by in ("memory", "time", "step"):
                rows.append(
                    {
                        "chain": name,
                        "fraction": fraction,
                        "budget": budget,
                        **row(model, x, y, loss, budget, by),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        meta = {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
        }
        with open(args.out, "w") as f:
            json.dump({"environment": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
