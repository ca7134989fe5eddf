"""The registry of the dynamic runtime's memory backends, by name; the region and the tests list it.

A memory backend is a class that runs and re-runs ops on real tensors for the core
(:class:`~remat.dynamic.accounting.AccountingBackend` and its kin); each registers itself here.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from remat._errors import RematValueError, message
from remat.core.pool import Pool


class MemoryBackend(Protocol):
    """What a region asks of a backend class before it makes one."""

    name: str
    places: bool  # it puts tensors at the pool's addresses: it needs a budget and layout=True

    def create(self, device: torch.device, thrash_limit: float, pool: Pool, reserve: int) -> Any:
        """A backend for one region over ``pool``, with ``reserve`` bytes of the budget beside it."""
        ...


_BACKENDS: dict[str, MemoryBackend] = {}


def register(kind: Any) -> Any:
    """Make backend class ``kind`` known under ``kind.name`` (a class decorator)."""
    if kind.name in _BACKENDS:
        raise ValueError(f"a memory backend named {kind.name!r} is already registered")
    _BACKENDS[kind.name] = kind
    return kind


def names() -> tuple[str, ...]:
    """The registered backend names, sorted."""
    return tuple(sorted(_BACKENDS))


def get(name: object, api: str = "dynamic") -> MemoryBackend:
    """The backend class registered as ``name``; a RematValueError listing the known names otherwise."""
    try:
        return _BACKENDS[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise RematValueError(
            message(api, "unknown memory backend", f"got {name!r}", f"use one of {', '.join(names())}")
        ) from None
