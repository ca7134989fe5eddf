"""Plans whose regions run as their module called again (NOTE [module re-run] in
``remat.planner.rerun_regions``, ``remat.planner.rerun``): which regions qualify, the allocator's
peak against the prediction, training bit for bit as the plain model, the executor's work, and
the errors."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import io
from typing import Any

import pytest
import torch
from models import MLP, assert_same, train, twin
from plans import fixed_costs, trace_with_fixed_costs
from test_plan_floor import FAMILIES, _peak
from torch import nn

import remat
import remat.planner.module_calls as module_calls
from remat import RecomputationError, RematTypeError, RematValueError
from remat.planner import Plan, plan_trace, trace_step
from remat.planner.api import block_key
from remat.planner.cost_model import ExecutorCost
from remat.planner.lowering import chain_from_trace
from remat.planner.rerun_regions import rerun_of
from remat.planner.search import Candidate, Step, simple
from remat.trace.codec import load, save
from remat.trace.types import Trace

Batch = dict[str, Any]


@functools.cache
def _family(name: str) -> tuple[nn.Module, Batch, Trace]:
    torch.manual_seed(0)
    model, batch = FAMILIES[name]()
    model.train()
    return model, batch, fixed_costs(trace_step(model, batch, repeats=1))


def _every_layer(model: nn.Module, trace: Trace, rerun: bool) -> tuple[Step, Candidate]:
    key = block_key(model)
    step = Step(trace, key, rerun_modules=rerun)
    plans = simple(step, chain_from_trace(trace, key=key))
    return step, next(c for c in plans if c.notes == "every layer checkpointed")


def _plan(trace: Trace, model: nn.Module, candidate: Candidate) -> Plan:
    plan = plan_trace(trace, 1.0, block_key=block_key(model))
    return dataclasses.replace(plan, regions=tuple(r for r, _ in candidate.regions))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_layer_runs_again_as_predicted(name: str) -> None:
    """Llama, ViT, GPT-2 (dropout) and BERT (post-norm: each layer's last op saves its own
    statistics): each layer is one region run as the layer called again, the allocator measures
    the predicted peak, and the executor neither checks nor records the layers' ops (nor, in the
    steady state, the taped layers', which run from templates)."""
    model, batch, trace = _family(name)
    _, again = _every_layer(model, trace, rerun=True)
    _, taped = _every_layer(model, trace, rerun=False)
    assert len(again.regions) == 4 and all(r.rerun for r, _ in again.regions)
    assert not any(r.rerun for r, _ in taped.regions)
    assert again.pred.work.recorded == 0 and again.pred.work.replayed == 0
    # taped layers run from their templates in the steady state (NOTE [taped call run bare]),
    # GPT-2's and BERT's dropout draws included (NOTE [random ops of a template])
    assert again.pred.work.checked == taped.pred.work.checked == taped.pred.work.recorded == 0
    assert again.pred.recompute_cost <= taped.pred.recompute_cost * 1.2  # the ops before each last save
    assert _peak(model, batch, _plan(trace, model, again)) == again.pred.peak_bytes


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_a_plan_running_layers_again_trains_exactly_as_the_plain_model(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Losses, every gradient, buffers and the RNG stream after two steps (dropout in GPT-2 and
    BERT draws the same numbers again), and one module call run again per layer and forward."""
    model, batch, trace = _family(name)
    _, again = _every_layer(model, trace, rerun=True)
    plan = _plan(trace, model, again)
    calls = []
    run_again = module_calls.run_again
    monkeypatch.setattr(module_calls, "run_again", lambda *a: calls.append(1) or run_again(*a))
    planned = twin(model)
    ran = train(planned, lambda _: batch, steps=2, region=lambda: plan.apply(planned))
    assert len(calls) == 2 * 4
    assert_same(train(twin(model), lambda _: batch, steps=2), ran)


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return h + self.ff(h)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_SelfAttention() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_a_module_given_one_tensor_in_several_places_runs_again_on_one_tensor() -> None:
    """``attn(h, h, h)`` run again on three detached copies took the projection path for distinct
    query, key and value, and the re-run was refused as differing from the forward."""
    torch.manual_seed(0)
    model = _Blocks()
    batch = {"x": torch.randn(4, 24, 32)}
    trace = fixed_costs(trace_step(model, batch, repeats=1))
    costs = ExecutorCost(check=2e-5, record=3e-5, replay=2e-5)
    plan = plan_trace(trace, 0.5, block_key=block_key(model), rerun_modules=True, executor_cost=costs)
    assert any(r.rerun.endswith(".attn") for r in plan.regions), plan.regions
    planned = twin(model)
    assert_same(
        train(twin(model), lambda _: batch, steps=2),
        train(planned, lambda _: batch, steps=2, region=lambda: plan.apply(planned)),
    )


def test_remat_plan_runs_modules_again_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """On fixed op costs and executor figures, so that the pick is the same on every run."""
    trace_with_fixed_costs(monkeypatch)
    torch.manual_seed(0)
    model = MLP(width=32, depth=6).train()
    x = torch.randn(256, 32)
    figures = ExecutorCost(check=2e-5, record=3e-5, replay=2e-5)
    asked = remat.plan(model, (x,), 0.7, rerun_modules=True, executor_cost=figures)
    plain = remat.plan(model, (x,), 0.7, executor_cost=figures)
    assert any(r.rerun for r in asked.regions) and not any(r.rerun for r in plain.regions)
    assert any("runs layers" in str(r) for r in asked.regions)
    assert any(t.reason.endswith("run again") for t in asked.tensors)
    table = io.StringIO()
    asked.explain(file=table)
    assert "(run again)" in table.getvalue()
    assert Plan.from_json(asked.to_json()) == asked
    planned = twin(model)
    ran = train(planned, lambda _: {"x": x}, steps=2, region=lambda: asked.apply(planned))
    assert_same(train(twin(model), lambda _: {"x": x}, steps=2), ran)


class _Twice(nn.Module):
    """One block applied twice (ALBERT shares its layer so), then another once."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.once = nn.Sequential(nn.Linear(16, 16), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.once(self.shared(self.shared(x))).sum()


def _ops_of(step: Step, module: str) -> list[int]:
    return [op.index for op in step.forward if op.module == module or op.module.startswith(module + ".")]


def test_only_one_call_of_one_module_that_writes_nothing_before_it_qualifies() -> None:
    torch.manual_seed(0)
    model = _Twice()
    trace = trace_step(model, (torch.randn(4, 16, requires_grad=True),), repeats=1)
    assert dict(trace.calls)["shared"] == 2 and dict(trace.calls)["once"] == 1
    step = Step(trace, rerun_modules=True)
    once, shared = _ops_of(step, "once"), _ops_of(step, "shared")
    assert rerun_of(trace, once, frozenset()) is not None
    assert rerun_of(trace, shared, frozenset()) is None  # two calls
    assert rerun_of(trace, once[1:], frozenset()) is None  # part of a call
    assert rerun_of(trace, once, frozenset(once[:1])) is None  # keeps an output
    assert rerun_of(dataclasses.replace(trace, calls=()), once, frozenset()) is None  # calls unknown
    made = step.region("once", once)
    assert made is not None and made[0].rerun == "once"
    norm = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)).train()  # writes its statistics
    traced = trace_step(norm, (torch.randn(4, 16),), lambda m, x: m(x).sum(), repeats=1)
    assert rerun_of(traced, [op.index for op in Step(traced).forward if op.module], frozenset()) is None


