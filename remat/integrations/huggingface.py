"""One line to make a ``transformers`` model's own gradient checkpointing run on remat.

``transformers`` layers that support gradient checkpointing call
``self._gradient_checkpointing_func(forward, *args)`` when the flag is on; by default that is
``torch.utils.checkpoint``. ``enable`` installs remat's function form (``remat.checkpoint``) or
region form (``remat.scope``) there instead, with a policy, so batch-norm statistics, RNG,
autocast and selective saving behave as remat documents, and nothing else about the model
changes (``state_dict``, hooks, ``gradient_checkpointing_disable()`` all keep working).
``activation_checkpointing_kwargs`` (or its older name ``gradient_checkpointing_kwargs``), what
transformers users pass to ``gradient_checkpointing_enable`` today, is read as the keywords of
``torch.utils.checkpoint`` (``remat.manual.keywords``): ``{"use_reentrant": False}`` above all.

transformers 5 renamed ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`` to
``activation_checkpointing_enable(activation_checkpointing_kwargs=..., every_n_layers=...,
offload=...)``; ``enable`` takes the keywords of both, and a model of either version (it sets the
layers' function through ``_set_gradient_checkpointing``, which both have). ``offload=True`` does
what it does there: the tensors each checkpointed layer keeps for its recomputation (its inputs)
are held in host memory, through ``torch.autograd.graph.save_on_cpu`` (pinned where CUDA is
available), and copied back for backward; on CPU they are already there and nothing is copied.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from remat._errors import RematTypeError, RematValueError, message
from remat._units import whole
from remat.manual import keywords
from remat.manual.checkpoint import run
from remat.manual.checks import Check
from remat.manual.fused import ReplayMode, executor
from remat.policy import Policy

Form = Literal["checkpoint", "scope"]


def _checkpoint_func(
    form: Form, s: keywords.Settings, replay: ReplayMode, offload: bool
) -> Callable[..., Any]:
    policy = s.policy
    if form == "checkpoint" and offload:
        pin = torch.cuda.is_available()

        def remat_checkpoint_offloaded(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            # the layer's inputs, which remat.checkpoint saves through autograd, go to host memory
            with torch.autograd.graph.save_on_cpu(pin_memory=pin):
                return run(function, args, kwargs, s.policy, s.check, s.preserve_rng)

        return remat_checkpoint_offloaded
    if form == "checkpoint":

        def remat_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return run(function, args, kwargs, s.policy, s.check, s.preserve_rng)

        return remat_checkpoint

    from remat.manual.scope import scope

    def remat_scope(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with scope(policy=policy, replay=replay):
            return function(*args, **kwargs)

    return remat_scope


def enable(
    model: nn.Module,
    form: Form = "checkpoint",
    policy: Policy | None = None,
    check: Check = "shapes",
    every_n_layers: int = 1,
    replay: ReplayMode = "eager",
    activation_checkpointing_kwargs: dict[str, Any] | None = None,
    gradient_checkpointing_kwargs: dict[str, Any] | None = None,
    offload: bool = False,
) -> nn.Module:
    """Turn on ``model``'s gradient checkpointing, executed by remat. Returns the model.

    ``form="checkpoint"`` re-runs each layer's forward in backward; ``form="scope"`` records the
    layer's ops and replays only what backward needs, with ``replay="compiled"`` through fused
    ``torch.compile``d graphs (see ``remat.scope``). ``policy`` (e.g.
    ``remat.SaveComputeIntensive()``) keeps chosen op outputs instead of recomputing them.
    ``activation_checkpointing_kwargs`` / ``gradient_checkpointing_kwargs``: torch's checkpoint
    keywords, as transformers takes them (``{"use_reentrant": False}``); the region form takes
    ``use_reentrant`` and ``context_fn`` (a policy) only. ``offload=True`` (transformers 5's
    keyword; the function form only): each layer's saved inputs are held in host memory.
    """
    api = "integrations.huggingface.enable"
    if activation_checkpointing_kwargs is not None and gradient_checkpointing_kwargs is not None:
        raise RematValueError(
            message(
                api,
                "gradient_checkpointing_kwargs is the older name of activation_checkpointing_kwargs",
                "got both",
                "pass one of them",
            )
        )
    named = (activation_checkpointing_kwargs, gradient_checkpointing_kwargs)
    given = next((k for k in named if k is not None), {})  # ``[]`` is refused too, not taken for none
    if not isinstance(given, dict):
        name = "activation" if activation_checkpointing_kwargs is not None else "gradient"
        rule = f"{name}_checkpointing_kwargs must be a dict of torch's checkpoint keywords"
        raise RematTypeError(message(api, rule, f"got {given!r}"[:200], 'pass {"use_reentrant": False}'))
    if not isinstance(offload, bool):
        rule, todo = (
            "offload must be True or False",
            "pass offload=True to hold each layer's inputs on the host",
        )
        raise RematTypeError(message(api, rule, f"got {offload!r}", todo))
    if form == "scope" and check == "values":
        rule = "check applies to the function form, which runs each layer's forward again"
        raise RematValueError(
            message(api, rule, f"got check={check!r} with form='scope'", 'pass form="checkpoint"')
        )
    torch_kwargs, unknown = keywords.split(given)
    if unknown or (form == "scope" and set(torch_kwargs) - {"use_reentrant", "context_fn"}):
        others = sorted(unknown) or sorted(set(torch_kwargs) - {"use_reentrant", "context_fn"})
        raise RematValueError(
            message(
                api,
                "these checkpoint keywords are not available here",
                f"got {', '.join(others)} with form={form!r}",
                "pass keywords of torch.utils.checkpoint.checkpoint (use_reentrant, preserve_rng_state, "
                "context_fn, determinism_check, debug, early_stop); form='scope' takes use_reentrant "
                "and context_fn",
            )
        )
    s = keywords.settings(api, torch_kwargs, policy, check)
    setter = getattr(model, "_set_gradient_checkpointing", None)
    if (
        not isinstance(model, nn.Module)
        or setter is None
        or not getattr(model, "supports_gradient_checkpointing", False)
    ):
        raise RematTypeError(
            message(
                "integrations.huggingface.enable",
                "the model must be a transformers PreTrainedModel that supports gradient checkpointing",
                f"got {type(model).__name__}",
                "wrap its blocks with remat.checkpoint(block) instead",
            )
        )
    if form not in ("checkpoint", "scope"):
        raise RematValueError(
            message(
                "integrations.huggingface.enable",
                "form must be 'checkpoint' or 'scope'",
                f"got {form!r}",
                "pick the function form or the region form",
            )
        )
    executor("integrations.huggingface.enable", replay)
    if replay != "eager" and form != "scope":
        raise RematValueError(
            message(
                "integrations.huggingface.enable",
                "replay applies to the region form, which records the ops it replays",
                f"got replay={replay!r} with form={form!r}",
                'pass form="scope"',
            )
        )
    every_n_layers = whole(every_n_layers)
    if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
        raise RematValueError(
            message(
                "integrations.huggingface.enable",
                "every_n_layers must be a positive int",
                f"got {every_n_layers!r}",
                "pass 1 to checkpoint every layer",
            )
        )
    if offload and form != "checkpoint":
        raise RematValueError(
            message(
                api,
                "offload applies to the function form, whose layer inputs autograd saves",
                f"got offload=True with form={form!r}",
                'pass form="checkpoint", or leave offload off',
            )
        )
    func = _checkpoint_func(form, s, replay, offload)
    if "every_n_layers" in inspect.signature(setter).parameters:
        setter(enable=True, gradient_checkpointing_func=func, every_n_layers=every_n_layers)
    elif every_n_layers == 1:
        setter(enable=True, gradient_checkpointing_func=func)
    else:
        raise RematValueError(
            message(
                "integrations.huggingface.enable",
                "this transformers version has no every_n_layers",
                f"got {every_n_layers}",
                "upgrade transformers or pass every_n_layers=1",
            )
        )
    return model
