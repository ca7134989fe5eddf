"""The simulator's backend: running a trace through the rematerialization core, keeping accounts
only.

:class:`SimBackend` is the simulator's side of :class:`~remat.core.backend.Backend`: running a record
costs its recorded time, and every storage gets a *value*, a hash of its recipe (the op, the output
position and the values of the inputs). A recomputation must reproduce the value of the first run,
and an op whose input is not resident has no value to read: both raise at once, so a simulation
that finishes has also checked that the core recomputes the right things in the right order. A
storage swapped to the host (:mod:`remat.core.swap`) keeps its value there until it comes back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from remat._errors import RecomputationError
from remat.core.driver import ThrashMeter, deep_recursion
from remat.core.graph import Record
from remat.core.policies.base import EvictionPolicy
from remat.core.pool import Pool
from remat.core.runtime import Runtime
from remat.trace.types import Op, Trace


class SimBackend:
    """Adds up recorded op times; checks values (see the module docstring)."""

    def __init__(self, base_compute: float, ops: int, thrash_limit: float) -> None:
        self.values: dict[int, int] = {}
        self.first: dict[int, int] = {}  # storage -> value at its first run
        self.host: dict[int, int] = {}  # storage -> value of its host copy
        # The whole trace's first runs are known up front: past the limit the run has thrashed.
        self.meter = ThrashMeter(thrash_limit, base_compute, ops)

    def constant(self, storage: int, handle: int) -> None:
        # ints only: a string's hash is salted per process, and digests are compared across runs
        self.values[storage] = self.first[storage] = hash((-1, handle))

    def materialize(self, record: Record, recompute: bool) -> float:
        try:
            inputs = tuple(self.values[s] for s in record.inputs)
        except KeyError:
            missing = [s for s in record.inputs if s not in self.values]
            raise RecomputationError(
                f"op {record.op.index} ({record.op.name}) ran without its input storages {missing} resident"
            ) from None
        for position, storage in enumerate(record.outputs):
            value = hash((record.op.index, position, inputs))
            if recompute and self.first[storage] != value:
                raise RecomputationError(
                    f"recomputing op {record.op.index} ({record.op.name}) gave a different value for "
                    f"storage {storage} than its first run"
                )
            self.first.setdefault(storage, value)
            self.values[storage] = value
        if recompute:
            self.meter.recomputed(record.op.cost)
        return record.op.cost

    def free(self, storage: int) -> None:
        del self.values[storage]

    def swap_out(self, storage: int) -> None:
        self.host[storage] = self.values[storage]

    def swap_in(self, storage: int) -> None:
        self.values[storage] = self.host[storage]

    def drop(self, storage: int) -> None:
        del self.host[storage]

    def digest(self) -> int:
        """One hash of every value computed at a first run, in storage order."""
        return hash(tuple(self.first[s] for s in sorted(self.first)))


def run_trace(
    trace: Trace,
    pool: Pool,
    policy: EvictionPolicy,
    backend: SimBackend | None = None,
) -> Runtime:
    """A runtime over ``pool`` that has run every event of ``trace``."""
    if backend is None:
        backend = SimBackend(0.0, 0, math.inf)
    runtime = Runtime(pool, policy, backend)
    drive(runtime, trace, backend)
    return runtime


def drive(
    runtime: Runtime,
    trace: Trace,
    backend: SimBackend,
    finish: bool = True,
    wants: Sequence[tuple[int, int]] = (),
    first_sight: bool = False,
) -> None:
    """Feed every event of ``trace`` to ``runtime``, then (``finish``) restore what it leaves live.
    Raises :class:`~remat.core.pool.OutOfMemory` or :class:`~remat.core.driver.Thrashed` when
    the run cannot finish. ``wants``: the marks another run of the trace made (its
    ``Residency.wants``: ops run before, handle), made again at the same moments, each before the
    constants the next op shows first (NOTE [wanted at the end] in ``remat.core.residency``).

    Constants are all registered before the first event (a trace's convention: they exist from its
    start), unless ``first_sight``.

    NOTE [first sight] A region of ``remat.dynamic`` registers a tensor from before the region when
    an op first reads or writes it, and registering a constant can evict, so its log replays the
    same way (``DynamicStats.compare``, ``first_sight=True``): the constants before the first tensor
    an op made (parameters, inputs) before the first event, each later one just before the first op
    that reads or writes it; one whose only event is its release was never seen, and is skipped."""
    tensors = trace.tensors
    due: dict[int, list[int]] = {}
    for position, handle in wants:
        due.setdefault(position, []).append(handle)
    made = next((t.id for t in tensors if not t.constant), len(tensors))
    if not first_sight:
        made = len(tensors)
    later = {t.id for t in tensors if t.constant and t.id > made}

    def register(tensor: int) -> None:
        runtime.constant(tensor, tensors[tensor].nbytes)
        backend.constant(runtime.storage_of(tensor), tensor)

    with deep_recursion():
        for tensor in range(made):
            if tensors[tensor].constant:
                register(tensor)
        ops = 0
        for event in trace.events:
            if isinstance(event, Op):
                for handle in due.pop(ops, ()):
                    runtime.want(handle)
                ops += 1
                if later and (seen := later.intersection((*event.inputs, *event.mutates))):
                    for tensor in sorted(seen):
                        register(tensor)
                    later -= seen
                runtime.call(event, [tensors[t] for t in event.outputs])
            elif event.tensor in later:  # never seen by an op
                later.discard(event.tensor)
            else:
                runtime.release(event.tensor)
        if finish:
            for position in sorted(due):
                for handle in due[position]:
                    runtime.want(handle)
            runtime.finish()