def test_the_calls_and_their_inputs_go_through_a_trace_file(tmp_path) -> None:
    torch.manual_seed(0)
    trace = trace_step(_Twice(), (torch.randn(4, 16),), repeats=1)
    assert trace.calls and trace.call_inputs
    save(trace, tmp_path / "t.jsonl")
    back = load(tmp_path / "t.jsonl")
    assert (back.calls, back.call_inputs) == (trace.calls, trace.call_inputs)
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    bad = lines[0].replace('"calls":{', '"calls":{"x":-1,')
    assert bad != lines[0]
    (tmp_path / "bad.jsonl").write_text("\n".join([bad, *lines[1:]]) + "\n")
    with pytest.raises(RematValueError, match="calls must map module paths to call counts"):
        load(tmp_path / "bad.jsonl")


class _Growing(nn.Module):
    """Each call concatenates its input once more: a Python count the module changes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.cat([self.inner(x)] * self.calls, dim=1).sin().sum(dim=1, keepdim=True)


class _Outer(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.head = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x)).sum()


def _rerun_plan(model: nn.Module, x: torch.Tensor) -> Plan:
    # a module whose calls grow (``_Growing``) makes more in the capture's call that measures the
    # allocator than in the traced one: no unseen bytes here (NOTE [unseen bytes])
    trace = dataclasses.replace(trace_step(model, (x,), repeats=1), unseen_bytes=0)
    step = Step(trace, rerun_modules=True)
    made = step.region("block", _ops_of(step, "block"))
    assert made is not None and made[0].rerun == "block"
    return dataclasses.replace(plan_trace(trace, 1.0), regions=(made[0],))


def test_a_module_that_computes_other_shapes_when_run_again_is_refused() -> None:
    torch.manual_seed(0)
    model, x = _Outer(_Growing()), torch.randn(4, 8)
    plan = _rerun_plan(model, x)
    model.block.calls = 1  # the forward as traced (its second: planning's untimed forward, then the
    # traced one; its first call is checked), the call again not
    with plan.apply(model):
        loss = model(x)
    with pytest.raises(RecomputationError, match="a tensor made again differs from the forward's"):
        loss.backward()


class _OwnGradient(nn.Module):
    """Differentiates inside its forward (a gradient penalty)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x).tanh()
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        return y + g.pow(2).sum(dim=1, keepdim=True)


