"""The keywords of ``torch.utils.checkpoint``, read as remat settings, so that switching is an import.

torch's ``checkpoint(fn, *args, use_reentrant=, preserve_rng_state=, context_fn=,
determinism_check=, debug=, early_stop=, **kwargs)`` mixes its own keywords with the function's.
``remat.checkpoint`` and ``remat.checkpoint_sequential`` consume the same keywords (any other
keyword still goes to ``fn``) and turn them into one ``Settings``:

=====================  =========================================================================
torch keyword          in remat
=====================  =========================================================================
use_reentrant          None or False: accepted (remat is non-reentrant); True: an error
preserve_rng_state     False: the recomputation runs on the generators as they are (no replay)
determinism_check      "default": shapes and dtypes checked; "none": no check
debug                  True: the value check (``check="values"``), which names the op and module
early_stop             accepted: remat stops once the op making the last saved tensor again has
                       run, which changes no result
context_fn             ``partial(create_selective_checkpoint_contexts, ops_or_policy_fn)``: a
                       remat policy (``SaveOps`` or ``PolicyFunction``; ``MUST_CPU_OFFLOAD``
                       offloads); anything else an error
=====================  =========================================================================
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

from remat._errors import RematTypeError, RematValueError, message
from remat._reusable import reusable
from remat.host.offloader import Offloader
from remat.manual.checks import Check
from remat.policy import Decision, OpContext, Policy, SaveOps, checked

__all__ = ["TORCH_KEYWORDS", "PolicyFunction", "Settings", "set_checkpoint_early_stop", "settings", "split"]

TORCH_KEYWORDS = frozenset(
    {"use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop"}
)

_SAVE = frozenset({"MUST_SAVE", "PREFER_SAVE"})
_RECOMPUTE = frozenset({"MUST_RECOMPUTE", "PREFER_RECOMPUTE"})
_OFFLOAD = frozenset({"MUST_CPU_OFFLOAD"})


@dataclass(frozen=True)
class Settings:
    """What one checkpointed call does: the policy, the check, whether RNG is replayed, and the
    offloader that moves what the policy decides OFFLOAD."""

    policy: Policy | None = None
    check: Check = "shapes"
    preserve_rng: bool = True
    offloader: Offloader | None = None


_DEFAULTS = Settings()


@dataclass(frozen=True)
class PolicyFunction:
    """A ``torch.utils.checkpoint`` policy function ``policy_fn(ctx, op, *args, **kwargs)`` run as
    a remat policy: ``MUST_SAVE``/``PREFER_SAVE`` (or True) save, ``MUST_RECOMPUTE``/
    ``PREFER_RECOMPUTE`` (or False) recompute, ``MUST_CPU_OFFLOAD`` offloads (which torch's eager
    checkpoint recomputes instead)."""

    policy_fn: Callable[..., Any]

    def decide(self, ctx: OpContext) -> Decision:
        scc = torch_checkpoint.SelectiveCheckpointContext(is_recompute=False)
        choice = self.policy_fn(scc, ctx.overload, *ctx.args, **ctx.kwargs)
        name = choice.name if isinstance(choice, torch_checkpoint.CheckpointPolicy) else None
        if choice is True or name in _SAVE:
            return Decision.SAVE
        if choice is False or name in _RECOMPUTE:
            return Decision.RECOMPUTE
        if name in _OFFLOAD:
            return Decision.OFFLOAD
        raise RematTypeError(
            message(
                "checkpoint",
                "a selective-checkpoint policy function must return a CheckpointPolicy or a bool",
                f"got {choice!r} for {ctx.op}",
                "return e.g. CheckpointPolicy.MUST_SAVE or CheckpointPolicy.PREFER_RECOMPUTE",
            )
        )


def split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate torch's checkpoint keywords from the function's own keywords."""
    ours = {k: v for k, v in kwargs.items() if k in TORCH_KEYWORDS}
    theirs = {k: v for k, v in kwargs.items() if k not in TORCH_KEYWORDS}
    return ours, theirs


