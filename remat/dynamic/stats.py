"""What one dynamic region did, and the simulator's prediction for the same step.

The region records its own events as a :class:`~remat.trace.types.Trace` (NOTE [same decisions] in
:mod:`remat.dynamic.engine`), so :meth:`DynamicStats.compare` can run exactly that step through the
simulator and put the two side by side: the same evictions in the same order, and the overhead
the simulator predicts from recorded op times next to the one measured.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from remat._units import format_bytes
from remat.core.driver import make_pool
from remat.core.policies.base import EvictionPolicy
from remat.core.pool import End, Fit
from remat.core.residency import Residency
from remat.core.runtime import Runtime
from remat.core.swap import SwapCounts
from remat.sim.backend import SimBackend, drive
from remat.trace.types import Op, Trace


class Recorder:
    """An eviction policy that remembers the victims another one chooses, in order."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.end: Callable[[Op], End] = policy.end  # the runtime asks on every op: no call in between
        self.victims: list[int] = []
        self.moments: list[tuple[int, str]] = []  # (time.time_ns(), "evict") per victim

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def needs(self) -> frozenset[str]:
        return self.policy.needs

    @property
    def inplace(self) -> bool:
        return self.policy.inplace

    def choose(self, runtime: Residency, nbytes: int) -> list[int]:
        victims = self.policy.choose(runtime, nbytes)
        self.victims.extend(victims)
        now = time.time_ns()
        self.moments.extend((now, "evict") for _ in victims)
        return victims


UNLIMITED = 2**62
"""The budget of ``remat.dynamic(None)``: more than any memory."""


@dataclass(frozen=True)
class Comparison:
    """The simulator against the runtime on one recorded step."""

    predicted_overhead: float  # from recorded op times: 1 + recomputed cost / first-run cost
    measured_overhead: float  # 1 + measured recomputation time / first-run cost
    simulated_evictions: tuple[int, ...]
    evictions: tuple[int, ...]
    simulated_recomputations: int = 0  # up to the program's last op, as ``DynamicStats.recomputations``
    simulated_peak: int = 0  # the simulated pool's peak, as ``DynamicStats.peak_bytes``

    @property
    def same_evictions(self) -> bool:
        return self.simulated_evictions == self.evictions

    @property
    def error(self) -> float:
        """Relative error of the prediction: predicted / measured - 1."""
        return self.predicted_overhead / self.measured_overhead - 1.0

    def __str__(self) -> str:
        same = "the same" if self.same_evictions else "DIFFERENT"
        return (
            f"predicted overhead {self.predicted_overhead:.3f}, measured {self.measured_overhead:.3f} "
            f"({self.error:+.1%}); {len(self.evictions)} evictions, {same} as simulated"
        )


@dataclass(frozen=True)
class DynamicStats:
    """Figures of one region. Times in seconds of the host; bytes include the constants (the
    parameters and every other tensor from before the region that an op read)."""

    policy: str
    backend: str
    layout: bool
    fit: Fit
    budget: int
    reserve: int  # of the budget, set aside for what the runtime cannot count ahead; the pool has the rest
    outside_bytes: int  # of the storages from before the region that it counted (constants)
    arriving: int  # set aside beside the reserve (NOTE [arriving constants] in ``.keep``)
    capacity: int  # what the pool could hold: the budget less the reserve and ``arriving``, aligned
    arrived_bytes: int  # of the constants that arrived uncounted (``keep.arrived``): the next ``arriving``
    ops: int
    evictions: int  # while the program ran (not counting the hand-over at the end)
    recomputations: int  # likewise
    base_seconds: float  # first runs of the ops, measured
    recompute_seconds: float  # recomputations, measured
    recompute_cost: float  # recomputations, at the recorded cost of their first runs
    peak_bytes: int  # the pool's peak
    peak_real_bytes: int  # real bytes held, sampled after each op (NOTE [real bytes])
    needed_bytes: int  # the most one op needed at once: no budget below it can work
    fragmentation: float  # mean free bytes / budget over allocations that had to evict
    search_seconds: float  # time spent choosing victims
    copied_ops: tuple[str, ...]  # arena: ops with no out= overload, computed then copied
    unmeasured_scratch: int  # ops run with their kernel's scratch unknown, counted as 0 (warned)
    evicted: tuple[int, ...]  # core storages in eviction order
    exit_recomputations: int  # recomputations to hand back what the program holds at the end
    wants: tuple[tuple[int, int], ...]  # (ops run before, handle) of each mark wanted at the end
    trace: Trace = field(repr=False, compare=False)
    policy_object: EvictionPolicy = field(repr=False, compare=False)
    moments: tuple[tuple[int, str], ...] = field(default=(), repr=False, compare=False)
    """``(time.time_ns(), "evict" | "recompute")`` of each eviction and recomputation, the clock of
    ``remat.memory.track``'s allocator timeline: marks for ``remat.memory.plot``."""
    swap: SwapCounts | None = None
    """With ``swap=``: victims sent to host memory, reloads, host bytes and predicted stalls."""

    @property
    def overhead(self) -> float:
        """1 + measured recomputation time / measured first-run time of the ops."""
        return 1.0 + self.recompute_seconds / self.base_seconds if self.base_seconds else 1.0

    def compare(self) -> Comparison:
        """Run this region's trace through the simulator's core under the same budget, pool (its
        fit included) and policy; see :class:`Comparison`."""
        recorder = Recorder(self.policy_object)
        pool = make_pool(self.capacity, self.layout, self.fit)
        backend = SimBackend(self.trace.total_cost, len(self.trace.ops), math.inf)
        compact = self.backend == "accounting"  # NOTE [model addresses] in ``remat.core.runtime``
        runtime = Runtime(pool, recorder, backend, compact=compact)
        # Up to the last op, as ``overhead``; constants where the region first saw them.
        drive(runtime, self.trace, backend, finish=False, wants=self.wants, first_sight=True)
        base = self.trace.total_cost
        predicted = 1.0 + backend.meter.recompute_cost / base if base else 1.0
        measured = self.overhead
        telemetry = runtime.telemetry
        return Comparison(
            predicted,
            measured,
            tuple(recorder.victims),
            self.evicted,
            telemetry.recomputations,
            telemetry.peak_bytes,
        )

    def __str__(self) -> str:
        copied = f", {len(self.copied_ops)} op kinds copied" if self.copied_ops else ""
        return (
            f"{self.policy} ({self.backend}) "
            f"{'without a budget' if self.budget >= UNLIMITED else 'in ' + format_bytes(self.budget)} "
            f"(reserve {format_bytes(self.reserve)}): {self.ops} ops, "
            f"{self.evictions} evictions, {self.recomputations} recomputations "
            f"({self.recompute_seconds * 1e3:.1f} ms, overhead {self.overhead:.3f}), "
            f"peak {format_bytes(self.peak_bytes)}, needs {format_bytes(self.needed_bytes)}, "
            f"fragmentation {self.fragmentation:.1%}{copied}"
        )