def test_backward_inside_a_module_run_again_is_refused() -> None:
    torch.manual_seed(0)
    model, x = _Outer(_OwnGradient()), torch.randn(4, 8, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="could not run again saving nothing"):  # NOTE [let go]
        plan = _rerun_plan(model, x)
    with pytest.raises(RecomputationError, match="whose call is still running"), plan.apply(model):
        model(x)


def test_a_plan_running_a_module_again_needs_the_model_it_was_made_for() -> None:
    torch.manual_seed(0)
    model, x = _Outer(_Growing()), torch.randn(4, 8)
    plan = _rerun_plan(model, x)
    other = nn.Sequential(nn.Linear(8, 1))
    refused = pytest.raises(RematTypeError, match="a module the plan runs again is not in the model")
    with refused, plan.apply(other):
        pass


def test_the_capture_leaves_no_hook_behind() -> None:
    """The call inputs are noted by a forward hook on each named module, removed after the capture
    (a global hook with keyword arguments leaves an entry behind in torch 2.13, and Dynamo then
    compiled no module call of the process)."""
    model = _Twice()
    trace_step(model, (torch.randn(4, 16),), repeats=1)
    assert not any(m._forward_hooks or m._forward_hooks_with_kwargs for m in model.modules())
    assert not nn.modules.module._global_forward_hooks_with_kwargs


class _Drawing(nn.Module):
    """Dropout drawn from a generator of its own, given to the op."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.generator = torch.Generator().manual_seed(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        return (h * torch.rand(h.shape, generator=self.generator).gt(0.5)).sin().sum(dim=1, keepdim=True)


class _Holder:
    """An object that holds a tensor, which no trace sees."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _Holding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, holder: _Holder | None = None) -> torch.Tensor:
        return self.inner(x).sin()


