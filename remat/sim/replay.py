"""Replaying a trace through the rematerialization core, with a backend that only keeps accounts.

:class:`SimBackend` is the simulator's side of :class:`~remat.core.runtime.Backend`: running a record
costs its recorded time, and every storage gets a *value*, a hash of its recipe (the op, the output
position and the values of the inputs). A recomputation must reproduce the value of the first run,
and an op whose input is not resident has no value to read: both raise at once, so a simulation
that finishes has also checked that the core recomputes the right things in the right order.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from remat._errors import RecomputationError
from remat.core.graph import Record
from remat.core.policies.base import EvictionPolicy
from remat.core.pool import Pool
from remat.core.runtime import Runtime
from remat.trace.types import Op, Trace

_DEPTH = 200_000  # recomputation chains recurse once per evicted ancestor


class Thrashed(Exception):
    """Recomputation passed the limit the simulation was given."""


class SimBackend:
    """Adds up recorded op times; checks values (see the module docstring)."""

    def __init__(self, base_compute: float, ops: int, thrash_limit: float) -> None:
        self.values: dict[int, int] = {}
        self.first: dict[int, int] = {}  # storage -> value at its first run
        self.recompute_seconds = 0.0
        self.recompute_ops = 0
        # Past this much recomputation the run has thrashed; with no recorded times at all, count ops.
        extra = thrash_limit - 1.0
        self._limit = math.inf if math.isinf(extra) else extra * base_compute
        self._op_limit = extra * ops if base_compute == 0 and not math.isinf(extra) else None

    def constant(self, storage: int, handle: int) -> None:
        self.values[storage] = self.first[storage] = hash(("constant", handle))

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
            self.recompute_seconds += record.op.cost
            self.recompute_ops += 1
            if self.recompute_seconds > self._limit or (
                self._op_limit is not None and self.recompute_ops > self._op_limit
            ):
                raise Thrashed
        return record.op.cost

    def free(self, storage: int) -> None:
        del self.values[storage]

    def digest(self) -> int:
        """One hash of every value computed at a first run, in storage order."""
        return hash(tuple(self.first[s] for s in sorted(self.first)))


def replay(
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


def drive(runtime: Runtime, trace: Trace, backend: SimBackend, finish: bool = True) -> None:
    """Feed every event of ``trace`` to ``runtime``, then (``finish``) restore what it leaves live.
    Raises :class:`~remat.core.runtime.OutOfMemory` or :class:`Thrashed` when the run cannot
    finish."""
    tensors = trace.tensors
    with _deep_recursion():
        for tensor in tensors:
            if tensor.constant:
                runtime.constant(tensor.id, tensor.nbytes)
                backend.constant(runtime.storage_of(tensor.id), tensor.id)
        for event in trace.events:
            if isinstance(event, Op):
                runtime.call(event, [tensors[t] for t in event.outputs])
            else:
                runtime.release(event.tensor)
        if finish:
            runtime.finish()


@contextmanager
def _deep_recursion() -> Iterator[None]:
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(max(previous, _DEPTH))
    try:
        yield
    finally:
        sys.setrecursionlimit(previous)
