"""A taped region that is one module's call runs, after a recorded call in its setting, from that
call's template (NOTE [taped call run bare] in ``remat.planner.taped_calls``): no dispatch mode,
training bit for bit as the plain model, the same allocator peak, recorded again where the setting
or the module's plain values change, refused where the call diverges, and recorded every time where
a later call's replay could not be the recorded one's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import assert_same, train, twin
from plans import fixed_costs
from test_plan_floor import _peak
from test_rerun import _every_layer, _family, _plan
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

import remat
import remat.planner.module_calls as module_calls
import remat.planner.samples as samples
import remat.planner.taped_calls as taped_calls
from remat import RecomputationError
from remat.planner import Plan, plan_trace, trace_step
from remat.planner.api import block_key
from remat.planner.cost_model import ExecutorCost

ACT = torch.tanh  # Python state no setting sees: what the blocks run
SHORT = False  # and whether they skip their second layer
GAIN = 1.0  # and a number their forward multiplies by
EXECUTOR = ExecutorCost(check=2e-5, record=4e-5, replay=2e-5, offload=3e-4)  # plans not of this machine's


HELPER_GAIN = 1.0  # a number the blocks multiply by, read where the setting does not look
GEN = torch.Generator().manual_seed(0)  # a generator the blocks' code hands a random op


def _short() -> bool:
    """``SHORT``, read where the setting does not look (a helper's global)."""
    return SHORT


def _helper_gain() -> float:
    return HELPER_GAIN


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)
        self.scale = 1.0  # a plain value of the module: part of the setting
        self.peek = False  # reads a value into Python (``item``)
        self.drop = 0.0  # dropout after the activation
        # random numbers: at the call's start ("start"), two draws with nothing saved between
        # ("twice"), a draw the replay does not run and one it runs with nothing saved between
        # ("unreplayed"), from ``GEN`` ("generator"), two with a seed set between ("reseed"),
        # RReLU's noise, which the op draws into the tensor autograd saved ("rrelu"); or batch norm
        # over statistics made in the call, which the op writes after autograd saved them ("norm")
        self.noise = ""
        self.modes: list[object] = []

    def forward(self, x: torch.Tensor, gain: float = 1.0) -> torch.Tensor:
        self.modes.append(_get_current_dispatch_mode())
        spare = torch.randn_like(x).sum() if self.noise == "unreplayed" else 0.0
        if self.noise in ("start", "unreplayed"):
            x = x * torch.rand_like(x)
        h = self.fc1(x)
        if self.noise == "twice":
            h = h + torch.randn_like(h) * 0.1 + torch.randn_like(h) * 0.1
        if self.noise == "generator":
            h = h + torch.rand(h.shape, generator=GEN)
        if self.noise == "reseed":
            h = nn.functional.dropout(h, 0.3, self.training)
            torch.manual_seed(7)
            h = nn.functional.dropout(h.sin(), 0.3, self.training)
        if self.noise == "rrelu":
            h = nn.functional.rrelu(h, training=self.training)
        if self.noise == "norm":
            h = nn.functional.batch_norm(h, torch.zeros(64), torch.ones(64), training=True)
        h = ACT(h) * (self.scale * gain * GAIN * _helper_gain())
        h = nn.functional.dropout(h, self.drop, self.training)
        if self.peek and h.sum().item() > 1e9:
            h = h * 2
        return (x + h[..., :16] if _short() else x + self.fc2(h)) + spare * 0.0


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(16, 1)
        self.gain = 1.0  # Python state of the stack's own, handed to each block's call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, gain=self.gain)
        return self.head(x).square().mean()


def _stack(
    peek: bool = False, drop: float = 0.0, noise: str = "", device: torch.device | None = None
) -> tuple[_Stack, dict[str, torch.Tensor], Plan]:
    """The stack and a plan of every block a taped region anchored at the block's call."""
    torch.manual_seed(0)
    model = _Stack().train()
    for block in model.blocks:
        block.peek, block.drop, block.noise = peek, drop, noise
    batch = {"x": torch.randn(32, 16)}
    if device is not None:
        model, batch = model.to(device), {"x": batch["x"].to(device)}
    trace = fixed_costs(trace_step(model, batch, repeats=1))
    _, every = _every_layer(model, trace, rerun=False)
    assert all(not r.rerun and r.anchor == r.name for r, _ in every.regions)
    return model, batch, _plan(trace, model, every)


