"""The result of one simulation: a frozen record with a readable ``str`` and a JSON form."""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass

from remat._units import format_bytes


class Outcome(enum.StrEnum):
    """How a simulation ended."""

    OK = "ok"
    OOM = "oom"  # the budget cannot hold what some op needs (``SimResult.needed_bytes``)
    THRASHED = "thrashed"  # recomputation passed the thrash limit; the run was stopped


@dataclass(frozen=True)
class SimResult:
    """What one simulation did.

    ``overhead`` is total compute, recomputation included, over the compute of running every op
    once; for a thrashed run it is where the run was stopped, for OOM it is NaN. ``fragmentation``
    is the mean of free bytes / budget over the allocations that had to evict, taken once each was
    placed. ``digest`` hashes every value computed at a first run (equal across budgets when the
    recomputations are right); it is 0 unless the run finished. ``costs``: whether the op costs
    added up were measured, or estimated by the cost model (a trace taken on fake tensors).
    With a ``link`` (its ``str``; empty without), victims may be swapped to the host: ``swaps``
    victims went, ``reloads`` came back instead of being recomputed, the host held at most
    ``host_peak_bytes``, and the program waited ``stall_seconds`` for reloads (in ``overhead``)."""

    trace: str
    policy: str
    layout: bool
    budget: int
    ratio: float  # budget / unconstrained peak
    outcome: Outcome
    overhead: float
    peak_bytes: int
    unconstrained_peak: int
    needed_bytes: int  # a budget at which counting bytes never runs out (the worst case, or more)
    evictions: int
    recomputations: int
    fragmentation: float
    search_seconds: float  # host time spent choosing victims
    searches: int  # calls to the policy's search (a greedy policy makes one per victim)
    evicting_allocations: int  # allocations that had to evict
    tensors: int
    digest: int = 0
    reason: str = ""
    costs: str = "measured"
    link: str = ""
    swaps: int = 0
    reloads: int = 0
    host_peak_bytes: int = 0
    stall_seconds: float = 0.0

    def __str__(self) -> str:
        head = f"{self.policy} on {self.trace} at {self.ratio:.2f} ({format_bytes(self.budget)})"
        if self.outcome is Outcome.OOM:
            return f"{head}: OOM, {self.reason}"
        counts = f"{self.evictions} evictions, {self.recomputations} recomputations"
        if self.link:
            counts += (
                f", {self.swaps} swaps, {self.reloads} reloads over {self.link}, host peak "
                f"{format_bytes(self.host_peak_bytes)}, stall {self.stall_seconds * 1e3:.1f} ms"
            )
        if self.outcome is Outcome.THRASHED:  # stopped: its overhead so far says nothing
            return f"{head}: thrashed (stopped past the thrash limit after {counts})"
        return (
            f"{head}: ok, overhead {self.overhead:.3f} ({self.costs} costs), {counts}, "
            f"fragmentation {self.fragmentation:.1%}, search {self.search_seconds * 1e3:.1f} ms"
        )

    @property
    def label(self) -> str:
        """The policy's name, with " + swap" where victims could go to the host."""
        return f"{self.policy} + swap" if self.link else self.policy

    @property
    def search_per_allocation(self) -> float:
        """Seconds spent finding victims per allocation that had to evict (0 when none did)."""
        return self.search_seconds / self.evicting_allocations if self.evicting_allocations else 0.0

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (NaN becomes None)."""
        out = asdict(self)
        out["outcome"] = str(self.outcome)
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in out.items()}
