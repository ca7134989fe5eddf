"""Plans whose every region runs as its module called again run their forwards bare after the first
in each setting (NOTE [bare forward] in ``remat.planner.module_calls``): no dispatch mode, training
bit for bit as the plain model, the same allocator peak, and the checks where the setting changes."""

from __future__ import annotations

import contextlib
import types
from typing import Any

import pytest
import torch
from models import assert_same, train, twin
from plans import fixed_costs
from test_plan_floor import FAMILIES, _peak
from test_rerun import _every_layer, _family, _plan
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import remat.planner.module_calls as module_calls
from remat import RecomputationError, RematValueError
from remat.planner import Plan, trace_step
from remat.planner.predict import predict
from remat.trace.types import Phase


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(64, 16)

        self.short = False  # Python state no setting sees: the block runs fewer ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(nn.functional.gelu(self.fc1(x)))
        return h if self.short else x + self.fc2(h)


class _Stack(nn.Module):
    """Four blocks and a head; notes the dispatch mode its forward runs under, and ``skip`` or
    ``twice`` (Python state no setting sees) change which blocks it calls."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(4))
        self.head = nn.Linear(16, 1)
        self.modes: list[object] = []
        self.skip = self.twice = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append(_get_current_dispatch_mode())
        for i, block in enumerate(self.blocks):
            if not (self.skip and i == 1):
                x = block(x)
            if self.twice and i == 2:
                x = block(x)
        return self.head(x).square().mean()


def _stack(rerun: bool = True, hook: bool = False) -> tuple[_Stack, dict[str, torch.Tensor], Plan]:
    """The stack and a plan of every block its own region: run again as the block (``rerun``) or
    taped, each anchored at the block's call; with ``hook``, the third block has a forward pre-hook
    that runs an op."""
    torch.manual_seed(0)
    model = _Stack().train()
    if hook:
        model.blocks[2].register_forward_pre_hook(lambda _, args: (args[0] * 1.0,))
    batch = {"x": torch.randn(32, 16)}
    trace = fixed_costs(trace_step(model, batch, repeats=1))
    _, every = _every_layer(model, trace, rerun=rerun)
    regions = [r for r, _ in every.regions]
    assert len(regions) == 4 and all(bool(r.rerun) is rerun and r.anchor == r.name for r in regions)
    return model, batch, _plan(trace, model, every)


def _started(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each forward's ``Bare.start``: True where it ran bare."""
    starts: list[bool] = []
    start = module_calls.Bare.start

    def counted(self: module_calls.Bare, args: Any, kwargs: Any) -> bool:
        starts.append(start(self, args, kwargs))
        return starts[-1]

    monkeypatch.setattr(module_calls.Bare, "start", counted)
    return starts


@pytest.mark.parametrize("rerun", [True, False], ids=["run again", "taped"])
def test_after_its_first_forward_a_plan_of_anchored_regions_runs_bare(
    rerun: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three steps, each in an apply block of its own: the first forward runs under the executor's
    mode, the next two under none outside the regions, and losses, gradients, buffers and the RNG
    stream (dropout) are the plain model's."""
    model, batch, plan = _stack(rerun)
    starts = _started(monkeypatch)
    planned = twin(model)
    planned.modes.clear()
    ran = train(planned, lambda _: batch, steps=3, region=lambda: plan.apply(planned))
    assert_same(train(twin(model), lambda _: batch, steps=3), ran)
    assert starts == [False, True, True]
    assert planned.modes[0] is not None and planned.modes[1:] == [None, None]


def test_check_every_checks_every_forward() -> None:
    model, batch, plan = _stack()
    planned = twin(model)
    planned.modes.clear()
    ran = train(planned, lambda _: batch, steps=3, region=lambda: plan.apply(planned, check="every"))
    assert_same(train(twin(model), lambda _: batch, steps=3), ran)
    assert all(mode is not None for mode in planned.modes) and len(planned.modes) == 3


def test_check_must_be_first_or_every() -> None:
    model, batch, plan = _stack()
    with (
        pytest.raises(
            RematValueError, match=r"remat\.plan\.apply: check is 'first' or 'every' \(got 'once'\)"
        ),
        plan.apply(model, check="once"),
    ):  # type: ignore[arg-type]
        pass


def _bare_twice(model: _Stack, batch: dict[str, torch.Tensor], plan: Plan) -> None:
    for _ in range(2):
        with plan.apply(model):
            model(**batch).backward()
    assert model.modes[-1] is None


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        (
            "batch size",
            r"op #\d+ aten\.addmm\.default in head made float32\[16, 1\], planned float32\[32, 1\]",
        ),
        ("eval mode", r"diverged from the traced step"),
        ("input requires grad", None),  # the same ops: checked, and run
    ],
)
def test_a_forward_in_another_setting_is_checked_again(change: str, refused: str | None) -> None:
    model, batch, plan = _stack()
    _bare_twice(model, batch, plan)
    x = batch["x"]
    if change == "batch size":
        x = x[:16]
    elif change == "eval mode":
        model.eval()
    else:
        x = x.clone().requires_grad_()
    refusal = pytest.raises(RecomputationError, match=refused) if refused else contextlib.nullcontext()
    with refusal, plan.apply(model):
        model(x).backward()
    assert model.modes[-1] is not None


