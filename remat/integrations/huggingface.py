"""One line to make a ``transformers`` model's own gradient checkpointing run on remat.

``transformers`` layers that support gradient checkpointing call
``self._gradient_checkpointing_func(forward, *args)`` when the flag is on; by default that is
``torch.utils.checkpoint``. ``enable`` installs remat's function form (``remat.checkpoint``) or
region form (``remat.scope``) there instead, with a policy, so batch-norm statistics, RNG,
autocast and selective saving behave as remat documents, and nothing else about the model
changes (``state_dict``, hooks, ``gradient_checkpointing_disable()`` all keep working).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

from torch import nn

from remat._errors import RematTypeError, RematValueError, message
from remat.manual.checkpoint import Check, run
from remat.manual.fused import ReplayMode, executor
from remat.policy import Policy

Form = Literal["checkpoint", "scope"]


def _checkpoint_func(
    form: Form, policy: Policy | None, check: Check, replay: ReplayMode
) -> Callable[..., Any]:
    if form == "checkpoint":

        def remat_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return run(function, args, kwargs, policy, check)

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
) -> nn.Module:
    """Turn on ``model``'s gradient checkpointing, executed by remat. Returns the model.

    ``form="checkpoint"`` re-runs each layer's forward in backward; ``form="scope"`` records the
    layer's ops and replays only what backward needs, with ``replay="compiled"`` through fused
    ``torch.compile``d graphs (see ``remat.scope``). ``policy`` (e.g.
    ``remat.SaveComputeIntensive()``) keeps chosen op outputs instead of recomputing them.
    """
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
    if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
        raise RematValueError(
            message(
                "integrations.huggingface.enable",
                "every_n_layers must be a positive int",
                f"got {every_n_layers!r}",
                "pass 1 to checkpoint every layer",
            )
        )
    func = _checkpoint_func(form, policy, check, replay)
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
