"""What a plan promises beyond its regions: it runs only on the shapes and dtypes it was made for
(its memory is theirs), planning leaves every tensor of the user's as it was (not only the
model's), a module run again holds the generators' state as long as its first op's saves, and a
damaged plan file is refused."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import remat
from remat import Plan, RecomputationError, RematValueError
from remat.planner import plan_trace, trace_step
from remat.planner.api import block_key
from remat.planner.cost_model import NO_EXECUTOR_COST
from remat.planner.search import Step, predicted


def _mlp(width: int = 64, hidden: int = 256) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width)) for _ in range(4)]
    )


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


HOOKS: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "remat.offload": remat.offload,
    "remat.scope": remat.scope,
    "save_on_cpu": torch.autograd.graph.save_on_cpu,
}


@pytest.mark.parametrize("around", list(HOOKS))
def test_a_plan_refuses_a_forward_under_saved_tensor_hooks_of_another(around: str) -> None:
    """Inside ``remat.offload`` the plan named the offloader's own ops diverged from the traced
    step ("plan again with inputs that take this path"): the hooks around decide what autograd
    keeps, as the plan does. Refused, naming them, before the first op; the plan runs after."""
    model, x = _mlp(), torch.randn(256, 64)
    plan = remat.plan(model, (x,), 0.6, loss_fn=_loss, repeats=1)
    rule = r"remat\.plan: a plan runs the model's forward under no saved-tensor hooks of another"
    with (
        pytest.raises(RematValueError, match=rule + r".*\(the forward started under \w"),
        HOOKS[around](),
        plan.apply(model),
    ):
        _loss(model, x)
    model.zero_grad(set_to_none=True)
    with plan.apply(model):
        _loss(model, x).backward()
    planned = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    _loss(model, x).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), planned, strict=True))


def test_a_plan_refuses_a_model_run_inside_torch_utils_checkpoint() -> None:
    """``torch.utils.checkpoint(model, x)`` under a plan: the checkpoint's hooks and the plan's both
    took what autograd saves (the checkpoint refused its recomputation, or its gradients were off)."""
    model, x = _mlp(), torch.randn(256, 64)
    plan = remat.plan(model, (x,), 0.6, loss_fn=_loss, repeats=1)
    rule = r"remat\.plan: a plan runs the model's forward under no saved-tensor hooks of another"
    with pytest.raises(RematValueError, match=rule), plan.apply(model):
        torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)


def test_a_plan_refuses_a_model_checkpointed_whole() -> None:
    """``remat.checkpoint(model)`` pushes its hooks inside the forward, after the plan's start: its
    own ops were named diverged from the traced step ("plan again with inputs that take this path")."""
    model, x = _mlp(), torch.randn(256, 64)
    plan = remat.plan(model, (x,), 0.6, loss_fn=_loss, repeats=1)
    wrapped = remat.checkpoint(copy.deepcopy(model))
    rule = r"remat\.plan: a plan runs the model's forward under no saved-tensor hooks of another"
    with pytest.raises(RematValueError, match=rule), plan.apply(wrapped):
        _loss(wrapped, x)


def test_a_child_checkpointed_after_planning_is_named_in_the_divergence() -> None:
    """A module wrapped with ``remat.checkpoint`` after the plan was made runs other ops (its own
    hooks' among them): the divergence's advice named control flow, shapes and modes only."""
    model, x = _mlp(), torch.randn(256, 64)
    plan = remat.plan(model, (x,), 0.9, loss_fn=_loss, repeats=1)
    remat.checkpoint(model[2])
    hint = r"diverged from the traced step .*and with the modules as they run \(a checkpoint wrapped around"
    with pytest.raises(RecomputationError, match=hint), plan.apply(model):
        _loss(model, x)


def test_copies_of_the_model_made_under_a_plan_run_plainly() -> None:
    """A deep copy (an EMA's snapshot) made inside ``apply`` took a copy of the plan's runner, which
    refused any other batch for good; ``torch.save`` of the model failed on its local hooks."""
    import io

    model, x = _mlp(), torch.randn(256, 64)
    plan = remat.plan(model, (x,), 0.9, loss_fn=_loss, repeats=1)
    with plan.apply(model):
        _loss(model, x).backward()
        snapshot = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    other = torch.randn(3, 64)
    expected = model(other)
    for copied in (snapshot, loaded):
        assert torch.equal(copied(other), expected)
        with plan.apply(model):  # a block of the original's leaves the copies plain as well
            assert torch.equal(copied(other), expected)


def test_a_second_apply_block_on_one_model_is_refused() -> None:
    """It counted the model's ops twice and was refused as a forward that diverged from the trace."""
    model, x = _mlp(), torch.randn(256, 64)
    plan = remat.plan(model, (x,), 0.9, loss_fn=_loss, repeats=1)
    with plan.apply(model):
        with pytest.raises(
            RematValueError, match=r"remat\.plan\.apply: a model runs under one plan at a time"
        ):
            plan.apply(model).__enter__()
        _loss(model, x).backward()  # the open block runs on


def test_a_plan_refuses_parameters_trained_otherwise_than_planned(tmp_path: Path) -> None:
    """A plan made with half the layers frozen ran silently with them unfrozen, at 1.9x its budget
    (autograd saves other tensors); the flags travel with a saved plan, and as planned it runs."""
    model, x = _mlp(), torch.randn(256, 64)
    for p in model[:2].parameters():
        p.requires_grad_(False)
    plan = remat.plan(model, (x,), 0.9, loss_fn=_loss, repeats=1)
    plan.save(tmp_path / "plan.json")
    for p in model[:2].parameters():
        p.requires_grad_(True)
    for made in (plan, Plan.load(tmp_path / "plan.json")):
        with pytest.raises(
            RematValueError, match=r"remat\.plan\.apply: the model's parameters require grad "
        ):
            made.apply(model)
    for p in model[:2].parameters():
        p.requires_grad_(False)
    with remat.memory.track(allocator=True) as measured, plan.apply(model):
        _loss(model, x).backward()
    assert measured.peak_bytes <= plan.budget_bytes


@pytest.mark.parametrize(
    "change", ["batch", "width", "dtype"], ids=["another batch size", "another width", "another dtype"]
)
def test_a_plan_refuses_shapes_it_was_not_made_for(change: str) -> None:
    """A plan made for a 256-row batch ran silently on 512 rows, a wider model or float64, and
    passed its budget by up to 1.6x: each op's first result is now checked against the trace."""
    model, x = _mlp(), torch.randn(256, 64)
    plan = remat.plan(model, (x,), 0.6, loss_fn=_loss)
    assert plan.regions and len(plan.shapes) == len(plan.ops)
    other, y = model, x
    if change == "batch":
        y = torch.randn(512, 64)
    elif change == "width":
        other, y = _mlp(hidden=512), x
    else:
        other, y = _mlp().double(), x.double()
    with (
        pytest.raises(
            RecomputationError, match=r"remat\.plan: each op makes the dtype and shape .* planned float32\["
        ),
        plan.apply(other),
    ):
        _loss(other, y)
    with plan.apply(model):  # the runner is left clean: the plan still runs what it was made for
        _loss(model, x).backward()


def test_planning_leaves_an_inputs_gradient_and_a_loss_heads_state_as_they_were() -> None:
    """The capture's backward accumulated into an input's ``.grad`` and into a loss head's weights,
    and the head's batch norm counted two more batches; only the model's own state was put back."""
    model = _mlp()
    torch.manual_seed(1)
    head = nn.Sequential(nn.Linear(64, 10), nn.BatchNorm1d(10))
    x, y = torch.randn(256, 64, requires_grad=True), torch.randint(0, 10, (256,))
    mean = head[1].running_mean.clone()

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(m(x)), y)

    remat.plan(model, (x, y), 0.6, loss_fn=loss)
    assert x.grad is None and head[0].weight.grad is None
    assert torch.equal(head[1].running_mean, mean) and int(head[1].num_batches_tracked) == 0
    assert all(p.grad is None for p in model.parameters())


def test_planning_between_accumulated_steps_leaves_every_gradient_as_it_was() -> None:
    """Gradients already there (accumulation over micro-batches) keep their values: backward adds
    into an existing ``.grad`` in place, so giving back the same tensor gave back the sum."""
    model = _mlp()
    torch.manual_seed(1)
    head = nn.Linear(64, 10)
    x, y = torch.randn(256, 64, requires_grad=True), torch.randint(0, 10, (256,))

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(head(m(x)), y)

    loss(model, x, y).backward()
    tensors = [x, *model.parameters(), *head.parameters()]
    before = [(t.grad, t.grad.clone()) for t in tensors if t.grad is not None]
    assert len(before) == len(tensors)
    remat.plan(model, (x, y), 0.6, loss_fn=loss)
    for t, (grad, value) in zip(tensors, before, strict=True):
        assert t.grad is grad and torch.equal(grad, value)


_HEAD = nn.BatchNorm1d(64)


def _global_head_loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _HEAD(m(x)).square().mean()


def test_planning_puts_back_a_module_the_loss_reaches_as_a_global() -> None:
    before = int(_HEAD.num_batches_tracked)
    remat.plan(_mlp(), (torch.randn(256, 64),), 0.6, loss_fn=_global_head_loss)
    assert int(_HEAD.num_batches_tracked) == before


class _Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(100, 32)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)
        )
        self.head = nn.Linear(32, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def test_a_module_run_again_holds_the_generators_state_while_its_first_ops_saves_live() -> None:
    """An embedding run again as a region of its own: its hooks also pack the indices its first op
    saves, which live until the embedding's backward, and with them the generators' state its
    frame keeps (5,056 bytes on CPU); the prediction let that state go after the forward op and
    the step measured 5,056 bytes over it."""
    model = _Embedded()
    ids, target = torch.randint(0, 100, (8, 32)), torch.randint(0, 100, (8, 32))

    def loss(m: nn.Module, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(ids).flatten(0, 1), target.flatten())

    trace = trace_step(model, (ids, target), loss)
    step = Step(trace, block_key(model), rerun_modules=True)
    region, ops = step.region("emb", [op.index for op in step.forward if op.module == "emb"])
    assert region.rerun == "emb"
    whole = plan_trace(trace, 1.0, block_key=block_key(model))
    plan = dataclasses.replace(
        whole, regions=(region,), predicted_peak_bytes=predicted(step, [(region, ops)]).peak_bytes
    )
    with remat.memory.track(allocator=True) as tracked:
        with plan.apply(model):
            out = loss(model, ids, target)
        out.backward()
    assert tracked.peak_bytes == plan.predicted_peak_bytes


class _RunningScale(nn.Module):
    """Divides by a running average of its input's size that its forward updates in place first."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("avg", torch.ones(channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.avg.mul_(0.5).add_(x.abs().mean((0, 2)).unsqueeze(1), alpha=0.5)
        return x / self.avg


def test_a_buffer_a_region_writes_in_place_is_predicted_as_the_tape_holds_it() -> None:
    """A region that writes a buffer (an EMA) keeps a snapshot of it, and what autograd saves of the
    buffer after the write is the region's own, replayed into a copy: the step measured 1,280 bytes
    over its prediction (and its budget, where planned at it)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv1d(16, 16, 3, padding=1), _RunningScale(16), nn.Tanh()) for _ in range(6)]
    model, plain = nn.Sequential(*blocks), nn.Sequential(*blocks)
    plain = copy.deepcopy(model)
    x = torch.randn(4, 16, 512)

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x).sin().sum()

    plan = remat.plan(model, (x,), 0.75, loss_fn=loss, repeats=1, executor_cost=NO_EXECUTOR_COST)
    _runs_as_planned(plan, model, plain, loss, x)


