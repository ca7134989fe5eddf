"""The registry of eviction policies, by name; the CLI and the simulator list it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat._errors import RematValueError, message

if TYPE_CHECKING:
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
