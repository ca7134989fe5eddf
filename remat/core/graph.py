"""The recomputation graph: storages, the op records that fill them, and who depends on whom.

A *storage* is one piece of memory with one content. A handle of the program (a trace tensor, later
a real tensor) points at a storage; views and extra handles share their base's storage. A mutation
does not change a storage's content in this graph: it creates a new *version* (a new storage) that
the mutated handles move to, so that a recorded op always names the exact contents it read and a
recomputation reads them again. Whether the new version gets new memory (DTR's copy-on-write) or
takes over the old one's (Coop's recomputable in-place) is the runtime's choice, not the graph's.

The graph only grows; what is resident, locked or alive is the runtime's state.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat.trace.types import Op

NO_REUSE = -1
"""``Record.reuse`` entry of an output that needs memory of its own."""


@dataclass(eq=False, slots=True)
class Record:
    """One recorded execution of an op: re-running it needs ``inputs`` resident and fills ``outputs``.

    ``outputs`` are the storages the op creates: its fresh results, then the new versions of the
    storages it mutates. ``reuse[i]`` is the input storage whose memory output ``i`` may take over
    (the old version of a mutated storage), else :data:`NO_REUSE`."""

    id: int
    op: Op
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    reuse: tuple[int, ...]


def with_cost(op: Op, cost: float) -> Op:
    """``dataclasses.replace(op, cost=cost)`` at a fraction of its price (an eager runtime learns
    the cost of every op it runs): a frozen dataclass with no ``__post_init__`` is its fields, so
    a copy of them with the cost changed is the same value."""
    copy = object.__new__(Op)
    copy.__dict__.update(op.__dict__)
    copy.__dict__["cost"] = cost
    return copy


class Column:
    """Per-storage numbers kept twice: a list for fast scalar reads and writes, and a numpy array for
    vectorized policy scoring, brought up to date when it is read (:attr:`array`, at each victim
    search). Between two searches a write costs a list write and a set insertion, not a numpy
    scalar write: an eager runtime writes columns a dozen times per op and may search rarely."""

    def __init__(self, dtype: type = float) -> None:
        self.values: list = []  # type: ignore[type-arg]
        self._array: np.ndarray = np.zeros(1024, dtype=dtype)
        self._synced = 0  # values[:_synced] are in the array, but for the indices in _dirty
        self._dirty: set[int] = set()

    @property
    def array(self) -> np.ndarray:
        """The values as a numpy array (at least as long; zeros beyond). Valid until the next write."""
        values, n = self.values, len(self.values)
        if n > len(self._array):
            grown = np.zeros(max(2 * len(self._array), n), dtype=self._array.dtype)
            grown[: self._synced] = self._array[: self._synced]
            self._array = grown
        if self._dirty:
            dirty = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
            self._array[dirty] = [values[i] for i in dirty.tolist()]
            self._dirty.clear()
        if self._synced < n:
            self._array[self._synced : n] = values[self._synced : n]
            self._synced = n
        return self._array

    def append(self, value: float) -> None:
        """The same as ``values.append(value)``, which hot paths call directly."""
        self.values.append(value)

    def set(self, index: int, value: float) -> None:
        self.values[index] = value
        if index < self._synced:
            self._dirty.add(index)


class Graph:
    """Storages (indexed from 0) and records (indexed from 0), with parent and child lists."""

    def __init__(self) -> None:
        self._nbytes = Column()
        self._cost = Column()
        self.nbytes: list[int] = self._nbytes.values  # type: ignore[assignment]
        self.cost: list[float] = self._cost.values  # seconds to restore: producer and views
        self.producer: list[int] = []  # record id, -1 for constants
        self.constant: list[bool] = []
        self.parents: list[list[int]] = []  # storages that must be resident to restore this one
        self.children: list[list[int]] = []
        self.views: list[list[int]] = []  # view records re-run after a restore
        self.records: list[Record] = []

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def nbytes_array(self) -> np.ndarray:
        return self._nbytes.array

    @property
    def cost_array(self) -> np.ndarray:
        return self._cost.array

    def add_storage(self, nbytes: int, producer: int, constant: bool, parents: tuple[int, ...]) -> int:
        storage = len(self.nbytes)
        self.nbytes.append(nbytes)  # the columns' values: appending there is Column.append
        self.cost.append(0.0 if producer < 0 else self.records[producer].op.cost)
        self.producer.append(producer)
        self.constant.append(constant)
        self.parents.append(list(parents))
        self.children.append([])
        self.views.append([])
        for parent in parents:
            self.children[parent].append(storage)
        return storage

    def add_record(self, op: Op, inputs: tuple[int, ...]) -> Record:
        record = Record(len(self.records), op, inputs, (), ())
        self.records.append(record)
        return record

    def add_view(self, storage: int, record: Record) -> None:
        """``record`` only derives views of ``storage``: restoring it re-runs ``record`` too, so its
        cost and its other inputs count for ``storage``."""
        self.views[storage].append(record.id)
        self._cost.set(storage, self.cost[storage] + record.op.cost)
        for parent in record.inputs:
            if parent != storage and parent not in self.parents[storage]:
                self.parents[storage].append(parent)
                self.children[parent].append(storage)

    def set_cost(self, record: Record, cost: float) -> None:
        """``record``'s op took ``cost`` seconds: an eager runtime learns it only once the op ran,
        after its outputs were added with the op's provisional cost."""
        delta = cost - record.op.cost
        record.op = with_cost(record.op, cost)
        for storage in record.outputs:
            self._cost.set(storage, self.cost[storage] + delta)

    def neighbours(self, storage: int) -> list[int]:
        return self.parents[storage] + self.children[storage]
