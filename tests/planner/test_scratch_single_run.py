"""An op that cannot run twice has its kernel's scratch measured on its one run (NOTE [scratch of a
single run] in ``remat.trace.recorder``): CPU attention (``_scaled_dot_product_flash_attention_for_cpu``,
which takes a dropout probability and so is random by its schema, though at 0 it draws nothing)
allocates buffers it frees before it returns; a step whose peak is that op was predicted 27% under
the allocator's peak before."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import aten
from remat.manual.scope import Recorder
from remat.manual.tape import Tape
from remat.planner import plan_trace, trace_step
from remat.policy import RecomputeAll

ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu.default"


class _FrozenAttention(nn.Module):
    """Attention over the input itself, then a small trained head: the attention's forward, its
    output beside its kernel's buffers, is the step's peak."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = x.view(4, 128, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return (
            F.scaled_dot_product_attention(
                q,
                k,
                v,
            ).sum(-1)
            * self.w[0]
        ).sum()


def test_a_random_ops_scratch_is_in_the_trace_and_the_prediction_meets_the_allocator() -> None:
    torch.manual_seed(0)
    model, x = _FrozenAttention(), torch.randn(4, 128, 96)
    trace = trace_step(model, (x,), repeats=1)
    (attention,) = [op for op in trace.ops if op.name == ATTENTION]
    assert not aten.facts(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default).pure
    assert attention.scratch > 0
    plan = plan_trace(trace, 10**9)
    model.zero_grad(set_to_none=True)
    with remat.memory.track(timeline=False, allocator=True) as tracked, plan.apply(model):
        model(x).backward()
    assert tracked.peak_bytes == plan.predicted_peak_bytes


def test_attention_without_dropout_draws_nothing() -> None:
    """NOTE [no dropout draws nothing] in ``remat.aten.schema``: the CPU kernel (it takes no other
    probability) leaves the generator as it was, so the trace and the dynamic runtime count no random
    op and a tape keeps no generator state for it; the same call with a probability is one that
    draws."""
    torch.manual_seed(0)
    model, x = _FrozenAttention(), torch.randn(4, 128, 96)
    before = torch.get_rng_state()
    model(x)
    assert torch.equal(before, torch.get_rng_state())
    (attention,) = [op for op in trace_step(model, (x,), repeats=1).ops if op.name == ATTENTION]
    assert not attention.random
    tape = Tape(RecomputeAll())
    with Recorder(tape):
        model(x)
    (node,) = [n for n in tape.nodes if str(n.func) == ATTENTION]
    assert node.rng is None
    region = remat.dynamic(None, keep=model, cost="model")
    with region:
        model(x).backward()
    (seen,) = [op for op in region.stats.trace.ops if op.name == ATTENTION]
    assert not seen.random
    facts = aten.facts(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    q = x.view(4, 128, 3, 2, 16)[:, :, 0]
    assert facts.random and aten.draws(facts, (q, q, q, 0.1), {})
    assert not aten.draws(facts, (q, q, q), {}) and not aten.draws(facts, (q, q, q), {"dropout_p": 0.0})


def test_an_op_that_cannot_run_twice_runs_once_where_it_changes_its_arguments_geometry() -> None:
    """``t_`` transposes in place: on a square tensor its signature (strides included) differs
    before and after it runs. Learned once on a transposed tensor, the next ``t_`` on a plain one
    matches what the first left, and was then run a second time to measure its scratch under the
    key it had after running, transposing the tensor back."""
    made = []

    def step() -> None:
        first = torch.empty_strided((8, 8), (1, 8)).copy_(torch.arange(64.0).view(8, 8))
        first.t_()
        second = torch.arange(64.0).view(8, 8).clone()
        second.t_()
        made.append(second)

    remat.trace.capture(step, repeats=1)
    assert torch.equal(made[0], torch.arange(64.0).view(8, 8).t())
