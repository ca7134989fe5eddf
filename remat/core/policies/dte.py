"""DTE (MegEngine): h = c'_eq / (m' · s), where m' adds the free bytes adjacent to t in the pool.

Evicting a storage that borders free blocks yields a larger contiguous block than its own size, so
DTE favours it. It needs addresses (an address pool) for that; otherwise it is h_DTR^eq.
"""

from __future__ import annotations

from dataclasses import dataclass

from remat.core.policies.base import Greedy
from remat.core.policies.dtr_eq import choose_by_classes
from remat.core.policies.registry import register
from remat.core.residency import Residency


@dataclass(frozen=True)
class DTE(Greedy):
    name: str = "dte"
    needs: frozenset[str] = frozenset({"classes", "layout"})

    def choose(self, runtime: Residency, nbytes: int) -> list[int]:
        return choose_by_classes(runtime, adjacent_free=True)


register(DTE())