class _Around(nn.Module):
    """Calls ``block`` with an object argument, then its child straight after it."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _Holding()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x, holder=_Holder(x * 2)) if self.training else self.block(x)
        return self.head(self.block.inner(h)).sum()


def test_modules_whose_call_running_again_the_trace_cannot_account_for_do_not_qualify() -> None:
    """A module drawing from a generator passed to an op (not replayed), one given an object that
    may hold tensors (not in the prediction), one whose child is called again outside its call
    (its ops are then two runs)."""
    torch.manual_seed(0)
    drawing = _Outer(_Drawing())
    trace = trace_step(drawing, (torch.randn(4, 8),), repeats=1)
    step = Step(trace, rerun_modules=True)
    assert dict(trace.calls)["block"] == 1 and "block" not in dict(trace.call_inputs)
    made = step.region("block", _ops_of(step, "block"))
    assert made is not None and made[0].rerun == ""
    around = _Around().train()
    trace = trace_step(around, (torch.randn(4, 8),), repeats=1)
    assert dict(trace.calls)["block"] == 2  # its own call and its child's after it
    assert "block" not in dict(trace.call_inputs)  # given an object
    assert rerun_of(trace, _ops_of(Step(trace), "block"), frozenset()) is None


class _Scaled(nn.Module):
    """Reads a tensor it holds as a plain attribute."""

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.inner(x) * self.scale.exp()).sin().sum(dim=1, keepdim=True)


def test_a_tensor_the_module_read_written_before_it_runs_again_is_refused() -> None:
    torch.manual_seed(0)
    scale = torch.zeros(8)
    model, x = _Outer(_Scaled(scale)), torch.randn(4, 8)
    plan = _rerun_plan(model, x)
    with plan.apply(model):
        loss = model(x)
    scale.add_(0.5)  # an update after the forward read it (an EMA, say)
    with pytest.raises(RecomputationError, match="modified in place before the module ran again"):
        loss.backward()


def test_a_copy_made_while_the_plan_runs_computes_with_its_own_weights() -> None:
    torch.manual_seed(0)
    model, x = _Outer(_Scaled(torch.zeros(8))), torch.randn(4, 8)
    plan = _rerun_plan(model, x)
    with plan.apply(model):
        copied = copy.deepcopy(model)
        nn.init.zeros_(copied.block.inner.weight)
        nn.init.zeros_(copied.block.inner.bias)
        assert torch.equal(copied.block(x), torch.zeros(4, 1))
    assert "forward" not in vars(model.block)


def test_a_forward_pre_hook_running_ops_is_refused() -> None:
    """Its ops would be the module's in the trace, but run before the forward the plan wraps: one
    registered before planning keeps the module from being run again (``_Hooked`` below), one
    registered after is refused when the plan runs."""
    torch.manual_seed(0)
    model, x = _Outer(_Scaled(torch.zeros(8))), torch.randn(4, 8)
    plan = _rerun_plan(model, x)
    model.block.register_forward_pre_hook(lambda m, args: (args[0] + 1,))
    with (
        pytest.raises(RecomputationError, match=r"diverged from the traced step \(op #0: .* got aten\.add"),
        plan.apply(model),
    ):
        model(x)


class _Rising(nn.Module):
    """Dropout at rate 0 when traced (no random number drawn), raised before training."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.inner(x)).sin().sum(dim=1, keepdim=True)


def test_a_module_taking_another_path_than_traced_is_refused_at_its_first_call() -> None:
    """NOTE [a call run bare is checked once]: a dropout whose rate rose from 0 after the plan was
    made draws random numbers the traced call did not, and holds a mask the plan did not count
    (a Llama planned in eval mode and trained ran 12% over its budget, unseen); the tape refuses
    such a forward op by op, and so does the first call of a module run again."""
    torch.manual_seed(0)
    model, x = _Outer(_Rising()), torch.randn(4, 8)
    plan = _rerun_plan(model, x)
    model.block.drop.p = 0.5
    got = r"\(block, run again as a module: op #2: expected aten\.sin\.default, got aten\.empty_like"
    with pytest.raises(RecomputationError, match=r"diverged from the traced step " + got), plan.apply(model):
        model(x)