def _runs_as_planned(
    plan: Plan,
    model: nn.Module,
    plain: nn.Module,
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
) -> None:
    """The plan (with regions) applied to ``model`` measures within its prediction and its budget
    on the allocator, and gives ``plain``'s gradients and buffers."""
    assert plan.regions
    loss(plain, x).backward()
    with remat.memory.track(allocator=True) as tracked:
        with plan.apply(model):
            out = loss(model, x)
        out.backward()
    assert tracked.peak_bytes <= plan.predicted_peak_bytes <= plan.budget_bytes
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    for a, b in zip(model.buffers(), plain.buffers(), strict=True):
        assert torch.equal(a, b)


class _MaskedBlock(nn.Module):
    """A block whose first op runs with grad off (a mask of its input)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            keep = (h.abs() < 3).to(h.dtype)
        return h + self.b(F.gelu(self.a(h * keep)))


@pytest.mark.parametrize("solver", ["auto", "sqrt", "greedy"])
def test_a_region_whose_first_op_runs_with_grad_off_still_recomputes(solver: str) -> None:
    """The executor opened a region only where grad was on at its first op: a region starting at
    a ``no_grad`` op (a mask, a spectral norm's power iteration, a custom Function's forward)
    never ran, and the step measured the plain peak whatever the plan promised."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_MaskedBlock(32) for _ in range(4)])
    plain = copy.deepcopy(model)
    x = torch.randn(256, 32)
    plan = remat.plan(
        model, (x,), 0.5, loss_fn=_loss, solver=solver, repeats=1, executor_cost=NO_EXECUTOR_COST
    )
    _runs_as_planned(plan, model, plain, _loss, x)


