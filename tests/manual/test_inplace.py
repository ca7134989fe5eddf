"""In-place writes to an output a selective policy saves: the plain function's gradients, every time,
also where the program writes it through an alias the saved op's schema does not announce (a 3-D
``x @ w`` is ``mm`` then ``_unsafe_view``: NOTE [aliases of saved outputs])."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat


def _save_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return (
        CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE
    )


POLICIES: dict[str, dict[str, Any]] = {
    "SaveOps": {"policy": remat.SaveOps(frozenset({"aten.mm"}))},
    "SaveComputeIntensive": {"policy": remat.SaveComputeIntensive()},
    "context_fn_ops": {
        "context_fn": functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    },
    "context_fn_policy_fn": {"context_fn": functools.partial(create_selective_checkpoint_contexts, _save_mm)},
    "OffloadComputeIntensive": {"policy": remat.OffloadComputeIntensive()},
}
SHAPES = {"2-D": (5, 4), "3-D": (2, 5, 4)}  # x @ w: mm; mm and _unsafe_view


def _inputs(shape: tuple[int, ...] = SHAPES["2-D"]) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(*shape, requires_grad=True), torch.randn(4, 6, requires_grad=True)


def _written_inside(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x @ w  # saved by the policy ...
    h.mul_(2)  # ... then written in place
    h.add_(x.sum())
    return h.tanh() * h


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_saved_output_written_inside_the_function(kind: str, shape: str) -> None:
    x, w = _inputs(SHAPES[shape])
    expected = torch.autograd.grad(_written_inside(x, w).sum(), (x, w))
    out = remat.checkpoint(_written_inside, x, w, **POLICIES[kind])
    for _ in range(2):  # the same gradients from one backward to the next
        got = torch.autograd.grad(out.sum(), (x, w), retain_graph=True)
        for e, g in zip(expected, got, strict=True):
            assert torch.equal(e, g)


def _returns_saved(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x @ w
    return h, h.exp()  # exp saves its output, not h: the caller may write h


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_saved_output_written_after_the_function(kind: str, shape: str) -> None:
    x, w = _inputs(SHAPES[shape])

    def loss(h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        h.add_(1)
        return (h * 3).sum() + e.sum()

    expected = torch.autograd.grad(loss(*_returns_saved(x, w)), (x, w))
    got = torch.autograd.grad(loss(*remat.checkpoint(_returns_saved, x, w, **POLICIES[kind])), (x, w))
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_unwritten_saved_outputs_are_not_recomputed() -> None:
    x, w = _inputs()
    calls: list[str] = []

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        calls.append(str(op))
        return _save_mm(ctx, op)

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)
    counted: list[str] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            counted.append(str(func))
            return func(*args, **(kwargs or {}))

    out = remat.checkpoint(lambda a, b: (a @ b).tanh(), x, w, context_fn=context_fn)
    with Count():
        out.sum().backward()
    assert "aten.mm.default" in calls
    assert counted.count("aten.mm.default") == 2  # backward's two matmuls; the forward's one is kept


@pytest.mark.parametrize(
    "policy", [remat.SaveOps(frozenset({"aten.mm"})), remat.SaveComputeIntensive()], ids=str
)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_saved_output_written_inside_a_scope(policy: remat.Policy, shape: str) -> None:
    x, w = _inputs(SHAPES[shape])
    expected = torch.autograd.grad(_written_inside(x, w).sum(), (x, w))
    with remat.scope(policy=policy):
        out = _written_inside(x, w)
    for _ in range(2):
        got = torch.autograd.grad(out.sum(), (x, w), retain_graph=True)
        for e, g in zip(expected, got, strict=True):
            assert torch.equal(e, g)


def _saved_then_written(x: torch.Tensor) -> torch.Tensor:
    h = x.relu()  # relu saves its output ...
    h.add_(1.0)  # ... which the next op writes: plain autograd refuses the backward
    return h * x  # a later save: the recomputation runs the write too; h dies with the function


def _in_scope(x: torch.Tensor) -> torch.Tensor:
    with remat.scope():
        return _saved_then_written(x)


@pytest.mark.parametrize(
    "form",
    [
        pytest.param(lambda x: remat.checkpoint(_saved_then_written, x), id="checkpoint"),
        pytest.param(_in_scope, id="scope"),
    ],
)
def test_a_saved_output_written_in_the_region_is_refused_as_autograd_refuses_it(form: Any) -> None:
    """The written tensor dies with the function, so its forward's version cannot be checked; the
    recomputation ran the write too, and a backward reading it gave a wrong gradient silently
    (``torch.utils.checkpoint`` does)."""
    x = torch.tensor([[-1.0, 2.0, -3.0, 4.0]], requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _saved_then_written(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"remat\.(checkpoint|scope): a tensor saved for backward"):
        form(x).sum().backward()


@pytest.mark.parametrize("form", ["checkpoint", "scope"])
def test_a_parameter_written_between_forward_and_backward_is_refused_through_a_saved_view(form: str) -> None:
    """``nn.Linear`` saves ``weight.t()``, a view that dies with the region: the recomputation ran
    on the new weights and gave their gradient, where plain autograd refuses (the view shares the
    weight's version counter)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)

    def run() -> torch.Tensor:
        if form == "checkpoint":
            return remat.checkpoint(lambda h: lin(h).tanh(), x)
        with remat.scope():
            return lin(x).tanh()

    for wrapped in (False, True):
        out = run() if wrapped else lin(x).tanh()
        with torch.no_grad():
            lin.weight.mul_(2)
        with pytest.raises(RuntimeError, match=r"modified by an inplace operation|modified in place"):
            out.sum().backward()


@pytest.mark.parametrize("form", ["checkpoint", "module", "sequential", "closure"])
def test_a_parameter_autograd_did_not_save_written_before_backward_is_refused(form: str) -> None:
    """The first layer's weight is not saved where its input needs no gradient, so plain autograd
    lets it be written between forward and backward (its gradient reads the forward's input); the
    recomputation read the written weight and gave other gradients in silence (0.017 apart)."""

    def build() -> tuple[torch.nn.Sequential, torch.nn.Linear]:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16)
        ), torch.nn.Linear(16, 1)

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    grads = []
    for wrapped in (False, True):
        block, head = build()
        if not wrapped:
            h = block(x)
        elif form == "checkpoint":
            h = remat.checkpoint(block, x)
        elif form == "module":
            h = remat.checkpoint(block)(x)
        elif form == "sequential":
            h = remat.checkpoint_sequential(block, 2, x)
        else:
            h = remat.checkpoint(lambda v, b=block: b(v), x)
        loss = head(h).pow(2).mean()
        with torch.no_grad():
            block[0].weight.mul_(1.5)
        if wrapped:
            with pytest.raises(
                remat.RecomputationError,
                match=r"remat\.checkpoint: a parameter or tensor the function read by reference \(not a "
                r"tensor argument: .*\) was modified in place before backward recomputed from it "
                r"\(float32\[32, 16\] at version 2, read at version 1\)",
            ):
                loss.backward()
        else:
            loss.backward()
            grads.append(block[0].weight.grad)
    block, head = build()  # written before the forward: read as the forward read it, exact
    with torch.no_grad():
        block[0].weight.mul_(1.5)
    remat.checkpoint(block, x).sum().backward()
    plain, _ = build()
    with torch.no_grad():
        plain[0].weight.mul_(1.5)
    plain(x).sum().backward()
    assert torch.equal(block[0].weight.grad, plain[0].weight.grad)