def test_a_refused_call_leaves_the_block_ready_for_a_forward_that_takes_the_traced_path() -> None:
    """The refusal stops the forward, as the tape's does: one run again in the same block starts
    from its first op (it was refused as "ran ops of its call before its forward": the count
    stayed at the region's first op, past the ops before it)."""
    torch.manual_seed(0)
    model, x = _Outer(_Rising()), torch.randn(4, 8)
    model.forward = lambda x: model.head(model.block(x * 2)).sum()  # an op before the region
    plan = _rerun_plan(model, x)
    assert plan.regions[0].first > 0
    with plan.apply(model):
        model.block.drop.p = 0.5
        with pytest.raises(RecomputationError, match="run again as a module"):
            model(x)
        model.block.drop.p = 0.0
        loss = model(x)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("change", ["dropout rate", "attention kernels"])
def test_a_setting_changed_after_the_first_check_is_checked_again(change: str) -> None:
    """The dropout rates of its modules and the attention kernels allowed are in the setting a
    call is checked once for (NOTE [a call run bare is checked once])."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    x = torch.randn(8, 8)
    model = _Outer(_Attending() if change == "attention kernels" else _Rising())
    outer = sdpa_kernel(SDPBackend.MATH) if change == "attention kernels" else contextlib.nullcontext()
    with outer:
        plan = _rerun_plan(model, x)
        with plan.apply(model):
            model(x).backward()
    if change == "dropout rate":
        model.block.drop.p = 0.5
    with (
        pytest.raises(RecomputationError, match=r"run again as a module: op #\d+: expected"),
        plan.apply(model),
    ):
        model(x)


def test_the_first_call_checks_the_shapes_the_plan_was_made_for() -> None:
    """As the executor checks each op's result outside the module regions."""
    torch.manual_seed(0)
    model = _Outer(_Rising())
    plan = _rerun_plan(model, torch.randn(8, 8))
    made = (
        r"run again as a module: op #\d+ aten\.addmm\.default made float32\[4, 8\], planned float32\[8, 8\]"
    )
    with pytest.raises(RecomputationError, match=made), plan.apply(model):
        model(torch.randn(4, 8))


def test_a_module_run_again_is_checked_once_per_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first call in a train or eval mode and autocast state runs under the check; later calls
    in the same setting run bare, with the same gradients as the plain model's."""
    checks = []

    class Counted(module_calls.CallCheck):
        def __init__(self, *args: Any) -> None:
            checks.append(args[4])
            super().__init__(*args)

    monkeypatch.setattr(module_calls, "CallCheck", Counted)
    torch.manual_seed(0)
    model, x = _Outer(_Rising()), torch.randn(4, 8)
    plan = _rerun_plan(model, x)
    planned = twin(model)
    ran = train(planned, lambda _: {"x": x}, steps=3, region=lambda: plan.apply(planned))
    assert_same(train(twin(model), lambda _: {"x": x}, steps=3), ran)
    assert checks == ["block"]


def test_a_failed_apply_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model, x = _Outer(_Growing()), torch.randn(4, 8)
    plan = _rerun_plan(model, x)
    other = nn.Sequential(nn.Linear(8, 1))
    with pytest.raises(RematTypeError), plan.apply(other):
        pass
    assert not other._forward_pre_hooks and not other._forward_hooks
    assert all("forward" not in vars(m) for m in other.modules())
    assert other(x).shape == (4, 1)


def test_an_inference_tensor_given_to_a_module_run_again_is_refused() -> None:
    torch.manual_seed(0)
    model, x = _Outer(_Scaled(torch.zeros(8))), torch.randn(4, 8)
    plan = _rerun_plan(model, x)
    with torch.inference_mode():
        frozen = torch.randn(4, 8)
    with pytest.raises(RematTypeError, match="cannot keep an inference tensor"), plan.apply(model):
        model(frozen)


class _Attending(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 4, 3, 2, 4).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(8, 8).sum(dim=1, keepdim=True)


