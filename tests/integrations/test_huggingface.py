"""remat.integrations.huggingface.enable: a transformers model's own checkpointing, run by remat."""

from __future__ import annotations

import pytest
import torch
from models import assert_close, assert_same, build, train, twin
from torch import nn

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
