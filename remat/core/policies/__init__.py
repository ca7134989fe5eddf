"""Eviction policies, one per module, registered by name (:func:`get`, :func:`names`)."""

from remat.core.policies import coop, dte, dtr, dtr_eq, dtr_local, largest, lru
from remat.core.policies.base import EvictionPolicy
from remat.core.policies.registry import get, names, register

__all__ = [
    "EvictionPolicy",
    "coop",
    "dte",
    "dtr",
    "dtr_eq",
    "dtr_local",
    "get",
    "largest",
    "lru",
    "names",
    "register",
]
