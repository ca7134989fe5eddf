"""remat.integrations.huggingface.enable: a transformers model's own checkpointing, run by remat."""

from __future__ import annotations

import copy
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
    with pytest.raises(
        remat.RematTypeError, match=r"activation_checkpointing_kwargs must be a dict .*got 'use_r"
    ):
        huggingface.enable(model, activation_checkpointing_kwargs="use_reentrant")  # type: ignore[arg-type]
    with pytest.raises(remat.RematTypeError, match=r"gradient_checkpointing_kwargs must be a dict .*got 1\)"):
        huggingface.enable(model, gradient_checkpointing_kwargs=1)  # type: ignore[arg-type]
    for empty in ([], 0, "", ()):  # refused as well, not taken for no keywords
        with pytest.raises(remat.RematTypeError, match=r"activation_checkpointing_kwargs must be a dict"):
            huggingface.enable(model, activation_checkpointing_kwargs=empty)  # type: ignore[arg-type]
    with pytest.raises(remat.RematTypeError, match=r"enable: offload must be True or False \(got 'no'\)"):
        huggingface.enable(model, offload="no")  # type: ignore[arg-type]
    with pytest.raises(
        remat.RematValueError, match=r"check applies to the function form, .*check=.values. with form=.scope."
    ):
        huggingface.enable(model, form="scope", check="values")


class _Counted(torch.autograd.graph.saved_tensors_hooks):
    """Stands in for ``save_on_cpu``: counts what it is given to hold, and holds it as is."""

    packed: list[tuple[int, ...]] = []

    def __init__(self, pin_memory: bool = False) -> None:
        def pack(t: torch.Tensor) -> torch.Tensor:
            _Counted.packed.append(tuple(t.shape))
            return t

        super().__init__(pack, lambda t: t)


def test_offload_holds_each_layers_inputs_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    model, batch, _ = build("gpt2")
    wrapped = huggingface.enable(twin(model), offload=True)  # transformers 5's keyword
    assert_same(train(model, batch), train(wrapped, batch))  # on CPU: nothing to copy, same bits
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", _Counted)
    _Counted.packed.clear()
    counted = huggingface.enable(twin(model), offload=True)
    counted(**batch(0)).loss.backward()
    hidden = counted.config.n_embd
    layers = len(counted.transformer.h)
    assert sum(shape[-1:] == (hidden,) for shape in _Counted.packed) >= layers  # every layer's input


def test_offload_is_for_the_function_form() -> None:
    model, _, _ = build("gpt2")
    with pytest.raises(remat.RematValueError, match=r"offload applies to the function form, .*form='scope'"):
        huggingface.enable(model, form="scope", offload=True)


class _OldStyle(nn.Module):
    """A transformers 4.x-style model: ``gradient_checkpointing_enable`` only, and a
    ``_set_gradient_checkpointing`` without ``every_n_layers``."""

    supports_gradient_checkpointing = True

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func: object = None

    def _set_gradient_checkpointing(
        self, enable: bool = True, gradient_checkpointing_func: object = None
    ) -> None:
        self.gradient_checkpointing = enable
        self._gradient_checkpointing_func = gradient_checkpointing_func

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: object = None) -> None:
        raise AssertionError("remat sets the function itself")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.gradient_checkpointing:
                x = self._gradient_checkpointing_func(lambda h, layer=layer: torch.tanh(layer(h)), x)  # type: ignore[operator]
            else:
                x = torch.tanh(layer(x))
        return x


def test_a_4x_style_model_takes_both_keyword_names() -> None:
    torch.manual_seed(0)
    plain = _OldStyle()
    x = torch.randn(4, 8)
    plain(x).sum().backward()
    for kwargs in ({"gradient_checkpointing_kwargs": {"use_reentrant": False}}, {"offload": True}):
        ours = huggingface.enable(copy.deepcopy(plain), **kwargs)  # type: ignore[arg-type]
        ours.zero_grad(set_to_none=True)
        ours(x).sum().backward()
        for a, b in zip(plain.parameters(), ours.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)  # type: ignore[arg-type]
    with pytest.raises(remat.RematValueError, match=r"this transformers version has no every_n_layers"):
        huggingface.enable(_OldStyle(), every_n_layers=2)