def _from_templates() -> tuple[_Stack, dict[str, torch.Tensor], Plan]:
    """The stack after two steps under its plan: its blocks' templates recorded and used."""
    model, batch, plan = _stack()
    for _ in range(2):
        with plan.apply(model):
            model(**batch).backward()
    return model, batch, plan


def _runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The region modules each call run from a template (``Run``) was for."""
    names: list[str] = []
    init = taped_calls.Run.__init__

    def counted(self: taped_calls.Run, template: Any, module: nn.Module, leaves: Any, name: str) -> None:
        names.append(name)
        init(self, template, module, leaves, name)

    monkeypatch.setattr(taped_calls.Run, "__init__", counted)
    return names


def _halved_from_step_2(
    name: str, batch: dict[str, torch.Tensor]
) -> Callable[[int], dict[str, torch.Tensor]]:
    """The batch of each step, setting this module's global number ``name`` to 1.0 before step 2
    and to 0.5 from it on."""

    def batch_at(step: int) -> dict[str, torch.Tensor]:
        globals()[name] = 1.0 if step < 2 else 0.5
        return batch

    return batch_at


def _modes(model: _Stack) -> list[list[object]]:
    return [block.modes for block in model.blocks]


def test_after_a_recorded_call_a_taped_block_runs_from_its_template(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four steps: the first forward is checked (each block recorded, leaving its template), the
    later ones run each block with no dispatch mode at all; losses, gradients and the RNG stream
    are the plain model's."""
    model, batch, plan = _stack()
    runs = _runs(monkeypatch)
    planned = twin(model)
    for modes in _modes(planned):
        modes.clear()
    ran = train(planned, lambda _: batch, steps=4, region=lambda: plan.apply(planned))
    assert_same(train(twin(model), lambda _: batch, steps=4), ran)
    assert runs == ["blocks.0", "blocks.1", "blocks.2"] * 3
    for modes in _modes(planned):
        assert modes[0] is not None and modes[1:] == [None, None, None]


def test_a_plain_value_of_the_module_changed_records_the_call_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block's ``scale`` (a number the module holds) changed between steps: the block's next
    call is recorded again, and the training stays the plain model's."""
    model, batch, plan = _stack()
    runs = _runs(monkeypatch)
    planned, plain = twin(model), twin(model)

    def batch_at(step: int) -> dict[str, torch.Tensor]:
        for m in (planned, plain):
            m.blocks[1].scale = 1.0 if step < 2 else 0.5
        return batch

    ran = train(planned, batch_at, steps=4, region=lambda: plan.apply(planned))
    assert_same(train(plain, batch_at, steps=4), ran)
    # step 0 checked; step 1 all from templates; step 2 block 1 recorded again; step 3 all
    assert runs == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "blocks.0",
        "blocks.2",
        *["blocks.0", "blocks.1", "blocks.2"],
    ]


def test_another_argument_to_the_call_records_it_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack hands each block a number of its own (no setting of the forward sees it): a call
    given another one is recorded again, and the training stays the plain model's."""
    model, batch, plan = _stack()
    runs = _runs(monkeypatch)
    planned, plain = twin(model), twin(model)

    def batch_at(step: int) -> dict[str, torch.Tensor]:
        planned.gain = plain.gain = 1.0 if step < 2 else 0.5
        return batch

    ran = train(planned, batch_at, steps=4, region=lambda: plan.apply(planned))
    assert_same(train(plain, batch_at, steps=4), ran)
    assert runs == ["blocks.0", "blocks.1", "blocks.2"] * 2


