"""Dispatch modes without torch's per-call Dynamo wrapper (``remat._dispatch``)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

import remat
from remat._dispatch import Unguarded, no_modes


class _Count(Unguarded):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_an_unguarded_mode_loses_the_wrapper_and_still_sees_every_op() -> None:
    x = torch.randn(4, 4)
    with _Count() as counted:
        y = torch.relu(x @ x).sum()
    assert "__wrapped__" not in vars(_Count.__dict__["__torch_dispatch__"])
    assert counted.ops == ["aten.mm.default", "aten.relu.default", "aten.sum.default"]
    assert torch.equal(y, torch.relu(x @ x).sum())


def test_dynamo_compiles_the_functions_run_under_an_unguarded_mode_and_not_the_mode() -> None:
    """A function compiled before the mode runs from Dynamo's cache under it, one compiled under it
    runs too, with eager results: Dynamo compiles the one function and never the mode's own code
    (without the skip mark it compiles the mode's method on each op, a cache entry per op)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    f = torch.compile(lambda a: (a * 2).sin() + 1, backend=counter)
    x = torch.randn(8)
    f(x)
    with _Count() as counted:
        y = f(x)
        z = torch.compile(lambda a: a.cos() * 3, backend=counter)(x)
    assert torch.equal(y, (x * 2).sin() + 1) and torch.equal(z, x.cos() * 3)
    assert "aten.sin.default" in counted.ops and "aten.cos.default" in counted.ops
    assert counter.frame_count == 1
    assert _debug_get_cache_entry_list(_Count.__dict__["__torch_dispatch__"].__code__) == []


def test_a_scope_around_compiled_code_gives_the_plain_gradients() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    inner = torch.compile(lambda h: torch.nn.functional.gelu(layer(h)) * h, backend="eager")
    x = torch.randn(4, 8, requires_grad=True)

    def grads(use_scope: bool) -> list[Any]:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        if use_scope:
            with remat.scope():
                out = inner(x)
        else:
            out = inner(x)
        out.square().sum().backward()
        return [x.grad, layer.weight.grad, layer.bias.grad]

    plain = grads(False)
    for got, want in zip(grads(True), plain, strict=True):
        assert torch.equal(got, want)


def test_no_modes_hides_remat_own_ops_from_a_mode_and_is_nothing_without_one() -> None:
    """``no_modes``: under a dispatch mode, the ops inside it do not reach the mode (remat's own
    ops are not the program's); with no mode on, it is a plain context (nothing popped)."""
    x = torch.randn(4)
    with _Count() as counted:
        torch.sin(x)
        with no_modes():
            torch.cos(x)
        torch.tan(x)
    assert counted.ops == ["aten.sin.default", "aten.tan.default"]
    assert isinstance(no_modes(), contextlib.nullcontext)


def test_remats_saved_tensor_hooks_are_never_compiled_by_dynamo() -> None:
    """A ``torch.compile``d child inside a plan's region, a scope or a checkpoint: its compiled code
    runs while remat's saved-tensor hooks are set, and Dynamo compiled the tape's ``pack`` there as a
    frame of its own, once per saved tensor (a guard on its counter) until its recompile limit.
    Now the hooks' code is marked for Dynamo to skip; the child compiles once, the gradients are
    the plain ones."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.testing import CompileCounter

    from remat.manual.checkpoint import _Frame
    from remat.manual.scope import TapedRegion
    from remat.planner.taped_calls import Run

    torch.manual_seed(0)
    counter = CompileCounter()
    nn = torch.nn
    blocks = [nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Sigmoid(), nn.Linear(64, 32)) for _ in range(3)]
    model = nn.Sequential(*blocks)
    plain = copy.deepcopy(model)
    model[1] = torch.compile(model[1], backend=counter)
    x = torch.randn(2, 16, 32)

    def step(run: Any) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        run().square().mean().backward()
        return [p.grad for p in model.parameters()]

    plain(x).square().mean().backward()
    expected = [p.grad for p in plain.parameters()]
    plan = remat.plan(model, (x,), "min", loss_fn=lambda m, x: m(x).square().mean())
    assert plan.regions

    def planned() -> torch.Tensor:
        with plan.apply(model):
            return model(x)

    def scoped() -> torch.Tensor:
        with remat.scope():
            return model(x)

    for run in (planned, planned, planned, scoped, lambda: remat.checkpoint(model, x)):
        assert all(map(torch.equal, step(run), expected))
    for code in (Run.pack.__code__, TapedRegion.pack.__code__, _Frame.pack.__code__):
        assert _debug_get_cache_entry_list(code) == []
    assert counter.frame_count <= 2  # the child, and at most once more for the grad mode planning set