def test_the_attention_kernels_the_forward_was_allowed_are_those_of_the_run_again() -> None:
    """``sdpa_kernel`` around the forward only: backward outside it runs the module again with the
    forward's kernel, so the gradients are the plain model's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model, x = _Outer(_Attending()), torch.randn(8, 8)
    with sdpa_kernel(SDPBackend.MATH):  # the plan's path: another kernel is another path
        plan = _rerun_plan(model, x)
        model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with sdpa_kernel(SDPBackend.MATH), plan.apply(model):
        loss = model(x)
    loss.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected, strict=True))


def test_rerun_modules_must_be_a_flag() -> None:
    torch.manual_seed(0)
    model, x = _Outer(_Growing()), torch.randn(4, 8)
    rule = r"remat.plan: rerun_modules must be True or False \(got 'yes'\)"
    with pytest.raises(RematTypeError, match=rule):
        remat.plan(model, (x,), 0.9, rerun_modules="yes")  # type: ignore[arg-type]
    trace = trace_step(model, (x,), repeats=1)
    with pytest.raises(RematTypeError, match="rerun_modules must be True or False"):
        plan_trace(trace, 0.9, rerun_modules=1)  # type: ignore[arg-type]


def test_asking_for_modules_run_again_never_raises_the_floor() -> None:
    """A module run again holds what its call holds, which on DeBERTa (whose attention returns its
    probabilities to the encoder's loop) is more than the tape's replay: the tape's plans stay
    candidates, so the smallest feasible peak is no higher with ``rerun_modules``."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    from remat.planner.api import BudgetTooSmall

    torch.manual_seed(0)
    config = DebertaV2Config(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        vocab_size=96,
        max_position_embeddings=64,
        relative_attention=True,
        position_buckets=8,
        max_relative_positions=16,
        pos_att_type=["p2c", "c2p"],
    )
    model = DebertaV2ForMaskedLM(config).train()
    ids = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(19))
    trace = fixed_costs(trace_step(model, {"input_ids": ids, "labels": ids}, repeats=1))
    floors = {}
    for rerun in (False, True):
        with pytest.raises(BudgetTooSmall) as info:
            plan_trace(trace, 1, block_key=block_key(model), rerun_modules=rerun)
        floors[rerun] = info.value.minimum_bytes
    assert floors[True] <= floors[False]


def test_a_module_run_again_that_recomputes_nothing_holds_its_generator_state_as_predicted() -> None:
    """A linear layer on the raw input saves only the input and its weight: nothing to recompute,
    but its frame keeps the generators' state until its node's backward, which the prediction let
    go of at the region's end (5 KiB over it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    x = torch.randn(128, 32)
    trace = fixed_costs(trace_step(model, (x,), lambda m, x: m(x).square().mean(), repeats=1))
    step = Step(trace, rerun_modules=True)
    made = step.region("0", _ops_of(step, "0"))
    assert made is not None and made[0].rerun == "0" and not made[1].save
    plan = dataclasses.replace(plan_trace(trace, 1.0), regions=(made[0],))
    predicted = remat.planner.search.predicted(step, [made]).peak_bytes
    model.zero_grad(set_to_none=True)
    with remat.memory.track(timeline=False, allocator=True) as tracked, plan.apply(model):
        model(x).square().mean().backward()
    assert tracked.peak_bytes == predicted


def test_a_llama_planned_in_eval_mode_and_trained_is_refused() -> None:
    """``from_pretrained`` gives a model in eval mode: planned so and then trained, its attention
    layers draw dropout masks the plan never counted. The tape's plan refuses the step op by op;
    the plan running modules again did not (its gradients were right, its peak 12% over the
    budget, 32 KB over its prediction); it refuses it now, at the first call."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=64,
        attention_dropout=0.5,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 96, (2, 24))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    trace = trace_step(model, batch, repeats=1)
    _, every = _every_layer(model, trace, rerun=True)
    plan = _plan(trace, model, every)
    assert [r.rerun for r in plan.regions] == ["model.layers.0", "model.layers.1"]
    model.train()
    refused = r"diverged from the traced step \(model\.layers\.0, run again as a module: op #\d+"
    with pytest.raises(RecomputationError, match=refused), plan.apply(model):
        model(**batch)
    assert all(p.grad is None for p in model.parameters())


