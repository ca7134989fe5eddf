"""Migration: code written for ``torch.utils.checkpoint`` runs unchanged on remat, with the same results.

Each script below calls checkpointing through a module ``ckpt`` the way torch's users write it.
It runs once with ``ckpt = torch.utils.checkpoint`` and once with ``ckpt = remat``; the losses,
every gradient, the buffers and the RNG stream after training must be bitwise equal.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from models import Run, assert_same, build, train, twin
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat

Script = Callable[[ModuleType, nn.Module, torch.Tensor], torch.Tensor]


def _save_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _per_block(**keywords: Any) -> Script:
    def script(ckpt: ModuleType, body: nn.Module, x: torch.Tensor) -> torch.Tensor:
        for block in body:  # type: ignore[attr-defined]
            x = ckpt.checkpoint(block, x, **keywords)
        return x

    return script


def _early_stop_off(ckpt: ModuleType, body: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with ckpt.set_checkpoint_early_stop(False):
        return _per_block(use_reentrant=False)(ckpt, body, x)


def _sequential(ckpt: ModuleType, body: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return ckpt.checkpoint_sequential(body, 2, x, use_reentrant=False)


def _sequential_keywords(ckpt: ModuleType, body: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return ckpt.checkpoint_sequential(list(body), 3, x, use_reentrant=False, preserve_rng_state=True)


def _sequential_named(ckpt: ModuleType, body: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every argument by torch's name for it (``checkpoint_sequential(model, 2, input=x)`` raised
    a bare TypeError, remat's third argument being named ``x``)."""
    return ckpt.checkpoint_sequential(functions=body, segments=2, input=x, use_reentrant=False)


def _function_keywords(ckpt: ModuleType, body: nn.Module, x: torch.Tensor) -> torch.Tensor:
    def masked(h: torch.Tensor, *, mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return body(h * mask) * scale

    mask = (torch.arange(x.shape[-1]) % 3 != 0).to(x.dtype)
    return ckpt.checkpoint(masked, x, mask=mask, scale=0.5, use_reentrant=False)


SCRIPTS: dict[str, Script] = {
    "use_reentrant": _per_block(use_reentrant=False),
    "preserve_rng_state": _per_block(use_reentrant=False, preserve_rng_state=True),
    "determinism_check_none": _per_block(use_reentrant=False, determinism_check="none"),
    "determinism_check_default": _per_block(use_reentrant=False, determinism_check="default"),
    "debug": _per_block(use_reentrant=False, debug=True),
    "early_stop_false": _per_block(use_reentrant=False, early_stop=False),
    "set_checkpoint_early_stop": _early_stop_off,
    "context_fn_ops": _per_block(
        use_reentrant=False,
        context_fn=functools.partial(
            create_selective_checkpoint_contexts, [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
        ),
    ),
    "context_fn_policy_fn": _per_block(
        use_reentrant=False, context_fn=functools.partial(create_selective_checkpoint_contexts, _save_mm)
    ),
    "checkpoint_sequential": _sequential,
    "checkpoint_sequential_keywords": _sequential_keywords,
    "checkpoint_sequential_named": _sequential_named,
    "function_keywords": _function_keywords,
}


class _Net(nn.Module):
    """Blocks with dropout (the RNG must be replayed) and a constant buffer."""

    def __init__(self, script: Script, ckpt: ModuleType, dropout: float = 0.2) -> None:
        super().__init__()
        self.script, self.ckpt = script, ckpt
        self.body = nn.Sequential(
            *[nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(dropout)) for _ in range(4)]
        )
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.script(self.ckpt, self.body, x * self.scale).pow(2).mean()


def _batch(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(10 + step)
    return {"x": torch.randn(8, 16, generator=g, requires_grad=True)}


def _run(script: Script, ckpt: ModuleType, dropout: float = 0.2) -> Run:
    torch.manual_seed(0)
    return train(_Net(script, ckpt, dropout), _batch)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_same_on_torch_and_remat(name: str) -> None:
    assert_same(_run(SCRIPTS[name], torch_checkpoint), _run(SCRIPTS[name], remat))


def test_preserve_rng_state_false_same_without_randomness() -> None:
    # Without the replay a region that draws random numbers is recomputed with other ones, in torch
    # and in remat alike; users turn it off for regions that draw none.
    script = _per_block(use_reentrant=False, preserve_rng_state=False)
    assert_same(_run(script, torch_checkpoint, dropout=0.0), _run(script, remat, dropout=0.0))


def _gpt2_checkpointed(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renamed it; both work
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def test_transformers_gradient_checkpointing_enable(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.modeling_utils

    model, batch, _ = build("gpt2")
    theirs = train(_gpt2_checkpointed(twin(model)), batch)
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", remat.checkpoint)
    ours_model = _gpt2_checkpointed(twin(model))
    func = ours_model.transformer.h[0]._gradient_checkpointing_func
    assert func.func is remat.checkpoint and func.keywords == {"use_reentrant": False}
    assert_same(theirs, train(ours_model, batch))
    assert_same(train(model, batch), theirs)