@pytest.mark.parametrize("save", ['"12"', "[1000000]", "[1.5]"])
def test_a_plan_file_with_kept_positions_outside_their_region_is_refused(save: str, tmp_path: Path) -> None:
    model, x = _mlp(), torch.randn(256, 64)
    plan = remat.plan(model, (x,), 0.6, loss_fn=_loss)
    body = plan.to_json()
    body["regions"][0]["save"] = json.loads(save)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(body))
    with pytest.raises(
        RematValueError, match=r"remat\.plan\.load: the plan file is incomplete or damaged .*save"
    ):
        Plan.load(path)


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("budget_bytes", "abc", "budget_bytes must be a byte count"),
        ("predicted_peak_bytes", -5, "predicted_peak_bytes must be a byte count"),
        ("gap", "x", "gap must be a finite number"),
        ("notes", 3, "notes must be text"),
        ("modules", "ints", "modules must list names"),  # loaded, and explain() crashed on them
        ("regions", "named 7", "a region's name must be a string"),
    ],
)
def test_a_plan_file_with_a_figure_of_another_type_is_refused(
    key: str, value: object, rule: str, tmp_path: Path
) -> None:
    """Such files loaded, and ``str(plan)`` crashed on them later."""
    plan = remat.plan(_mlp(), (torch.randn(256, 64),), 0.6, loss_fn=_loss)
    body = {**plan.to_json(), key: value}
    if value == "ints":
        body[key] = [1 for _ in plan.modules]
    elif value == "named 7":
        body[key] = [{**r, "name": 7} for r in plan.to_json()[key]]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(body))
    with pytest.raises(
        RematValueError, match=rf"remat\.plan\.load: the plan file is incomplete or damaged \({rule}"
    ):
        Plan.load(path)
    assert str(Plan.load(_saved(plan, tmp_path))) == str(plan)  # the plan as written loads