def _policy_of(api: str, context_fn: Any) -> Policy | None:
    if context_fn is torch_checkpoint.noop_context_fn:
        return None
    if (
        isinstance(context_fn, functools.partial)
        and context_fn.func is torch_checkpoint.create_selective_checkpoint_contexts
        and len(context_fn.args) + ("policy_fn_or_list" in context_fn.keywords) == 1
        and set(context_fn.keywords) <= {"policy_fn_or_list", "allow_cache_entry_mutation"}
    ):
        # Writes to saved outputs are always handled exactly, so allow_cache_entry_mutation changes
        # nothing here.
        chosen = context_fn.args[0] if context_fn.args else context_fn.keywords["policy_fn_or_list"]
        if isinstance(chosen, (list, tuple, set, frozenset)):
            return SaveOps(frozenset(str(op) for op in chosen))
        if callable(chosen):
            return PolicyFunction(chosen)
    raise RematValueError(
        message(
            api,
            "context_fn must be partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, "
            "ops_or_policy_fn)",
            f"got {context_fn!r}",
            "pass such a partial, or a remat policy as policy=",
        )
    )


def _flag(api: str, name: str, value: Any, allowed: tuple[Any, ...], required: bool = False) -> Any:
    if not any(value is a for a in allowed):
        raise RematValueError(
            message(
                api,
                f"{name} must be one of {', '.join(map(repr, allowed))}",
                f"got {name}={value!r}",
                f"pass {name}={allowed[-1]!r}" + ("" if required else " or leave it out"),
            )
        )
    return value


def settings(
    api: str,
    torch_kwargs: dict[str, Any],
    policy: Policy | None,
    check: Check,
    offloader: Offloader | None = None,
) -> Settings:
    """Read torch's keywords (see the module's table) together with remat's ``policy``/``check``."""
    if not torch_kwargs and policy is None and check == "shapes" and offloader is None:
        return _DEFAULTS  # the call every checkpointed layer makes, with nothing to read
    policy = checked(api, policy)
    if check not in ("none", "shapes", "values"):
        raise RematValueError(
            message(
                api,
                "check must be 'none', 'shapes' or 'values'",
                f"got {check!r}",
                "use check='values' to compare recomputed values with the forward's; remat takes the "
                "check= keyword itself, so pass a function's own check through functools.partial",
            )
        )
    if torch_kwargs.get("use_reentrant") is True:
        raise RematValueError(
            message(
                api,
                "remat's checkpoint is non-reentrant",
                "got use_reentrant=True",
                "pass use_reentrant=False or leave it out; the results are the same",
            )
        )
    _flag(api, "use_reentrant", torch_kwargs.get("use_reentrant"), (None, False))
    preserve = _flag(api, "preserve_rng_state", torch_kwargs.get("preserve_rng_state", True), (False, True))
    debug = _flag(api, "debug", torch_kwargs.get("debug", False), (True, False))
    _flag(api, "early_stop", torch_kwargs.get("early_stop"), (None, False, True))
    determinism = torch_kwargs.get("determinism_check", "default")
    if determinism not in ("default", "none"):
        raise RematValueError(
            message(
                api,
                "determinism_check must be 'default' or 'none'",
                f"got {determinism!r}",
                "pass determinism_check='default', or debug=True to compare values",
            )
        )
    if "context_fn" in torch_kwargs:
        from_context = _policy_of(api, torch_kwargs["context_fn"])
        if from_context is not None and policy is not None:
            raise RematValueError(
                message(
                    api,
                    "pass a policy or a context_fn, not both",
                    f"got policy={policy!r} and context_fn",
                    "keep one of them",
                )
            )
        policy = policy if from_context is None else from_context
    if (debug and check == "none") or (determinism == "none" and check == "values"):
        given = "check='none' and debug=True" if debug else "check='values' and determinism_check='none'"
        raise RematValueError(
            message(
                api,
                "torch's debug= and determinism_check= set remat's check=: they disagree",
                f"got {given}",
                "keep one of them",
            )
        )
    if debug or check == "values":
        check = "values"
    elif determinism == "none":
        check = "none"
    if offloader is not None and not isinstance(offloader, Offloader):
        raise RematTypeError(
            message(
                api,
                "offloader must be a remat.Offloader",
                f"got {type(offloader).__name__}",
                "pass remat.Offloader(link=..., prefetch=...) or leave it out",
            )
        )
    return Settings(policy, check, preserve, offloader)


@reusable
def set_checkpoint_early_stop(enable: bool) -> Iterator[None]:
    """``torch.utils.checkpoint.set_checkpoint_early_stop``'s counterpart. remat's recomputation
    stops once the op making the last saved tensor again has run, which changes no result, so both
    values are accepted and behave the same."""
    _flag("set_checkpoint_early_stop", "enable", enable, (False, True), required=True)
    yield
