"""NOTE [finer chains]: on a model whose blocks' children make a chain longer than the chain DP
takes (a 12-layer GPT-2: 83 stages), ``auto`` still plans on it with its cheap solvers (the greedy
ladder, sqrt's segment counts): a block's MLP recomputed alone, where whole blocks cost more at
the same peak. Checked on the predictions, with fixed op costs and executor figures."""

from __future__ import annotations

import pytest
import torch
from plans import fixed_costs

from remat.planner import trace_step
from remat.planner.api import block_key, plan_at
from remat.planner.cost_model import ExecutorCost
from remat.planner.frontier import _FINE_STAGES, finer_key, frontier, ladder, segment_counts
from remat.planner.lowering import chain_from_trace
from remat.planner.search import Step

EXECUTOR = ExecutorCost(check=2e-5, record=4e-5, replay=2e-5, offload=3e-4)


@pytest.fixture(scope="module")
def gpt2():  # type: ignore[no-untyped-def]
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, bos_token_id=255, eos_token_id=255, n_layer=12, n_embd=32, n_head=2)
    model = GPT2LMHeadModel(config)
    tokens = torch.randint(0, 256, (2, 33))
    labels = tokens[:, 1:]

    def loss_fn(m, ids):  # type: ignore[no-untyped-def]
        return torch.nn.functional.cross_entropy(m(ids).logits.flatten(0, 1), labels.flatten())

    return model, fixed_costs(trace_step(model, (tokens[:, :-1],), loss_fn, repeats=1))


def test_auto_plans_on_a_finer_chain_than_the_dp_takes_and_is_cheaper_for_it(gpt2) -> None:  # type: ignore[no-untyped-def]
    model, trace = gpt2
    key = block_key(model)
    found = frontier(trace, "auto", key, executor_cost=EXECUTOR)
    step = Step(trace, key, EXECUTOR)
    coarse = chain_from_trace(trace, key=key)
    assert len(coarse) < _FINE_STAGES < len(chain_from_trace(trace, key=finer_key(key)))
    # what the cheap solvers give on the blocks' chain alone (all auto planned on before)
    blocks_only = ladder(step, "greedy", coarse, {}) + segment_counts(step, coarse)
    low = min(c.pred.peak_bytes for c in found.candidates)
    budget = (low + found.baseline) // 2
    fitting = [c.pred.overhead for c in blocks_only if c.pred.peak_bytes <= budget]
    plan = plan_at(found, budget)
    assert plan.predicted_peak_bytes <= budget
    assert fitting and plan.predicted_overhead < min(fitting)
    assert any(r.name.endswith(".mlp") for r in plan.regions)
