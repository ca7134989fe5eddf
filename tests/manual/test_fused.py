"""Compiled replay (``replay="compiled"``, ``remat.manual.fused``): runs of deterministic recorded ops
replay through one compiled graph each, random ops and writes into foreign tensors op by op, and
the result equals the plain model up to floating-point rounding, with the RNG stream exact."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import pytest
import torch
from models import assert_close, build, train, twin
from plans import _measured_peak, _plan
from torch import nn

import remat
from remat import RematValueError
from remat.manual.fused import compiled_steps
from remat.manual.fused_graph import fusable_runs, reads, structure
from remat.manual.replay import replay
from remat.manual.scope import Recorder
from remat.manual.tape import Tape
from remat.planner import plan_trace, trace_step
from remat.policy import RecomputeAll

fused = importlib.import_module("remat.manual.fused")
# a run that falls back to eager replay warns: here that is a failure, except where a test wants it
pytestmark = pytest.mark.filterwarnings("error:remat. a run of:RuntimeWarning")


def _tape(fn: Any, *inputs: torch.Tensor) -> tuple[Tape, Any]:
    tape = Tape(RecomputeAll())
    with torch.no_grad(), Recorder(tape):
        out = fn(*inputs)
    return tape, out


def _block(x: torch.Tensor, w: torch.Tensor, running: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x * 0.5 + 1.0) * x  # a run: mul add tanh mul
    h = torch.nn.functional.dropout(h, 0.3, training=True)  # random: eager
    h = h.relu_()  # in place into the dropout's output, made by the run: fusable
    h = (h @ w).sigmoid()  # a run: mm sigmoid
    running.add_(1.0)  # a write into a tensor from outside: replayed into a clone, fusable
    return h * running.sum()


def test_runs_are_cut_at_random_ops_and_writes_into_foreign_tensors() -> None:
    x, w, running = torch.randn(4, 6), torch.randn(6, 3), torch.zeros(3)
    tape, out = _tape(_block, x, w, running)
    plan = tape.slice([tape.lookup(out)], ())
    runs = [(is_fused, [str(s.node.func) for s in run]) for is_fused, run in fusable_runs(plan.steps)]
    # dropout without grad: empty_like, bernoulli_ (random) and div_ (writes what bernoulli_ made)
    assert runs == [
        (
            True,
            [
                "aten.mul.Tensor",
                "aten.add.Tensor",
                "aten.tanh.default",
                "aten.mul.Tensor",
                "aten.empty_like.default",
            ],
        ),
        (False, ["aten.bernoulli_.float"]),
        (False, ["aten.div_.Scalar"]),
        (
            True,
            [
                "aten.mul.Tensor",
                "aten.relu_.default",
                "aten.mm.default",
                "aten.sigmoid.default",
                "aten.add_.Tensor",
                "aten.sum.default",
                "aten.mul.Tensor",
            ],
        ),
    ]


def test_compiled_replay_equals_eager_replay_and_compiles_each_structure_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fused, "_compiled", {})
    x, w, running = torch.randn(4, 6), torch.randn(6, 3), torch.zeros(3)
    torch.manual_seed(0)
    tape, out = _tape(_block, x, w, running)
    plan = tape.slice([tape.lookup(out)], ())
    eager = replay(plan)
    for _ in range(2):
        compiled = replay(plan, compiled_steps)
        torch.testing.assert_close(compiled, eager)
        assert len(fused._compiled) == 2  # the two runs, compiled in the first replay only
    assert torch.equal(running, torch.ones(3))  # written once, in the recording; replay wrote into clones
    assert all(fn is not None for fn in fused._compiled.values())


class _Net(nn.Module):
    """Conv, batch norm, in-place ReLU, dropout, a linear and tanh GELU, in one region or none."""

    def __init__(self, replay: str | None) -> None:
        super().__init__()
        self.replay = replay
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with remat.scope(replay=self.replay) if self.replay else contextlib.nullcontext():
            h = self.bn(self.conv(x)).relu_()
            h = nn.functional.dropout(h, 0.2, training=self.training)
            h = nn.functional.gelu(self.lin(h.mean((2, 3))), approximate="tanh")
        return h.square().mean()


def _net_batch(step: int) -> dict[str, Any]:
    return {"x": torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step))}


def _net_twins() -> tuple[_Net, _Net]:
    """A plain ``_Net`` and its copy with the block in a compiled-replay scope."""
    torch.manual_seed(0)
    plain = _Net(None)
    scoped = twin(plain)
    scoped.replay = "compiled"
    return plain, scoped


def test_scope_with_compiled_replay_matches_plain_model() -> None:
    plain, scoped = _net_twins()
    batch = _net_batch
    assert_close(train(plain, batch, steps=2), train(scoped, batch, steps=2))
    structures = len(fused._compiled)
    train(scoped, batch, steps=3)  # new tapes, new value ids: the same structures
    assert len(fused._compiled) == structures


@pytest.mark.parametrize("name", ["gpt2", "bert", "cnn"])
def test_plan_with_compiled_replay_matches_plain_model(name: str) -> None:
    plan = _plan(name, "chain")  # halfway between the smallest plan and the plain peak
    assert plan.regions, "nothing recomputed: the test would prove nothing"
    model, batch, _ = build(name)
    planned = twin(model)
    plain = train(model, batch, steps=2)
    ran = train(planned, batch, steps=2, region=lambda: plan.apply(planned, replay="compiled"))
    assert_close(plain, ran)
    assert any(fn is not None for fn in fused._compiled.values())


def test_a_run_that_fails_to_compile_replays_eagerly_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        def fn(*inputs: torch.Tensor) -> Any:
            raise RuntimeError("no compiler here")

        return fn

    monkeypatch.setattr(fused, "_compiled", {})
    monkeypatch.setattr(fused.torch, "compile", broken)
    x, w, running = torch.randn(4, 6), torch.randn(6, 3), torch.zeros(3)
    tape, out = _tape(_block, x, w, running)
    plan = tape.slice([tape.lookup(out)], ())
    with pytest.warns(
        RuntimeWarning, match=r"replays op by op, not compiled \(compilation failed: .*no compiler here"
    ):
        compiled = replay(plan, compiled_steps)
    torch.testing.assert_close(compiled, replay(plan))
    assert list(fused._compiled.values()) == [None, None]


@pytest.mark.parametrize("where", ["scope", "plan.apply"])
def test_unknown_replay_is_refused(where: str) -> None:
    model, batch, _ = build("mlp")
    pattern = rf'remat\.{where}: replay must be "eager" or "compiled" \(got \'fused\'\)'
    with pytest.raises(RematValueError, match=pattern):
        if where == "scope":
            with remat.scope(replay="fused"):
                pass
        else:
            plan = plan_trace(trace_step(model, batch(0), repeats=1), 1.0)
            with plan.apply(model, replay="fused"):
                pass


def test_constants_of_another_type_or_sign_are_another_structure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused, "_compiled", {})
    x = torch.arange(6, dtype=torch.int64)
    results = []
    for scalar in (1, 1.0, True, 0.0, -0.0):
        tape, out = _tape(lambda t, s=scalar: torch.div(t.mul(s), 1.0).add(s), x)
        results.append(replay(tape.slice([tape.lookup(out)], ()), compiled_steps)[tape.lookup(out)])
        torch.testing.assert_close(results[-1], out, equal_nan=True)
        assert results[-1].dtype == out.dtype
    assert len(fused._compiled) == 5


@pytest.mark.parametrize("name", ["gpt2", "cnn"])
def test_compiled_replay_stays_within_the_predicted_peak(name: str) -> None:
    """Compiled runs return only what later steps read, as eager replay keeps only that, and
    Inductor reuses its buffers: the prediction made for eager replay still bounds the peak."""
    plan = _plan(name, "chain")
    model, batch, _ = build(name)
    _measured_peak(model, batch(0), plan, "compiled")  # compiles in the first backward
    compiled = _measured_peak(model, batch(0), plan, "compiled")
    assert compiled <= plan.predicted_peak_bytes
    assert compiled >= 0.99 * plan.predicted_peak_bytes


def test_a_run_whose_compiled_dtypes_differ_from_eager_replays_eagerly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under bfloat16 autocast, eager batch norm with float32 weights returns float32 statistics;
    Inductor's decomposition returns bfloat16 ones. The first call compares with eager and keeps
    eager for that structure."""
    monkeypatch.setattr(fused, "_compiled", {})
    monkeypatch.setattr(fused, "_checked", {})
    plain, scoped = _net_twins()
    batch = _net_batch
    expected = train(plain, batch, steps=2, autocast=torch.bfloat16)
    with pytest.warns(
        RuntimeWarning, match=r"not compiled \(compiled bfloat16\[8\] where eager gives float32\[8\]\)"
    ):
        ran = train(scoped, batch, steps=2, autocast=torch.bfloat16)
    assert_close(expected, ran, rtol=2e-2, atol=1e-3)
    assert None in fused._compiled.values()  # the batch norm's run, eager from then on
    assert fused._checked  # the other runs matched eager and stay compiled