def test_a_forward_given_an_object_is_checked_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a namespace holds is not in the setting: its forwards are all checked."""

    class Holding(nn.Module):
        def __init__(self, inner: _Stack) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, batch: types.SimpleNamespace) -> torch.Tensor:
            return self.inner(batch.x)

    torch.manual_seed(0)
    model = Holding(_Stack())
    batch = {"batch": types.SimpleNamespace(x=torch.randn(32, 16))}
    trace = fixed_costs(trace_step(model, batch, repeats=1))
    _, again = _every_layer(model, trace, rerun=True)
    plan = _plan(trace, model, again)
    assert plan.regions and all(r.rerun for r in plan.regions)
    starts = _started(monkeypatch)
    for _ in range(3):
        with plan.apply(model):
            model(**batch).backward()
    assert starts == [False, False, False]


@pytest.mark.parametrize(
    ("rerun", "flag", "refused"),
    [
        (True, "skip", r"blocks\.1 not called"),
        (True, "twice", r"blocks\.2 called again in one forward"),
        (False, "skip", r"blocks\.1 not called"),
        (False, "twice", r"blocks\.2 called again in one forward"),
        (False, "short", r"blocks\.0 ran \d+ of its \d+ traced ops"),
    ],
)
def test_a_bare_forward_that_calls_a_region_module_otherwise_is_refused(
    rerun: bool, flag: str, refused: str
) -> None:
    """A path that changes with Python state no setting sees: each region's module must still be
    called once, and a taped region run its traced ops; after the refusal the block runs the
    traced path again, bare."""
    model, batch, plan = _stack(rerun)
    _bare_twice(model, batch, plan)
    where = model.blocks[0] if flag == "short" else model
    with plan.apply(model):
        setattr(where, flag, True)
        with pytest.raises(RecomputationError, match=r"remat\.plan: .*a forward run bare: " + refused):
            model(**batch)
        setattr(where, flag, False)
        model(**batch).backward()
    assert model.modes[-1] is None
    assert all(p.grad is not None for p in model.parameters())


def test_a_pre_hook_running_ops_keeps_every_forward_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its ops come before the taped region's first op in the count, not inside the block's call
    where a bare forward would start counting: the block stays checked, and trains as the plain
    model."""
    model, batch, plan = _stack(rerun=False, hook=True)
    assert plan.regions[2].anchor == "blocks.2" and plan.ops[plan.regions[2].first] == "aten.mul.Tensor"
    starts = _started(monkeypatch)
    plain = twin(model)
    planned = twin(model)
    assert_same(
        train(plain, lambda _: batch, steps=3),
        train(planned, lambda _: batch, steps=3, region=lambda: plan.apply(planned)),
    )
    assert starts == [False, False, False]


def test_the_prediction_checks_only_the_taped_ops_where_every_region_is_anchored() -> None:
    """NOTE [bare forward]: a plan of anchored regions is predicted at its steady state, where the
    executor's mode runs on no op: blocks run again are plain calls, taped ones (dropout's draws
    included) run from their templates; one region over two blocks is no call of any module, and
    the plan's every forward op is checked."""
    model, batch, _ = _stack()
    trace = fixed_costs(trace_step(model, batch, repeats=1))
    step, again = _every_layer(model, trace, rerun=True)
    _, taped = _every_layer(model, trace, rerun=False)
    assert again.pred.work.checked == 0
    assert taped.pred.work.checked == taped.pred.work.recorded == 0
    two = step.region("two blocks", [*again.regions[0][1].ops, *again.regions[1][1].ops])
    assert two is not None and not two[0].anchor and not two[1].anchored
    every_op = predict(trace, [two[1]]).work.checked
    assert every_op > taped.pred.work.checked
    assert every_op == sum(op.phase is Phase.FORWARD and bool(op.module) for op in trace.ops)


@pytest.mark.parametrize("rerun", [True, False], ids=["run again", "taped"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_bare_step_measures_the_predicted_peak(
    name: str, rerun: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Llama, ViT, GPT-2 and BERT with every layer its own region, run again or taped: the
    allocator's peak of a bare step is a checked step's, within the prediction (to the byte where
    the layers run again; BERT's taped plan measures 256 bytes under it)."""
    model, batch, trace = _family(name)
    _, every = _every_layer(model, trace, rerun=rerun)
    plan = _plan(trace, model, every)
    assert all(r.anchor for r in plan.regions)
    starts = _started(monkeypatch)
    checked, bare = (_peak(model, batch, plan) for _ in range(2))
    assert starts[-1] is True
    assert bare == checked <= every.pred.peak_bytes
    assert checked >= 0.99 * every.pred.peak_bytes


def test_a_saved_plan_keeps_its_anchors(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch, plan = _stack(rerun=False)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert (
        [r.anchor for r in loaded.regions]
        == [r.anchor for r in plan.regions]
        == [f"blocks.{i}" for i in range(4)]
    )
    starts = _started(monkeypatch)
    for _ in range(2):
        with loaded.apply(model):
            model(**batch).backward()
    assert starts == [False, True]


def test_a_plan_applied_to_a_model_without_its_anchors_checks_every_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A taped region is found by its ops' count, whatever the modules are named: the same blocks
    under another name train as the plain model, every forward checked, as before anchors."""
    model, batch, plan = _stack(rerun=False)

    class Renamed(nn.Module):
        def __init__(self, stack: _Stack) -> None:
            super().__init__()
            self.stages, self.head = stack.blocks, stack.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for stage in self.stages:
                x = stage(x)
            return self.head(x).square().mean()

    starts = _started(monkeypatch)
    planned = Renamed(twin(model))
    assert_same(
        train(Renamed(twin(model)), lambda _: batch, steps=3),
        train(planned, lambda _: batch, steps=3, region=lambda: plan.apply(planned)),
    )
    assert starts == []  # no Bare: the anchors are not the model's