def test_a_parameter_the_function_itself_writes_is_refused_not_written_again() -> None:
    """``nn.Embedding(max_norm=...)`` renormalizes its weight's rows in place in every forward: the
    recomputation renormalized them again, and the weight and every gradient came out other than
    the plain step's (2.9e-11 apart), in silence, ``check="values"`` included."""

    def build() -> torch.nn.Sequential:
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            torch.nn.Embedding(50, 32, max_norm=1.0), torch.nn.Tanh(), torch.nn.Linear(32, 32)
        )
        with torch.no_grad():
            m[0].weight.mul_(3)  # rows above max_norm
        return m

    idx = torch.randint(0, 50, (8, 64), generator=torch.Generator().manual_seed(1))
    for check in ("shapes", "values"):
        model = build()
        out = remat.checkpoint(model, idx, check=check)
        with pytest.raises(
            remat.RecomputationError,
            match=r"remat\.checkpoint: the function writes in place a parameter or tensor it reads besides "
            r"its arguments .*\(float32\[50, 32\] "
            r"written by the forward\); leave the module that writes it out of the function",
        ):
            out.square().mean().backward()
    plain, model = build(), build()  # the writing module outside the function: exact
    plain(idx).square().mean().backward()
    h = model[0](idx)
    remat.checkpoint(model[1:], h).square().mean().backward()
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)


