"""A plan's forward under saved-tensor hooks that are not its own is refused before its first op.

Saved-tensor hooks decide what autograd keeps, which the plan decides for itself, and their own
ops (an offloader's copies, a scope's recording) would run among the model's, where the executor's
check would name them diverged from the traced step. The three-way plan's own offloading hooks
say so (``steps_aside``, ``remat.planner.offload_execute``) and are let through.
"""

from __future__ import annotations

import torch

from remat._errors import RematValueError, message
from remat.manual.scope import TapedRegion

__all__ = ["hooks_of_another", "hooks_refused"]


def hooks_of_another(region: TapedRegion | None = None) -> RematValueError | None:
    """The error for a forward under saved-tensor hooks not the plan's (``remat.offload``,
    ``remat.scope``, ``torch.autograd.graph.save_on_cpu``): they decide what autograd keeps, which
    the plan decides for itself, and their own ops run among the model's (the check would name them
    diverged). ``region``: the plan's own, open now."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    owner = getattr(top[0], "__self__", top[0]) if top is not None else None
    if top is None or owner is region or getattr(owner, "steps_aside", False):  # a three-way plan's
        return None
    return hooks_refused(getattr(owner, "__qualname__", type(owner).__qualname__))


def hooks_refused(owner: str) -> RematValueError:
    return RematValueError(
        message(
            "plan",
            "a plan runs the model's forward under no saved-tensor hooks of another (it decides "
            "what autograd keeps)",
            f"the forward started under {owner}",
            "apply the plan outside remat.offload, remat.scope, remat.checkpoint and torch.autograd.graph "
            "hooks (plan with link= to offload)",
        )
    )