@pytest.mark.parametrize(("name", "room"), [("llama", 1.0), ("llama", 2.0), ("vit", 1.0)])
def test_plans_that_keep_part_of_a_layer_run_from_templates_exactly(
    name: str, room: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plans the search picks (at per-layer checkpointing's predicted peak, and at twice it), whose
    regions keep some of what autograd saves: the replay reads those from this call's saves, and
    the training is the plain model's bit for bit, at the checked step's allocator peak, within the
    prediction."""
    model, batch, trace = _family(name)
    _, every = _every_layer(model, trace, rerun=False)
    budget = int(every.pred.peak_bytes * room)
    plan = plan_trace(trace, budget, block_key=block_key(model), executor_cost=EXECUTOR)
    assert plan.regions and all(r.anchor for r in plan.regions)
    assert any(r.save for r in plan.regions)
    runs = _runs(monkeypatch)
    planned = twin(model)
    ran = train(planned, lambda _: batch, steps=3, region=lambda: plan.apply(planned))
    assert_same(train(twin(model), lambda _: batch, steps=3), ran)
    assert runs == [r.anchor for r in plan.regions] * 2
    peaks = [_peak(model, batch, plan) for _ in range(2)]
    assert peaks[0] == peaks[1] <= plan.predicted_peak_bytes


def test_a_global_number_the_forward_names_changed_records_the_call_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A global the blocks' ``forward`` multiplies by (no saved tensor changes its look when it
    does) changed between steps: every block's next call is recorded again, and the training stays
    the plain model's."""
    global GAIN
    model, batch, plan = _stack()
    runs = _runs(monkeypatch)
    planned, plain = twin(model), twin(model)
    batch_at = _halved_from_step_2("GAIN", batch)
    try:
        ran = train(planned, batch_at, steps=4, region=lambda: plan.apply(planned))
        assert_same(train(plain, batch_at, steps=4), ran)
    finally:
        GAIN = 1.0
    assert runs == ["blocks.0", "blocks.1", "blocks.2"] * 2


def test_a_call_whose_saves_differ_from_its_template_is_refused() -> None:
    """Python state no setting sees (a global) switches the blocks' activation: the saved tensors'
    autograd nodes differ from the recorded call's, and the forward is refused, not replayed with
    the recorded ops (as a recorded call refuses it, by its ops)."""
    global ACT
    model, batch, plan = _from_templates()
    ACT = torch.sigmoid
    try:
        with (
            pytest.raises(
                RecomputationError, match=r"blocks\.0's call run bare: saved tensor #\d+ is .*Sigmoid"
            ),
            plan.apply(model),
        ):
            model(**batch)
        with (
            pytest.raises(
                RecomputationError, match="expected aten.tanh.default in blocks.0, got aten.sigmoid"
            ),
            plan.apply(model, check="every"),
        ):  # the recorded call sees it op by op
            model(**batch)
    finally:
        ACT = torch.tanh


def test_a_call_that_saves_fewer_tensors_than_its_template_is_refused() -> None:
    """A global read by a helper (which the setting does not see) makes the blocks skip their second
    linear: fewer tensors saved than recorded, refused."""
    global SHORT
    model, batch, plan = _from_templates()
    SHORT = True
    try:
        with (
            pytest.raises(
                RecomputationError, match=r"blocks\.0's call run bare: autograd saved \d+ tensors, \d+ when"
            ),
            plan.apply(model),
        ):
            model(**batch)
    finally:
        SHORT = False


def test_templates_under_autocast_train_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """bfloat16 autocast (part of the setting): the recorded call's casts are the template's, and
    training from templates is the plain model's under the same autocast, bit for bit."""
    model, batch, _ = _stack()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trace = fixed_costs(trace_step(model, batch, repeats=1))
    _, every = _every_layer(model, trace, rerun=False)
    plan = _plan(trace, model, every)
    runs = _runs(monkeypatch)
    planned = twin(model)
    ran = train(
        planned, lambda _: batch, steps=3, autocast=torch.bfloat16, region=lambda: plan.apply(planned)
    )
    assert_same(train(twin(model), lambda _: batch, steps=3, autocast=torch.bfloat16), ran)
    assert runs == ["blocks.0", "blocks.1", "blocks.2"] * 2


def test_a_region_that_reads_a_value_into_python_is_recorded_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``item`` in the block: what it does next may depend on the data, so no template."""
    model, batch, plan = _stack(peek=True)
    runs = _runs(monkeypatch)
    planned = twin(model)
    ran = train(planned, lambda _: batch, steps=3, region=lambda: plan.apply(planned))
    assert_same(train(twin(model), lambda _: batch, steps=3), ran)
    assert runs == []
    assert all(modes[-1] is not None for modes in _modes(planned))


def _trains_from_templates(
    model: nn.Module, batch: dict[str, Any], trace: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[Plan, Any]:
    """Every layer of ``model`` one taped region: three steps train bit for bit as the plain model,
    each layer run from its template in the second and third. The plan, and its candidate."""
    _, every = _every_layer(model, trace, rerun=False)
    plan = _plan(trace, model, every)
    runs = _runs(monkeypatch)
    planned = twin(model)
    ran = train(planned, lambda _: batch, steps=3, region=lambda: plan.apply(planned))
    assert_same(train(twin(model), lambda _: batch, steps=3), ran)
    assert runs == [r.anchor for r in plan.regions] * 2
    return plan, every


@pytest.mark.parametrize("name", ["gpt2", "llama", "vit"])
def test_transformer_layers_run_from_templates(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2 (dropout in training: each layer's replay draws), Llama and ViT (no dropout; their
    attention draws nothing) run every layer from its template after the first step, training bit
    for bit as the plain model (dropout's masks and the generator's stream after each step
    included), at the checked step's allocator peak and the prediction's."""
    model, batch, trace = _family(name)
    plan, every = _trains_from_templates(model, batch, trace, monkeypatch)
    peaks = [_peak(model, batch, plan) for _ in range(2)]
    assert peaks[0] == peaks[1] == every.pred.peak_bytes


def test_check_every_records_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch, plan = _stack()
    runs = _runs(monkeypatch)
    planned = twin(model)
    ran = train(planned, lambda _: batch, steps=3, region=lambda: plan.apply(planned, check="every"))
    assert_same(train(twin(model), lambda _: batch, steps=3), ran)
    assert runs == [] and not module_calls._TEMPLATES.get(planned)


def test_the_templates_kept_per_model_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A setting that changes every step (here the number the stack hands its blocks) leaves
    templates each time; the oldest go first past the bound, and training stays exact."""
    monkeypatch.setattr(module_calls, "_MOST_TEMPLATES", 4)
    model, batch, plan = _stack()
    planned, plain = twin(model), twin(model)

    def batch_at(step: int) -> dict[str, torch.Tensor]:
        planned.gain = plain.gain = 1.0 + step
        return batch

    ran = train(planned, batch_at, steps=3, region=lambda: plan.apply(planned))
    assert_same(train(plain, batch_at, steps=3), ran)
    kept = module_calls._TEMPLATES[planned]
    assert len(kept) == 4 and all(isinstance(t, taped_calls.Template) for t in kept.values())


@pytest.mark.parametrize(
    ("drop", "noise"),
    [(0.3, ""), (0.0, "start"), (0.3, "start"), (0.3, "twice"), (0.0, "rrelu"), (0.0, "norm")],
)
def test_random_ops_replay_from_a_template_exactly(
    drop: float, noise: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [random ops of a template]: dropout (its state taken where the op before it saves),
    numbers drawn at the call's start (taken before the call), both, two draws back to back (one
    state: NOTE [one state per run of draws]), RReLU (its noise drawn into a tensor autograd saved
    before); and batch norm over statistics the call makes (written after their save: no sample of
    them is checked, NOTE [a template's replay checked]): every block runs from its template after
    the first step, and the masks, losses, gradients and the generator's stream after training are
    the plain model's, bit for bit."""
    model, batch, plan = _stack(drop=drop, noise=noise)
    runs = _runs(monkeypatch)
    planned = twin(model)
    ran = train(planned, lambda _: batch, steps=4, region=lambda: plan.apply(planned))
    assert_same(train(twin(model), lambda _: batch, steps=4), ran)
    assert runs == ["blocks.0", "blocks.1", "blocks.2"] * 3
    peaks = []
    for _ in range(2):  # a recorded step, then one from templates
        with remat.memory.track(timeline=False, allocator=True) as tracked, plan.apply(model):
            model(**batch).backward()
        peaks.append(tracked.peak_bytes)
    # the recorded step also held the generator states of draws it does not replay, for a while
    assert peaks[1] <= peaks[0] <= plan.predicted_peak_bytes


@pytest.mark.parametrize("noise", ["unreplayed", "generator", "reseed"])
def test_random_ops_with_no_state_to_take_keep_the_block_recorded(
    noise: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A draw the replay does not run, then one it runs with nothing saved between (no hook before
    the second to take its state in), a draw from a generator the code hands the op, or two draws
    with a seed set between (the generator moved where no op shows): every call is recorded, and
    trains exactly."""
    model, batch, plan = _stack(noise=noise)
    runs = _runs(monkeypatch)
    planned, plain = twin(model), twin(model)

    def batch_at(step: int) -> dict[str, torch.Tensor]:
        GEN.manual_seed(step)
        return batch

    ran = train(planned, batch_at, steps=3, region=lambda: plan.apply(planned))
    assert_same(train(plain, batch_at, steps=3), ran)
    assert runs == []
    assert all(modes[-1] is not None for modes in _modes(planned))


def test_a_replay_that_differs_from_the_call_is_refused() -> None:
    """NOTE [a template's replay checked]: a number the blocks multiply by, read by a helper (no
    setting sees it), changed after the templates were recorded: every saved tensor keeps its look,
    and the replay, with the recorded ops, would recompute the old values; the samples the call
    left catch it in backward. Recording every call trains as the plain model through the change."""
    global HELPER_GAIN
    model, batch, plan = _stack()
    planned, plain = twin(model), twin(model)
    batch_at = _halved_from_step_2("HELPER_GAIN", batch)
    try:
        ran = train(planned, batch_at, steps=4, region=lambda: plan.apply(planned, check="every"))
        assert_same(train(plain, batch_at, steps=4), ran)
        HELPER_GAIN = 1.0
        _changed_after_templates(
            model,
            batch,
            plan,
            r"recomputed from a template differs from the one the call saved \(blocks\.2's call",
        )
    finally:
        HELPER_GAIN = 1.0


def _changed_after_templates(model: _Stack, batch: dict[str, torch.Tensor], plan: Plan, match: str) -> None:
    """Two steps leave the blocks' templates; then the helper's number changes, and the next
    backward raises remat's error matching ``match``."""
    global HELPER_GAIN
    for _ in range(2):
        with plan.apply(model):
            model(**batch).backward()
    model.zero_grad(set_to_none=True)
    HELPER_GAIN = 0.5
    with plan.apply(model):
        loss = model(**batch)
        with pytest.raises(RecomputationError, match=match):
            loss.backward()


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(a))) * b


class _Paired(nn.Module):
    """Calls its block with one tensor twice, or with that tensor and a copy (``tied``: no setting
    the plan reads sees it)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Pair()])
        self.tied = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        return self.blocks[0](h, h if self.tied else h + 1).square().mean()


def test_a_tensor_given_twice_keys_a_template_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block called with one tensor in two places leaves a template that binds both to it; a
    later call with two tensors of the same look is another call (``call_key``): recorded, and the
    training is the plain model's (with the first template, the replay would read the second
    tensor for both)."""
    torch.manual_seed(0)
    model = _Paired().train()
    batch = {"x": torch.randn(8, 16)}
    trace = fixed_costs(trace_step(model, batch, repeats=1))
    _, every = _every_layer(model, trace, rerun=False)
    assert all(not r.rerun and r.anchor == r.name for r, _ in every.regions)
    plan = _plan(trace, model, every)
    runs = _runs(monkeypatch)
    planned, plain = twin(model), twin(model)

    def batch_at(step: int) -> dict[str, torch.Tensor]:
        planned.tied = plain.tied = step % 2 == 0
        return batch

    ran = train(planned, batch_at, steps=4, region=lambda: plan.apply(planned))
    assert_same(train(plain, batch_at, steps=4), ran)
    assert runs == ["blocks.0", "blocks.0"]  # steps 2 and 3 from the templates steps 0 and 1 left


def _settles(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many samples each ``samples.settle`` found waiting (NOTE [a template's replay checked])."""
    found: list[int] = []
    settle = samples.settle

    def counted(waiting: samples.Waiting) -> None:
        found.append(len(waiting.checks))
        settle(waiting)

    monkeypatch.setattr(samples, "settle", counted)
    return found


@pytest.mark.parametrize("drop", [0.0, 0.3])
def test_samples_compared_when_backward_ends_train_exactly(
    drop: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [a template's replay checked] as on an accelerator (host memory made to wait as device
    memory does): each call run from its template leaves its samples copied, they are compared when
    the backward pass ends, nothing is left waiting after it, and the training is the plain
    model's bit for bit, with dropout too."""
    monkeypatch.setattr(samples, "_DEFER_IN_HOST_MEMORY", True)
    model, batch, plan = _stack(drop=drop)
    runs = _runs(monkeypatch)
    found = _settles(monkeypatch)
    planned = twin(model)
    ran = train(planned, lambda _: batch, steps=3, region=lambda: plan.apply(planned))
    assert_same(train(twin(model), lambda _: batch, steps=3), ran)
    assert runs == ["blocks.0", "blocks.1", "blocks.2"] * 2
    assert len(found) == 2 and found[0] == found[1] > 0  # one settle per backward, of them all
    assert not samples._waiting


def _refused_when_backward_ends(device: torch.device) -> None:
    """The helper's number changed after the templates were recorded (as in
    ``test_a_replay_that_differs_from_the_call_is_refused``): with the samples compared when the
    backward pass ends, ``backward`` raises, after autograd wrote every gradient (the first block's,
    which comes last, too), so before an optimizer could use them."""
    global HELPER_GAIN
    model, batch, plan = _stack(device=device)
    try:
        match = r"differs from the one the call saved \(blocks\.\d's call.*gradients of this backward"
        _changed_after_templates(model, batch, plan, match)
        assert model.blocks[0].fc1.weight.grad is not None
        assert not samples._waiting
    finally:
        HELPER_GAIN = 1.0


def test_a_replay_that_differs_is_refused_when_backward_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(samples, "_DEFER_IN_HOST_MEMORY", True)
    _refused_when_backward_ends(torch.device("cpu"))


def test_a_backward_that_fails_leaves_no_check_to_a_later_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backward that raises after its calls' samples were queued (a hook on the input's gradient,
    the last one made) runs no end-of-backward callback: its checks go with it, and a later backward
    is not refused for them (the helper's number had changed for the failed one only)."""
    global HELPER_GAIN
    monkeypatch.setattr(samples, "_DEFER_IN_HOST_MEMORY", True)
    model, batch, plan = _stack()
    found = _settles(monkeypatch)
    try:
        for _ in range(2):
            with plan.apply(model):
                model(**batch).backward()
        HELPER_GAIN = 0.5
        x = batch["x"].clone().requires_grad_()
        x.register_hook(lambda _: (_ for _ in ()).throw(ValueError("stop")))
        with plan.apply(model), pytest.raises(ValueError, match="stop"):
            model(x).backward()
        assert not samples._waiting
        HELPER_GAIN = 1.0
        settled = len(found)
        with plan.apply(model):
            model(**batch).backward()
        assert len(found) == settled + 1 and found[-1] > 0
    finally:
        HELPER_GAIN = 1.0


@pytest.mark.cuda
def test_a_replay_that_differs_on_cuda_is_refused_when_backward_ends(device: torch.device) -> None:
    """On CUDA the samples are copied to pinned host memory and compared when the backward ends."""
    if device.type != "cuda":
        pytest.skip("needs CUDA")
    _refused_when_backward_ends(device)


def _decoder(name: str) -> tuple[nn.Module, dict[str, Any]]:
    """Mistral and Qwen2 (grouped-query attention with dropout) and GPT-NeoX (attention and hidden
    dropout) from ``transformers`` configs, 2 layers of width 32."""
    import transformers

    common = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    common |= {"num_attention_heads": 4, "max_position_embeddings": 64, "attention_dropout": 0.1}
    kinds = {
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"num_key_value_heads": 2}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"num_key_value_heads": 2}),
        "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, {"hidden_dropout": 0.1}),
    }
    config, model_class, own = kinds[name]
    torch.manual_seed(0)
    model = model_class(config(**common, **own)).train()
    ids = torch.randint(2, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}


@pytest.mark.parametrize("name", ["mistral", "qwen2", "gpt_neox"])
def test_a_reshape_viewed_bare_matches_its_recorded_view(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [a reshape's node]: these attentions ``matmul`` a transposed key, whose reshape autograd
    saves as ``ViewBackward0`` under the tape's mode and as ``ReshapeAliasBackward0`` run bare; every
    layer runs from its template after the first step (it was refused as a diverged forward) and the
    model trains bit for bit as the plain one."""
    model, batch = _decoder(name)
    _trains_from_templates(model, batch, fixed_costs(trace_step(model, batch, repeats=1)), monkeypatch)