def _saved(plan: Plan, folder: Path) -> Path:
    path = folder / "good.json"
    plan.save(path)
    return path


def test_a_plan_file_nested_past_the_stack_is_not_json(tmp_path: Path) -> None:
    """It raised Python's RecursionError."""
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(
        RematValueError, match=r"remat\.plan\.load: the plan file is not JSON .*nested too deep"
    ):
        Plan.load(path)


def test_a_plan_saved_where_no_file_can_be_is_refused(tmp_path: Path) -> None:
    """It raised Python's FileNotFoundError."""
    plan = remat.plan(_mlp(), (torch.randn(256, 64),), 0.6, loss_fn=_loss, repeats=1)
    with pytest.raises(RematValueError, match=r"remat\.plan\.save: the file could not be written .*missing"):
        plan.save(tmp_path / "missing" / "plan.json")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp(16, 32)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_a_step_that_does_not_call_the_model_once_is_refused_when_planned() -> None:
    """A loss_fn calling submodules (``m.head(m.body(x))``) was planned, and the plan applied to that
    step ran nothing (the plan runs inside the model's call): the plain peak, 1.67 times the budget,
    in silence. A loss_fn calling the model twice was planned, and its plan refused at every use."""
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(
        RematValueError, match=r"loss_fn calls the model once.*called 0 times: loss_fn called its submodules"
    ):
        remat.plan(_Net(), (x,), budget=0.6, loss_fn=lambda m, x: m.head(m.body(x)).pow(2).mean(), repeats=1)
    with pytest.raises(
        RematValueError, match=r"loss_fn calls the model once.*called 2 times\); .*wrap two calls"
    ):
        remat.plan(
            _mlp(16, 32), (x, x), budget=0.6, loss_fn=lambda m, a, b: (m(a) - m(b)).pow(2).mean(), repeats=1
        )


