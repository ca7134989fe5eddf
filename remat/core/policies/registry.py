"""The registry of eviction policies, by name; the CLI and the simulator list it."""

from __future__ import annotations

from remat._errors import RematTypeError, RematValueError, message
from remat.core.policies.base import EvictionPolicy

_POLICIES: dict[str, EvictionPolicy] = {}


def register(policy: EvictionPolicy) -> EvictionPolicy:
    """Make ``policy`` known under ``policy.name``."""
    if policy.name in _POLICIES:
        raise ValueError(f"an eviction policy named {policy.name!r} is already registered")
    _POLICIES[policy.name] = policy
    return policy


def names() -> tuple[str, ...]:
    """The registered policy names, sorted."""
    return tuple(sorted(_POLICIES))


def get(name: str, api: str = "core.policies.get") -> EvictionPolicy:
    """The policy registered as ``name``; a RematValueError listing the known names otherwise."""
    try:
        return _POLICIES[name]
    except (KeyError, TypeError):
        raise RematValueError(
            message(api, "unknown eviction policy", f"got {name!r}", f"use one of {', '.join(names())}")
        ) from None


_POLICY_PARTS = ("choose", "end", "needs", "inplace", "name")


def resolve(policy: object, layout: bool, api: str) -> EvictionPolicy:
    """``policy`` as a policy object: a registered name looked up, or an object with the policy's
    methods; refused with an error naming ``api`` if it reads addresses and ``layout`` is off."""
    if isinstance(policy, str):
        chosen: EvictionPolicy = get(policy, api)
    elif all(hasattr(policy, a) for a in _POLICY_PARTS):
        chosen = policy  # type: ignore[assignment]
    else:
        raise RematTypeError(
            message(
                api,
                "policy must be a registered name or an eviction policy",
                f"got {policy!r}",
                f"use one of {', '.join(names())}",
            )
        )
    if "layout" in chosen.needs and not layout:
        raise RematValueError(
            message(
                api,
                "this policy reads addresses, which byte counting does not model",
                f"policy {chosen.name!r} with layout=False",
                "pass layout=True or a policy without layout-aware parts (e.g. 'dtr-eq', 'coop-no-layout')",
            )
        )
    return chosen
