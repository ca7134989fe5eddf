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

from dataclasses import dataclass, replace

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


class Column:
    """Per-storage numbers kept twice: a list for fast scalar reads, and a growable numpy array
    (amortized O(1) append) for vectorized policy scoring."""

    def __init__(self, dtype: type = float) -> None:
        self.values: list = []  # type: ignore[type-arg]
        self.array: np.ndarray = np.zeros(1024, dtype=dtype)

    def append(self, value: float) -> None:
        if len(self.values) == len(self.array):
            self.array = np.concatenate([self.array, np.zeros_like(self.array)])
        self.array[len(self.values)] = value
        self.values.append(value)

    def set(self, index: int, value: float) -> None:
        self.values[index] = value
        self.array[index] = value


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
        self._nbytes.append(nbytes)
        self._cost.append(0.0 if producer < 0 else self.records[producer].op.cost)
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
        record.op = replace(record.op, cost=cost)
        for storage in record.outputs:
            self._cost.set(storage, self.cost[storage] + delta)

    def neighbours(self, storage: int) -> list[int]:
        return self.parents[storage] + self.children[storage]