@pytest.mark.parametrize("bypass", ["submodules", "forward"])
def test_a_plan_refuses_a_step_that_calls_around_the_model(bypass: str) -> None:
    """Applied to a step that calls the model's children itself, or ``model.forward`` (no hooks
    run), a plan ran nothing, in silence; now the first child's call is refused."""
    model = _Net()
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    plan = remat.plan(model, (x,), budget=0.6, loss_fn=lambda m, x: m(x).pow(2).mean(), repeats=1)
    assert plan.regions
    step = (lambda: model.head(model.body(x))) if bypass == "submodules" else (lambda: model.forward(x))
    with (
        pytest.raises(
            RematValueError,
            match=r"the plan runs inside a call of the model .*_Net.body was called before any call of _Net",
        ),
        plan.apply(model),
    ):
        step()
    with plan.apply(model):  # a call of the model first: the children's calls after it are the step's own
        model(x).pow(2).mean().backward()
        model.head(model.body(x)).sum().backward()


def test_planning_puts_back_a_weight_the_step_writes() -> None:
    """``nn.Embedding(max_norm=...)`` renormalizes its weight in every forward: planning ran the
    step several times and left it renormalized again, so the planned step trained other weights
    than the plain step (even a plan of no region)."""

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Embedding(50, 32, max_norm=1.0), nn.Tanh(), nn.Linear(32, 32))
        with torch.no_grad():
            m[0].weight.mul_(3)
        return m

    idx = torch.randint(0, 50, (8, 64), generator=torch.Generator().manual_seed(1))

    def loss(m: nn.Module, i: torch.Tensor) -> torch.Tensor:
        return m(i).square().mean()

    plain, model = build(), build()
    loss(plain, idx).backward()
    before = model[0].weight.detach().clone()
    plan = remat.plan(model, (idx,), budget=1.0, loss_fn=loss, repeats=1)
    assert torch.equal(model[0].weight, before)
    with plan.apply(model):
        out = loss(model, idx)
    out.backward()
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


class _AddsToItsInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1.0)


