"""torch.utils.checkpoint's keywords on remat.checkpoint: consumed, never passed to the function."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat import aten
from remat.manual import keywords


def _grads(out: torch.Tensor, params: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(out.tanh().sum(), params)


def _setup() -> tuple[nn.Module, torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6))
    x = torch.randn(4, 6, requires_grad=True)
    return net, x, [x, *net.parameters()]


def _assert_equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    assert len(a) == len(b) > 0
    for e, g in zip(a, b, strict=True):
        assert torch.equal(e, g)


@pytest.mark.parametrize(
    "torch_kwargs",
    [
        {"use_reentrant": False},
        {"use_reentrant": None},
        {"preserve_rng_state": False},
        {"determinism_check": "none"},
        {"debug": True},
        {"early_stop": False},
        {"early_stop": None},
        {"context_fn": torch.utils.checkpoint.noop_context_fn},
        {"context_fn": functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])},
    ],
    ids=lambda kw: "-".join(f"{k}={v if not callable(v) else type(v).__name__}" for k, v in kw.items()),
)
def test_torch_keywords_are_not_passed_to_fn(torch_kwargs: dict[str, Any]) -> None:
    net, x, params = _setup()
    seen: list[dict[str, Any]] = []

    def fn(h: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        seen.append(kwargs)
        return net(h)

    _assert_equal(_grads(net(x), params), _grads(remat.checkpoint(fn, x, **torch_kwargs), params))
    assert seen == [{}, {}]  # forward and recomputation, neither with torch's keywords


def test_function_keywords_still_go_to_fn() -> None:
    net, x, params = _setup()
    mask = torch.ones(6)

    def fn(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return net(h * mask)

    out = remat.checkpoint(fn, x, mask=mask, use_reentrant=False, preserve_rng_state=True)
    _assert_equal(_grads(fn(x, mask), params), _grads(out, params))


def test_call_with_only_torch_keywords_runs_fn_like_torch() -> None:
    net, x, params = _setup()
    out = remat.checkpoint(lambda: net(x), use_reentrant=False)
    assert isinstance(out, torch.Tensor)
    _assert_equal(_grads(net(x), params), _grads(out, params))


def test_decorator_takes_torch_keywords() -> None:
    net, x, params = _setup()
    wrapped = remat.checkpoint(use_reentrant=False, debug=True)(net)
    _assert_equal(_grads(net(x), params), _grads(wrapped(x), params))


def test_keywords_map_to_settings() -> None:
    def s(**kw: Any) -> keywords.Settings:
        return keywords.settings("checkpoint", kw, None, "shapes")

    assert s() == keywords.Settings(None, "shapes", True)
    assert s(determinism_check="none").check == "none"
    assert s(determinism_check="none", debug=True).check == "values"
    assert s(debug=True).check == "values"
    assert s(preserve_rng_state=False).preserve_rng is False
    ops = functools.partial(
        create_selective_checkpoint_contexts, [torch.ops.aten.mm.default, torch.ops.aten.bmm]
    )
    assert s(context_fn=ops).policy == remat.SaveOps(frozenset({"aten.mm.default", "aten.bmm"}))


def test_preserve_rng_state_false_skips_the_replay() -> None:
    x = torch.ones(64, requires_grad=True)

    def fn(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(h, 0.5).sin()

    for preserve in (True, False):
        torch.manual_seed(3)
        out = remat.checkpoint(fn, x, preserve_rng_state=preserve)
        torch.manual_seed(3)
        ref = fn(x)
        assert torch.equal(out, ref)
        torch.manual_seed(4)  # the recomputation draws here when it is not replayed
        (grad,) = torch.autograd.grad(out.sum(), x)
        (expected,) = torch.autograd.grad(ref.sum(), x)
        assert torch.equal(grad, expected) is preserve


def test_selective_policy_function() -> None:
    net, x, params = _setup()
    decided: list[str] = []

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        assert ctx.is_recompute is False and all(isinstance(a, (torch.Tensor, int, float)) for a in args)
        decided.append(str(op))
        return (
            CheckpointPolicy.MUST_SAVE
            if op == torch.ops.aten.addmm.default
            else CheckpointPolicy.PREFER_RECOMPUTE
        )

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)
    out = remat.checkpoint(net, x, use_reentrant=False, context_fn=context_fn)
    assert "aten.addmm.default" in decided
    _assert_equal(_grads(net(x), params), _grads(out, params))


def test_must_cpu_offload_moves_the_output_to_host_memory_and_back() -> None:
    net, x, params = _setup()

    def offload_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_CPU_OFFLOAD if op is torch.ops.aten.addmm.default else False

    context_fn = functools.partial(create_selective_checkpoint_contexts, offload_matmuls)
    offloader = remat.Offloader()
    out = remat.checkpoint(net, x, context_fn=context_fn, offloader=offloader)
    _assert_equal(_grads(net(x), params), _grads(out, params))
    stats = offloader.stats()
    assert stats.moved == 2 and stats.bytes_out == stats.bytes_back == 2 * 4 * 6 * 4


def test_set_checkpoint_early_stop_gives_the_same_results() -> None:
    net, x, params = _setup()
    expected = _grads(net(x), params)
    for enable in (True, False):
        with remat.set_checkpoint_early_stop(enable):
            _assert_equal(expected, _grads(remat.checkpoint(net, x), params))
    with (
        pytest.raises(
            remat.RematValueError, match=r"remat\.set_checkpoint_early_stop: enable must be .*got enable=1"
        ),
        remat.set_checkpoint_early_stop(1),
    ):  # type: ignore[arg-type]
        pass


def test_checkpoint_sequential_forwards_keywords() -> None:
    net, x, params = _setup()
    out = remat.checkpoint_sequential(net, 2, x, False, preserve_rng_state=False, debug=True)
    _assert_equal(_grads(net(x), params), _grads(out, params))
    with pytest.raises(
        remat.RematTypeError, match=r"remat\.checkpoint_sequential: unknown keyword \(got mask\)"
    ):
        remat.checkpoint_sequential(net, 2, x, mask=x)
    with pytest.raises(
        remat.RematValueError, match=r"remat\.checkpoint_sequential: remat's checkpoint is non-reentrant"
    ):
        remat.checkpoint_sequential(net, 2, x, use_reentrant=True)


def test_keyword_errors() -> None:
    net, x, _ = _setup()
    with pytest.raises(
        remat.RematValueError,
        match=r"remat\.checkpoint: remat's checkpoint is non-reentrant \(got use_reentrant=True\); pass",
    ):
        remat.checkpoint(net, x, use_reentrant=True)
    with pytest.raises(
        remat.RematValueError, match=r"determinism_check must be 'default' or 'none' \(got 'strict'\)"
    ):
        remat.checkpoint(net, x, determinism_check="strict")
    with pytest.raises(
        remat.RematValueError,
        match=r"preserve_rng_state must be one of False, True \(got preserve_rng_state='yes'\)",
    ):
        remat.checkpoint(net, x, preserve_rng_state="yes")
    with pytest.raises(remat.RematValueError, match=r"debug must be one of True, False"):
        remat.checkpoint(net, x, debug=1)
    with pytest.raises(remat.RematValueError, match=r"early_stop must be one of None, False, True"):
        remat.checkpoint(net, x, early_stop="no")
    with pytest.raises(
        remat.RematValueError,
        match=r"remat\.checkpoint: context_fn must be partial\(torch\.utils\.checkpoint\.create_selective",
    ):
        remat.checkpoint(net, x, context_fn=lambda: (None, None))
    ops = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    with pytest.raises(remat.RematValueError, match=r"pass a policy or a context_fn, not both"):
        remat.checkpoint(net, x, context_fn=ops, policy=remat.SaveComputeIntensive())

    def returns_string(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> str:
        return "save"

    with pytest.raises(
        remat.RematTypeError, match=r"must return a CheckpointPolicy or a bool \(got 'save' for aten\."
    ):
        remat.checkpoint(
            net, x, context_fn=functools.partial(create_selective_checkpoint_contexts, returns_string)
        )


class _Sized(torch.Tensor):
    """A wrapper subclass whose size and stride queries go through dispatch, as many do."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> _Sized:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined,no-any-return]
            cls,
            elem.shape,
            dtype=elem.dtype,
            requires_grad=elem.requires_grad,
            dispatch_sizes_strides_policy="sizes",
        )

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.sym_size.default:
            return args[0].elem.size()
        if func is torch.ops.aten.sym_stride.default:
            return args[0].elem.stride()

        def unwrap(t: Any) -> Any:
            return t.elem if isinstance(t, _Sized) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda t: _Sized(t) if isinstance(t, torch.Tensor) else t, out)