class _Hooked(nn.Module):
    """Blocks whose calls run more than their forward: a pre-hook scaling the input, or a full
    backward hook (torch wraps the call's input and output in ops of its own)."""

    def __init__(self, hook: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
            for _ in range(4)
        )
        self.head = nn.Linear(32, 1)
        for block in self.blocks:
            if hook == "pre":
                block.register_forward_pre_hook(lambda module, args: (args[0] * 0.9,))
            else:
                block.register_full_backward_hook(lambda module, grad_in, grad_out: None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).square().mean()


@pytest.mark.parametrize("hook", ["pre", "backward"])
def test_a_module_whose_calls_the_program_hooks_is_not_run_again(hook: str) -> None:
    """Its hooks' ops are part of its call in the trace and not of its ``forward``: the planner
    made plans running it again, which ``plan.apply`` then refused at the first forward."""
    model, x = _Hooked(hook), torch.randn(8, 16, 32)
    trace = fixed_costs(trace_step(model, (x,), repeats=1))
    assert not any(name.startswith("blocks.") and name.count(".") == 1 for name, _ in trace.call_inputs)
    plain = twin(model)
    plain(x).backward()
    for budget in (0.5, 0.7):
        plan = plan_trace(trace, budget, block_key=block_key(model), rerun_modules=True)
        assert plan.regions and not any(r.rerun for r in plan.regions)
        model.zero_grad(set_to_none=True)
        with plan.apply(model):
            loss = model(x)
        loss.backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name


class _Averaging(nn.Module):
    """A layer that binds a new tensor to its buffer in every training forward (a running average
    ``self.ema = ...``, as Wav2Vec2-Conformer's ``self.pe = self.pe.to(x.dtype)`` binds one under
    autocast) and reads it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = (
            nn.Linear(width, 2 * width),
            nn.Linear(2 * width, width),
            nn.Dropout(0.1),
        )
        self.register_buffer("ema", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * x.detach().mean((0, 1))
        return x + self.fc2(self.drop(torch.relu(self.fc1(x - self.ema))))


class _Averaged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 32), nn.Linear(32, 50)
        self.layers = nn.ModuleList([_Averaging(32), _Averaging(32)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten())


def _steps(model: nn.Module, ids: torch.Tensor, plan: Plan | None) -> list[list[torch.Tensor]]:
    """Three SGD steps: each one's loss, gradients, buffers and generator state."""
    seen = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        with plan.apply(model) if plan is not None else contextlib.nullcontext():
            loss = model(ids)
        loss.backward()
        seen.append(
            [loss.detach(), *(p.grad for p in model.parameters()), *model.buffers(), torch.get_rng_state()]
        )
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
    return seen


@pytest.mark.parametrize("rerun", [False, True], ids=["tape", "modules-run-again"])
def test_a_buffer_bound_anew_in_forward_is_put_back_by_planning_and_read_as_found(
    rerun: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planning left each layer's ``ema`` bound to the tensor its last planning step made, so every
    planned step trained from other averages than the plain one (silently); a layer run again in
    backward read the average its forward had just made and advanced it once more."""
    trace_with_fixed_costs(monkeypatch)
    torch.manual_seed(0)
    model = _Averaged().train()
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    plain = copy.deepcopy(model)
    before = {name: (b, b.clone()) for name, b in model.named_buffers()}
    plan = remat.plan(model, (ids,), 0.95, rerun_modules=rerun, repeats=1)
    after = dict(model.named_buffers())
    assert all(after[name] is b and torch.equal(b, value) for name, (b, value) in before.items())
    if rerun:  # every layer one region, run again as the layer
        trace = fixed_costs(trace_step(model, (ids,), repeats=1))
        plan = _plan(trace, model, _every_layer(model, trace, rerun=True)[1])
    assert plan.regions and all(bool(r.rerun) == rerun for r in plan.regions if r.name.startswith("layers"))
    assert any(r.name.startswith("layers") for r in plan.regions)
    ran, ref = _steps(model, ids, plan), _steps(plain, ids, None)
    assert all(
        torch.equal(a, b)
        for step, twin_step in zip(ref, ran, strict=True)
        for a, b in zip(step, twin_step, strict=True)
    )