def test_planning_puts_back_an_input_the_step_writes() -> None:
    """A model whose first op writes its input in place: planning runs the step several times, and
    the caller's batch came back with an addition per run (3.0 more everywhere)."""
    torch.manual_seed(0)
    model = nn.Sequential(_AddsToItsInput(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    x = torch.randn(64, 16)
    before = x.clone()
    plan = remat.plan(model, (x,), budget=1.0, loss_fn=_loss, repeats=1)
    assert torch.equal(x, before)
    plain = copy.deepcopy(model)
    _loss(plain, x.clone()).backward()
    with plan.apply(model):
        out = _loss(model, x)
    out.backward()
    assert torch.equal(x, before + 1.0)  # the planned step's own write, as the plain step's
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_a_forward_that_raised_under_the_plan_leaves_nothing_behind() -> None:
    """An error out of the model's forward (a forward hook's), caught inside the ``with`` block,
    left the plan's dispatch mode on the stack, its op count where it stopped and a region's
    saved-tensor hooks pushed: the retried step was refused as diverged, and so was unrelated code."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model = _mlp(16, 32)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    plan = remat.plan(model, (x,), budget=0.6, loss_fn=_loss, repeats=1)
    assert plan.regions
    plain = copy.deepcopy(model)
    _loss(plain, x).backward()
    failing = [True]

    def hook(module: nn.Module, args: object, out: object) -> None:
        if failing:
            failing.clear()
            raise ValueError("a forward hook's error")

    handle = model[1][1].register_forward_hook(hook)  # mid-region: its hooks pushed
    with plan.apply(model):
        with pytest.raises(ValueError, match="a forward hook's error"):
            _loss(model, x)
        assert _get_current_dispatch_mode() is None
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()  # unrelated code runs as it is
        _loss(model, x).backward()  # the step again: planned, and exact
    handle.remove()
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


class _LaterWrite(nn.Module):
    """Each block reads ``x0 + 1``; ``x0`` is written in place after the block (legal: autograd
    saved no ``x0``), so a replay of the add would read the new value."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
            for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for linear, block in zip(self.l0, self.blocks, strict=True):
            x0 = linear(x)
            h = block(x0 + 1.0)
            x0.mul_(3.0)
            x = h + x0
        return x.square().mean()


@pytest.mark.parametrize("solver", ["auto", "chain", "sqrt", "greedy"])
def test_no_region_replays_from_a_value_written_in_place_after_it(solver: str) -> None:
    """NOTE [written after the region]: every plan of every solver, at budgets from the floor to
    the plain peak, runs and gives the plain gradients (chain and sqrt made plans whose backward
    the tape refused: a tensor the region read modified in place since)."""
    torch.manual_seed(0)
    model, x = _LaterWrite(), torch.randn(8, 16, 32)
    model(x).backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    trace = trace_step(model, (x,), repeats=1)
    options: dict[str, object] = dict(
        block_key=block_key(model), executor_cost=NO_EXECUTOR_COST, solver=solver
    )
    base = plan_trace(trace, 1.0, **options)
    ran = 0
    for budget in torch.linspace(0.2, 1.0, 5).tolist():
        try:
            plan = plan_trace(trace, budget, **options)
        except remat.RematError:
            continue
        if not plan.regions:
            continue
        with plan.apply(model):
            model(x).backward()
        assert all(torch.equal(p.grad, plain[n]) for n, p in model.named_parameters() if n in plain)
        model.zero_grad(set_to_none=True)
        ran += 1
    assert ran > 0 and base.baseline_peak_bytes > 0


def test_a_plan_made_on_the_meta_device_is_refused_for_a_real_model(tmp_path: Path) -> None:
    """No kernel ran to make it: no scratch, no allocator's rounding; it ran silently at 1.21 times
    its predicted peak. The device travels with a saved plan; on meta it still applies."""
    with torch.device("meta"):
        meta, x = _mlp(), torch.randn(256, 64)
    plan = remat.plan(meta, (x,), "64MB", loss_fn=_loss, repeats=1)
    real = remat.plan(_mlp(), (torch.randn(256, 64),), "64MB", loss_fn=_loss, repeats=1)
    assert plan.device == "meta" and real.device == "cpu"
    plan.save(tmp_path / "plan.json")
    for loaded in (plan, Plan.load(tmp_path / "plan.json")):
        with (
            pytest.raises(
                RematValueError, match=r"remat\.plan\.apply: a plan made on the meta device .*on cpu\)"
            ),
            loaded.apply(_mlp()),
        ):
            pass
    with plan.apply(meta):
        _loss(meta, x).backward()
