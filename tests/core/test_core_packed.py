"""Pools whose addresses are a model (NOTE [model addresses]): Coop's greedy eviction where no window
can hold a request."""

from __future__ import annotations

import pytest

from remat.core.policies import get
from remat.core.pool import AddressPool, OutOfMemory
from remat.core.runtime import Runtime
from remat.sim.backend import SimBackend, drive
from remat.sim.synthetic import Builder
from remat.trace.types import Trace


def run(trace: Trace, capacity: int, policy: str, compact: bool) -> Runtime:
    backend = SimBackend(1.0, 0, 100.0)
    runtime = Runtime(AddressPool(capacity), get(policy), backend, compact=compact)
    drive(runtime, trace, backend)
    return runtime


@pytest.mark.parametrize("policy", ["coop", "coop-exact"])
def test_coop_evicts_greedily_where_locked_pieces_leave_no_window(policy: str) -> None:
    p = Builder()
    x = p.tensor(10, constant=True)  # [0, 10)
    made = {}
    for name in "abed":  # [10, 20), [20, 30), [30, 40), [40, 50); [50, 60) free
        made[name] = p.tensor(10)
        p.op(name, (x,), (made[name],), 1.0)
    c = p.tensor(30)
    p.op("c", (made["b"], made["d"]), (c,), 1.0)  # b and d locked: a and e lie apart
    for tensor in made.values():
        p.release(tensor)
    trace = p.trace("split")
    with pytest.raises(OutOfMemory, match="no contiguous room"):
        run(trace, 60, policy, compact=False)
    packed = run(trace, 60, policy, compact=True)
    assert packed.telemetry.evictions == 2  # a and e: their 20 bytes and the 10 free ones, packed
    assert (
        not packed.resident[packed.storage_of(made["a"])]
        and not packed.resident[packed.storage_of(made["e"])]
    )
    assert packed.resident[packed.storage_of(c)]