def _twice(
    block: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``block`` run on ``params`` swapped in (MAML's fast weights), the gradients for them."""
    y = torch.func.functional_call(block, params, (x,))
    return (y, *torch.autograd.grad(y.square().sum(), list(params.values())))


def test_a_checkpointed_module_under_functional_call_recomputes_with_the_tensors_its_forward_read() -> None:
    """``torch.func.functional_call`` puts its tensors in for the forward and takes them out before
    the backward; the recomputation runs with them put back (``torch.utils.checkpoint``'s reads
    the module's own and gives other gradients)."""
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        if wrap:
            remat.checkpoint(block)
        fast = {k: (v.detach() * 2).requires_grad_() for k, v in block.named_parameters()}
        results.append(_twice(block, fast, torch.randn(5, 8)))
        assert all(p is q for p, q in zip(block.parameters(), block.parameters(), strict=True))
    for plain, recomputed in zip(*results, strict=True):
        assert torch.equal(plain, recomputed)


def test_a_parameter_replaced_between_forward_and_backward_is_put_back_for_the_recomputation() -> None:
    grads = []
    for wrap in (False, True):
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        if wrap:
            remat.checkpoint(block)
        y = block(torch.randn(5, 8))
        old = block[0].weight
        block[0].weight = torch.nn.Parameter(old.detach() * 3)  # averaged weights swapped in
        replacement = block[0].weight
        y.square().sum().backward()
        assert block[0].weight is replacement and replacement.grad is None
        grads.append(old.grad)
    assert torch.equal(grads[0], grads[1])


class _Shifted(torch.nn.Module):
    """A plain tensor attribute (no buffer), read by the forward, or written by it (``count``)."""

    def __init__(self, count: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.shift = torch.full((8,), 0.5)
        self.count = count

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.count:
            self.shift.add_(1.0)
        return torch.tanh(self.lin(h) + self.shift)


@pytest.mark.parametrize("where", ["module attribute", "closure"])
def test_a_tensor_read_besides_the_arguments_written_before_backward_is_refused(where: str) -> None:
    """Neither saved by autograd nor a parameter of the function's modules: a plain tensor attribute,
    a parameter held by the function's closure only (``mm`` does not save it where its input needs
    no gradient). The recomputation would read the new values; it is refused, as ``remat.scope``
    refuses it."""
    torch.manual_seed(0)
    if where == "closure":
        w = torch.nn.Parameter(torch.randn(8, 8))
        out = remat.checkpoint(lambda h: torch.tanh(h @ w.t()), torch.randn(5, 8))
        written, shape = w, r"float32\[8, 8\]"
    else:
        module = remat.checkpoint(_Shifted())
        out = module(torch.randn(5, 8, requires_grad=True))
        written, shape = module.shift, r"float32\[8\]"
    with torch.no_grad():
        written.mul_(1.5)
    with pytest.raises(
        remat.RecomputationError,
        match=r"remat\.checkpoint: a parameter or tensor the function read by reference \(not a tensor "
        r"argument: a module's, a closure's, or one an argument object such as a dataclass holds\) "
        rf"was modified in place before backward recomputed from it \({shape} at version 1, read at "
        r"version 0\)",
    ):
        out.square().sum().backward()


def test_a_plain_tensor_attribute_the_function_writes_is_refused_not_written_again() -> None:
    module = remat.checkpoint(_Shifted(count=True))
    out = module(torch.randn(5, 8, requires_grad=True))
    with pytest.raises(remat.RecomputationError, match=r"writes in place a parameter or tensor it reads"):
        out.square().sum().backward()
    assert module.shift[0].item() == 1.5  # written once, by the forward