class _Asked(remat.SaveOps):
    """Saves matrix products and remembers every op it was asked about."""

    def __init__(self) -> None:
        super().__init__(frozenset({"aten.mm"}))
        object.__setattr__(self, "asked", [])

    def decide(self, ctx: remat.OpContext) -> remat.Decision:
        self.asked.append(ctx.packet)  # type: ignore[attr-defined]
        return super().decide(ctx)


def test_metadata_queries_take_no_position_in_a_selective_policy() -> None:
    """A tensor subclass sends size queries (``is_contiguous`` under ``reshape``) through dispatch:
    the policy is never asked about them, so its positions are those of the data ops, and the
    gradients are the plain function's."""

    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh((x @ w).reshape(-1)).reshape(4, 6) @ w

    x = torch.randn(4, 6)
    w = torch.randn(6, 6, requires_grad=True)

    def plain(t: torch.Tensor) -> torch.Tensor:
        return t.elem if isinstance(t, _Sized) else t

    expected = plain(torch.autograd.grad(fn(_Sized(x), w).square().sum(), w)[0])
    policy = _Asked()
    out = remat.checkpoint(fn, _Sized(x), w, policy=policy)
    got = plain(torch.autograd.grad(out.square().sum(), w)[0])
    assert policy.asked and not set(policy.asked) & aten.METADATA_PACKETS  # type: ignore[attr-defined]
    assert torch.equal(expected, got)