def test_views_and_in_place_ops_inside_a_compiled_run() -> None:
    x, w = torch.randn(6, 5, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    grads = []
    for how in (None, "compiled"):
        with remat.scope(replay=how) if how else contextlib.nullcontext():
            h = (x.t() * 2).sin()  # a view of an outside tensor, then pointwise ops
            h[1:, :].mul_(3)  # in place through a view the run made
            y = (h.exp() @ w).tanh().unsqueeze(0).expand(2, -1, -1).sum(0)
        grads.append(torch.autograd.grad(y.square().sum(), [x, w]))
    for plain, compiled in zip(*grads, strict=True):
        torch.testing.assert_close(compiled, plain, rtol=1e-4, atol=1e-5)


def test_a_run_whose_compiled_values_differ_replays_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    def off_by_one(gm: torch.fx.GraphModule, **kwargs: Any) -> Any:
        return lambda *inputs: tuple(t + 1 if t.is_floating_point() else t for t in gm(*inputs))

    monkeypatch.setattr(fused, "_compiled", {})
    monkeypatch.setattr(fused, "_checked", {})
    monkeypatch.setattr(fused.torch, "compile", off_by_one)
    x, w, running = torch.randn(4, 6), torch.randn(6, 3), torch.zeros(3)
    tape, out = _tape(_block, x, w, running)
    plan = tape.slice([tape.lookup(out)], ())
    with pytest.warns(RuntimeWarning, match=r"not compiled \(compiled values of float32\[4, [36]\] differ"):
        compiled = replay(plan, compiled_steps)
    torch.testing.assert_close(compiled, replay(plan), rtol=0, atol=0)
    assert list(fused._compiled.values()) == [None, None] and not fused._checked


def test_gpt2_blocks_replay_compiled_with_eager_layouts() -> None:
    """GPT-2's attention concatenates keys, transposes, scales, expands and views them: eager
    ``cat`` is contiguous where the meta kernel keeps the permuted layout, so the recorded
    ``view`` fails under compilation unless it becomes a reshape (NOTE [view as reshape]), and
    the compiled outputs come back in meta strides unless copied into eager's (NOTE [eager
    layouts])."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=96, n_head=12, vocab_size=64, n_positions=32)
    plain = GPT2LMHeadModel(config).train()
    scoped = twin(plain)
    for block in scoped.transformer.h:
        forward = block.forward

        def wrapped(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            with remat.scope(replay="compiled"):
                return _forward(*args, **kwargs)

        block.forward = wrapped

    def batch(step: int) -> dict[str, Any]:
        ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}

    assert_close(train(plain, batch, steps=2), train(scoped, batch, steps=2))


def test_equal_programs_on_other_value_ids_are_one_structure() -> None:
    """Each step records a new tape, so the same run comes with other value ids; its structure
    (the compile cache's key) must not depend on them."""
    x, w = torch.randn(4, 6), torch.randn(6, 3)
    keys = []
    for shift in range(0, 70, 5):  # some of them put the run across a multiple of a set's table size

        def shifted(x: torch.Tensor, w: torch.Tensor, running: torch.Tensor, n: int = shift) -> torch.Tensor:
            for _ in range(n):  # values recorded before the block move its value ids
                x = x + 0
            return _block(x, w, running)

        tape, out = _tape(shifted, x, w, torch.zeros(3))
        plan = tape.slice([tape.lookup(out)], ())
        run = [run for is_fused, run in fusable_runs(plan.steps) if is_fused][-1]
        inputs, made = reads(run)
        assert made == sorted(made), "made in program order"
        keys.append(structure(run, inputs, made))
    assert all(key == keys[0] for key in keys)
