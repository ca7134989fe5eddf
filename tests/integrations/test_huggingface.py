"""remat.integrations.huggingface.enable: a transformers model's own checkpointing, run by remat."""

from __future__ import annotations

import functools

import pytest
import torch
from models import assert_close, assert_same, build, train, twin
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat.integrations import huggingface

FORMS = ["checkpoint", "scope"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_enable_matches_plain(name: str, form: str) -> None:
    model, batch, _ = build(name)
    wrapped = huggingface.enable(twin(model), form=form)
    assert_same(train(model, batch), train(wrapped, batch))


@pytest.mark.parametrize("form", FORMS)
def test_enable_with_policy_matches_plain(form: str) -> None:
    model, batch, _ = build("gpt2")
    wrapped = huggingface.enable(twin(model), form=form, policy=remat.SaveComputeIntensive())
    assert_same(train(model, batch), train(wrapped, batch))


@pytest.mark.parametrize("form", FORMS)
def test_enable_lowers_counted_peak(form: str) -> None:
    model, batch, _ = build("gpt2")
    model.eval()  # no dropout: the comparison is about saved activations only
    inputs = batch(0)

    def peak(m: nn.Module) -> int:
        with remat.memory.track(timeline=False) as t:
            m(**inputs).loss.backward()
        return t.peak_bytes

    plain = peak(model)
    wrapped = huggingface.enable(twin(model), form=form)
    wrapped.train()
    for module in wrapped.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    assert peak(wrapped) < plain


def test_same_as_transformers_own_checkpointing() -> None:
    model, batch, _ = build("gpt2")
    theirs = twin(model)
    if hasattr(theirs, "activation_checkpointing_enable"):
        theirs.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        theirs.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ours = huggingface.enable(twin(model))
    assert_same(train(theirs, batch), train(ours, batch))


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_enable_with_compiled_replay_matches_plain(name: str) -> None:
    model, batch, _ = build(name)
    wrapped = huggingface.enable(twin(model), form="scope", replay="compiled")
    assert_close(train(model, batch), train(wrapped, batch))


def test_enable_rejects_other_models_and_options() -> None:
    with pytest.raises(remat.RematTypeError, match=r"remat\.integrations\.huggingface\.enable: .*got Linear"):
        huggingface.enable(nn.Linear(2, 2))
    model, _, _ = build("gpt2")
    with pytest.raises(remat.RematValueError, match=r"form must be 'checkpoint' or 'scope' \(got 'region'\)"):
        huggingface.enable(model, form="region")  # type: ignore[arg-type]
    with pytest.raises(remat.RematValueError, match=r"every_n_layers must be a positive int \(got 0\)"):
        huggingface.enable(model, every_n_layers=0)
    with pytest.raises(remat.RematValueError, match=r"region form, .*with form='checkpoint'"):
        huggingface.enable(model, replay="compiled")
    with pytest.raises(remat.RematValueError, match=r'replay must be "eager" or "compiled" \(got \'jit\'\)'):
        huggingface.enable(model, form="scope", replay="jit")  # type: ignore[arg-type]


def test_every_n_layers() -> None:
    model, batch, _ = build("gpt2")
    wrapped = huggingface.enable(twin(model), every_n_layers=2)
    flags = [block.gradient_checkpointing for block in wrapped.transformer.h]
    assert flags == [True, False]
    assert_same(train(model, batch), train(wrapped, batch))
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("name", ["gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"])
def test_enable_forwards_checkpointing_kwargs(name: str) -> None:
    model, batch, _ = build("gpt2")
    theirs = twin(model)
    if hasattr(theirs, "activation_checkpointing_enable"):
        theirs.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        theirs.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ours = huggingface.enable(twin(model), **{name: {"use_reentrant": False, "preserve_rng_state": True}})
    assert_same(train(theirs, batch), train(ours, batch))


def _save_addmm(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    return (
        CheckpointPolicy.MUST_SAVE
        if op == torch.ops.aten.addmm.default
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


@pytest.mark.parametrize("chosen", [[torch.ops.aten.addmm.default], _save_addmm], ids=["ops", "policy_fn"])
@pytest.mark.parametrize("form", FORMS)
def test_enable_takes_a_selective_context_fn(form: str, chosen: object) -> None:
    model, batch, _ = build("gpt2")
    context_fn = functools.partial(create_selective_checkpoint_contexts, chosen)
    kwargs = {"use_reentrant": False, "context_fn": context_fn}
    wrapped = huggingface.enable(twin(model), form=form, activation_checkpointing_kwargs=kwargs)  # type: ignore[arg-type]
    assert_same(train(model, batch), train(wrapped, batch))


def test_enable_checkpointing_kwargs_errors() -> None:
    model, _, _ = build("gpt2")
    with pytest.raises(remat.RematValueError, match=r"enable: remat's checkpoint is non-reentrant"):
        huggingface.enable(model, gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(
        remat.RematValueError, match=r"not available here \(got offload with form='checkpoint'\)"
    ):
        huggingface.enable(model, gradient_checkpointing_kwargs={"offload": True})
    with pytest.raises(remat.RematValueError, match=r"not available here \(got debug with form='scope'\)"):
        huggingface.enable(model, form="scope", activation_checkpointing_kwargs={"debug": True})
    with pytest.raises(
        remat.RematValueError, match=r"older name of activation_checkpointing_kwargs \(got both\)"
    ):
        huggingface.enable(model, gradient_checkpointing_kwargs={}, activation_checkpointing_kwargs={})
